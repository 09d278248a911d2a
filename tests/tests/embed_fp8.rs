//! In-process trainers registering their shards in place, feeding fp8 engines in the Hugging
//! Face layout: quantisation, fp8 blocks straddling uneven FSDP shards (gathered between
//! trainers) and plain bf16 copies in one job. Every engine tensor (fp8 weights, f32
//! `weight_scale_inv`, bf16 norms and embeddings) equals the demo's independent recomputation
//! (`weightsync_demo::weights::expected_rollout`: the scalar reference quantiser on the
//! logical tensors), byte for byte.

use std::time::Duration;

use weightsync_agent::embed::{
    DstTensor, DstTensorInfo, EngineHandle, EngineOptions, ShardInfo, SourceTensor, TrainerHandle,
    TrainerOptions,
};
use weightsync_common::DType;
use weightsync_common::protocol::WorldSpec;
use weightsync_demo::weights::{expected_rollout, fill_shard};
use weightsync_schedules::job::{self, JobLayouts};
use weightsync_schedules::table::{LocalShard, ParamRef, TensorBox};
use weightsync_tests::controller_harness::{JOB_TOKEN, ServedController};
use weightsync_tests::embed_fixture::{Buffer, serve_job};

const CONFIG: &str = r#"{"model_type":"qwen3","hidden_size":256,"intermediate_size":512,
 "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,
 "vocab_size":320}"#;
const SEED: u64 = 7;
const TRAIN: &str = "fsdp=3";
const INFER: &str = "tp=1,dp=2,format=hf";

type Buffers<T> = Vec<(T, Buffer)>;

/// The controller of the fp8 job, served on loopback, and the job's layouts.
fn serve(dir: &tempfile::TempDir) -> (tokio::runtime::Runtime, ServedController, JobLayouts) {
    let (rt, ctl) = serve_job(dir, CONFIG, TRAIN, INFER, DType::F8E4M3);
    let world = WorldSpec {
        model: dir
            .path()
            .join("config.json")
            .to_string_lossy()
            .into_owned(),
        train: TRAIN.into(),
        infer: INFER.into(),
        dtype: DType::F8E4M3,
        verify: true,
    };
    let layouts = job::layouts(&world, Some(CONFIG)).unwrap();
    (rt, ctl, layouts)
}

/// An engine registering zeroed tensors of its planned layout.
fn engine(control: &str, rank: u32) -> (EngineHandle, Buffers<DstTensorInfo>) {
    let e = EngineHandle::connect(EngineOptions {
        job_token: Some(JOB_TOKEN.into()),
        ..EngineOptions::new(control, rank)
    })
    .unwrap();
    let bufs = Buffer::zeroed_layout(e.layout());
    let dst = bufs
        .iter()
        .map(|(t, b)| DstTensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            memory: b.memory(),
        })
        .collect();
    e.register(dst).unwrap();
    (e, bufs)
}

/// A trainer registering zeroed shards of its layout.
fn trainer(control: &str, rank: u32) -> (TrainerHandle, Buffers<ShardInfo>) {
    let t = TrainerHandle::connect(TrainerOptions {
        job_token: Some(JOB_TOKEN.into()),
        ..TrainerOptions::new(control, rank)
    })
    .unwrap();
    let shards: Vec<_> = t
        .layout()
        .into_iter()
        .map(|s| {
            let len = s.shape.iter().product::<u64>() as usize * s.dtype.size();
            (s, Buffer::zeroed(len))
        })
        .collect();
    let tensors = shards
        .iter()
        .map(|(s, b)| SourceTensor {
            name: s.name.clone(),
            dtype: s.dtype,
            shape: s.shape.clone(),
            memory: b.memory(),
        })
        .collect();
    t.register(tensors).unwrap();
    (t, shards)
}

/// A training step: every shard takes the demo values of `version`.
fn step(layouts: &JobLayouts, shards: &Buffers<ShardInfo>, version: u64) {
    let params = &layouts.model.params;
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
        b.fill(&data);
    }
}

/// Every tensor of inference rank `rank` equals the reference of `version`.
fn check(layouts: &JobLayouts, rank: u32, bufs: &Buffers<DstTensorInfo>, version: u64) {
    let want = expected_rollout(&layouts.model, &layouts.infer, rank, SEED, version);
    let planned = job::rollout_layout(&layouts.infer, rank).unwrap();
    for (t, b) in bufs {
        let p = planned.tensors.iter().find(|p| p.name == t.name).unwrap();
        let (a, z) = (p.offset as usize, (p.offset + p.len) as usize);
        assert!(
            b.read() == want[p.mr as usize][a..z],
            "rollout-{rank}: {} ({}) differs from the reference at version {version}",
            t.name,
            t.dtype
        );
    }
}

#[test]
fn fp8_engines_hold_the_reference_quantisation_of_registered_shards() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl, layouts) = serve(&dir);
    let control = ctl.control.to_string();
    let engines: Vec<_> = (0..2).map(|r| engine(&control, r)).collect();
    let trainers: Vec<_> = (0..3).map(|r| trainer(&control, r)).collect();
    let wait = Some(Duration::from_secs(60));
    for version in 1..=2 {
        for (_, shards) in &trainers {
            step(&layouts, shards, version);
        }
        let pushes: Vec<_> = trainers
            .iter()
            .map(|(t, _)| t.push(version).unwrap())
            .collect();
        for p in &pushes {
            let o = p.wait(wait).unwrap();
            // fp8 weights are quantised through staging; bf16 norms and embeddings go direct.
            assert!(o.staged_bytes > 0 && o.direct_bytes > 0, "{o:?}");
        }
        for (rank, (e, bufs)) in engines.iter().enumerate() {
            e.wait_for_version(version, wait).unwrap();
            check(&layouts, rank as u32, bufs, version);
        }
    }
}
