//! In-process trainers and engines (`weightsync_agent::embed`, what the Python package binds)
//! over Vec-backed tensors, against a real controller served on loopback: uneven FSDP trainers
//! (3 ranks) push several versions into two engines in the Hugging Face layout, and every engine
//! tensor equals the trainers' full parameter byte for byte; a plain bf16 -> bf16 job is written
//! straight from the registered tensors (no staging); a failing engine makes the push fail
//! naming it and leaves the other invalid until a later version commits; a layout mismatch
//! names the tensor; an engine's own pause, load and resume show on its lane of the sync in the
//! controller's views and trace, and a bad report of them changes nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;
use weightsync_agent::embed::{
    ApiClient, DstTensor, EmbedError, EngineHandle, EngineOptions, EngineStatus, FailureKind,
    ShardInfo, SourceTensor, Stage, TrainerHandle, TrainerOptions,
};
use weightsync_common::DType;
use weightsync_tests::controller_harness::{API_TOKEN, JOB_TOKEN, ServedController};
use weightsync_tests::embed_fixture::{Buffer, bf16_value, serve_job};
use weightsync_tests::http_raw;

/// A small dense Qwen3: row counts that 3 FSDP ranks split unevenly (256 = 86 + 86 + 84).
const CONFIG: &str = r#"{"model_type":"qwen3","hidden_size":256,"intermediate_size":512,
 "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,
 "vocab_size":320}"#;

const WAIT: Option<Duration> = Some(Duration::from_secs(15));

/// The value of element `flat` of parameter `name` at `version` (a bf16 bit pattern).
fn value(name: &str, flat: u64, version: u64) -> [u8; 2] {
    bf16_value(name, flat, version).to_le_bytes()
}

/// A shard's bytes at `version`: each local element's value at its global position.
fn shard_bytes(s: &ShardInfo, version: u64) -> Vec<u8> {
    let n: u64 = s.shape.iter().product();
    let mut out = Vec::with_capacity(n as usize * 2);
    for local in 0..n {
        let (mut rest, mut global) = (local, 0u64);
        let mut stride = 1u64;
        let mut coords = vec![0u64; s.shape.len()];
        for d in (0..s.shape.len()).rev() {
            coords[d] = rest % s.shape[d] + s.offset[d];
            rest /= s.shape[d];
        }
        for d in (0..s.shape.len()).rev() {
            global += coords[d] * stride;
            stride *= s.global_shape[d];
        }
        out.extend_from_slice(&value(&s.name, global, version));
    }
    out
}

/// A full parameter's bytes at `version`.
fn full_bytes(name: &str, shape: &[u64], version: u64) -> Vec<u8> {
    let n: u64 = shape.iter().product();
    (0..n).flat_map(|i| value(name, i, version)).collect()
}

struct Trainer {
    handle: TrainerHandle,
    shards: Vec<(ShardInfo, Buffer)>,
}

/// Each shard of a trainer's layout on a zeroed buffer of `elem` bytes per element.
fn zeroed_shards(layout: Vec<ShardInfo>, elem: usize) -> Vec<(ShardInfo, Buffer)> {
    layout
        .into_iter()
        .map(|s| {
            let b = Buffer::zeroed(s.shape.iter().product::<u64>() as usize * elem);
            (s, b)
        })
        .collect()
}

/// The source tensors of `shards`, each in `dtype` where given, else in its layout's.
fn source_tensors(shards: &[(ShardInfo, Buffer)], dtype: Option<DType>) -> Vec<SourceTensor> {
    shards
        .iter()
        .map(|(s, b)| SourceTensor {
            name: s.name.clone(),
            dtype: dtype.unwrap_or(s.dtype),
            shape: s.shape.clone(),
            memory: b.memory(),
        })
        .collect()
}

impl Trainer {
    fn join(control: &str, rank: u32) -> Trainer {
        let handle = TrainerHandle::connect(TrainerOptions {
            job_token: Some(JOB_TOKEN.into()),
            ..TrainerOptions::new(control, rank)
        })
        .unwrap();
        let shards = zeroed_shards(handle.layout(), 2);
        handle.register(source_tensors(&shards, None)).unwrap();
        Trainer { handle, shards }
    }

    fn step(&self, version: u64) {
        for (s, b) in &self.shards {
            b.fill(&shard_bytes(s, version));
        }
    }
}

struct Engine {
    handle: EngineHandle,
    tensors: Vec<(String, Vec<u64>, DType, Buffer)>,
}

impl Engine {
    fn join(control: &str, rank: u32, fail_before: Option<Arc<AtomicBool>>) -> Engine {
        Engine::join_with(control, rank, fail_before, false)
    }

    /// `one_allocation`: every tensor carved out of one vector (one region once merged).
    fn join_with(
        control: &str,
        rank: u32,
        fail_before: Option<Arc<AtomicBool>>,
        one_allocation: bool,
    ) -> Engine {
        let handle = EngineHandle::connect(EngineOptions {
            job_token: Some(JOB_TOKEN.into()),
            ..EngineOptions::new(control, rank)
        })
        .unwrap();
        if let Some(fail) = fail_before {
            handle.set_hooks(
                Some(Box::new(move |v| {
                    if fail.load(Ordering::SeqCst) {
                        Err(format!("refusing version {v}"))
                    } else {
                        Ok(())
                    }
                })),
                None,
            );
        }
        let layout = handle.layout();
        let lens: Vec<usize> = layout
            .iter()
            .map(|t| t.shape.iter().product::<u64>() as usize * t.dtype.size())
            .collect();
        let buffers = if one_allocation {
            Buffer::carved(&lens)
        } else {
            lens.iter().map(|&l| Buffer::zeroed(l)).collect()
        };
        let tensors: Vec<_> = layout
            .into_iter()
            .zip(buffers)
            .map(|(t, b)| (t.name, t.shape, t.dtype, b))
            .collect();
        let dst = tensors
            .iter()
            .map(|(name, shape, dtype, b)| DstTensor {
                name: name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
                memory: b.memory(),
            })
            .collect();
        handle.register(dst).unwrap();
        Engine { handle, tensors }
    }

    /// Every tensor equals the trainers' full parameter of its name at `version`.
    fn check(&self, version: u64) {
        for (name, shape, _, b) in &self.tensors {
            assert!(
                b.read() == full_bytes(name, shape, version),
                "{}: {name} differs from the trainers' version {version}",
                self.handle.worker_id()
            );
        }
    }
}

/// A small Qwen3-MoE as transformers 5 holds it (stacked experts): 4 experts over 3 FSDP ranks
/// are 2, 2 and none.
const MOE_CONFIG: &str = r#"{"model_type":"qwen3_moe","hidden_size":128,"intermediate_size":256,
 "moe_intermediate_size":64,"num_experts":4,"num_experts_per_tok":2,"num_hidden_layers":2,
 "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"vocab_size":256}"#;

/// A controller of the job served on loopback, on its own runtime.
fn controller(dir: &tempfile::TempDir, train: &str) -> (tokio::runtime::Runtime, ServedController) {
    controller_of(dir, CONFIG, train)
}

fn controller_of(
    dir: &tempfile::TempDir,
    config: &str,
    train: &str,
) -> (tokio::runtime::Runtime, ServedController) {
    controller_with(dir, config, train, DType::BF16)
}

fn controller_with(
    dir: &tempfile::TempDir,
    config: &str,
    train: &str,
    dtype: DType,
) -> (tokio::runtime::Runtime, ServedController) {
    serve_job(dir, config, train, "tp=1,dp=2,format=hf", dtype)
}

/// Pushes `version` from every trainer and waits for each.
fn push_all(
    trainers: &[Trainer],
    version: u64,
) -> Vec<Result<weightsync_agent::embed::SyncOutcome, EmbedError>> {
    for t in trainers {
        t.step(version);
    }
    let handles: Vec<_> = trainers
        .iter()
        .map(|t| t.handle.push(version).unwrap())
        .collect();
    handles.iter().map(|h| h.wait(WAIT)).collect()
}

#[test]
fn uneven_fsdp_trainers_land_every_version_in_two_hf_engines_without_staging() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller(&dir, "fsdp=3");
    let control = ctl.control.to_string();
    // rollout-0's tensors share one allocation (one region, offsets unlike the plan's).
    let engines: Vec<Engine> = (0..2)
        .map(|r| Engine::join_with(&control, r, None, r == 0))
        .collect();
    let trainers: Vec<Trainer> = (0..3).map(|r| Trainer::join(&control, r)).collect();
    // torch.chunk over 3 ranks: 86, 86, 84 rows of a 256-row parameter.
    let q = |t: &Trainer| {
        t.shards
            .iter()
            .find(|(s, _)| s.name == "model.layers.0.self_attn.q_proj.weight")
            .map(|(s, _)| s.shape.clone())
            .unwrap()
    };
    assert_eq!(q(&trainers[2]), vec![84, 256]);
    for version in 1..=3 {
        for (rank, r) in push_all(&trainers, version).into_iter().enumerate() {
            let out = r.unwrap_or_else(|e| {
                let why = ctl.state.read(|c| {
                    format!(
                        "plan error {:?}, plan {:?}, active {:?}, ready {}",
                        c.plan_error(),
                        c.latest_plan().map(|p| (p.id, p.awaiting_ready.clone())),
                        c.active().and_then(|a| c.sync(a)).map(|s| format!("{s:?}")),
                        c.plan_ready()
                    )
                });
                panic!("trainer-{rank} version {version}: {e}; controller: {why}")
            });
            assert_eq!(out.version, version);
            assert!(out.direct_bytes > 0 && out.staged_bytes == 0, "{out:?}");
            // Each shard goes to both engines (dp=2); small boxes also to their gatherer.
            assert!(out.bytes >= out.direct_bytes, "{out:?}");
        }
        for e in &engines {
            let st = e.handle.wait_for_version(version, WAIT).unwrap();
            assert_eq!(
                (st.version, st.status),
                (Some(version), EngineStatus::Committed)
            );
            e.check(version);
        }
    }
    // The HTTP trigger moves whatever the registered tensors hold (a driver outside the loop).
    for t in &trainers {
        t.step(4);
    }
    let client = ApiClient::new(&format!("http://{}", ctl.http), Some(API_TOKEN)).unwrap();
    let r = client.sync(4, true, Duration::from_secs(60)).unwrap();
    assert_eq!(
        (r.version, r.state.as_str(), &r.failure),
        (4, "committed", &None)
    );
    assert!(r.bytes > 0 && r.seconds.is_some_and(|s| s > 0.0), "{r:?}");
    assert!(r.direct_bytes > 0 && r.staged_bytes == 0, "{r:?}");
    for e in &engines {
        e.handle.wait_for_version(4, WAIT).unwrap();
        e.check(4);
    }
    // Idempotent for a committed version; an older one never synced is refused.
    let again = client.sync(2, false, Duration::from_secs(10)).unwrap();
    assert_eq!((again.state.as_str(), again.created), ("committed", false));
    let stale = client.sync(0, false, Duration::from_secs(10)).unwrap_err();
    assert!(stale.to_string().contains("409"), "{stale}");
}

#[test]
fn stacked_moe_experts_over_uneven_fsdp_land_in_hf_engines() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller_of(&dir, MOE_CONFIG, "fsdp=3,experts=transformers");
    let control = ctl.control.to_string();
    let engines: Vec<Engine> = (0..2).map(|r| Engine::join(&control, r, None)).collect();
    let trainers: Vec<Trainer> = (0..3).map(|r| Trainer::join(&control, r)).collect();
    let experts = "model.layers.0.mlp.experts.gate_up_proj";
    let held: Vec<Option<Vec<u64>>> = trainers
        .iter()
        .map(|t| {
            t.shards
                .iter()
                .find(|(s, _)| s.name == experts)
                .map(|(s, _)| s.shape.clone())
        })
        .collect();
    assert_eq!(
        held,
        vec![Some(vec![2, 128, 128]), Some(vec![2, 128, 128]), None],
        "rank 2's expert shard is empty and needs no tensor"
    );
    for version in 1..=2 {
        for r in push_all(&trainers, version) {
            let out = r.unwrap();
            assert_eq!(out.staged_bytes, 0, "{out:?}");
        }
        for e in &engines {
            e.handle.wait_for_version(version, WAIT).unwrap();
            e.check(version);
        }
    }
}

/// The failing worker of a failed push.
fn failing_worker(r: &Result<weightsync_agent::embed::SyncOutcome, EmbedError>) -> String {
    match r {
        Err(EmbedError::SyncFailed { worker, .. }) => worker.clone(),
        other => panic!("expected a failed sync, got {other:?}"),
    }
}

#[test]
fn a_failing_engine_fails_the_push_naming_it_and_a_later_version_commits() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller(&dir, "fsdp=2");
    let control = ctl.control.to_string();
    let refuse = Arc::new(AtomicBool::new(false));
    let e0 = Engine::join(&control, 0, None);
    let mut e1 = Engine::join(&control, 1, Some(refuse.clone()));
    let trainers: Vec<Trainer> = (0..2).map(|r| Trainer::join(&control, r)).collect();
    for r in push_all(&trainers, 1) {
        r.unwrap();
    }
    e0.check(1);

    // rollout-1's before_landing hook refuses version 2.
    refuse.store(true, Ordering::SeqCst);
    for r in push_all(&trainers, 2) {
        assert_eq!(failing_worker(&r), "rollout-1");
        assert!(
            matches!(
                r,
                Err(EmbedError::SyncFailed {
                    kind: FailureKind::Hook,
                    ..
                })
            ),
            "{r:?}"
        );
        assert!(r.unwrap_err().to_string().contains("before_landing(2)"));
    }
    let err = e0.handle.wait_for_version(2, WAIT).unwrap_err();
    assert!(
        matches!(err, EmbedError::SyncFailed { version: 2, .. }),
        "{err}"
    );
    let st = e0.handle.state();
    assert_eq!((st.status, st.version), (EngineStatus::Invalid, Some(1)));
    assert!(
        st.cause.unwrap().contains("rollout-1"),
        "the cause names the engine"
    );
    refuse.store(false, Ordering::SeqCst);
    for r in push_all(&trainers, 3) {
        r.unwrap();
    }
    for e in [&e0, &e1] {
        e.handle.wait_for_version(3, WAIT).unwrap();
        e.check(3);
    }

    // rollout-1 closes while version 4 is landing: the push fails naming it, rollout-0 is left
    // invalid; once rollout-1 is back (a new engine registering its tensors), version 5 commits.
    let (landing_tx, landing) = std::sync::mpsc::channel();
    e1.handle.set_hooks(
        Some(Box::new(move |v| {
            let _ = landing_tx.send(v);
            std::thread::sleep(Duration::from_millis(1500));
            Ok(())
        })),
        None,
    );
    for t in &trainers {
        t.step(4);
    }
    let pushes: Vec<_> = trainers.iter().map(|t| t.handle.push(4).unwrap()).collect();
    assert_eq!(landing.recv_timeout(Duration::from_secs(30)).unwrap(), 4);
    // rollout-0 is landing version 4 too before rollout-1 goes: the controller prepares the
    // two independently, and closing rollout-1 first would abort a sync rollout-0 never began.
    let began = std::time::Instant::now();
    while e0.handle.state().status != EngineStatus::Landing {
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "rollout-0 never began landing version 4: {:?}",
            e0.handle.state()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    e1.handle.close();
    for p in &pushes {
        assert_eq!(failing_worker(&p.wait(WAIT)), "rollout-1");
    }
    assert!(e0.handle.wait_for_version(4, WAIT).is_err());
    assert_eq!(e0.handle.state().status, EngineStatus::Invalid);
    e1 = Engine::join(&control, 1, None);
    for r in push_all(&trainers, 5) {
        r.unwrap();
    }
    for e in [&e0, &e1] {
        let st = e.handle.wait_for_version(5, WAIT).unwrap();
        assert_eq!((st.status, st.cause), (EngineStatus::Committed, None));
        e.check(5);
    }

    // The abort arrives while rollout-0's before_landing still runs (rollout-1 refuses at once):
    // rollout-0 was told to stop reading for version 6, so it must hear that 6 failed.
    e1.handle
        .set_hooks(Some(Box::new(|v| Err(format!("refusing {v}")))), None);
    e0.handle.set_hooks(
        Some(Box::new(|_| {
            std::thread::sleep(Duration::from_millis(1500));
            Ok(())
        })),
        None,
    );
    for r in push_all(&trainers, 6) {
        assert_eq!(failing_worker(&r), "rollout-1");
    }
    let err = e0.handle.wait_for_version(6, WAIT).unwrap_err();
    assert!(
        matches!(err, EmbedError::SyncFailed { version: 6, .. }),
        "{err}"
    );
    assert_eq!(e0.handle.state().status, EngineStatus::Invalid);
}

#[test]
fn tensors_that_differ_from_the_layout_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller(&dir, "fsdp=2");
    let control = ctl.control.to_string();
    // A trainer whose q_proj shard has the unsharded shape.
    let t = TrainerHandle::connect(TrainerOptions {
        job_token: Some(JOB_TOKEN.into()),
        ..TrainerOptions::new(&control, 1)
    })
    .unwrap();
    let mut layout = t.layout();
    for s in &mut layout {
        if s.name == "model.layers.1.self_attn.q_proj.weight" {
            s.shape = s.global_shape.clone();
        }
    }
    let buffers = zeroed_shards(layout, 2);
    match t.register(source_tensors(&buffers, None)) {
        Err(EmbedError::LayoutMismatch {
            worker,
            tensor,
            expected,
            actual,
        }) => {
            assert_eq!(worker, "trainer-1");
            assert_eq!(tensor, "model.layers.1.self_attn.q_proj.weight");
            assert!(expected.contains("[128, 256]") && actual.contains("[256, 256]"));
        }
        other => panic!("expected a layout mismatch, got {other:?}"),
    }
    // A trainer whose shards are f32 (FSDP2 under mixed precision) in a job that says bf16:
    // refused naming the first, with what the job must say instead.
    let buffers = zeroed_shards(t.layout(), 4);
    let err = t
        .register(source_tensors(&buffers, Some(DType::F32)))
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(&err, EmbedError::LayoutMismatch { tensor, .. } if *tensor == buffers[0].0.name),
        "{err}"
    );
    assert!(
        text.contains("dtype bf16") && text.contains("got dtype f32") && text.contains("dtype=f32"),
        "{text}"
    );
    // An engine whose lm_head is f32.
    let e = EngineHandle::connect(EngineOptions {
        job_token: Some(JOB_TOKEN.into()),
        ..EngineOptions::new(&control, 0)
    })
    .unwrap();
    let buffers: Vec<_> = e
        .layout()
        .into_iter()
        .map(|t| {
            let f32_head = t.name == "lm_head.weight";
            let dtype = if f32_head { DType::F32 } else { t.dtype };
            let len = t.shape.iter().product::<u64>() as usize * dtype.size();
            (t, dtype, Buffer::zeroed(len))
        })
        .collect();
    let dst = buffers
        .iter()
        .map(|(t, dtype, b)| DstTensor {
            name: t.name.clone(),
            dtype: *dtype,
            shape: t.shape.clone(),
            memory: b.memory(),
        })
        .collect();
    let err = e.register(dst).unwrap_err();
    assert!(
        matches!(&err, EmbedError::LayoutMismatch { tensor, .. } if tensor == "lm_head.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("rollout-0") && err.to_string().contains("f32"));
    // Neither joined the job.
    assert!(ctl.state.read(|c| c.missing_workers().len()) == 4);
}

/// `GET path` from the controller's HTTP API, as JSON.
fn get_json(ctl: &ServedController, path: &str) -> Value {
    let r = http_raw::send(ctl.http, "GET", path, None, b"").unwrap();
    assert_eq!(r.status, 200, "GET {path}: {}", r.text());
    r.json().unwrap()
}

/// The id of the (last) sync of `version`, from the history.
fn sync_id_of(ctl: &ServedController, version: u64) -> u64 {
    let list = get_json(ctl, "/v1/syncs");
    list["syncs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["version"] == version)
        .and_then(|s| s["id"].as_u64())
        .unwrap_or_else(|| panic!("no sync of version {version}: {list}"))
}

/// `(stage, start_ns, end_ns)` of every span on `worker`'s lane of a sync view, in lane order.
fn lane_spans(view: &Value, worker: &str) -> Vec<(String, u64, u64)> {
    let lane = view["lanes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["worker"] == worker)
        .unwrap_or_else(|| panic!("no lane of {worker}: {view}"));
    lane["spans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["stage"].as_str().unwrap().to_string(),
                x["start_ns"].as_u64().unwrap(),
                x["end_ns"].as_u64().unwrap(),
            )
        })
        .collect()
}

const ENGINE_STAGES: [&str; 3] = ["pause", "load", "resume"];

/// The engine stages on `worker`'s lane of a sync view.
fn engine_spans(view: &Value, worker: &str) -> Vec<(String, u64, u64)> {
    lane_spans(view, worker)
        .into_iter()
        .filter(|(s, _, _)| ENGINE_STAGES.contains(&s.as_str()))
        .collect()
}

/// Polls sync `id`'s view until `worker`'s lane holds `n` engine spans (the report travels on
/// its own, unanswered); the view then.
fn view_with_engine_spans(ctl: &ServedController, id: u64, worker: &str, n: usize) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let view = get_json(ctl, &format!("/v1/syncs/{id}"));
        let have = engine_spans(&view, worker).len();
        assert!(
            have <= n,
            "{worker} has {have} engine spans, expected {n}: {view}"
        );
        if have == n {
            return view;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{worker}'s engine spans never reached sync {id}: {view}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An engine's part after a commit, as a staged engine does it: held, loads, resumes; the
/// spans on its own clock, `(pause, load, resume)`.
fn pause_load_resume(e: &EngineHandle) -> [(Stage, u64, u64); 3] {
    let paused = e.now_ns();
    std::thread::sleep(Duration::from_millis(2));
    let load = e.now_ns();
    std::thread::sleep(Duration::from_millis(20));
    let loaded = e.now_ns();
    std::thread::sleep(Duration::from_millis(5));
    let resumed = e.now_ns();
    [
        (Stage::Pause, paused, resumed),
        (Stage::Load, load, loaded),
        (Stage::Resume, loaded, resumed),
    ]
}

#[test]
fn an_engines_pause_load_and_resume_show_on_its_lane_of_the_sync_and_in_the_trace() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller(&dir, "fsdp=2");
    let control = ctl.control.to_string();
    let engines: Vec<Engine> = (0..2).map(|r| Engine::join(&control, r, None)).collect();
    let trainers: Vec<Trainer> = (0..2).map(|r| Trainer::join(&control, r)).collect();
    let e0 = &engines[0].handle;
    for r in push_all(&trainers, 1) {
        r.unwrap();
    }
    e0.wait_for_version(1, WAIT).unwrap();
    let spans = pause_load_resume(e0);
    e0.report_stages(1, &spans).unwrap();
    let id = sync_id_of(&ctl, 1);
    let view = view_with_engine_spans(&ctl, id, "rollout-0", 3);
    assert_eq!(view["state"], "committed");

    // On rollout-0's lane, after its landing, in start order; rollout-1 reported none.
    let lane = lane_spans(&view, "rollout-0");
    let land_end = lane
        .iter()
        .filter(|(s, _, _)| s == "land")
        .map(|&(_, _, e)| e)
        .max()
        .expect("a land span");
    let mine = engine_spans(&view, "rollout-0");
    let names: Vec<&str> = mine.iter().map(|(s, _, _)| s.as_str()).collect();
    assert_eq!(names, ENGINE_STAGES, "{view}");
    let (pause, load, resume) = (&mine[0], &mine[1], &mine[2]);
    assert!(pause.1 >= land_end, "paused after it landed: {lane:?}");
    assert!(
        pause.1 < load.1 && load.2 <= resume.1 && resume.2 == pause.2,
        "{mine:?}"
    );
    // The spans keep their lengths on the sync's axis.
    let len = |s: &(String, u64, u64)| s.2 - s.1;
    assert_eq!(len(load), spans[1].2 - spans[1].1);
    assert!(len(load) >= 20_000_000, "{mine:?}");
    assert!(engine_spans(&view, "rollout-1").is_empty(), "{view}");

    // The trace shows the same spans on rollout-0's thread (microseconds).
    let trace = get_json(&ctl, &format!("/v1/syncs/{id}/trace"));
    let events = trace["traceEvents"].as_array().unwrap();
    let tid = events
        .iter()
        .find(|e| {
            e["name"] == "thread_name"
                && e["args"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("rollout-0"))
        })
        .map(|e| e["tid"].clone())
        .unwrap();
    let traced: Vec<(String, u64)> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["tid"] == tid)
        .filter(|e| ENGINE_STAGES.contains(&e["name"].as_str().unwrap()))
        .map(|e| {
            let ts = e["ts"].as_f64().unwrap();
            (
                e["name"].as_str().unwrap().to_string(),
                (ts * 1e3).round() as u64,
            )
        })
        .collect();
    let want: Vec<(String, u64)> = mine.iter().map(|(s, a, _)| (s.clone(), *a)).collect();
    assert_eq!(traced, want);

    // The next version's stages go to the next sync; the first keeps its own.
    for r in push_all(&trainers, 2) {
        r.unwrap();
    }
    e0.wait_for_version(2, WAIT).unwrap();
    e0.report_stages(2, &pause_load_resume(e0)).unwrap();
    let id2 = sync_id_of(&ctl, 2);
    assert_ne!(id2, id);
    view_with_engine_spans(&ctl, id2, "rollout-0", 3);
    let first = get_json(&ctl, &format!("/v1/syncs/{id}"));
    assert_eq!(engine_spans(&first, "rollout-0"), mine);
    engines[1].check(2);
}

#[test]
fn a_bad_stage_report_changes_nothing_and_the_engine_keeps_syncing() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller(&dir, "fsdp=2");
    let control = ctl.control.to_string();
    let refuse = Arc::new(AtomicBool::new(false));
    let e0 = Engine::join(&control, 0, None);
    let _e1 = Engine::join(&control, 1, Some(refuse.clone()));
    let trainers: Vec<Trainer> = (0..2).map(|r| Trainer::join(&control, r)).collect();
    for r in push_all(&trainers, 1) {
        r.unwrap();
    }
    let h = &e0.handle;
    h.wait_for_version(1, WAIT).unwrap();
    let id1 = sync_id_of(&ctl, 1);
    let before = get_json(&ctl, &format!("/v1/syncs/{id1}"));

    // Refused before anything is sent, naming what was wrong.
    let now = h.now_ns();
    let refusal = |r: Result<(), EmbedError>| match r {
        Err(e @ EmbedError::InvalidStageReport { .. }) => e.to_string(),
        other => panic!("expected a refused report, got {other:?}"),
    };
    let never = refusal(h.report_stages(9, &[(Stage::Pause, now - 10, now)]));
    assert!(never.contains("never told to prepare version 9"), "{never}");
    let backwards = refusal(h.report_stages(1, &[(Stage::Load, now, now - 10)]));
    assert!(backwards.contains("ends before it starts"), "{backwards}");
    let not_mine = refusal(h.report_stages(1, &[(Stage::Land, now - 10, now)]));
    assert!(
        not_mine.contains("land is not a stage an engine reports"),
        "{not_mine}"
    );

    // Version 2 fails (rollout-1 refuses it): rollout-0 prepared it, so its report is sent,
    // and the controller refuses it.
    refuse.store(true, Ordering::SeqCst);
    for r in push_all(&trainers, 2) {
        assert_eq!(failing_worker(&r), "rollout-1");
        assert!(
            matches!(
                r,
                Err(EmbedError::SyncFailed {
                    kind: FailureKind::Hook,
                    ..
                })
            ),
            "{r:?}"
        );
    }
    assert!(h.wait_for_version(2, WAIT).is_err());
    let id2 = sync_id_of(&ctl, 2);
    h.report_stages(2, &pause_load_resume(h)).unwrap();

    // The engine keeps syncing, and its next report lands; the same connection carried the
    // refused one first, so by now the controller has dealt with it.
    refuse.store(false, Ordering::SeqCst);
    for r in push_all(&trainers, 3) {
        r.unwrap();
    }
    h.wait_for_version(3, WAIT).unwrap();
    e0.check(3);
    h.report_stages(3, &pause_load_resume(h)).unwrap();
    let id3 = sync_id_of(&ctl, 3);
    view_with_engine_spans(&ctl, id3, "rollout-0", 3);
    let failed = get_json(&ctl, &format!("/v1/syncs/{id2}"));
    assert_eq!(failed["state"], "failed");
    assert!(engine_spans(&failed, "rollout-0").is_empty(), "{failed}");
    assert_eq!(get_json(&ctl, &format!("/v1/syncs/{id1}")), before);
}

#[test]
fn a_stage_report_sent_just_before_the_engine_leaves_reaches_the_controller() {
    // The report waits in the engine's queue to the controller; leaving writes that queue out
    // before the connection closes, rather than dropping it with the runtime (seen as an
    // engine's last version without its pause, load and resume on the dashboard).
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller(&dir, "fsdp=2");
    let control = ctl.control.to_string();
    let engines: Vec<Engine> = (0..2).map(|r| Engine::join(&control, r, None)).collect();
    let trainers: Vec<Trainer> = (0..2).map(|r| Trainer::join(&control, r)).collect();
    for r in push_all(&trainers, 1) {
        r.unwrap();
    }
    for e in &engines {
        e.handle.wait_for_version(1, WAIT).unwrap();
        e.check(1);
        e.handle
            .report_stages(1, &pause_load_resume(&e.handle))
            .unwrap();
        e.handle.close();
        assert!(matches!(
            e.handle.report_stages(1, &pause_load_resume(&e.handle)),
            Err(EmbedError::Closed { .. })
        ));
    }
    let id = sync_id_of(&ctl, 1);
    for worker in ["rollout-0", "rollout-1"] {
        let view = view_with_engine_spans(&ctl, id, worker, 3);
        let names: Vec<String> = engine_spans(&view, worker)
            .into_iter()
            .map(|(s, _, _)| s)
            .collect();
        assert_eq!(names, ENGINE_STAGES, "{view}");
    }
}
