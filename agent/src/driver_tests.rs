//! The production drivers with no controller: what a trainer builds is what its slice says, and a
//! rollout's own layout is the table's (only the expectations come with the assignment).

use std::sync::Arc;
use std::time::Duration;

use weightsync_common::DType;
use weightsync_common::fabric::FabricConfig;
use weightsync_common::protocol::{Assignment, Blob, WorldSpec};
use weightsync_schedules::job::{Job, plan_job};

use crate::driver::SyncDriver;
use crate::rollout::{RolloutDriver, RolloutDriverConfig};
use crate::source::{ProvideSource, SourceSpec};
use crate::trainer::{TrainerDriver, TrainerDriverConfig};

/// Two layers of a small Qwen3, 128-wide heads (so fp8 blocks straddle fsdp=4 shards).
const TINY: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
  "vocab_size": 1024, "tie_word_embeddings": false
}"#;

/// The tiny job, its config written where the world's `model` points.
fn job(dir: &std::path::Path) -> (WorldSpec, Job) {
    let path = dir.join("tiny.json");
    std::fs::write(&path, TINY).unwrap();
    let world = WorldSpec {
        model: path.display().to_string(),
        train: "fsdp=4".into(),
        infer: "tp=2,dp=2".into(),
        dtype: DType::F8E4M3,
        verify: true,
    };
    let job = plan_job(&world, Some(TINY)).unwrap();
    (world, job)
}

/// A source of zeros laid out as the plan's arena (what it holds does not matter here).
#[derive(Debug)]
struct ZeroedArena;

impl ProvideSource for ZeroedArena {
    fn attach(
        &self,
        plan: &weightsync_schedules::table::TrainerPlan,
    ) -> Result<Arc<dyn weightsync_worker::SourceView>, crate::DriverError> {
        Ok(Arc::new(vec![0u8; plan.source_arena_bytes as usize]))
    }
}

fn blob<T: serde::Serialize>(v: &T) -> Blob {
    Blob(bincode::serialize(v).unwrap())
}

#[tokio::test]
async fn a_trainer_executes_the_slice_it_is_sent_and_refuses_another_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let (world, job) = job(dir.path());
    let mut d = TrainerDriver::new(TrainerDriverConfig {
        world,
        rank: 1,
        fabric: FabricConfig::loopback("driver-tests", 1),
        watermark_bytes: 4 << 20,
        source: SourceSpec::Provided(Arc::new(ZeroedArena)),
    })
    .await
    .unwrap();
    let info = d.info();
    assert!(info.regions.is_empty() && info.tensors.is_empty());
    assert!(
        d.plan().is_none(),
        "nothing is planned before the assignment"
    );

    let slice = job.table.slice(1).unwrap();
    assert!(
        slice.gather_arena_bytes > 0,
        "the tiny job gathers straddling fp8 blocks"
    );
    let accepted = d
        .assign(Assignment::Trainer {
            plan_id: 1,
            slice: blob(&slice),
            delta: false,
        })
        .await
        .unwrap();
    let plan = slice.expand().unwrap();
    assert_eq!(d.plan(), Some(&plan), "it executes its slice, expanded");
    assert_eq!(accepted.regions.len(), 1, "its gather arena's descriptor");
    assert_eq!(accepted.tensors.len(), plan.shards.len());

    let other = job.table.slice(2).unwrap();
    let e = d
        .assign(Assignment::Trainer {
            plan_id: 2,
            slice: blob(&other),
            delta: false,
        })
        .await
        .unwrap_err();
    assert!(e.cause.contains("training rank 2's, this is rank 1"), "{e}");
    assert_eq!(d.plan(), Some(&plan), "the refused slice replaced nothing");
}

#[tokio::test]
async fn a_rollout_lays_out_what_the_table_does_and_takes_only_its_expectations() {
    let dir = tempfile::tempdir().unwrap();
    let (world, job) = job(dir.path());
    let mut d = rank_2_rollout(world, Duration::from_secs(5)).await;
    let planned = &job.table.rollout(2).unwrap();
    assert!(d.worker().plan().expect.is_empty(), "no table yet");
    assert_eq!(d.worker().layout(), &planned.tensors[..]);
    assert_eq!(d.info().regions.len(), planned.mr_bytes.len());

    let assign = |plan: &weightsync_schedules::table::RolloutPlan| Assignment::Rollout {
        plan_id: 1,
        expected: blob(plan),
        expected_writes: 0,
        expected_bytes: 0,
        delta: false,
    };
    let e = d
        .assign(assign(&job.table.rollout(0).unwrap()))
        .await
        .unwrap_err();
    assert!(e.cause.contains("another layout"), "{e}");
    d.assign(assign(planned)).await.unwrap();
    assert_eq!(d.worker().plan(), planned);
}

/// Issue 39: a rollout's regions take writes only between its `Prepare` and its landing, and
/// the close that follows a landing never lands after the next sync's arm (the next `Prepare`
/// may come at once; with verbs the close runs on the blocking pool, see `rollout.rs`).
#[tokio::test]
async fn a_rollout_takes_writes_only_between_its_prepare_and_its_landing() {
    use std::time::Instant;
    use weightsync_common::fabric::{Access, Fabric, FabricBackend, RemoteAccessKind, WriteOp};

    use crate::driver::{Outcome, SyncRef};

    let dir = tempfile::tempdir().unwrap();
    let (world, job) = job(dir.path());
    let mut d = rank_2_rollout(world, Duration::from_millis(200)).await;
    let planned = job.table.rollout(2).unwrap();
    d.assign(Assignment::Rollout {
        plan_id: 1,
        expected: blob(&planned),
        expected_writes: 0,
        expected_bytes: 0,
        delta: false,
    })
    .await
    .unwrap();
    let writer = Fabric::start(&FabricConfig::loopback("driver-tests", 1))
        .await
        .unwrap();
    let dst = d.worker().descriptors()[0].clone();
    let len = dst.len.min(4096);
    let src = writer.alloc(len as usize, Access::SOURCE).unwrap();
    let write = || writer.write(WriteOp::new(&src, 0, &dst, 0, len));
    let refused = |r: weightsync_common::fabric::Result<()>, when: &str| match r {
        Err(e) => assert_eq!(
            e.remote_access_kind(),
            Some(RemoteAccessKind::OutsideWindow),
            "{when}: {e}"
        ),
        Ok(()) => panic!("{when}: a write landed outside the window"),
    };
    let sync = |id: u64| SyncRef {
        sync_id: id,
        version: id,
        run: 1,
        reference: Instant::now(),
        reference_unix_ns: 0,
    };

    refused(write().await, "before any Prepare");
    d.prepare(sync(1)).await.unwrap();
    writer.set_send_epoch(1);
    write().await.expect("inside the armed window");
    // Nobody writes the rest: the landing times out, and the window closes all the same.
    assert!(d.run(sync(1)).await.is_err(), "the landing cannot complete");
    // The next sync arms at once; the first one's close must not undo that.
    d.prepare(sync(2)).await.unwrap();
    writer.set_send_epoch(2);
    write().await.expect("inside the second sync's window");
    assert!(d.run(sync(2)).await.is_err());
    // The close started by the landing is in force once the sync ends (and before `Verify`).
    d.finish(sync(2), Outcome::Aborted).await;
    refused(write().await, "after the sync ended");
}

/// The driver of rollout rank 2 of `world` on a loopback fabric, waiting `land_timeout` for a
/// landing.
async fn rank_2_rollout(world: WorldSpec, land_timeout: Duration) -> RolloutDriver {
    RolloutDriver::new(RolloutDriverConfig {
        world,
        rank: 2,
        fabric: FabricConfig::loopback("driver-tests", 1),
        land_timeout,
    })
    .await
    .unwrap()
}
