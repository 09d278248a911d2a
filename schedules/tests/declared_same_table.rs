//! A known model declared by its workers plans the same table as from its config: the
//! declarations a `format=hf`, `tp=1` job's workers would send (every trainer's FSDP boxes, every
//! engine's whole tensors), planned as a declared model, give a routing table equal to the
//! config path's, byte for byte once encoded. So a declared plan is the planner's own plan, not
//! an approximation of it.
//!
//! `declared_planning_time` (ignored; run with `--release -- --ignored --nocapture`) times both
//! paths interleaved in one process, Qwen3-0.6B's 310 tensors and Kimi-K2's 10,240-GPU training
//! side, and prints the ratios.

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

fn dims(d: &[u32]) -> Vec<u64> {
    d.iter().map(|&x| u64::from(x)).collect()
}

/// Every trainer's declarations of a planner-built training layout, as its workers send them.
fn trainer_declarations(l: &JobLayouts) -> Vec<Vec<TensorMeta>> {
    let mut out = vec![Vec::new(); l.train.ranks as usize];
    for s in &l.train.shards {
        let p = &l.model.params[s.param as usize];
        let n = s.global.ndim as usize;
        out[s.rank as usize].push(TensorMeta {
            name: p.name.to_string(),
            shape: dims(&s.global.len[..n]),
            dtype: s.dtype,
            bytes: s.global.numel() * s.dtype.size() as u64,
            global_shape: dims(p.shape.dims()),
            offset: dims(&s.global.start[..n]),
        });
    }
    out
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

/// Median of `xs` seconds.
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

#[test]
#[ignore = "timing: run with --release -- --ignored --nocapture"]
fn declared_planning_time() {
    // Qwen3-0.6B, 310 tensors: registration (frames) + planning from declarations, against
    // planning from the config, interleaved.
    let (train, infer) = ("fsdp=8", "dp=2,format=hf");
    let known = world("qwen3-0.6b", train, infer);
    let l = job::layouts(&known, None).unwrap();
    let (t, e) = (trainer_declarations(&l), engine_declarations(&l));
    let decl_world = world("declared:qwen3-0.6b", train, infer);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..40 {
        let config = || {
            let s = Instant::now();
            std::hint::black_box(job::plan_job(&known, None).unwrap());
            s.elapsed().as_secs_f64()
        };
        let declared = || {
            let s = Instant::now();
            let t = through_frames(&t, WorkerId::trainer);
            let e = through_frames(&e, WorkerId::rollout);
            std::hint::black_box(plan_declared(&decl_world, &t, &e));
            s.elapsed().as_secs_f64()
        };
        if i % 2 == 0 {
            a.push(config());
            b.push(declared());
        } else {
            b.push(declared());
            a.push(config());
        }
    }
    let (ma, mb) = (median(a), median(b));
    println!(
        "qwen3-0.6b {train} -> {infer}: config path {:.2} ms, declarations (frames + plan) \
         {:.2} ms: declared / config = {:.2}",
        ma * 1e3,
        mb * 1e3,
        mb / ma
    );

    // Kimi-K2's 10,240-GPU job: its training side (8,192 ranks) from declarations against the
    // layout string. (Its inference side, tp=8 ep=32 fused, is not declarable: engines of a
    // declared model hold whole tensors.)
    let kimi = world("kimi-k2", "pp=16,ep=32,fsdp=16", "tp=8,ep=32,dp=64");
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
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..6 {
        let from_spec = || {
            let s = Instant::now();
            std::hint::black_box(TrainingLayout::build(&model, &tspec).unwrap());
            s.elapsed().as_secs_f64()
        };
        let from_decls = || {
            let s = Instant::now();
            let refs: Vec<&[TensorMeta]> = decls.iter().map(Vec::as_slice).collect();
            std::hint::black_box(declared::from_trainers("kimi-k2", &refs).unwrap());
            s.elapsed().as_secs_f64()
        };
        if i % 2 == 0 {
            a.push(from_spec());
            b.push(from_decls());
        } else {
            b.push(from_decls());
            a.push(from_spec());
        }
    }
    let (ma, mb) = (median(a), median(b));
    println!(
        "kimi-k2 pp=16,ep=32,fsdp=16 ({} trainers, {shards} declared shards): training layout \
         from the spec {:.3} s, model + layout from declarations (tiling checked) {:.3} s: \
         declared / spec = {:.1}",
        lk.train.ranks,
        ma,
        mb,
        mb / ma
    );
}
