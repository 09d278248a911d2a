//! Steps (b) and (c) of the device check: whole syncs from a trainer source in device memory,
//! through the one pipeline, over the TCP loopback fabric, into a rollout.
//!
//! The plan mixes what the pipeline does with a device source: fp8 from bf16 and f32 -> bf16
//! casts of whole matrices (prepared on the device: D2D into the device staging, NVRTC kernel,
//! D2H into the pinned lease), bf16 copies of whole matrices (one D2H per piece) and of a column
//! band (strided rows, `cuMemcpy2DAsync`), so every device step runs.
//!
//! - (b) `device_source_sync_lands_every_byte`: one sync per kind of device source (an owned
//!   buffer; a borrowed range of a `cuMemAlloc` allocation) into a device destination (the
//!   receiver's regions as pinned bounce buffers, copied to device memory before the sync counts
//!   as landed), every byte of the device destination compared with the CPU kernels' result
//!   from the same bytes, and the checksums verified (on the bounce buffers); reports the sync's
//!   wall time (median of three), `ratio_vs_d2d` (a device-to-device copy of the source bytes
//!   over the sync's wall: how far the sync is from device speed), `ratio_vs_fabric` (the
//!   fabric alone moving the sync's bytes between host buffers, on fabrics configured as the
//!   sync's, in the same run, over the sync's wall: what the device pipeline costs on top of
//!   its wire, the performance issue's 0.9 goal with the preparation on the GPU) and the stage
//!   timeline.
//! - (c) `device_source_pipeline_overlaps_its_stages`: the same plan serialised and pipelined,
//!   `overlap_speedup` = serialised / pipelined median wall (the issue's target: 2.2).
//!
//! What this does not cover yet: both ends run in this one process (two fabrics over loopback),
//! and the device destination is verified by copying it back, not by a device-side checksum.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use serde_json::json;
use weightsync_common::DType;
use weightsync_common::fabric::limit::FabricLimit;
use weightsync_common::fabric::{FabricConfig, TcpFabric};
use weightsync_common::protocol::Stage;
use weightsync_schedules::table::{
    DstTensor, LocalShard, MeshGroup, ParamRef, RolloutPlan, Shape, Source, Task, TensorBox,
    TrainerPlan, Transform, UnitExpect, Write, WriteTarget,
};

use super::{device, emit};
use crate::gpu::{
    BorrowedDevice, DeviceDestination, DeviceSource, GpuDevice, GpuSource, IpcExport,
};
use crate::prepare::{Fp8Shape, Threads, cast, gather_box, quantise_fp8};
use crate::rollout::RolloutWorker;
use crate::sync::SyncId;
use crate::trainer::{Destinations, PipelineMode, SyncReport, TrainerConfig, TrainerWorker};

const ROWS: u32 = 4096;
const COLS: u32 = 4096;
const LAYERS: u32 = 12;
const WATERMARK: u64 = 256 << 20;
const PIECE: u64 = 16 << 20;
/// The overlap step's figure of merit for a verbs/NIC configuration, reported (not asserted):
/// with a device source on loopback TCP the write dominates (the preparation on the GPU is
/// nearly free), so serialised / pipelined cannot reach it (device review N6).
const TARGET_OVERLAP_SPEEDUP: f64 = 2.2;
/// What the pipeline can promise on any configuration, asserted: the pipelined sync within
/// this factor of its slowest stage (that stage's busy time in the serialised run, where the
/// stages do not overlap); the margin covers the pipeline's fill and drain (one piece each).
const MAX_PIPELINED_OVER_SLOWEST_STAGE: f64 = 1.25;
/// Sync landing rate over the fabric limit's (reported, not asserted: a figure of the run).
const TARGET_RATIO_VS_FABRIC: f64 = 0.9;
/// Timed runs of each measurement after its warm-up (the median is reported).
const MEASURED: usize = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Fp8FromBf16,
    CastF32ToBf16,
    CopyBf16,
    CopyBf16Band,
}

impl Kind {
    fn of(i: u32) -> Kind {
        [
            Kind::Fp8FromBf16,
            Kind::CastF32ToBf16,
            Kind::CopyBf16,
            Kind::CopyBf16Band,
        ][i as usize % 4]
    }
    fn from(self) -> DType {
        if self == Kind::CastF32ToBf16 {
            DType::F32
        } else {
            DType::BF16
        }
    }
}

/// Trainer 0 holds `LAYERS` matrices of `ROWS x COLS`; rollout 0 receives each (see the
/// module docs) in one MR.
fn plans() -> (TrainerPlan, RolloutPlan) {
    let shape = Shape::new(&[ROWS, COLS]);
    let numel = shape.numel();
    let align = |x: u64| x.div_ceil(256) * 256;
    let mut tp = TrainerPlan {
        rank: 0,
        params: Vec::new(),
        shards: Vec::new(),
        source_arena_bytes: 0,
        gather_arena_bytes: 0,
        groups: vec![MeshGroup {
            id: 0,
            name: "all".into(),
            first_task: 0,
            num_tasks: LAYERS,
            gather_sends: 0,
            local_tasks: LAYERS,
            gather_expect: 0,
        }],
        tasks: Vec::new(),
        copies: Vec::new(),
        writes: Vec::new(),
    };
    let mut tensors = Vec::new();
    let mut at = 0u64;
    for i in 0..LAYERS {
        let kind = Kind::of(i);
        let name = format!("layers.{i}.weight");
        tp.params.push(ParamRef {
            id: i,
            name: name.clone().into(),
            shape,
        });
        tp.shards.push(LocalShard {
            param: i,
            global: TensorBox::full(shape),
            dtype: kind.from(),
            offset: tp.source_arena_bytes,
        });
        tp.source_arena_bytes += numel * kind.from().size() as u64;
        let first_write = tp.writes.len() as u32;
        let write = |src_offset, dst_offset, len: u64| Write {
            dst: WriteTarget::Rollout(0),
            mr: 0,
            unit: 0,
            len: len as u32,
            src_offset,
            dst_offset,
        };
        let tensor = |name: String, shape, dtype, offset, len| DstTensor {
            name,
            shape,
            dtype,
            mr: 0,
            offset,
            len,
        };
        let (region, transform) = match kind {
            Kind::Fp8FromBf16 => {
                let scale_shape = Shape::new(&[ROWS.div_ceil(128), COLS.div_ceil(128)]);
                let scales = scale_shape.numel() * 4;
                let scales_at = align(at + numel);
                tp.writes.push(write(0, at, numel));
                tp.writes
                    .push(write(numel.div_ceil(16) * 16, scales_at, scales));
                tensors.push(tensor(name.clone(), shape, DType::F8E4M3, at, numel));
                tensors.push(tensor(
                    format!("{name}_scale_inv"),
                    scale_shape,
                    DType::F32,
                    scales_at,
                    scales,
                ));
                at = align(scales_at + scales);
                (
                    TensorBox::full(shape),
                    Transform::Fp8Block {
                        from: DType::BF16,
                        recipe: weightsync_common::Fp8Recipe::Vllm,
                    },
                )
            }
            Kind::CastF32ToBf16 | Kind::CopyBf16 => {
                tp.writes.push(write(0, at, numel * 2));
                tensors.push(tensor(name, shape, DType::BF16, at, numel * 2));
                at = align(at + numel * 2);
                let transform = if kind == Kind::CopyBf16 {
                    Transform::Copy { dtype: DType::BF16 }
                } else {
                    Transform::Cast {
                        from: DType::F32,
                        to: DType::BF16,
                    }
                };
                (TensorBox::full(shape), transform)
            }
            Kind::CopyBf16Band => {
                // Columns COLS/4 .. 3*COLS/4 of every row: a strided box.
                let band = TensorBox::new(&[0, COLS / 4], &[ROWS, COLS / 2]);
                let len = band.numel() * 2;
                tp.writes.push(write(0, at, len));
                tensors.push(tensor(
                    name,
                    Shape::new(&[ROWS, COLS / 2]),
                    DType::BF16,
                    at,
                    len,
                ));
                at = align(at + len);
                (band, Transform::Copy { dtype: DType::BF16 })
            }
        };
        tp.tasks.push(Task {
            param: i,
            region,
            source: Source::Shard { shard: i },
            transform,
            first_write,
            num_writes: tp.writes.len() as u32 - first_write,
            first_copy: 0,
            num_copies: 0,
        });
    }
    let writes = tp.writes.len() as u64;
    let rp = RolloutPlan {
        rank: 0,
        engine: 0,
        local_rank: 0,
        mr_bytes: vec![at],
        tensors,
        expect: vec![UnitExpect { unit: 0, writes }],
    };
    (tp, rp)
}

/// The source arena: weight-like values, distinct per layer.
fn source_bytes(tp: &TrainerPlan) -> Vec<u8> {
    let mut out = Vec::with_capacity(tp.source_arena_bytes as usize);
    for (i, s) in tp.shards.iter().enumerate() {
        let n = s.global.numel() as usize;
        let bytes = super::random_input(n, COLS as usize, s.dtype, 0x5eed + i as u64);
        out.extend_from_slice(&bytes);
    }
    out
}

/// What the rollout's MR must hold, from the CPU kernels.
fn expected(tp: &TrainerPlan, rp: &RolloutPlan, src: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; rp.mr_bytes[0] as usize];
    let shape = Fp8Shape {
        rows: ROWS as usize,
        cols: COLS as usize,
    };
    for (i, t) in tp.tasks.iter().enumerate() {
        let s = tp.shards[i];
        let input = &src[s.offset as usize..(s.offset + s.bytes()) as usize];
        let w = &tp.writes[t.first_write as usize];
        let dst = w.dst_offset as usize;
        match Kind::of(i as u32) {
            Kind::Fp8FromBf16 => {
                let n = shape.rows * shape.cols;
                let sw = &tp.writes[t.first_write as usize + 1];
                let (mut values, mut scales) = (vec![0u8; n], vec![0u8; sw.len as usize]);
                quantise_fp8(
                    input,
                    DType::BF16,
                    shape,
                    &mut values,
                    &mut scales,
                    Threads::All,
                )
                .unwrap();
                out[dst..dst + n].copy_from_slice(&values);
                let sd = sw.dst_offset as usize;
                out[sd..sd + scales.len()].copy_from_slice(&scales);
            }
            Kind::CastF32ToBf16 => {
                let len = w.len as usize;
                cast(
                    input,
                    DType::F32,
                    &mut out[dst..dst + len],
                    DType::BF16,
                    Threads::All,
                )
                .unwrap();
            }
            Kind::CopyBf16 => out[dst..dst + input.len()].copy_from_slice(input),
            Kind::CopyBf16Band => {
                let len = w.len as usize;
                let dims = [ROWS as usize, COLS as usize];
                let (start, extent) = ([0, COLS as usize / 4], [ROWS as usize, COLS as usize / 2]);
                gather_box(
                    input,
                    2,
                    &dims,
                    &start,
                    &extent,
                    &mut out[dst..dst + len],
                    Threads::All,
                )
                .unwrap();
            }
        }
    }
    out
}

/// A trainer on `source` and a rollout landing in device memory, each on its own TCP fabric
/// over loopback.
async fn pair(
    source: Arc<DeviceSource>,
    mode: PipelineMode,
) -> (
    TrainerWorker<TcpFabric>,
    RolloutWorker<TcpFabric>,
    Arc<DeviceDestination>,
) {
    let (tp, rp) = plans();
    let ft = TcpFabric::start(&fabric_config()).await.unwrap();
    let fr = TcpFabric::start(&fabric_config()).await.unwrap();
    let mut rollout = RolloutWorker::new(fr, "rollout-0", rp).unwrap();
    let device = source.device().clone();
    let destination = Arc::new(DeviceDestination::allocate(device, rollout.regions()).unwrap());
    rollout.set_device_landing(destination.clone());
    let mut cfg = TrainerConfig::new("trainer-0", WATERMARK);
    cfg.piece_bytes = Some(PIECE);
    cfg.mode = mode;
    let mut trainer = TrainerWorker::new(ft, source, tp, cfg).unwrap();
    let mut dsts = Destinations::default();
    dsts.rollouts.insert(0, rollout.descriptors());
    trainer.set_destinations(&dsts).unwrap();
    (trainer, rollout, destination)
}

/// The loopback fabric both ends of a check's sync run on (and its fabric limit).
fn fabric_config() -> FabricConfig {
    FabricConfig::loopback("gpu-check", FabricConfig::machine_lanes_per_peer(1))
}

/// Median seconds of the fabric alone moving `bytes` from one host buffer to one host region
/// in large blocks, on fabrics configured as the sync's ([`FabricLimit`]), after a warm-up:
/// what `ratio_vs_fabric` divides by.
async fn fabric_limit_seconds(bytes: u64) -> f64 {
    let limit = FabricLimit::start(&[(0, 0, bytes)], &fabric_config())
        .await
        .unwrap();
    limit.sync().await.unwrap();
    let mut times = Vec::new();
    for _ in 0..MEASURED {
        times.push(limit.sync().await.unwrap());
    }
    median(times)
}

/// The middle value (the upper one of an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One sync, trigger to landed: the trainer's report and the wall seconds.
async fn sync(
    trainer: &TrainerWorker<TcpFabric>,
    rollout: &RolloutWorker<TcpFabric>,
    epoch: u64,
) -> (SyncReport, f64) {
    let id = SyncId {
        version: epoch,
        epoch,
    };
    rollout.arm(id).unwrap();
    let t0 = Instant::now();
    let report = trainer.run_sync(id).await.unwrap();
    rollout
        .await_landed(Duration::from_secs(120))
        .await
        .unwrap();
    (report, t0.elapsed().as_secs_f64())
}

/// Busy seconds and spans of each pipeline stage in a sync.
fn stage_summary(report: &SyncReport) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for stage in [Stage::H2d, Stage::Prepare, Stage::Write, Stage::Barrier] {
        let events: Vec<_> = report
            .timeline
            .events
            .iter()
            .filter(|e| e.stage == stage)
            .collect();
        let busy: u64 = events.iter().map(|e| e.duration_ns()).sum();
        let bytes: u64 = events.iter().map(|e| e.bytes).sum();
        out.insert(
            format!("{stage:?}").to_lowercase(),
            json!({"spans": events.len(), "busy_s": busy as f64 * 1e-9, "bytes": bytes}),
        );
    }
    serde_json::Value::Object(out)
}

/// Median seconds of a device-to-device copy of `src` (CUDA events with timing).
fn d2d_seconds(dev: &GpuDevice, src: &cudarc::driver::CudaSlice<u8>) -> f64 {
    let stream = dev.stream();
    let mut dst = dev.alloc(src.len()).unwrap();
    let mut times = Vec::new();
    for _ in 0..5 {
        let start = stream.record_event(Some(CU_EVENT_DEFAULT)).unwrap();
        stream.memcpy_dtod(src, &mut dst).unwrap();
        let end = stream.record_event(Some(CU_EVENT_DEFAULT)).unwrap();
        end.synchronize().unwrap();
        times.push(start.elapsed_ms(&end).unwrap() as f64 * 1e-3);
    }
    median(times)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU"]
async fn device_source_sync_lands_every_byte() {
    let (tp, rp) = plans();
    let host = source_bytes(&tp);
    let want = expected(&tp, &rp, &host);
    let dev = Arc::new(device());
    let owned = dev.upload(&host).unwrap();
    let d2d = d2d_seconds(&dev, &owned);
    let mut export = IpcExport::new(&dev, host.len()).unwrap();
    export.write(0, &host).unwrap();
    // SAFETY: `export` is a live cuMemAlloc allocation of this context, dropped after every
    // trainer built on the borrowed source (the end of this test), and not written meanwhile.
    let borrowed = unsafe { BorrowedDevice::new(&dev, export.device_ptr(), host.len()) }.unwrap();
    let sources = [
        ("owned", GpuSource::Owned(owned)),
        ("borrowed", GpuSource::Borrowed(borrowed)),
    ];
    let mut failures = Vec::new();
    for (epoch, (kind, arena)) in (1u64..).zip(sources) {
        let source = Arc::new(DeviceSource::new(dev.clone(), arena).unwrap());
        let (trainer, rollout, destination) = pair(source, PipelineMode::Pipelined).await;
        // One warm-up sync (connections, first-touch of the staging), then the measured ones;
        // the last one's bytes are checked.
        sync(&trainer, &rollout, epoch * 10).await;
        let mut runs = Vec::new();
        for r in 1..=MEASURED as u64 {
            runs.push(sync(&trainer, &rollout, epoch * 10 + r).await);
        }
        let verified = rollout.verify(&runs[runs.len() - 1].0.checksums).is_ok();
        let wall = median(runs.iter().map(|r| r.1).collect());
        let report = &runs[runs.len() - 1].0;
        // The same bytes by the fabric alone, in the same run: the sync's landing rate over
        // its fabric's (the performance issue's `ratio_vs_fabric`, target 0.9).
        let fabric_s = fabric_limit_seconds(report.bytes_written).await;
        let got = destination.download(0).unwrap();
        let mismatched = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        let exact = got.len() == want.len() && mismatched == 0;
        emit(json!({
            "check": "device_sync", "source": kind,
            "destination": "device (pinned bounce buffers, H2D before landed)",
            "transport": "tcp loopback, one process",
            "source_bytes": host.len(), "written_bytes": report.bytes_written,
            "pieces": report.pieces, "staged_bytes": report.staged_bytes,
            "peak_staging_bytes": report.peak_staging_bytes, "watermark_bytes": WATERMARK,
            "sync_s": wall, "sync_gb_per_s": host.len() as f64 / wall / 1e9,
            "d2d_copy_s": d2d, "ratio_vs_d2d": d2d / wall,
            "fabric_limit_s": fabric_s, "ratio_vs_fabric": fabric_s / wall,
            "target_ratio_vs_fabric": TARGET_RATIO_VS_FABRIC, "syncs_measured": MEASURED,
            "every_byte_equal": exact, "mismatched_bytes": mismatched, "checksums_verified": verified,
            "stages": stage_summary(report), "split": report.split,
            "timeline": report.timeline,
        }));
        if !exact || !verified {
            failures.push(format!(
                "{kind}: {mismatched} bytes differ, verified {verified}"
            ));
        }
    }
    drop(export);
    assert!(failures.is_empty(), "{failures:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU"]
async fn device_source_pipeline_overlaps_its_stages() {
    let (tp, _) = plans();
    let host = source_bytes(&tp);
    let dev = Arc::new(device());
    let mut walls = Vec::new();
    let mut stages = Vec::new();
    for (i, mode) in [PipelineMode::Serialised, PipelineMode::Pipelined]
        .into_iter()
        .enumerate()
    {
        let arena = GpuSource::Owned(dev.upload(&host).unwrap());
        let source = Arc::new(DeviceSource::new(dev.clone(), arena).unwrap());
        let (trainer, rollout, _destination) = pair(source, mode).await;
        let base = 100 * (i as u64 + 1);
        sync(&trainer, &rollout, base).await;
        let mut runs = Vec::new();
        for r in 1..=5 {
            let (report, wall) = sync(&trainer, &rollout, base + r).await;
            rollout.verify(&report.checksums).unwrap();
            runs.push((wall, report));
        }
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (wall, report) = &runs[runs.len() / 2];
        walls.push(*wall);
        stages.push(stage_summary(report));
    }
    let speedup = walls[0] / walls[1];
    // The slowest stage of the serialised run (its stages never overlap).
    let slowest_s = ["h2d", "prepare", "write"]
        .iter()
        .filter_map(|s| stages[0][*s]["busy_s"].as_f64())
        .fold(0.0, f64::max);
    let over_slowest = walls[1] / slowest_s;
    let pass = over_slowest <= MAX_PIPELINED_OVER_SLOWEST_STAGE;
    emit(json!({
        "check": "device_overlap", "source_bytes": host.len(),
        "serialised_s": walls[0], "pipelined_s": walls[1], "overlap_speedup": speedup,
        "target_overlap_speedup": TARGET_OVERLAP_SPEEDUP,
        "slowest_stage_s": slowest_s, "pipelined_over_slowest_stage": over_slowest,
        "max_pipelined_over_slowest_stage": MAX_PIPELINED_OVER_SLOWEST_STAGE, "pass": pass,
        "serialised_stages": stages[0], "pipelined_stages": stages[1],
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
    }));
    assert!(
        pass,
        "pipelined {:.3} s is {over_slowest:.2}x its slowest stage ({slowest_s:.3} s), over \
         {MAX_PIPELINED_OVER_SLOWEST_STAGE} (overlap_speedup {speedup:.2})",
        walls[1]
    );
}

/// Runs without a GPU: the plan is consistent and the expected bytes cover every write.
#[test]
fn the_check_plan_builds_and_its_expectation_covers_the_mr() {
    let (tp, rp) = plans();
    assert_eq!(tp.shards.len(), LAYERS as usize);
    let fab = crate::mem_fabric::MemFabric::new_switch("t");
    let src: Arc<Vec<u8>> = Arc::new(vec![0u8; tp.source_arena_bytes as usize]);
    let mut cfg = TrainerConfig::new("trainer-0", WATERMARK);
    cfg.piece_bytes = Some(PIECE);
    let trainer = TrainerWorker::new(fab.clone(), src, tp.clone(), cfg).unwrap();
    assert!(trainer.pieces() > LAYERS as usize);
    let rollout = RolloutWorker::new(fab.peer("r"), "r", rp.clone()).unwrap();
    assert_eq!(rollout.descriptors().len(), 1);
    let written: u64 = tp.writes.iter().map(|w| w.len as u64).sum();
    assert!(written <= rp.mr_bytes[0]);
}
