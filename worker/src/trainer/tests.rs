//! Pipeline and receiver together over the in-process fabric: bytes, counts, watermark, refusals.

use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use weightsync_common::DType;
use weightsync_schedules::table::{
    DstTensor, LocalShard, MeshGroup, ParamRef, RolloutPlan, Shape, Source, Task, TensorBox,
    TrainerPlan, Transform, UnitExpect, Write, WriteTarget,
};

use super::*;
use crate::mem_fabric::MemFabric;
use crate::prepare::{Fp8Shape, Threads, cast, quantise_fp8};
use crate::rollout::RolloutWorker;
use weightsync_common::protocol::Stage;

const W_ROWS: u32 = 300;
const W_COLS: u32 = 256;
const B_ROWS: u32 = 100;
const B_COLS: u32 = 64;

/// Trainer 0 holds `w` [300, 256] bf16 (fp8 on the rollout) and `b` [100, 64] f32 (bf16 on the
/// rollout); rollout 0 holds `w`, `w_scale_inv` and `b` in one MR.
pub(super) fn plans() -> (TrainerPlan, RolloutPlan) {
    let w_shape = Shape::new(&[W_ROWS, W_COLS]);
    let b_shape = Shape::new(&[B_ROWS, B_COLS]);
    let w_bytes = w_shape.numel() * 2;
    let values = w_shape.numel();
    let scale_offset = values.div_ceil(16) * 16;
    let scale_shape = Shape::new(&[3, 2]);
    let scales = scale_shape.numel() * 4;
    let b_out = b_shape.numel() * 2;
    let trainer = TrainerPlan {
        rank: 0,
        params: vec![
            ParamRef {
                id: 0,
                name: "w".into(),
                shape: w_shape,
            },
            ParamRef {
                id: 1,
                name: "b".into(),
                shape: b_shape,
            },
        ],
        shards: vec![
            LocalShard {
                param: 0,
                global: TensorBox::full(w_shape),
                dtype: DType::BF16,
                offset: 0,
            },
            LocalShard {
                param: 1,
                global: TensorBox::full(b_shape),
                dtype: DType::F32,
                offset: w_bytes,
            },
        ],
        source_arena_bytes: w_bytes + b_shape.numel() * 4,
        gather_arena_bytes: 0,
        groups: vec![MeshGroup {
            id: 0,
            name: "all".into(),
            first_task: 0,
            num_tasks: 2,
            gather_sends: 0,
            local_tasks: 2,
            gather_expect: 0,
        }],
        tasks: vec![
            Task {
                param: 0,
                region: TensorBox::full(w_shape),
                source: Source::Shard { shard: 0 },
                transform: Transform::Fp8Block {
                    from: DType::BF16,
                    recipe: weightsync_common::Fp8Recipe::Vllm,
                },
                first_write: 0,
                num_writes: 2,
                first_copy: 0,
                num_copies: 0,
            },
            Task {
                param: 1,
                region: TensorBox::full(b_shape),
                source: Source::Shard { shard: 1 },
                transform: Transform::Cast {
                    from: DType::F32,
                    to: DType::BF16,
                },
                first_write: 2,
                num_writes: 1,
                first_copy: 0,
                num_copies: 0,
            },
        ],
        copies: Vec::new(),
        writes: vec![
            Write {
                dst: WriteTarget::Rollout(0),
                mr: 0,
                unit: 0,
                len: values as u32,
                src_offset: 0,
                dst_offset: 0,
            },
            Write {
                dst: WriteTarget::Rollout(0),
                mr: 0,
                unit: 0,
                len: scales as u32,
                src_offset: scale_offset,
                dst_offset: 76800,
            },
            Write {
                dst: WriteTarget::Rollout(0),
                mr: 0,
                unit: 0,
                len: b_out as u32,
                src_offset: 0,
                dst_offset: 77056,
            },
        ],
    };
    let rollout = RolloutPlan {
        rank: 0,
        engine: 0,
        local_rank: 0,
        mr_bytes: vec![77056 + b_out],
        tensors: vec![
            DstTensor {
                name: "w".into(),
                shape: w_shape,
                dtype: DType::F8E4M3,
                mr: 0,
                offset: 0,
                len: values,
            },
            DstTensor {
                name: "w_scale_inv".into(),
                shape: scale_shape,
                dtype: DType::F32,
                mr: 0,
                offset: 76800,
                len: scales,
            },
            DstTensor {
                name: "b".into(),
                shape: b_shape,
                dtype: DType::BF16,
                mr: 0,
                offset: 77056,
                len: b_out,
            },
        ],
        expect: vec![UnitExpect { unit: 0, writes: 3 }],
    };
    (trainer, rollout)
}

/// Source bytes for step `step`: w as bf16, b as f32, values varying with the step.
pub(super) fn source_bytes(step: u32) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..W_ROWS * W_COLS {
        let x = ((i * 7 + step * 13) % 1001) as f32 / 100.0 - 5.0;
        out.extend_from_slice(&bf16::from_f32(x).to_le_bytes());
    }
    for i in 0..B_ROWS * B_COLS {
        let x = (i as f32 + step as f32) * 0.37 - 100.0;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// What the rollout must hold, computed from whole tensors with the kernels directly.
pub(super) fn expected(src: &[u8]) -> Vec<u8> {
    let w_bytes = (W_ROWS * W_COLS * 2) as usize;
    let shape = Fp8Shape {
        rows: W_ROWS as usize,
        cols: W_COLS as usize,
    };
    let mut values = vec![0u8; (W_ROWS * W_COLS) as usize];
    let mut scales = vec![0u8; 24];
    quantise_fp8(
        &src[..w_bytes],
        DType::BF16,
        shape,
        &mut values,
        &mut scales,
        Threads::One,
    )
    .unwrap();
    let mut b = vec![0u8; (B_ROWS * B_COLS * 2) as usize];
    cast(
        &src[w_bytes..],
        DType::F32,
        &mut b,
        DType::BF16,
        Threads::One,
    )
    .unwrap();
    let mut out = vec![0u8; 77056 + b.len()];
    out[..values.len()].copy_from_slice(&values);
    out[76800..76824].copy_from_slice(&scales);
    out[77056..].copy_from_slice(&b);
    out
}

pub(super) type SharedSource = Arc<parking_lot::RwLock<Vec<u8>>>;

pub(super) fn setup(
    watermark: u64,
    mode: PipelineMode,
) -> (
    TrainerWorker<MemFabric>,
    RolloutWorker<MemFabric>,
    SharedSource,
    MemFabric,
) {
    let (tp, rp) = plans();
    let fab = MemFabric::new_switch("trainer-0");
    let rollout = RolloutWorker::new(fab.peer("rollout-0"), "rollout-0", rp).unwrap();
    let source: SharedSource = Arc::new(parking_lot::RwLock::new(source_bytes(0)));
    let mut cfg = TrainerConfig::new("trainer-0", watermark);
    cfg.mode = mode;
    let mut trainer = TrainerWorker::new(fab.clone(), source.clone(), tp, cfg).unwrap();
    let mut dsts = Destinations::default();
    dsts.rollouts.insert(0, rollout.descriptors());
    trainer.set_destinations(&dsts).unwrap();
    (trainer, rollout, source, fab)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_syncs_land_exact_bytes_under_the_watermark() {
    // The smallest fp8 strip needs 98368 bytes of staging; 200 KiB forces splitting.
    let watermark = 200 << 10;
    for mode in [PipelineMode::Pipelined, PipelineMode::Serialised] {
        let (trainer, rollout, source, _) = setup(watermark, mode);
        assert!(
            trainer.pieces() > 2,
            "tasks were split: {}",
            trainer.pieces()
        );
        for step in 0..3u32 {
            *source.write() = source_bytes(step);
            let sync = SyncId {
                version: step as u64,
                epoch: step as u64 + 1,
            };
            rollout.arm(sync).unwrap();
            let report = trainer.run_sync(sync).await.unwrap();
            let landed = rollout.await_landed(Duration::from_secs(10)).await.unwrap();
            assert_eq!(landed.writes, 3);
            let verified = rollout.verify(&report.checksums).unwrap();
            assert_eq!(verified.bytes, 77056 - 256 + 24 + 12800);
            let got = rollout.region(0).unwrap().to_vec().unwrap();
            assert_eq!(got, expected(&source.read()), "step {step} {mode:?}");
            // The watermark is never exceeded: the staging allocator's measured peak.
            assert!(report.peak_staging_bytes <= watermark);
            assert!(report.peak_staging_bytes > 0);
            let tl = &report.timeline;
            for stage in [Stage::Prepare, Stage::Write] {
                assert_eq!(
                    tl.events.iter().filter(|e| e.stage == stage).count() as u64,
                    report.pieces,
                    "{stage}"
                );
            }
            // Pieces of contiguous boxes are prepared reading the source in place: no H2D.
            let st = &trainer.state;
            let copied: usize = (0..st.pieces.len())
                .filter(|&t| st.in_place[t].is_none())
                .map(|t| st.pieces[t].len())
                .sum();
            assert_eq!(
                tl.events.iter().filter(|e| e.stage == Stage::H2d).count(),
                copied
            );
            assert!(st.in_place.iter().any(Option::is_some));
            assert_eq!(
                report.staged_bytes,
                st.pieces
                    .iter()
                    .flatten()
                    .map(|p| p.layout.input)
                    .sum::<u64>()
            );
            assert_eq!(
                tl.events
                    .iter()
                    .filter(|e| e.stage == Stage::Barrier)
                    .count(),
                1
            );
        }
    }
}

/// The report's split tiles the trainer's wall (wire + idle + overhead = wall, within the
/// rounding of nothing: the meter charges every nanosecond once), its wall lies within the
/// caller's own measurement of the sync, and a sync that moved bytes spent time on the wire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_time_split_adds_up_to_the_wall_and_counts_the_wire() {
    for mode in [PipelineMode::Pipelined, PipelineMode::Serialised] {
        let (trainer, rollout, _, _) = setup(200 << 10, mode);
        let sync = SyncId {
            version: 1,
            epoch: 1,
        };
        rollout.arm(sync).unwrap();
        let t0 = std::time::Instant::now();
        let report = trainer.run_sync(sync).await.unwrap();
        let outside = t0.elapsed().as_nanos() as u64;
        rollout.await_landed(Duration::from_secs(10)).await.unwrap();
        let s = report.split;
        assert!(report.bytes_written > 0);
        assert_eq!(s.wire_ns + s.idle_ns + s.overhead_ns, s.wall_ns, "{s:?}");
        assert!(
            s.wall_ns > 0 && s.wall_ns <= outside,
            "{s:?} vs {outside} ns"
        );
        assert!(s.wire_ns > 0, "bytes moved but no wire time: {s:?}");
        // Staging and preparing with nothing in flight (the first piece at least) is overhead.
        assert!(s.overhead_ns > 0, "{s:?}");
        assert!(report.mean_writes_in_flight >= 1.0, "{report:?}");
        // The protocol's report carries the same split.
        let secs = s.seconds();
        assert!((secs.wire_s + secs.idle_s + secs.overhead_s - secs.wall_s).abs() < 1e-9);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_write_fails_verification_naming_the_tensor() {
    let (trainer, rollout, _, fab) = setup(1 << 20, PipelineMode::Pipelined);
    // Corrupt the run that lands at b's first byte.
    fab.corrupt_at(&rollout.descriptors()[0], 77056);
    let sync = SyncId {
        version: 1,
        epoch: 1,
    };
    rollout.arm(sync).unwrap();
    let report = trainer.run_sync(sync).await.unwrap();
    rollout.await_landed(Duration::from_secs(10)).await.unwrap();
    let err = rollout.verify(&report.checksums).unwrap_err();
    assert!(matches!(err, WorkerError::ChecksumMismatch { .. }), "{err}");
    assert!(err.to_string().contains("in b on rollout rank 0"), "{err}");
    // Missing records are not a pass either.
    let err = rollout.verify(&report.checksums[1..]).unwrap_err();
    assert!(matches!(err, WorkerError::ChecksumCoverage { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_of_an_aborted_epoch_never_count_later() {
    let (trainer, rollout, _, _) = setup(1 << 20, PipelineMode::Pipelined);
    // Epoch 1 is armed, then aborted before the trainer's writes arrive.
    let first = SyncId {
        version: 1,
        epoch: 1,
    };
    rollout.arm(first).unwrap();
    assert_eq!(rollout.abort(), Some(first));
    trainer.run_sync(first).await.unwrap();
    // Epoch 2: the three writes of epoch 1 are strays, not counted.
    let second = SyncId {
        version: 1,
        epoch: 2,
    };
    rollout.arm(second).unwrap();
    let err = rollout
        .await_landed(Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("0 of 3 writes"), "{err}");
    // Epoch 3 lands normally.
    let third = SyncId {
        version: 1,
        epoch: 3,
    };
    rollout.arm(third).unwrap();
    trainer.run_sync(third).await.unwrap();
    rollout.await_landed(Duration::from_secs(10)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_sync_stops_with_cancelled_and_the_next_one_lands() {
    for mode in [PipelineMode::Pipelined, PipelineMode::Serialised] {
        let (trainer, rollout, _, _) = setup(200 << 10, mode);
        let first = SyncId {
            version: 1,
            epoch: 1,
        };
        rollout.arm(first).unwrap();
        // Cancelled before anything was scheduled: nothing may land for epoch 1.
        let err = trainer
            .run_sync_until(first, std::future::ready(()))
            .await
            .unwrap_err();
        assert!(matches!(err, WorkerError::Cancelled), "{err} ({mode:?})");
        let err = rollout
            .await_landed(Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("0 of 3 writes"), "{err}");
        rollout.abort();
        // The worker is usable again at once.
        let second = SyncId {
            version: 1,
            epoch: 2,
        };
        rollout.arm(second).unwrap();
        trainer.run_sync(second).await.unwrap();
        rollout.await_landed(Duration::from_secs(10)).await.unwrap();
    }
}

#[tokio::test]
async fn bad_input_is_refused_before_anything_is_written() {
    let (tp, _) = plans();
    let fab = MemFabric::new_switch("t");
    // Source shorter than the table says.
    let short: Arc<Vec<u8>> = Arc::new(vec![0u8; 1000]);
    let err = TrainerWorker::new(
        fab.clone(),
        short,
        tp.clone(),
        TrainerConfig::new("t", 1 << 20),
    )
    .unwrap_err();
    assert!(matches!(err, WorkerError::SourceTooShort { .. }), "{err}");
    let src: Arc<Vec<u8>> = Arc::new(source_bytes(0));
    let refused = |plan: TrainerPlan| {
        TrainerWorker::new(
            fab.clone(),
            src.clone(),
            plan,
            TrainerConfig::new("t", 1 << 20),
        )
        .unwrap_err()
        .to_string()
    };
    // dtype mismatch.
    let mut bad = tp.clone();
    bad.shards[1].dtype = DType::BF16;
    let err = refused(bad);
    assert!(
        err.contains("source holds bf16 but the transform reads f32"),
        "{err}"
    );
    // A shard whose box cannot be addressed (as a corrupt or hostile plan could carry).
    for (ndim, len) in [(9u8, [2, 2, 2]), (3, [u32::MAX, u32::MAX, u32::MAX])] {
        let mut bad = tp.clone();
        bad.shards[1].global.ndim = ndim;
        bad.shards[1].global.len = len;
        let err = refused(bad);
        assert!(err.contains("too large to address"), "{err}");
    }
    // Watermark below one fp8 block strip.
    let err = TrainerWorker::new(
        fab.clone(),
        src.clone(),
        tp.clone(),
        TrainerConfig::new("t", 64 << 10),
    )
    .unwrap_err();
    assert!(
        matches!(err, WorkerError::WatermarkTooSmall { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("128-row fp8 block strip"), "{err}");
    // A destination nobody described.
    let mut t = TrainerWorker::new(fab.clone(), src, tp, TrainerConfig::new("t", 1 << 20)).unwrap();
    let err = t.set_destinations(&Destinations::default()).unwrap_err();
    assert!(matches!(err, WorkerError::MissingDestination(_)), "{err}");
    let err = t
        .run_sync(SyncId {
            version: 0,
            epoch: 0,
        })
        .await
        .unwrap_err();
    assert!(matches!(err, WorkerError::Protocol(_)), "{err}");
}

/// Two trainers hold `g` [256, 256] bf16 split by rows at 100 (an fsdp-style uneven shard), so
/// the first 128-row fp8 block straddles them. Trainer 0 owns that block: both trainers first copy
/// their rows of it into trainer 0's gather arena, and trainer 0 quantises it from there after
/// its gather count arrived; trainer 1 quantises the second block from its own shard.
pub(super) fn gather_plans() -> (TrainerPlan, TrainerPlan, RolloutPlan) {
    let full = Shape::new(&[256, 256]);
    let row = 256 * 2u64; // bf16 bytes per row
    let param = vec![ParamRef {
        id: 0,
        name: "g".into(),
        shape: full,
    }];
    let fp8 = Transform::Fp8Block {
        from: DType::BF16,
        recipe: weightsync_common::Fp8Recipe::Vllm,
    };
    let values = 128 * 256u64;
    let group = |gather_sends, local_tasks, gather_expect, num_tasks| MeshGroup {
        id: 5,
        name: "layer".into(),
        first_task: 0,
        num_tasks,
        gather_sends,
        local_tasks,
        gather_expect,
    };
    let rows = |a: u32, n: u32| TensorBox::new(&[a, 0], &[n, 256]);
    let t0 = TrainerPlan {
        rank: 0,
        params: param.clone(),
        shards: vec![LocalShard {
            param: 0,
            global: rows(0, 100),
            dtype: DType::BF16,
            offset: 0,
        }],
        source_arena_bytes: 100 * row,
        gather_arena_bytes: 128 * row,
        groups: vec![group(1, 0, 2, 2)],
        tasks: vec![
            // Gather send: own rows 0..100 into own gather arena.
            Task {
                param: 0,
                region: rows(0, 100),
                source: Source::Shard { shard: 0 },
                transform: Transform::Copy { dtype: DType::BF16 },
                first_write: 0,
                num_writes: 1,
                first_copy: 0,
                num_copies: 0,
            },
            // Quantise block row 0 from the gather arena.
            Task {
                param: 0,
                region: rows(0, 128),
                source: Source::Gather { offset: 0 },
                transform: fp8,
                first_write: 1,
                num_writes: 2,
                first_copy: 0,
                num_copies: 0,
            },
        ],
        copies: Vec::new(),
        writes: vec![
            Write {
                dst: WriteTarget::Trainer(0),
                mr: 0,
                unit: 5,
                len: (100 * row) as u32,
                src_offset: 0,
                dst_offset: 0,
            },
            Write {
                dst: WriteTarget::Rollout(0),
                mr: 0,
                unit: 0,
                len: values as u32,
                src_offset: 0,
                dst_offset: 0,
            },
            Write {
                dst: WriteTarget::Rollout(0),
                mr: 0,
                unit: 0,
                len: 8,
                src_offset: values,
                dst_offset: 65536,
            },
        ],
    };
    let t1 = TrainerPlan {
        rank: 1,
        params: param,
        shards: vec![LocalShard {
            param: 0,
            global: rows(100, 156),
            dtype: DType::BF16,
            offset: 0,
        }],
        source_arena_bytes: 156 * row,
        gather_arena_bytes: 0,
        groups: vec![group(1, 1, 0, 2)],
        tasks: vec![
            // Gather send: rows 100..128 (local 0..28) into trainer 0's arena after its 100 rows.
            Task {
                param: 0,
                region: rows(100, 28),
                source: Source::Shard { shard: 0 },
                transform: Transform::Copy { dtype: DType::BF16 },
                first_write: 0,
                num_writes: 1,
                first_copy: 0,
                num_copies: 0,
            },
            // Block row 1 (rows 128..256 = local 28..156) from its own shard.
            Task {
                param: 0,
                region: rows(128, 128),
                source: Source::Shard { shard: 0 },
                transform: fp8,
                first_write: 1,
                num_writes: 2,
                first_copy: 0,
                num_copies: 0,
            },
        ],
        copies: Vec::new(),
        writes: vec![
            Write {
                dst: WriteTarget::Trainer(0),
                mr: 0,
                unit: 5,
                len: (28 * row) as u32,
                src_offset: 0,
                dst_offset: 100 * row,
            },
            Write {
                dst: WriteTarget::Rollout(0),
                mr: 0,
                unit: 0,
                len: values as u32,
                src_offset: 0,
                dst_offset: values,
            },
            Write {
                dst: WriteTarget::Rollout(0),
                mr: 0,
                unit: 0,
                len: 8,
                src_offset: values,
                dst_offset: 65544,
            },
        ],
    };
    // Scales are row-major [2 block rows, 2 block cols]: block row 0 at 65536, row 1 at 65544.
    let rollout = RolloutPlan {
        rank: 0,
        engine: 0,
        local_rank: 0,
        mr_bytes: vec![65536 + 256],
        tensors: vec![
            DstTensor {
                name: "g".into(),
                shape: full,
                dtype: DType::F8E4M3,
                mr: 0,
                offset: 0,
                len: 2 * values,
            },
            DstTensor {
                name: "g_scale_inv".into(),
                shape: Shape::new(&[2, 2]),
                dtype: DType::F32,
                mr: 0,
                offset: 65536,
                len: 16,
            },
        ],
        expect: vec![UnitExpect { unit: 0, writes: 4 }],
    };
    (t0, t1, rollout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn straddling_fp8_block_is_gathered_to_its_owner_first() {
    let (t0p, t1p, rp) = gather_plans();
    let fab = MemFabric::new_switch("trainer-0");
    let f1 = fab.peer("trainer-1");
    let rollout = RolloutWorker::new(fab.peer("rollout-0"), "rollout-0", rp).unwrap();
    let full: Vec<u8> = (0..256 * 256u32)
        .flat_map(|i| bf16::from_f32(((i * 31) % 977) as f32 * 0.01 - 4.0).to_le_bytes())
        .collect();
    let row = 512usize;
    let s0: Arc<Vec<u8>> = Arc::new(full[..100 * row].to_vec());
    let s1: Arc<Vec<u8>> = Arc::new(full[100 * row..].to_vec());
    let mut w0 = TrainerWorker::new(
        fab.clone(),
        s0,
        t0p,
        TrainerConfig::new("trainer-0", 1 << 20),
    )
    .unwrap();
    let mut w1 = TrainerWorker::new(f1, s1, t1p, TrainerConfig::new("trainer-1", 1 << 20)).unwrap();
    let mut dsts = Destinations::default();
    dsts.rollouts.insert(0, rollout.descriptors());
    dsts.trainers.insert(0, w0.gather_descriptor().unwrap());
    w0.set_destinations(&dsts).unwrap();
    w1.set_destinations(&dsts).unwrap();
    for epoch in 1..=2 {
        let sync = SyncId {
            version: epoch,
            epoch,
        };
        rollout.arm(sync).unwrap();
        let (r0, r1) = tokio::join!(w0.run_sync(sync), w1.run_sync(sync));
        let (r0, r1) = (r0.unwrap(), r1.unwrap());
        assert!(
            r0.timeline
                .events
                .iter()
                .any(|e| e.stage == Stage::GatherWait)
        );
        rollout.await_landed(Duration::from_secs(10)).await.unwrap();
        let sums: Vec<_> = r0.checksums.iter().chain(&r1.checksums).copied().collect();
        rollout.verify(&sums).unwrap();
        let mut values = vec![0u8; 256 * 256];
        let mut scales = vec![0u8; 16];
        quantise_fp8(
            &full,
            DType::BF16,
            Fp8Shape {
                rows: 256,
                cols: 256,
            },
            &mut values,
            &mut scales,
            Threads::One,
        )
        .unwrap();
        assert_eq!(rollout.read_tensor("g").unwrap(), values);
        assert_eq!(rollout.read_tensor("g_scale_inv").unwrap(), scales);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_fails_the_sync_naming_the_task() {
    let (trainer, rollout, _, _) = setup(1 << 20, PipelineMode::Pipelined);
    drop(trainer);
    let (tp, _) = plans();
    let fab = MemFabric::new_switch("lonely");
    let src: Arc<Vec<u8>> = Arc::new(source_bytes(0));
    let mut t = TrainerWorker::new(fab, src, tp, TrainerConfig::new("t", 1 << 20)).unwrap();
    // Descriptors of a rollout on another switch: unknown rkeys here.
    let mut dsts = Destinations::default();
    dsts.rollouts.insert(0, rollout.descriptors());
    t.set_destinations(&dsts).unwrap();
    let err = t
        .run_sync(SyncId {
            version: 0,
            epoch: 1,
        })
        .await
        .unwrap_err();
    assert!(matches!(err, WorkerError::Fabric { .. }), "{err}");
    assert!(err.to_string().contains("task"), "{err}");
    assert!(err.to_string().contains("unknown rkey"), "{err}");
}

/// Trainer 0 copies rows 4..12 of its [16, 8] bf16 `w` to rollout 0's `w` [8, 8].
pub(super) fn one_copy_plans() -> (TrainerPlan, RolloutPlan) {
    copy_plans(TensorBox::new(&[4, 0], &[8, 8]))
}

/// Trainer 0 copies `region` of its [16, 8] bf16 `w` to rollout 0's `w` (the region's shape).
pub(super) fn copy_plans(region: TensorBox) -> (TrainerPlan, RolloutPlan) {
    let shape = Shape::new(&[16, 8]);
    let len = region.numel() * 2;
    let trainer_plan = TrainerPlan {
        rank: 0,
        params: vec![ParamRef {
            id: 0,
            name: "w".into(),
            shape,
        }],
        shards: vec![LocalShard {
            param: 0,
            global: TensorBox::full(shape),
            dtype: DType::BF16,
            offset: 0,
        }],
        source_arena_bytes: shape.numel() * 2,
        gather_arena_bytes: 0,
        groups: vec![MeshGroup {
            id: 0,
            name: "g".into(),
            first_task: 0,
            num_tasks: 1,
            gather_sends: 0,
            local_tasks: 1,
            gather_expect: 0,
        }],
        tasks: vec![Task {
            param: 0,
            region,
            source: Source::Shard { shard: 0 },
            transform: Transform::Copy { dtype: DType::BF16 },
            first_write: 0,
            num_writes: 1,
            first_copy: 0,
            num_copies: 0,
        }],
        copies: Vec::new(),
        writes: vec![Write {
            dst: WriteTarget::Rollout(0),
            mr: 0,
            unit: 0,
            len: len as u32,
            src_offset: 0,
            dst_offset: 0,
        }],
    };
    let rollout_plan = RolloutPlan {
        rank: 0,
        engine: 0,
        local_rank: 0,
        mr_bytes: vec![len],
        tensors: vec![DstTensor {
            name: "w".into(),
            shape: region.shape(),
            dtype: DType::BF16,
            mr: 0,
            offset: 0,
            len,
        }],
        expect: vec![UnitExpect { unit: 0, writes: 1 }],
    };
    (trainer_plan, rollout_plan)
}

/// Registers a bf16 [16, 8] tensor `w` (byte `i` is `i * 7 % 251`) with `fab` as a training
/// job's own memory, runs one sync of `trainer_plan` from it into a rollout of `rollout_plan`,
/// and returns the rollout (landed and verified), the report and the tensor's bytes.
async fn sync_from_a_registered_tensor(
    fab: &MemFabric,
    trainer_plan: TrainerPlan,
    rollout_plan: RolloutPlan,
) -> (RolloutWorker<MemFabric>, SyncReport, Arc<Vec<u8>>) {
    let rollout = RolloutWorker::new(fab.peer("rollout-0"), "rollout-0", rollout_plan).unwrap();
    let tensor: Arc<Vec<u8>> = Arc::new((0..256u32).map(|i| (i * 7 % 251) as u8).collect());
    // SAFETY: the vector is kept alive by the owner passed along and never written.
    let memory = unsafe {
        crate::HostMemory::from_raw(
            tensor.as_ptr() as *mut u8,
            tensor.len(),
            Box::new(tensor.clone()),
        )
    };
    let set = Arc::new(
        crate::TensorSet::register(
            fab,
            vec![crate::SourceTensor {
                name: "w".into(),
                dtype: DType::BF16,
                shape: vec![16, 8],
                memory,
            }],
        )
        .unwrap(),
    );
    let source = Arc::new(set.for_plan(&trainer_plan).unwrap());
    let mut trainer = TrainerWorker::new(
        fab.clone(),
        source,
        trainer_plan,
        TrainerConfig::new("trainer-0", 4096),
    )
    .unwrap();
    let mut dsts = Destinations::default();
    dsts.rollouts.insert(0, rollout.descriptors());
    trainer.set_destinations(&dsts).unwrap();
    let sync = SyncId {
        version: 1,
        epoch: 1,
    };
    rollout.arm(sync).unwrap();
    let report = trainer.run_sync(sync).await.unwrap();
    rollout.await_landed(Duration::from_secs(10)).await.unwrap();
    rollout.verify(&report.checksums).unwrap();
    (rollout, report, tensor)
}

/// A bf16 -> bf16 copy of rows 4..12 of a caller-registered [16, 8] tensor is written straight
/// from the tensor (no staging), lands exactly, and verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_dtype_copy_from_registered_tensors_is_written_without_staging() {
    let (trainer_plan, rollout_plan) = one_copy_plans();
    let fab = MemFabric::new_switch("trainer-0");
    let (rollout, report, tensor) =
        sync_from_a_registered_tensor(&fab, trainer_plan, rollout_plan).await;
    assert_eq!(rollout.read_tensor("w").unwrap(), tensor[64..192].to_vec());
    assert_eq!((report.direct_bytes, report.staged_bytes), (128, 0));
    assert_eq!(report.peak_staging_bytes, 0);
}

/// A bf16 -> bf16 copy of a column slice (rows 4..12, columns 2..6 of a caller-registered
/// [16, 8] tensor: 8 runs of 8 bytes, 16 bytes apart) is written straight from the tensor with
/// strided sources, where the fabric takes runs that short: no staging, exact bytes, verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_slice_from_registered_tensors_is_written_strided_without_staging() {
    let (trainer_plan, rollout_plan) = copy_plans(TensorBox::new(&[4, 2], &[8, 4]));
    let fab = MemFabric::new_switch("trainer-0");
    assert_eq!(fab.min_strided_run(), 1);
    let (rollout, report, tensor) =
        sync_from_a_registered_tensor(&fab, trainer_plan, rollout_plan).await;
    assert!(!report.checksums.is_empty());
    let want: Vec<u8> = (4..12)
        .flat_map(|row| tensor[row * 16 + 4..row * 16 + 12].to_vec())
        .collect();
    assert_eq!(rollout.read_tensor("w").unwrap(), want);
    assert_eq!((report.direct_bytes, report.staged_bytes), (64, 0));
    assert_eq!(report.peak_staging_bytes, 0);
}
