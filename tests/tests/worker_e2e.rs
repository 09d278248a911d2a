//! End to end on loopback TCP: 4 trainers holding a small Qwen3-style model sharded along dim 0
//! (fsdp=4, so fp8 blocks straddle shards and are gathered first), 2 rollout engines with tp=2
//! taking fp8. Several syncs with changing weights: every destination byte must equal an
//! independent recomputation (slicing, fusing and quantising in the test, not through the
//! table), checksums must match, and a write of garbage into a destination run must fail the
//! sync's verification, naming the tensor.

use std::time::Duration;

use weightsync_common::fabric::{Access, FabricBackend, WriteOp};
use weightsync_schedules::cost::CostModel;
use weightsync_schedules::layout_infer::InferenceLayout;
use weightsync_schedules::layout_train::{TrainSpec, TrainingLayout};
use weightsync_schedules::model::{ExpertForm, Model};
use weightsync_schedules::planner::plan;
use weightsync_schedules::table::RoutingTable;
use weightsync_tests::loopback::{ClusterSync, LoopbackCluster};
use weightsync_tests::reference::{Geometry, LogicalWeights, expected};
use weightsync_worker::SyncId;
use weightsync_worker::WorkerError;

/// A two-layer Qwen3 with 128-wide heads, so every tp=2 slice is whole 128x128 blocks while
/// fsdp=4 row shards of 64 rows are not.
const TINY_QWEN3: &str = r#"{
  "model_type": "qwen3",
  "architectures": ["Qwen3ForCausalLM"],
  "hidden_size": 256,
  "intermediate_size": 512,
  "num_attention_heads": 2,
  "num_key_value_heads": 2,
  "head_dim": 128,
  "num_hidden_layers": 2,
  "vocab_size": 1000,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16"
}"#;

const TIMEOUT: Duration = Duration::from_secs(30);

/// A planned job: the model, the training spec (the dtype its shards are held in) and the table.
struct Job {
    model: Model,
    train: TrainSpec,
    table: RoutingTable,
}

fn table() -> Job {
    table_for("fsdp=4")
}

fn table_for(train: &str) -> Job {
    table_of(TINY_QWEN3, train, "tp=2,dp=2,dtype=fp8")
}

fn table_of(config: &str, train: &str, infer: &str) -> Job {
    let model = Model::from_config_json("tiny-qwen3", config, ExpertForm::PerExpert).unwrap();
    let spec: TrainSpec = train.parse().unwrap();
    let train = TrainingLayout::build(&model, &spec).unwrap();
    let infer = InferenceLayout::build(&model, &infer.parse().unwrap()).unwrap();
    let table = plan(&model, &train, &infer, &CostModel::default()).unwrap();
    Job {
        model,
        train: spec,
        table,
    }
}

fn geometry() -> Geometry {
    Geometry {
        heads: 2,
        kv_heads: 2,
        head_dim: 128,
        tp: 2,
    }
}

/// Writes step `step`'s weights into every trainer's source arena; returns them.
fn load_weights(job: &Job, cluster: &LoopbackCluster, step: u64) -> LogicalWeights {
    let w = LogicalWeights::random_held(&job.model, &job.train, 1000 + step);
    assert_eq!(job.table.trainers.len(), cluster.trainers.len());
    for (t, src) in cluster.trainers.iter().zip(&cluster.sources) {
        w.fill_source(t.plan(), &mut src.write().unwrap()).unwrap();
    }
    w
}

/// Every tensor of every rollout rank equals the reference.
fn check_every_byte(cluster: &LoopbackCluster, w: &LogicalWeights) {
    let mut tensors = 0;
    for r in &cluster.rollouts {
        let tp_rank = r.plan().local_rank as usize % 2;
        for t in r.layout() {
            let want = expected(w, geometry(), t, tp_rank).unwrap();
            let got = r.read_tensor(&t.name).unwrap();
            assert_eq!(
                got.len(),
                want.len(),
                "{} on rank {}",
                t.name,
                r.plan().rank
            );
            assert!(
                got == want,
                "{} on rollout rank {} differs",
                t.name,
                r.plan().rank
            );
            tensors += 1;
        }
    }
    assert!(tensors > 20, "only {tensors} tensors checked");
}

/// One training step's sync: step `version`'s weights written into the sources, synced,
/// verified with the trainers' checksums, and every byte compared with the reference.
async fn sync_and_check(
    job: &Job,
    cluster: &LoopbackCluster,
    version: u64,
    epoch: u64,
) -> ClusterSync {
    let w = load_weights(job, cluster, version);
    let sync = cluster
        .sync(SyncId { version, epoch }, TIMEOUT)
        .await
        .unwrap();
    cluster.verify(&sync).unwrap();
    check_every_byte(cluster, &w);
    sync
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_fsdp_trainers_to_two_tp2_engines_fp8() {
    let job = table();
    assert_eq!(job.table.trainers.len(), 4);
    assert_eq!(job.table.rollouts.len(), 4);
    // The straddling-block path is exercised: some trainer receives gathered rows.
    assert!(job.table.trainers.iter().any(|t| t.gather_arena_bytes > 0));
    // A small watermark so that large tasks are split into pieces.
    let cluster = LoopbackCluster::start(&job.table, 160 << 10, 2)
        .await
        .unwrap();
    assert!(
        cluster.trainers.iter().map(|t| t.pieces()).sum::<usize>()
            > cluster
                .trainers
                .iter()
                .map(|t| t.plan().tasks.len())
                .sum::<usize>()
    );

    for step in 0..3u64 {
        let sync = sync_and_check(&job, &cluster, step, step + 1).await;
        for r in &sync.trainers {
            assert!(r.peak_staging_bytes <= r.watermark_bytes);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_written_into_a_destination_run_fails_the_sync() {
    let job = table();
    let cluster = LoopbackCluster::start(&job.table, 1 << 20, 2)
        .await
        .unwrap();
    load_weights(&job, &cluster, 7);
    let sync = cluster
        .sync(
            SyncId {
                version: 7,
                epoch: 1,
            },
            TIMEOUT,
        )
        .await
        .unwrap();

    // A peer of the job writes garbage over the first bytes of a quantised tensor of rank 1.
    let victim = &cluster.rollouts[1];
    let tensor = victim
        .layout()
        .iter()
        .find(|t| t.name.ends_with("layers.1.self_attn.qkv_proj.weight"))
        .unwrap()
        .clone();
    let garbage = cluster.probe.alloc(64, Access::SOURCE).unwrap();
    garbage.write_at(0, &[0xA5; 64]).unwrap();
    let desc = victim.descriptors()[tensor.mr as usize].clone();
    cluster
        .probe
        .write(WriteOp::new(&garbage, 0, &desc, tensor.offset, 64))
        .await
        .unwrap();

    let err = cluster.verify(&sync).unwrap_err();
    assert!(matches!(err, WorkerError::ChecksumMismatch { .. }), "{err}");
    assert!(err.to_string().contains(&tensor.name), "{err}");

    // The next sync rewrites every byte and verifies again.
    sync_and_check(&job, &cluster, 8, 2).await;
}

/// How many of the cluster's tasks read a column slice where it lies
/// (`TrainerPlan::in_place_runs`), with no copy into staging first.
fn column_slices_in_place(cluster: &LoopbackCluster) -> usize {
    cluster
        .trainers
        .iter()
        .map(|t| {
            let plan = t.plan();
            plan.tasks
                .iter()
                .filter(|task| plan.in_place_runs(task).is_some())
                .count()
        })
        .sum()
}

/// fsdp=2: row shards of 128 rows, so the row-parallel tp=2 boxes (o_proj, down_proj) are
/// column slices of whole blocks, quantised reading their rows where they lie in the shard;
/// every byte still equals the independent recomputation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn column_slices_are_quantised_where_their_rows_lie() {
    let job = table_for("fsdp=2");
    let cluster = LoopbackCluster::start(&job.table, 160 << 10, 2)
        .await
        .unwrap();
    let column_slices = column_slices_in_place(&cluster);
    assert!(column_slices >= 4, "{column_slices} column slices");
    for step in 0..2u64 {
        sync_and_check(&job, &cluster, step, step + 1).await;
    }
}

/// FSDP2's sharded parameters are f32 (mixed precision casts only what it gathers):
/// `dtype=f32` shards of a bf16 model to bf16 engines are casts, and the row-parallel boxes' column slices are cast
/// reading their runs where they lie, split into pieces by a small watermark; every byte
/// equals the reference's own rounding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn column_slices_of_f32_shards_are_cast_where_they_lie() {
    let job = table_of(TINY_QWEN3, "fsdp=2,dtype=f32", "tp=2,dp=2,dtype=bf16");
    let cluster = LoopbackCluster::start(&job.table, 96 << 10, 2)
        .await
        .unwrap();
    let column_slices = column_slices_in_place(&cluster);
    assert!(column_slices >= 4, "{column_slices} column slices");
    assert!(cluster.trainers.iter().map(|t| t.pieces()).sum::<usize>() > column_slices);
    for step in 0..2u64 {
        sync_and_check(&job, &cluster, step, step + 1).await;
    }
}

/// f32 shards (`dtype=f32`) quantised to fp8 over fsdp=4, whose 64-row shards make blocks
/// straddle them: the straddling rows are gathered in f32 and quantised from f32; every byte
/// equals the reference's quantisation of the f32 weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f32_shards_are_quantised_to_fp8_across_straddled_blocks() {
    let job = table_for("fsdp=4,dtype=f32");
    assert!(job.table.trainers.iter().any(|t| t.gather_arena_bytes > 0));
    let cluster = LoopbackCluster::start(&job.table, 320 << 10, 2)
        .await
        .unwrap();
    for step in 0..2u64 {
        sync_and_check(&job, &cluster, step, step + 1).await;
    }
}
