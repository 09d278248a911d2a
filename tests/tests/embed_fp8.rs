//! In-process trainers registering their shards in place, feeding fp8 engines in the Hugging
//! Face layout: quantisation, fp8 blocks straddling uneven FSDP shards (gathered between
//! trainers) and plain bf16 copies in one job. Every engine tensor (fp8 weights, f32
//! `weight_scale_inv`, bf16 norms and embeddings) equals the demo's independent recomputation
//! (`weightsync_agent::demo_weights::expected_rollout`: the scalar reference quantiser on the
//! logical tensors), byte for byte.

use std::sync::Arc;
use std::time::Duration;

use weightsync_agent::demo_weights::{expected_rollout, fill_shard};
use weightsync_agent::embed::{
    DstTensor, EngineHandle, EngineOptions, HostMemory, SourceTensor, TrainerHandle, TrainerOptions,
};
use weightsync_common::protocol::WorldSpec;
use weightsync_common::DType;
use weightsync_controller::{AppState, ControllerConfig, SchedulesPlanner};
use weightsync_schedules::job;
use weightsync_schedules::table::{LocalShard, ParamRef, TensorBox};
use weightsync_tests::controller_harness::{ServedController, API_TOKEN, JOB_TOKEN};

const CONFIG: &str = r#"{"model_type":"qwen3","hidden_size":256,"intermediate_size":512,
 "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,
 "vocab_size":320}"#;
const SEED: u64 = 7;

/// A vector registered in place; the registration keeps a clone of the Arc.
fn memory(bytes: &Arc<Vec<u8>>) -> HostMemory {
    // SAFETY: heap memory of this length that never moves, kept alive by the owner passed
    // along; written by the test only between syncs, read only after a commit.
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
    // SAFETY: as in `memory`; no sync runs while the test writes.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), bytes.as_ptr() as *mut u8, data.len()) };
}

fn read(bytes: &Arc<Vec<u8>>) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    // SAFETY: read after the version committed.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr(), out.len()) };
    out
}

#[test]
fn fp8_engines_hold_the_reference_quantisation_of_registered_shards() {
    std::env::set_var("WEIGHTSYNC_JOB_TOKEN", JOB_TOKEN);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, CONFIG).unwrap();
    let world = WorldSpec {
        model: path.to_string_lossy().into_owned(),
        train: "fsdp=3".into(),
        infer: "tp=1,dp=2,format=hf".into(),
        dtype: DType::F8E4M3,
        verify: true,
    };
    let layouts = job::layouts(&world, Some(CONFIG)).unwrap();
    let cfg = ControllerConfig::for_job(
        world,
        JOB_TOKEN.into(),
        API_TOKEN.into(),
        Duration::from_secs(3),
        Duration::from_secs(30),
        16,
    )
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ctl = rt.block_on(ServedController::start(AppState::new(
        cfg,
        Box::new(SchedulesPlanner),
    )));
    let control = ctl.control.to_string();

    let mut engines = Vec::new();
    for rank in 0..2 {
        let e = EngineHandle::connect(EngineOptions::new(&control, rank)).unwrap();
        let bufs: Vec<_> = e
            .layout()
            .into_iter()
            .map(|t| {
                let len = t.shape.iter().product::<u64>() as usize * t.dtype.size();
                (t, Arc::new(vec![0u8; len]))
            })
            .collect();
        let dst = bufs
            .iter()
            .map(|(t, b)| DstTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                memory: memory(b),
            })
            .collect();
        e.register(dst).unwrap();
        engines.push((rank, e, bufs));
    }
    let params = &layouts.model.params;
    let mut trainers = Vec::new();
    for rank in 0..3 {
        let t = TrainerHandle::connect(TrainerOptions::new(&control, rank)).unwrap();
        let shards: Vec<_> = t
            .layout()
            .into_iter()
            .map(|s| {
                let len = s.shape.iter().product::<u64>() as usize * s.dtype.size();
                (s, Arc::new(vec![0u8; len]))
            })
            .collect();
        let tensors = shards
            .iter()
            .map(|(s, b)| SourceTensor {
                name: s.name.clone(),
                dtype: s.dtype,
                shape: s.shape.clone(),
                memory: memory(b),
            })
            .collect();
        t.register(tensors).unwrap();
        trainers.push((t, shards));
    }
    for version in 1..=2 {
        for (_, shards) in &trainers {
            for (s, b) in shards {
                let id = params.iter().position(|p| *p.name == *s.name).unwrap() as u32;
                let p = &params[id as usize];
                let start: Vec<u32> = s.offset.iter().map(|&d| d as u32).collect();
                let len: Vec<u32> = s.shape.iter().map(|&d| d as u32).collect();
                let shard = LocalShard {
                    param: id,
                    global: TensorBox::new(&start, &len),
                    dtype: s.dtype,
                    offset: 0,
                };
                let param = ParamRef {
                    id,
                    name: p.name.clone(),
                    shape: p.shape,
                };
                let mut data = vec![0u8; b.len()];
                fill_shard(&mut data, &shard, &param, SEED, version);
                write(b, &data);
            }
        }
        let pushes: Vec<_> = trainers
            .iter()
            .map(|(t, _)| t.push(version).unwrap())
            .collect();
        let outcomes: Vec<_> = pushes
            .iter()
            .map(|p| p.wait(Some(Duration::from_secs(60))).unwrap())
            .collect();
        // fp8 weights are quantised through staging; bf16 norms and embeddings go direct.
        assert!(outcomes
            .iter()
            .all(|o| o.staged_bytes > 0 && o.direct_bytes > 0));
        for (rank, e, bufs) in &engines {
            e.wait_for_version(version, Some(Duration::from_secs(60)))
                .unwrap();
            let want = expected_rollout(&layouts.model, &layouts.infer, *rank, SEED, version);
            let planned = job::rollout_layout(&layouts.infer, *rank).unwrap();
            for (t, b) in bufs {
                let p = planned.tensors.iter().find(|p| p.name == t.name).unwrap();
                let (a, z) = (p.offset as usize, (p.offset + p.len) as usize);
                assert!(
                    read(b) == want[p.mr as usize][a..z],
                    "rollout-{rank}: {} ({}) differs from the reference at version {version}",
                    t.name,
                    t.dtype
                );
            }
        }
    }
}
