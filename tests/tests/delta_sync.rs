//! Delta syncs end to end: in-process trainers and engines (`weightsync_agent::embed`) against a
//! real controller served on loopback, every byte over the TCP fabric.
//!
//! The trainers hold f32 master weights and the engines bf16 (a cast: the trainers stage every
//! task, so they keep bases and send deltas). Between versions about 2% of the elements change.
//! Checked after every version: each engine tensor equals the trainers' cast byte for byte; the
//! first sync is full, later ones send deltas to both engines and move a small fraction of the
//! full bytes (the sync's `delta` figures in the controller's JSON and `/metrics`); an engine
//! that restarted gets a full sync while the other gets deltas, then deltas again; a failed sync
//! makes the next one full for its engines; a job that turned deltas off (`--delta=off`) syncs
//! in full; a job that left the default (`auto`) probes a delta after its first full sync and
//! keeps whichever kind measured faster, saying why in each sync's `delta_policy`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;
use weightsync_agent::embed::{
    DstTensor, EngineHandle, EngineOptions, HostMemory, ShardInfo, SourceTensor, TrainerHandle,
    TrainerOptions,
};
use weightsync_common::DType;
use weightsync_common::protocol::WorldSpec;
use weightsync_controller::{AppState, ControllerConfig, DeltaMode, SchedulesPlanner};
use weightsync_tests::controller_harness::{API_TOKEN, JOB_TOKEN, ServedController};
use weightsync_tests::http_raw;

const CONFIG: &str = r#"{"model_type":"qwen3","hidden_size":128,"intermediate_size":256,
 "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
 "vocab_size":256}"#;

const WAIT: Option<Duration> = Some(Duration::from_secs(30));

/// Percent of elements that change per version.
const CHANGED_PERCENT: u64 = 2;

fn hash(name: &str, flat: u64, salt: u64) -> u64 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let x = (h ^ flat.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ salt.wrapping_mul(0x85eb_ca6b))
        .wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^ (x >> 29)
}

/// The bf16 bits of element `flat` of `name` at `version`: it changes at a version with
/// probability `CHANGED_PERCENT`%.
fn bf16_bits(name: &str, flat: u64, version: u64) -> u16 {
    let last = (1..=version)
        .rev()
        .find(|&v| hash(name, flat, v) % 100 < CHANGED_PERCENT)
        .unwrap_or(0);
    (hash(name, flat, last ^ 0xabcd) >> 17) as u16 & 0x3fff
}

/// Bytes of the memory at `ptr`, `len` long, kept alive by `owner`.
fn memory(bytes: &Arc<Vec<u8>>) -> HostMemory {
    // SAFETY: heap memory of a vector that never moves; the registration keeps a clone of the
    // Arc; the test writes it only between syncs and reads it only after a commit.
    unsafe {
        HostMemory::from_raw(
            bytes.as_ptr() as *mut u8,
            bytes.len(),
            Box::new(bytes.clone()),
        )
    }
}

fn write(bytes: &Arc<Vec<u8>>, data: &[u8]) {
    assert_eq!(bytes.len(), data.len());
    // SAFETY: in the vector; no sync runs while the test fills it.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), bytes.as_ptr() as *mut u8, data.len()) };
}

struct Trainer {
    handle: TrainerHandle,
    shards: Vec<(ShardInfo, Arc<Vec<u8>>)>,
}

impl Trainer {
    /// f32 shards (bf16 values widened: the engines' cast is exact).
    fn join(control: &str, rank: u32) -> Trainer {
        let handle = TrainerHandle::connect(TrainerOptions {
            job_token: Some(JOB_TOKEN.into()),
            ..TrainerOptions::new(control, rank)
        })
        .unwrap();
        let shards: Vec<_> = handle
            .layout()
            .into_iter()
            .map(|s| {
                let n = s.shape.iter().product::<u64>() as usize;
                (s, Arc::new(vec![0u8; n * 4]))
            })
            .collect();
        let tensors = shards
            .iter()
            .map(|(s, b)| SourceTensor {
                name: s.name.clone(),
                dtype: DType::F32,
                shape: s.shape.clone(),
                memory: memory(b),
            })
            .collect();
        handle.register(tensors).unwrap();
        Trainer { handle, shards }
    }

    fn step(&self, version: u64) {
        for (s, b) in &self.shards {
            let n: u64 = s.shape.iter().product();
            let mut out = Vec::with_capacity(n as usize * 4);
            let mut coords = vec![0u64; s.shape.len()];
            for local in 0..n {
                let mut rest = local;
                for d in (0..s.shape.len()).rev() {
                    coords[d] = rest % s.shape[d] + s.offset[d];
                    rest /= s.shape[d];
                }
                let (mut global, mut stride) = (0u64, 1u64);
                for d in (0..s.shape.len()).rev() {
                    global += coords[d] * stride;
                    stride *= s.global_shape[d];
                }
                let bits = u32::from(bf16_bits(&s.name, global, version)) << 16;
                out.extend_from_slice(&bits.to_le_bytes());
            }
            write(b, &out);
        }
    }
}

struct Engine {
    handle: EngineHandle,
    tensors: Vec<(String, Vec<u64>, Arc<Vec<u8>>)>,
}

impl Engine {
    fn join(control: &str, rank: u32, refuse: Option<Arc<AtomicBool>>) -> Engine {
        let handle = EngineHandle::connect(EngineOptions {
            job_token: Some(JOB_TOKEN.into()),
            ..EngineOptions::new(control, rank)
        })
        .unwrap();
        if let Some(refuse) = refuse {
            handle.set_hooks(
                Some(Box::new(move |v| {
                    if refuse.load(Ordering::SeqCst) {
                        Err(format!("refusing version {v}"))
                    } else {
                        Ok(())
                    }
                })),
                None,
            );
        }
        let tensors: Vec<_> = handle
            .layout()
            .into_iter()
            .map(|t| {
                let len = t.shape.iter().product::<u64>() as usize * t.dtype.size();
                (t.name, t.shape, Arc::new(vec![0u8; len]))
            })
            .collect();
        let dst = tensors
            .iter()
            .map(|(name, shape, b)| DstTensor {
                name: name.clone(),
                dtype: DType::BF16,
                shape: shape.clone(),
                memory: memory(b),
            })
            .collect();
        handle.register(dst).unwrap();
        Engine { handle, tensors }
    }

    /// Every tensor equals the trainers' version `version`, byte for byte.
    fn check(&self, version: u64) {
        self.handle.wait_for_version(version, WAIT).unwrap();
        for (name, shape, b) in &self.tensors {
            let n: u64 = shape.iter().product();
            let want: Vec<u8> = (0..n)
                .flat_map(|i| bf16_bits(name, i, version).to_le_bytes())
                .collect();
            assert!(
                **b == want,
                "{}: {name} differs from version {version}",
                self.handle.worker_id()
            );
        }
    }
}

/// A controller of the job; `delta`: its delta mode (`None`: the default).
fn controller(
    dir: &tempfile::TempDir,
    delta: Option<DeltaMode>,
) -> (tokio::runtime::Runtime, ServedController) {
    let path = dir.path().join("config.json");
    std::fs::write(&path, CONFIG).unwrap();
    let world = WorldSpec {
        model: path.to_string_lossy().into_owned(),
        train: "fsdp=2,dtype=f32".into(),
        infer: "tp=1,dp=2,format=hf".into(),
        dtype: DType::BF16,
        verify: true,
    };
    let mut cfg = ControllerConfig::for_job(
        world,
        JOB_TOKEN.into(),
        API_TOKEN.into(),
        Duration::from_secs(3),
        Duration::from_secs(60),
        64,
    )
    .unwrap();
    if let Some(mode) = delta {
        cfg.delta = mode;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ctl = rt.block_on(ServedController::start(AppState::new(
        cfg,
        Box::new(SchedulesPlanner),
    )));
    (rt, ctl)
}

/// Steps every trainer to `version` and pushes it; `Ok` when every push committed.
fn push(trainers: &[Trainer], version: u64) -> Result<(), String> {
    for t in trainers {
        t.step(version);
    }
    let handles: Vec<_> = trainers
        .iter()
        .map(|t| t.handle.push(version).unwrap())
        .collect();
    for h in handles {
        h.wait(WAIT).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn get(ctl: &ServedController, path: &str) -> http_raw::RawResponse {
    let r = http_raw::send(ctl.http, "GET", path, None, b"").unwrap();
    assert_eq!(r.status, 200, "GET {path}: {}", r.text());
    r
}

/// The JSON of the last sync of `version`.
fn sync_of(ctl: &ServedController, version: u64) -> Value {
    let list: Value = get(ctl, "/v1/syncs").json().unwrap();
    list["syncs"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|s| s["version"] == version)
        .cloned()
        .unwrap_or_else(|| panic!("no sync of version {version}: {list}"))
}

/// The `delta` figures of the last sync of `version` (`Null`: a full sync).
fn delta_of(ctl: &ServedController, version: u64) -> Value {
    sync_of(ctl, version)["delta"].clone()
}

/// A delta sync to `engines` of the 2 engines: those move under a fifth of their full bytes,
/// the others all of theirs.
fn assert_delta(d: &Value, engines: u64) {
    assert_eq!(d["engines"], engines, "{d}");
    let fraction = d["wire_fraction"].as_f64().unwrap();
    let most = (2 - engines) as f64 / 2.0 + 0.2 * engines as f64 / 2.0;
    assert!(fraction < most, "moved {fraction} of the full bytes: {d}");
    let changed = d["changed_fraction"].as_f64().unwrap();
    assert!(changed > 0.005 && changed < 0.05, "changed {changed}: {d}");
    assert!(d["delta_bytes"].as_u64().unwrap() > 0, "{d}");
}

#[test]
fn deltas_land_byte_exact_and_restarts_and_failures_get_a_full_sync_first() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller(&dir, Some(DeltaMode::On));
    let control = ctl.control.to_string();
    let refuse = Arc::new(AtomicBool::new(false));
    let e0 = Engine::join(&control, 0, None);
    let mut e1 = Engine::join(&control, 1, Some(refuse.clone()));
    let trainers: Vec<Trainer> = (0..2).map(|r| Trainer::join(&control, r)).collect();

    // Version 1: nothing committed yet, a full sync. Then deltas to both engines.
    push(&trainers, 1).unwrap();
    assert!(delta_of(&ctl, 1).is_null());
    for v in 2..=3 {
        push(&trainers, v).unwrap();
        e0.check(v);
        e1.check(v);
        assert_delta(&delta_of(&ctl, v), 2);
    }
    let metrics = get(&ctl, "/metrics").text();
    assert!(
        metrics.contains("weightsync_delta_syncs_total 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("weightsync_delta_wire_bytes_total"),
        "{metrics}"
    );

    // rollout-1 restarts (a new engine, zeroed tensors): it gets a full sync, rollout-0 deltas.
    e1.handle.close();
    e1 = Engine::join(&control, 1, Some(refuse.clone()));
    push(&trainers, 4).unwrap();
    e0.check(4);
    e1.check(4);
    assert_delta(&delta_of(&ctl, 4), 1);
    push(&trainers, 5).unwrap();
    e0.check(5);
    e1.check(5);
    assert_delta(&delta_of(&ctl, 5), 2);

    // rollout-1 refuses version 6: the sync fails; 7 is full for both engines, 8 deltas again.
    refuse.store(true, Ordering::SeqCst);
    assert!(push(&trainers, 6).is_err());
    refuse.store(false, Ordering::SeqCst);
    push(&trainers, 7).unwrap();
    e0.check(7);
    e1.check(7);
    assert!(delta_of(&ctl, 7).is_null(), "{}", delta_of(&ctl, 7));
    push(&trainers, 8).unwrap();
    e0.check(8);
    e1.check(8);
    assert_delta(&delta_of(&ctl, 8), 2);
}

#[test]
fn syncs_are_full_when_the_job_turns_deltas_off() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller(&dir, Some(DeltaMode::Off));
    let control = ctl.control.to_string();
    let engines: Vec<Engine> = (0..2).map(|r| Engine::join(&control, r, None)).collect();
    let trainers: Vec<Trainer> = (0..2).map(|r| Trainer::join(&control, r)).collect();
    for v in 1..=2 {
        push(&trainers, v).unwrap();
        for e in &engines {
            e.check(v);
        }
        assert!(delta_of(&ctl, v).is_null());
        assert_eq!(sync_of(&ctl, v)["delta_policy"], "off");
    }
}

/// A sync's `Start` to commit, ms, as its JSON shows it (what the auto policy compares), to the
/// reasons' precision.
fn start_to_commit(s: &Value) -> String {
    let total = s["stages"]["total_ms"].as_f64().unwrap();
    let prepare = s["stages"]["prepare_ms"].as_f64().unwrap();
    format!("{:.1} ms", total - prepare)
}

#[test]
fn a_default_controller_probes_deltas_and_keeps_the_kind_that_measured_faster() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller(&dir, None);
    let control = ctl.control.to_string();
    let engines: Vec<Engine> = (0..2).map(|r| Engine::join(&control, r, None)).collect();
    let trainers: Vec<Trainer> = (0..2).map(|r| Trainer::join(&control, r)).collect();
    for v in 1..=3 {
        push(&trainers, v).unwrap();
        for e in &engines {
            e.check(v);
        }
    }
    let s: Vec<Value> = (1..=3).map(|v| sync_of(&ctl, v)).collect();
    // Nothing to take deltas on: full, and measured.
    assert_eq!(
        s[0]["delta_policy"],
        "auto: full (nothing committed in this run yet)"
    );
    assert!(s[0]["delta"].is_null());
    // Both engines hold version 1: a probe, sent as deltas.
    let full_1 = start_to_commit(&s[0]);
    assert_eq!(s[1]["delta_policy"], format!("auto: probe (full {full_1})"));
    assert_delta(&s[1]["delta"], 2);
    // From then on, whichever kind was faster, with the measurements it compared.
    let mut last_full = full_1;
    let mut last_delta = start_to_commit(&s[1]);
    for (i, sync) in s.iter().enumerate().skip(2) {
        let why = sync["delta_policy"].as_str().unwrap();
        if sync["delta"].is_null() {
            assert!(
                why.starts_with(&format!(
                    "auto: full pays (delta {last_delta} vs full {last_full}; probe again in"
                )),
                "version {}: {why}",
                i + 1
            );
            last_full = start_to_commit(sync);
        } else {
            assert_eq!(
                why,
                format!("auto: delta pays ({last_delta} vs full {last_full})"),
                "version {}",
                i + 1
            );
            assert_delta(&sync["delta"], 2);
            last_delta = start_to_commit(sync);
        }
    }
    let metrics = get(&ctl, "/metrics").text();
    for decision in ["unavailable", "probe"] {
        assert!(
            metrics.contains(&format!(
                "weightsync_delta_decisions_total{{decision=\"{decision}\"}} 1"
            )),
            "{metrics}"
        );
    }
}
