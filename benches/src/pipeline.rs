//! `weightsync bench pipeline`: the trainer pipeline with its stages overlapped versus the same
//! tasks with the stages serialised, in the same run, over the loopback TCP fabric.
//!
//! Why: the point of the pipeline is that H2D, prepare and WRITE of different pieces run at
//! once, so a sync takes about as long as its slowest stage instead of the sum of all three.
//! The workload is sized so the three stages take similar time: f32 training weights quantised
//! to fp8 for the rollout (H2D moves 4 bytes per element, prepare reads 4 and writes 1, WRITE
//! sends 1 over a socket). The report gives each stage's busy time in the serialised run (to show
//! the balance), `overlap_speedup` = serialised / pipelined wall time, the `ideal_speedup` the
//! stage balance would allow (serialised / slowest stage), and `peak_staging_bytes` against the
//! watermark.
//!
//! What to expect on a small machine: the three stages are all CPU work here (H2D is a memcpy,
//! prepare runs on the rayon pool, WRITE is the kernel copying through loopback sockets on both
//! the sending and the receiving side). With 2 cores the pipeline cannot do better than the CPU
//! time of the three stages divided by 2, so the speedup is bounded well below 3; on a trainer
//! GPU, H2D is a DMA engine, prepare runs on the SMs and WRITE on the NIC, and they overlap fully.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use weightsync_common::fabric::{Fabric, FabricConfig, FabricError};
use weightsync_common::DType;
use weightsync_schedules::table::{
    DstTensor, Endpoint, LocalShard, MeshGroup, ParamRef, RolloutPlan, Shape, Source, Task,
    TensorBox, TrainerPlan, Transform, UnitExpect, Write,
};
use weightsync_worker::error::WorkerError;
use weightsync_worker::rollout::RolloutWorker;
use weightsync_worker::timeline::Stage;
use weightsync_worker::trainer::{
    Destinations, PipelineMode, SyncId, SyncReport, TrainerConfig, TrainerWorker,
};

/// What to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Number of weight matrices (tasks).
    pub tasks: u32,
    /// Rows of each matrix (a multiple of 128 keeps every piece whole blocks).
    pub rows: u32,
    /// Columns of each matrix.
    pub cols: u32,
    /// Staging watermark in MiB.
    pub watermark_mib: u64,
    /// Staging per piece in MiB (tasks larger than this are split).
    pub piece_mib: u64,
    /// Fabric lanes per peer.
    pub lanes: usize,
    /// Timed repetitions per mode (the median is reported).
    pub reps: usize,
    /// Prepare on every rayon thread (otherwise on one thread per piece).
    pub prepare_all_threads: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            tasks: 16,
            rows: 1024,
            cols: 2048,
            watermark_mib: 64,
            piece_mib: 4,
            lanes: 2,
            reps: 5,
            prepare_all_threads: false,
        }
    }
}

/// Why the bench could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The fabric failed.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// A worker failed.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// The configuration is unusable.
    #[error("bad configuration: {0}")]
    Config(String),
}

/// Busy time of each stage in one sync, seconds (sum over pieces).
#[derive(Debug, Clone, Serialize)]
pub struct StageSeconds {
    /// H2D (source -> staging).
    pub h2d: f64,
    /// Prepare (fp8 quantisation).
    pub prepare: f64,
    /// WRITE (posted until acknowledged).
    pub write: f64,
}

/// The `--json` object.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Source bytes read per sync.
    pub source_bytes: u64,
    /// Bytes written per sync.
    pub written_bytes: u64,
    /// Pieces per sync.
    pub pieces: u64,
    /// Median wall time of a serialised sync, seconds (trigger to landed).
    pub serialised_s: f64,
    /// Median wall time of a pipelined sync, seconds.
    pub pipelined_s: f64,
    /// `serialised_s / pipelined_s`.
    pub overlap_speedup: f64,
    /// Stage busy times in the median serialised sync.
    pub serialised_stages: StageSeconds,
    /// Stage busy times in the median pipelined sync (stages slow down when they share cores).
    pub pipelined_stages: StageSeconds,
    /// Slowest stage / fastest stage in the serialised run (1.0 = perfectly balanced).
    pub stage_imbalance: f64,
    /// `serialised_s / slowest serialised stage`: what perfect overlap would give.
    pub ideal_speedup: f64,
    /// The most staging in flight in any pipelined sync.
    pub peak_staging_bytes: u64,
    /// The watermark.
    pub watermark_bytes: u64,
    /// `peak_staging_bytes <= watermark_bytes`.
    pub peak_within_watermark: bool,
    /// Every sync verified byte-exact by checksum on the rollout.
    pub verified: bool,
    /// CPU seconds (user + system, this process: trainer, rollout and both fabrics) of the median
    /// serialised sync.
    pub serialised_cpu_s: f64,
    /// CPU seconds of the median pipelined sync.
    pub pipelined_cpu_s: f64,
    /// `serialised_s / (serialised_cpu_s / cores)`: the most any overlap can give on this
    /// machine, since all three stages are CPU work here. Meaningful only on an otherwise idle
    /// machine: when other processes take the cores, wall time grows without CPU time and this
    /// figure is inflated.
    pub cpu_bound_speedup_limit: f64,
    /// CPU cores available to this process.
    pub cores: usize,
    /// Repetitions per mode.
    pub reps: usize,
}

impl Report {
    /// Human-readable summary.
    pub fn human(&self) -> String {
        format!(
            "pipeline bench: {} pieces, {:.1} MiB source -> {:.1} MiB written per sync, {} cores\n\
             serialised {:.3} s  (h2d {:.3} s, prepare {:.3} s, write {:.3} s; imbalance {:.2})\n\
             pipelined  {:.3} s  (h2d {:.3} s, prepare {:.3} s, write {:.3} s busy)\n\
             overlap_speedup {:.2}  (ideal with this stage balance {:.2}; CPU-bound limit on {} cores {:.2})\n\
             peak staging {} of watermark {} bytes ({}), verified {}\n",
            self.pieces,
            self.source_bytes as f64 / (1 << 20) as f64,
            self.written_bytes as f64 / (1 << 20) as f64,
            self.cores,
            self.serialised_s,
            self.serialised_stages.h2d,
            self.serialised_stages.prepare,
            self.serialised_stages.write,
            self.stage_imbalance,
            self.pipelined_s,
            self.pipelined_stages.h2d,
            self.pipelined_stages.prepare,
            self.pipelined_stages.write,
            self.overlap_speedup,
            self.ideal_speedup,
            self.cores,
            self.cpu_bound_speedup_limit,
            self.peak_staging_bytes,
            self.watermark_bytes,
            if self.peak_within_watermark {
                "within"
            } else {
                "EXCEEDED"
            },
            self.verified,
        )
    }
}

/// The synthetic plans: `tasks` f32 matrices quantised to fp8 into one rollout rank.
pub fn plans(cfg: &Config) -> Result<(TrainerPlan, RolloutPlan), BenchError> {
    if cfg.tasks == 0 || cfg.rows == 0 || cfg.cols == 0 {
        return Err(BenchError::Config(
            "tasks, rows and cols must be positive".into(),
        ));
    }
    let shape = Shape::new(&[cfg.rows, cfg.cols]);
    let numel = shape.numel();
    let scale_shape = Shape::new(&[cfg.rows.div_ceil(128), cfg.cols.div_ceil(128)]);
    let scale_offset = numel.div_ceil(16) * 16;
    let scales = scale_shape.numel() * 4;
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
            num_tasks: cfg.tasks,
            gather_sends: 0,
            local_tasks: cfg.tasks,
            gather_expect: 0,
        }],
        tasks: Vec::new(),
        writes: Vec::new(),
    };
    let mut tensors = Vec::new();
    let mut dst = 0u64;
    for i in 0..cfg.tasks {
        let name = format!("layers.{i}.weight");
        tp.params.push(ParamRef {
            id: i,
            name: name.clone(),
            shape,
        });
        tp.shards.push(LocalShard {
            param: i,
            global: TensorBox::full(shape),
            dtype: DType::F32,
            offset: tp.source_arena_bytes,
        });
        tp.source_arena_bytes += numel * 4;
        let first_write = tp.writes.len() as u32;
        let values_at = dst;
        let scales_at = align(values_at + numel);
        dst = align(scales_at + scales);
        for (src_offset, dst_offset, len) in
            [(0, values_at, numel), (scale_offset, scales_at, scales)]
        {
            tp.writes.push(Write {
                dst: Endpoint::Rollout(0),
                mr: 0,
                unit: 0,
                len: len as u32,
                src_offset,
                dst_offset,
            });
        }
        tp.tasks.push(Task {
            param: i,
            region: TensorBox::full(shape),
            source: Source::Shard {
                shard: i,
                sub: TensorBox::full(shape),
            },
            transform: Transform::Fp8Block {
                from: DType::F32,
                block: 128,
                scale_offset,
                scale_shape,
            },
            prepared_bytes: scale_offset + scales,
            first_write,
            num_writes: 2,
        });
        tensors.push(DstTensor {
            name,
            shape,
            dtype: DType::F8E4M3,
            mr: 0,
            offset: values_at,
            len: numel,
        });
        tensors.push(DstTensor {
            name: format!("layers.{i}.weight_scale_inv"),
            shape: scale_shape,
            dtype: DType::F32,
            mr: 0,
            offset: scales_at,
            len: scales,
        });
    }
    let rp = RolloutPlan {
        rank: 0,
        engine: 0,
        local_rank: 0,
        mr_bytes: vec![dst],
        tensors,
        expect: vec![UnitExpect {
            unit: 0,
            writes: tp.writes.len() as u64,
        }],
    };
    Ok((tp, rp))
}

fn stage_seconds(r: &SyncReport) -> StageSeconds {
    let s = |st| r.timeline.busy_ns(st) as f64 / 1e9;
    StageSeconds {
        h2d: s(Stage::H2D),
        prepare: s(Stage::Prepare),
        write: s(Stage::Write),
    }
}

/// CPU seconds (user + system) this process has used, from `/proc/self/stat` (clock ticks of
/// 1/100 s, Linux's fixed USER_HZ); 0 where that file does not exist.
fn process_cpu_s() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which is in parentheses and may contain spaces).
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let f: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn median_by<T: Clone>(mut v: Vec<(f64, T)>) -> (f64, T) {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v[v.len() / 2].clone()
}

/// Runs the bench (builds its own tokio runtime).
pub fn run(cfg: &Config) -> Result<Report, BenchError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Config(format!("tokio runtime: {e}")))?;
    rt.block_on(run_async(cfg))
}

async fn run_async(cfg: &Config) -> Result<Report, BenchError> {
    let (tp, rp) = plans(cfg)?;
    let token = "weightsync-bench-pipeline";
    let trainer_fabric = Fabric::start(&FabricConfig::loopback(token, cfg.lanes)).await?;
    let rollout_fabric = Fabric::start(&FabricConfig::loopback(token, cfg.lanes)).await?;
    let rollout = RolloutWorker::new(rollout_fabric, "rollout-0", rp)?;
    let mut dsts = Destinations::default();
    dsts.rollouts.insert(0, rollout.descriptors());

    // Deterministic, non-trivial weights.
    let mut source = Vec::with_capacity(tp.source_arena_bytes as usize);
    let mut x = 0x9e37_79b9_u32;
    while (source.len() as u64) < tp.source_arena_bytes {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let v = (x as f32 / u32::MAX as f32 - 0.5) * 8.0;
        source.extend_from_slice(&v.to_le_bytes());
    }
    let source: Arc<Vec<u8>> = Arc::new(source);
    let source_bytes = tp.source_arena_bytes;

    let watermark = cfg.watermark_mib << 20;
    let mut workers = Vec::new();
    for mode in [PipelineMode::Serialised, PipelineMode::Pipelined] {
        let mut c = TrainerConfig::new("trainer-0", watermark);
        c.piece_bytes = Some(cfg.piece_mib << 20);
        c.mode = mode;
        c.verify = true;
        c.prepare_all_threads = cfg.prepare_all_threads;
        let mut w = TrainerWorker::new(trainer_fabric.clone(), source.clone(), tp.clone(), c)?;
        w.set_destinations(&dsts)?;
        workers.push(w);
    }

    let mut epoch = 0u64;
    let mut results: [Vec<(f64, (SyncReport, f64))>; 2] = [Vec::new(), Vec::new()];
    let mut verified = true;
    // One untimed warm-up per mode (connects lanes, faults pages in), then alternate modes.
    for rep in 0..=cfg.reps {
        for (m, worker) in workers.iter().enumerate() {
            epoch += 1;
            let sync = SyncId {
                version: epoch,
                epoch,
            };
            rollout.arm(sync)?;
            let cpu0 = process_cpu_s();
            let t0 = Instant::now();
            let report = worker.run_sync(sync).await?;
            rollout.await_landed(Duration::from_secs(120)).await?;
            let secs = t0.elapsed().as_secs_f64();
            let cpu = process_cpu_s() - cpu0;
            verified &= rollout.verify(&report.checksums).is_ok();
            if rep > 0 {
                results[m].push((secs, (report, cpu)));
            }
        }
    }
    let peak = results[1]
        .iter()
        .map(|r| r.1 .0.peak_staging_bytes)
        .max()
        .unwrap_or(0);
    let [serial, piped] = results;
    let (serialised_s, (serial_report, serialised_cpu_s)) = median_by(serial);
    let (pipelined_s, (piped_report, pipelined_cpu_s)) = median_by(piped);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ss = stage_seconds(&serial_report);
    let slowest = ss.h2d.max(ss.prepare).max(ss.write);
    let fastest = ss.h2d.min(ss.prepare).min(ss.write);
    Ok(Report {
        source_bytes,
        written_bytes: piped_report.bytes_written,
        pieces: piped_report.pieces,
        serialised_s,
        pipelined_s,
        overlap_speedup: serialised_s / pipelined_s,
        pipelined_stages: stage_seconds(&piped_report),
        serialised_stages: ss,
        stage_imbalance: slowest / fastest.max(1e-12),
        ideal_speedup: serialised_s / slowest.max(1e-12),
        peak_staging_bytes: peak,
        watermark_bytes: watermark,
        peak_within_watermark: peak <= watermark,
        verified,
        serialised_cpu_s,
        pipelined_cpu_s,
        cpu_bound_speedup_limit: serialised_s / (serialised_cpu_s / cores as f64).max(1e-9),
        cores,
        reps: cfg.reps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_lands_verified_within_the_watermark() {
        let cfg = Config {
            tasks: 3,
            rows: 256,
            cols: 384,
            watermark_mib: 1,
            piece_mib: 1,
            lanes: 2,
            reps: 1,
            prepare_all_threads: false,
        };
        let r = run(&cfg).unwrap();
        assert!(r.verified);
        assert!(r.peak_within_watermark && r.peak_staging_bytes > 0);
        assert_eq!(r.source_bytes, 3 * 256 * 384 * 4);
        assert!(r.written_bytes >= 3 * 256 * 384);
        assert!(r.pieces >= 3);
    }

    /// The full-size bench through the test harness (prints the JSON report):
    /// `cargo test --release -p weightsync-benches pipeline::tests::full -- --ignored --nocapture`.
    #[test]
    #[ignore = "a benchmark, not a test: run explicitly"]
    fn full() {
        for prepare_all_threads in [false, true] {
            let r = run(&Config {
                prepare_all_threads,
                ..Config::default()
            })
            .unwrap();
            println!("{}", serde_json::to_string(&r).unwrap());
            print!("prepare_all_threads={prepare_all_threads}: {}", r.human());
        }
    }
}
