//! A known model declared by its workers plans the same table as from its config: the
//! declarations a `format=hf`, `tp=1` job's workers would send (every trainer's FSDP boxes, every
//! engine's whole tensors), planned as a declared model, give a routing table equal to the
//! config path's, byte for byte once encoded: Qwen3-0.6B (310 tensors) and Kimi-K2 (fp8, its
//! experts stacked as transformers holds them). So a declared plan is the planner's own plan,
//! not an approximation of it.
//!
//! `declared_planning_time` (ignored; run with `--release -- --ignored --nocapture`) times both
//! paths interleaved in one process (Qwen3-0.6B's 310 tensors; Kimi-K2 from the 10,240-GPU job's
//! 8,192 trainers into an fp8 hf engine; that job's per-expert training side; that whole job,
//! its fused tp=8 ep=32 inference side declared as its engines would, `declared_fused.rs`) and
//! prints the figures and ratios as one JSON object.

use std::time::Instant;

use weightsync_common::DType;
use weightsync_common::protocol::{
    Blob, DEFAULT_MAX_FRAME, FromWorker, Registration, TensorMeta, WorkerId, WorldSpec,
    decode_frame, encode_frame,
};
use weightsync_schedules::TrainingLayout;
use weightsync_schedules::declared::{self, EngineDeclaration};
use weightsync_schedules::job::{self, JobLayouts};

fn world(model: &str, train: &str, infer: &str) -> WorldSpec {
    WorldSpec {
        model: model.into(),
        train: train.into(),
        infer: infer.into(),
        dtype: DType::BF16,
        verify: true,
    }
}

fn fp8(w: WorldSpec) -> WorldSpec {
    WorldSpec {
        dtype: DType::F8E4M3,
        ..w
    }
}

fn dims(d: &[u32]) -> Vec<u64> {
    d.iter().map(|&x| u64::from(x)).collect()
}

/// Every trainer's declarations of a planner-built training layout, as its workers send them.
fn trainer_declarations(l: &JobLayouts) -> Vec<Vec<TensorMeta>> {
    declared::trainer_declarations(&l.model, &l.train)
}

/// Every engine's declarations (its tensors, whole) of a planner-built inference layout.
fn engine_declarations(l: &JobLayouts) -> Vec<Vec<TensorMeta>> {
    l.infer
        .ranks
        .iter()
        .map(|r| {
            r.tensors
                .iter()
                .map(|t| TensorMeta::whole(t.name.clone(), dims(t.shape.dims()), t.dtype))
                .collect()
        })
        .collect()
}

/// The declarations through the control protocol: each worker's registration encoded as a
/// frame and decoded, as the controller receives them.
fn through_frames(decls: &[Vec<TensorMeta>], id: fn(u32) -> WorkerId) -> Vec<Vec<TensorMeta>> {
    decls
        .iter()
        .enumerate()
        .map(|(r, tensors)| {
            let reg = FromWorker::Register(Box::new(Registration {
                id: id(r as u32),
                host: "h".into(),
                pid: 1,
                world: world("m", "", ""),
                fabric_endpoint: Blob::default(),
                regions: Vec::new(),
                tensors: tensors.clone(),
                placement: None,
                skip: Vec::new(),
            }));
            let bytes = encode_frame(&reg, DEFAULT_MAX_FRAME).unwrap();
            match decode_frame::<FromWorker>(&bytes, DEFAULT_MAX_FRAME).unwrap() {
                FromWorker::Register(r) => r.tensors,
                _ => unreachable!(),
            }
        })
        .collect()
}

fn plan_declared(
    w: &WorldSpec,
    t: &[Vec<TensorMeta>],
    e: &[Vec<TensorMeta>],
) -> weightsync_schedules::RoutingTable {
    let tr: Vec<&[TensorMeta]> = t.iter().map(Vec::as_slice).collect();
    let en: Vec<EngineDeclaration> = e
        .iter()
        .map(|x| EngineDeclaration {
            tensors: x,
            skip: &[],
        })
        .collect();
    job::plan_declared_job(w, &tr, &en).unwrap().table
}

#[test]
fn a_known_model_declared_plans_the_same_table() {
    for (train, infer) in [("fsdp=3", "dp=2,format=hf"), ("dp=2,fsdp=2", "format=hf")] {
        let known = world("qwen3-0.6b", train, infer);
        let l = job::layouts(&known, None).unwrap();
        let t = trainer_declarations(&l);
        let e = engine_declarations(&l);
        let from_config = job::plan_job(&known, None).unwrap().table;
        let declared = plan_declared(&world("declared:qwen3-0.6b", train, infer), &t, &e);
        assert_eq!(declared.num_params, 310);
        assert!(
            declared.to_bincode() == from_config.to_bincode(),
            "{train} / {infer}: the declared table differs from the config's"
        );
    }
}

/// Kimi-K2 (61 layers, 384 routed experts each, MLA attention) as transformers holds it (its
/// experts stacked: `experts=transformers`), spread by expert parallelism, FSDP and pipeline
/// stages, into an fp8 `format=hf` engine that declares every block-quantised tensor with its
/// `weight_scale_inv`: declared, it plans the config's table byte for byte (975 tensors).
/// (Engines that declare what each tensor is made of, per-expert trainer tensors stacked and
/// the production inference side, `tp=8` `ep=32` fused, are `declared_fused.rs`.)
#[test]
fn kimi_k2_declared_plans_the_same_table() {
    let (train, infer) = ("pp=2,ep=4,fsdp=2,experts=transformers", "format=hf");
    let known = fp8(world("kimi-k2", train, infer));
    let l = job::layouts(&known, None).unwrap();
    let t = trainer_declarations(&l);
    let e = engine_declarations(&l);
    let from_config = job::plan_job(&known, None).unwrap().table;
    let declared = plan_declared(&fp8(world("declared:kimi-k2", train, infer)), &t, &e);
    assert_eq!(declared.num_params, from_config.num_params);
    assert_eq!(declared.num_params, 975);
    assert!(
        declared.to_bincode() == from_config.to_bincode(),
        "kimi-k2 {train} / {infer} fp8: the declared table differs from the config's"
    );
}

/// Median of `xs` seconds.
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Times `a` and `b` `n` times each, interleaved (ABBA: neither always runs first); returns
/// their medians in seconds.
fn interleaved(n: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    let time = |f: &mut dyn FnMut()| {
        let s = Instant::now();
        f();
        s.elapsed().as_secs_f64()
    };
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for i in 0..n {
        if i % 2 == 0 {
            ta.push(time(&mut a));
            tb.push(time(&mut b));
        } else {
            tb.push(time(&mut b));
            ta.push(time(&mut a));
        }
    }
    (median(ta), median(tb))
}

/// One case's figures: both paths' medians and their ratio.
fn figures(
    case: &str,
    what: serde_json::Value,
    config_s: f64,
    declared_s: f64,
) -> serde_json::Value {
    serde_json::json!({
        "case": case,
        "what": what,
        "config_path_s": config_s,
        "declared_s": declared_s,
        "declared_vs_config": declared_s / config_s,
    })
}

/// A job planned both ways, `n` times each, interleaved: the config path (`plan_job`: layouts
/// from the spec, planning) against registration (every worker's declarations through the
/// control protocol's frames) and planning from the declarations (`plan_declared_job`).
fn time_job(case: &str, known: &WorldSpec, declared_as: &WorldSpec, n: usize) -> serde_json::Value {
    let l = job::layouts(known, None).unwrap();
    let (t, e) = (trainer_declarations(&l), engine_declarations(&l));
    let (config, declared) = interleaved(
        n,
        || {
            std::hint::black_box(job::plan_job(known, None).unwrap());
        },
        || {
            let t = through_frames(&t, WorkerId::trainer);
            let e = through_frames(&e, WorkerId::rollout);
            std::hint::black_box(plan_declared(declared_as, &t, &e));
        },
    );
    let what = serde_json::json!({
        "model": known.model, "train": known.train, "infer": known.infer,
        "dtype": known.dtype.to_string(), "tensors": l.model.params.len(),
        "trainers": t.len(), "engines": e.len(),
        "declared_shards": t.iter().map(Vec::len).sum::<usize>(), "runs": n,
    });
    figures(case, what, config, declared)
}

/// The 10,240-GPU job's training side with transformers' stacked experts.
const KIMI_TRAIN_STACKED: &str = "pp=16,ep=32,fsdp=16,experts=transformers";

/// `cargo test --release -p weightsync-schedules --test declared_same_table -- --ignored
/// --nocapture` prints one JSON object: for each case both paths' median seconds, interleaved
/// in this process, and `declared_vs_config` (their ratio; only ratios compare on a shared
/// machine). `$DECLARED_TIMING_JSON` names a file to write it to as well.
#[test]
#[ignore = "timing: run with --release -- --ignored --nocapture"]
fn declared_planning_time() {
    let mut cases = Vec::new();
    // Qwen3-0.6B, 310 tensors, 8 trainers and 2 engines: registration + planning.
    cases.push(time_job(
        "qwen3-0.6b",
        &world("qwen3-0.6b", "fsdp=8", "dp=2,format=hf"),
        &world("declared:qwen3-0.6b", "fsdp=8", "dp=2,format=hf"),
        40,
    ));
    // Kimi-K2 as transformers holds it (975 tensors), the 10,240-GPU job's 8,192 trainers into
    // one fp8 hf engine (the largest Kimi-K2 job a declared model can be here: see
    // kimi_k2_declared_plans_the_same_table).
    cases.push(time_job(
        "kimi-k2 8192 trainers -> hf engine",
        &fp8(world("kimi-k2", KIMI_TRAIN_STACKED, "format=hf")),
        &fp8(world("declared:kimi-k2", KIMI_TRAIN_STACKED, "format=hf")),
        4,
    ));

    // Kimi-K2's 10,240-GPU job: its training side (8,192 ranks) from declarations against the
    // layout string. The config path's whole plan of the job is timed too, for scale (and the
    // whole job planned from declarations below).
    let kimi = fp8(world("kimi-k2", "pp=16,ep=32,fsdp=16", "tp=8,ep=32,dp=64"));
    let tspec = job::train_spec(&kimi).unwrap();
    let model = job::model(&kimi, None, &tspec).unwrap();
    let built = TrainingLayout::build(&model, &tspec).unwrap();
    let lk = JobLayouts {
        model: model.clone(),
        train: built,
        infer: weightsync_schedules::InferenceLayout {
            ranks: Vec::new(),
            pieces: Vec::new(),
            fp8_recipe: Default::default(),
        },
        infer_spec: job::infer_spec(&kimi).unwrap(),
    };
    let decls = trainer_declarations(&lk);
    let shards: usize = decls.iter().map(Vec::len).sum();
    let (spec_s, decl_s) = interleaved(
        6,
        || {
            std::hint::black_box(TrainingLayout::build(&model, &tspec).unwrap());
        },
        || {
            let refs: Vec<&[TensorMeta]> = decls.iter().map(Vec::as_slice).collect();
            std::hint::black_box(declared::from_trainers("kimi-k2", &refs).unwrap());
        },
    );
    let plan_s = {
        let s = Instant::now();
        std::hint::black_box(job::plan_job(&kimi, None).unwrap());
        s.elapsed().as_secs_f64()
    };
    let what = serde_json::json!({
        "model": kimi.model, "train": kimi.train, "infer": kimi.infer, "dtype": "fp8",
        "trainers": lk.train.ranks, "declared_shards": shards, "runs": 6,
        "config_path": "TrainingLayout::build from the layout string",
        "declared": "model + training layout from the trainers' declarations, tiling checked",
        "config_whole_plan_s": plan_s,
    });
    let mut k = figures("kimi-k2 10240 training side", what, spec_s, decl_s);
    k["declared_vs_config_whole_plan"] = serde_json::json!(decl_s / plan_s);
    cases.push(k);
    cases.push(kimi_whole_job_declared(&kimi));
    let report = serde_json::json!({ "bench": "declared planning", "cases": cases });
    let text = serde_json::to_string_pretty(&report).unwrap();
    println!("{text}");
    if let Ok(path) = std::env::var("DECLARED_TIMING_JSON") {
        std::fs::write(path, text).unwrap();
    }
}

/// Kimi-K2's whole 10,240-GPU job (8,192 trainers, per-expert; 64 fp8 engines of tp=8 ep=32,
/// vLLM's fused layout) planned from every worker's declarations (the engines' from
/// [`declared::engine_declarations`]: each tensor's parts) against the config path, both
/// whole plans, interleaved. The declarations are in memory (no frames: 2,048 engine
/// registrations of ~3 thousand parts each); the 64 engines' ranks declare engine 0's ranks'
/// declarations by reference, as equal registrations would.
fn kimi_whole_job_declared(kimi: &WorldSpec) -> serde_json::Value {
    let l = job::layouts(kimi, None).unwrap();
    let t = declared::trainer_declarations(&l.model, &l.train);
    let e = declared::engine_declarations(&l.model, &l.infer);
    let ranks = l.infer.ranks.len();
    let pieces = l.infer.pieces.len();
    drop(l);
    let declared_as = WorldSpec {
        model: "declared:kimi-k2".into(),
        ..kimi.clone()
    };
    let tr: Vec<&[TensorMeta]> = t.iter().map(Vec::as_slice).collect();
    let en: Vec<EngineDeclaration> = (0..ranks)
        .map(|i| EngineDeclaration {
            tensors: &e[i % e.len()],
            skip: &[],
        })
        .collect();
    // Once, checked: the same table.
    let declared_table = job::plan_declared_job(&declared_as, &tr, &en)
        .unwrap()
        .table;
    let same = declared_table.to_bincode() == job::plan_job(kimi, None).unwrap().table.to_bincode();
    drop(declared_table);
    let n = 3;
    let (config, declared) = interleaved(
        n,
        || {
            std::hint::black_box(job::plan_job(kimi, None).unwrap());
        },
        || {
            std::hint::black_box(job::plan_declared_job(&declared_as, &tr, &en).unwrap());
        },
    );
    let parts: usize = e
        .iter()
        .flatten()
        .filter_map(|m| m.source.as_ref())
        .map(|s| s.parts.len())
        .sum();
    let what = serde_json::json!({
        "model": kimi.model, "train": kimi.train, "infer": kimi.infer, "dtype": "fp8",
        "trainers": t.len(), "engine_ranks": ranks, "pieces": pieces,
        "declared_shards": t.iter().map(Vec::len).sum::<usize>(),
        "engine_rank_parts": parts, "runs": n, "same_table": same,
        "config_path": "plan_job: model, layouts from the strings, planning",
        "declared": "plan_declared_job: model, training layout and fused inference layout from \
                     the declarations (tiling and parts checked), planning",
    });
    figures(
        "kimi-k2 10240 whole job, fused tp=8 ep=32",
        what,
        config,
        declared,
    )
}
