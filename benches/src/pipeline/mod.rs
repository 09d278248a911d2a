//! `weightsync bench pipeline`: the trainer pipeline with its stages overlapped versus the same
//! tasks with the stages serialised, in the same run, over the loopback TCP fabric.
//!
//! Why: the point of the pipeline is that H2D, prepare and WRITE of different pieces run at
//! once, so a sync takes about as long as its slowest stage instead of the sum of all three.
//! That only shows if the stages take similar time, and no single kind of tensor does that:
//! f32 -> fp8 is prepare-heavy, f32 -> bf16 is H2D-heavy (4 bytes in, 2 out), a bf16 copy
//! (norms, embeddings) is WRITE-heavy with no prepare work. So the bench first *measures* each
//! kind: a calibration run, serialised, with a few tasks of every kind, gives each kind's busy
//! seconds per task in each stage on this machine, now. It then picks how many tasks of each
//! kind (out of `tasks`) make the three stage totals most even, and interleaves them. Every
//! task is real work through the real worker (no sleeps, no mock stages), verified by checksum
//! on the rollout.
//!
//! The report gives each stage's busy time (serialised and pipelined), the imbalance, the
//! `ideal_speedup` that balance allows with unlimited cores (sum of stages / slowest stage),
//! `overlap_speedup` = serialised / pipelined wall time, and `peak_staging_bytes` against the
//! watermark.
//!
//! What to expect on a small machine: the three stages are all CPU work here (H2D is a memcpy,
//! prepare runs the kernels, WRITE is the kernel copying through loopback sockets on both the
//! sending and the receiving side). With C cores no overlap can beat
//! `cpu_bound_ceiling = sum / max(slowest stage, sum / C)` (2 cores: at most 2.0 even when
//! perfectly balanced), and since a loopback WRITE burns CPU on both ends, the measured
//! `cpu_bound_speedup_limit` (serialised wall time over process CPU time / C) is lower still.
//! And on a machine shared with other jobs the process does not get all C cores: the bench
//! measures the cores' worth it does get (`effective_cores`, a short spin on every core before
//! and after the timed syncs) and gives the ceiling for that too
//! (`cpu_bound_ceiling_effective`); with one core's worth, no overlap can win anything.
//! Compare `overlap_speedup` with those two, not with 3: on a trainer GPU, H2D is a DMA engine,
//! prepare runs on the SMs and WRITE on the NIC, and they overlap fully.

mod plans;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use weightsync_common::DType;
use weightsync_common::fabric::{Fabric, FabricConfig, FabricError};
use weightsync_common::protocol::Stage;
use weightsync_worker::RolloutWorker;
use weightsync_worker::WorkerError;
use weightsync_worker::{
    Destinations, PipelineMode, SyncId, SyncReport, TrainerConfig, TrainerWorker,
};

use crate::cpu_clock::process_cpu_s;
pub use plans::plans;
use plans::source_for;

/// This process's CPU seconds so far ([`process_cpu_s`]); NaN where there is no reading.
fn cpu_s() -> f64 {
    process_cpu_s().unwrap_or(f64::NAN)
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Number of weight matrices (tasks); the calibration picks how many of each [`Kind`].
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
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct StageSeconds {
    /// H2D (source -> staging).
    pub h2d: f64,
    /// Prepare (the task's transform, plus the checksums of its output).
    pub prepare: f64,
    /// WRITE (posted until acknowledged).
    pub write: f64,
}

impl StageSeconds {
    fn all(&self) -> [f64; 3] {
        [self.h2d, self.prepare, self.write]
    }
    /// Sum of the three stages.
    pub fn sum(&self) -> f64 {
        self.all().iter().sum()
    }
    /// The slowest stage.
    pub fn max(&self) -> f64 {
        self.all().into_iter().fold(0.0, f64::max)
    }
    /// The fastest stage.
    pub fn min(&self) -> f64 {
        self.all().into_iter().fold(f64::INFINITY, f64::min)
    }
    fn add_scaled(&mut self, other: &StageSeconds, k: f64) {
        self.h2d += other.h2d * k;
        self.prepare += other.prepare * k;
        self.write += other.write * k;
    }
}

/// What the trainer does to one matrix: the kinds the bench mixes to balance the stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// f32 quantised to fp8 e4m3 with 128x128 block scales: prepare-heavy.
    Fp8FromF32,
    /// f32 cast to bf16: H2D-heavy (4 bytes in, 2 written).
    CastF32ToBf16,
    /// bf16 sent unchanged (norms, embeddings): WRITE-heavy, no prepare work but checksums.
    CopyBf16,
}

impl Kind {
    /// Every kind, in a fixed order.
    pub const ALL: [Kind; 3] = [Kind::Fp8FromF32, Kind::CastF32ToBf16, Kind::CopyBf16];

    fn source_dtype(self) -> DType {
        match self {
            Kind::CopyBf16 => DType::BF16,
            _ => DType::F32,
        }
    }
}

/// One kind's part of the mix.
#[derive(Debug, Clone, Serialize)]
pub struct MixEntry {
    /// The kind.
    pub kind: Kind,
    /// Tasks of this kind in the measured plan.
    pub tasks: u32,
    /// Busy seconds per task of this kind in each stage, from the calibration run.
    pub per_task: StageSeconds,
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
    /// The task mix and each kind's calibrated cost per task.
    pub mix: Vec<MixEntry>,
    /// The stage imbalance the calibration predicted for the mix.
    pub predicted_imbalance: f64,
    /// Slowest stage / fastest stage in the serialised run (1.0 = perfectly balanced).
    pub stage_imbalance: f64,
    /// Sum of the serialised stages / slowest serialised stage: what perfect overlap would give
    /// with this balance and enough cores (3.0 when perfectly balanced).
    pub ideal_speedup: f64,
    /// `sum / max(slowest stage, sum / cores)` over the serialised stages: the best overlap this
    /// many cores allow when every stage is CPU work, as here (2 cores: at most 2.0).
    pub cpu_bound_ceiling: f64,
    /// Cores' worth of CPU this process actually got when it asked for all of them (`cores`
    /// threads spinning for a moment, process CPU time / wall time), measured just before and
    /// just after the timed syncs, the lower of the two. On a machine shared with other jobs
    /// this is below `cores`, and so is what any overlap can reach.
    pub effective_cores: f64,
    /// `cpu_bound_ceiling` with `effective_cores` instead of `cores`: the ceiling on this
    /// machine as it was during the run.
    pub cpu_bound_ceiling_effective: f64,
    /// The most staging in flight in any pipelined sync.
    pub peak_staging_bytes: u64,
    /// Source bytes copied into staging per sync (this bench's source is an arena nobody
    /// registered, so every byte is staged).
    pub staged_bytes: u64,
    /// Bytes written straight from registered source memory per sync.
    pub direct_bytes: u64,
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
    /// machine from the CPU time actually spent (a loopback WRITE costs CPU on both ends, so
    /// this is below `cpu_bound_ceiling`). Meaningful only on an otherwise idle machine: when
    /// other processes take the cores, wall time grows without CPU time and this figure is
    /// inflated.
    pub cpu_bound_speedup_limit: f64,
    /// CPU cores available to this process.
    pub cores: usize,
    /// Repetitions per mode.
    pub reps: usize,
}

impl Report {
    /// Human-readable summary.
    pub fn human(&self) -> String {
        let mix: Vec<String> = self
            .mix
            .iter()
            .map(|m| format!("{} x {:?}", m.tasks, m.kind))
            .collect();
        format!(
            "pipeline bench: {} pieces, {:.1} MiB source -> {:.1} MiB written per sync, {} cores\n\
             mix {} (predicted imbalance {:.2})\n\
             serialised {:.3} s  (h2d {:.3} s, prepare {:.3} s, write {:.3} s; imbalance {:.2})\n\
             pipelined  {:.3} s  (h2d {:.3} s, prepare {:.3} s, write {:.3} s busy)\n\
             overlap_speedup {:.2}  (ideal with this balance {:.2}; CPU-bound ceiling on {} cores {:.2}, \
             on the {:.2} cores' worth this process got {:.2}, from CPU time spent {:.2})\n\
             peak staging {} of watermark {} bytes ({}), verified {}\n",
            self.pieces,
            self.source_bytes as f64 / (1 << 20) as f64,
            self.written_bytes as f64 / (1 << 20) as f64,
            self.cores,
            mix.join(", "),
            self.predicted_imbalance,
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
            self.cpu_bound_ceiling,
            self.effective_cores,
            self.cpu_bound_ceiling_effective,
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

/// How many tasks of each kind (summing to `tasks`) make the stage totals most even, given each
/// kind's cost per task: the smallest max/min over every split (an exhaustive search: at most a
/// few thousand splits for the task counts a bench uses).
fn best_mix(per_task: &[StageSeconds; 3], tasks: u32) -> ([u32; 3], f64) {
    let mut best = ([tasks, 0, 0], f64::INFINITY);
    for a in 0..=tasks {
        for b in 0..=tasks - a {
            let counts = [a, b, tasks - a - b];
            let mut total = StageSeconds::default();
            for (c, k) in counts.iter().zip(per_task) {
                total.add_scaled(k, *c as f64);
            }
            let imbalance = total.max() / total.min().max(1e-12);
            if imbalance < best.1 {
                best = (counts, imbalance);
            }
        }
    }
    best
}

/// The order of the tasks: the kinds interleaved as evenly as their counts allow (smooth
/// weighted round robin), so that every stretch of the sync has the same balance as the whole.
fn interleave(counts: &[u32; 3]) -> Vec<Kind> {
    let total: i64 = counts.iter().map(|&c| c as i64).sum();
    let mut credit = [0i64; 3];
    let mut order = Vec::with_capacity(total as usize);
    for _ in 0..total {
        for (cr, &c) in credit.iter_mut().zip(counts) {
            *cr += c as i64;
        }
        let k = (0..3)
            .max_by_key(|&k| (credit[k], -(k as i64)))
            .unwrap_or(0);
        credit[k] -= total;
        order.push(Kind::ALL[k]);
    }
    order
}

fn stage_seconds(r: &SyncReport) -> StageSeconds {
    let s = |st| r.timeline.busy_ns(st) as f64 / 1e9;
    StageSeconds {
        h2d: s(Stage::H2d),
        prepare: s(Stage::Prepare),
        write: s(Stage::Write),
    }
}

/// Busy seconds per task of each kind, in one sync of the plan whose task `t` is `kinds[t]`.
fn per_kind_seconds(r: &SyncReport, kinds: &[Kind]) -> [StageSeconds; 3] {
    let mut out = [StageSeconds::default(); 3];
    let mut count = [0u32; 3];
    for &k in kinds {
        count[Kind::ALL.iter().position(|&x| x == k).unwrap_or(0)] += 1;
    }
    for e in &r.timeline.events {
        let Some(&kind) = kinds.get(e.task as usize) else {
            continue;
        };
        let k = Kind::ALL.iter().position(|&x| x == kind).unwrap_or(0);
        let secs = e.duration_ns() as f64 / 1e9 / count[k].max(1) as f64;
        match e.stage {
            Stage::H2d => out[k].h2d += secs,
            Stage::Prepare => out[k].prepare += secs,
            Stage::Write => out[k].write += secs,
            _ => {}
        }
    }
    out
}

/// Cores' worth of CPU this process gets right now: `threads` threads spin for `secs`, and the
/// process CPU time they used is divided by the wall time.
fn effective_cores(threads: usize, secs: f64) -> f64 {
    let cpu0 = cpu_s();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut x = 0u64;
                while t0.elapsed().as_secs_f64() < secs {
                    for _ in 0..1000 {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                }
                x
            });
        }
    });
    (cpu_s() - cpu0) / t0.elapsed().as_secs_f64()
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

/// A rollout and one trainer per mode, on their own loopback fabrics, for one plan.
struct Rig {
    rollout: RolloutWorker<Fabric>,
    workers: Vec<TrainerWorker<Fabric>>,
    epoch: u64,
}

/// One timed sync.
struct Timed {
    secs: f64,
    cpu_s: f64,
    report: SyncReport,
    verified: bool,
}

impl Rig {
    async fn new(cfg: &Config, kinds: &[Kind], modes: &[PipelineMode]) -> Result<Rig, BenchError> {
        let (tp, rp) = plans(cfg, kinds)?;
        let token = "weightsync-bench-pipeline";
        let trainer_fabric = Fabric::start(&FabricConfig::loopback(token, cfg.lanes)).await?;
        let rollout_fabric = Fabric::start(&FabricConfig::loopback(token, cfg.lanes)).await?;
        let rollout = RolloutWorker::new(rollout_fabric, "rollout-0", rp)?;
        let mut dsts = Destinations::default();
        dsts.rollouts.insert(0, rollout.descriptors());
        let source: Arc<Vec<u8>> = Arc::new(source_for(&tp));
        let mut workers = Vec::new();
        for &mode in modes {
            let mut c = TrainerConfig::new("trainer-0", cfg.watermark_mib << 20);
            c.piece_bytes = Some(cfg.piece_mib << 20);
            c.mode = mode;
            c.verify = true;
            c.prepare_all_threads = cfg.prepare_all_threads;
            let mut w = TrainerWorker::new(trainer_fabric.clone(), source.clone(), tp.clone(), c)?;
            w.set_destinations(&dsts)?;
            workers.push(w);
        }
        Ok(Rig {
            rollout,
            workers,
            epoch: 0,
        })
    }

    /// One sync of worker `m`, from trigger to landed, verified.
    async fn sync(&mut self, m: usize) -> Result<Timed, BenchError> {
        self.epoch += 1;
        let sync = SyncId {
            version: self.epoch,
            epoch: self.epoch,
        };
        self.rollout.arm(sync)?;
        let cpu0 = cpu_s();
        let t0 = Instant::now();
        let report = self.workers[m].run_sync(sync).await?;
        self.rollout.await_landed(Duration::from_secs(120)).await?;
        let secs = t0.elapsed().as_secs_f64();
        let cpu_s = cpu_s() - cpu0;
        let verified = self.rollout.verify(&report.checksums).is_ok();
        Ok(Timed {
            secs,
            cpu_s,
            report,
            verified,
        })
    }
}

/// Tasks of each kind in the calibration run.
const CALIBRATION_TASKS_PER_KIND: usize = 4;

/// Fewest timed calibration syncs (a task's stage takes about a millisecond, the same order as a
/// scheduling hiccup on a shared machine: the median of several is what the mix is built on).
const CALIBRATION_MIN_REPS: usize = 7;

/// Measures each kind's busy seconds per task and stage: serialised syncs of a plan with
/// [`CALIBRATION_TASKS_PER_KIND`] tasks of every kind, interleaved; the median of `reps` (at
/// least [`CALIBRATION_MIN_REPS`]) syncs after a warm-up, stage by stage.
async fn calibrate(cfg: &Config) -> Result<[StageSeconds; 3], BenchError> {
    let kinds: Vec<Kind> = (0..CALIBRATION_TASKS_PER_KIND)
        .flat_map(|_| Kind::ALL)
        .collect();
    let mut rig = Rig::new(cfg, &kinds, &[PipelineMode::Serialised]).await?;
    rig.sync(0).await?;
    let mut runs = Vec::new();
    for _ in 0..cfg.reps.max(CALIBRATION_MIN_REPS) {
        let t = rig.sync(0).await?;
        if !t.verified {
            return Err(BenchError::Config(
                "calibration sync failed verification".into(),
            ));
        }
        runs.push(per_kind_seconds(&t.report, &kinds));
    }
    let median = |f: &dyn Fn(&[StageSeconds; 3]) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut out = [StageSeconds::default(); 3];
    for (k, o) in out.iter_mut().enumerate() {
        *o = StageSeconds {
            h2d: median(&|r| r[k].h2d),
            prepare: median(&|r| r[k].prepare),
            write: median(&|r| r[k].write),
        };
    }
    Ok(out)
}

async fn run_async(cfg: &Config) -> Result<Report, BenchError> {
    if cfg.tasks == 0 {
        return Err(BenchError::Config("tasks must be positive".into()));
    }
    let per_task = calibrate(cfg).await?;
    let (counts, predicted_imbalance) = best_mix(&per_task, cfg.tasks);
    let kinds = interleave(&counts);
    let modes = [PipelineMode::Serialised, PipelineMode::Pipelined];
    let mut rig = Rig::new(cfg, &kinds, &modes).await?;
    let source_bytes = rig.workers[0].plan().source_arena_bytes;
    let watermark = cfg.watermark_mib << 20;

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let effective_before = effective_cores(cores, 0.25);
    let mut results: [Vec<(f64, (SyncReport, f64))>; 2] = [Vec::new(), Vec::new()];
    let mut verified = true;
    // One untimed warm-up per mode (connects lanes, faults pages in), then alternate modes.
    for rep in 0..=cfg.reps {
        for (m, res) in results.iter_mut().enumerate() {
            let t = rig.sync(m).await?;
            verified &= t.verified;
            if rep > 0 {
                res.push((t.secs, (t.report, t.cpu_s)));
            }
        }
    }
    let effective_cores = effective_before.min(effective_cores(cores, 0.25));
    let peak = results[1]
        .iter()
        .map(|r| r.1.0.peak_staging_bytes)
        .max()
        .unwrap_or(0);
    let [serial, piped] = results;
    let (serialised_s, (serial_report, serialised_cpu_s)) = median_by(serial);
    let (pipelined_s, (piped_report, pipelined_cpu_s)) = median_by(piped);
    let ss = stage_seconds(&serial_report);
    let (sum, slowest) = (ss.sum(), ss.max().max(1e-12));
    let mix = Kind::ALL
        .iter()
        .zip(counts)
        .zip(per_task)
        .map(|((&kind, tasks), per_task)| MixEntry {
            kind,
            tasks,
            per_task,
        })
        .collect();
    Ok(Report {
        source_bytes,
        written_bytes: piped_report.bytes_written,
        pieces: piped_report.pieces,
        serialised_s,
        pipelined_s,
        overlap_speedup: serialised_s / pipelined_s,
        pipelined_stages: stage_seconds(&piped_report),
        mix,
        predicted_imbalance,
        stage_imbalance: slowest / ss.min().max(1e-12),
        ideal_speedup: sum / slowest,
        cpu_bound_ceiling: sum / slowest.max(sum / cores as f64),
        effective_cores,
        cpu_bound_ceiling_effective: sum / slowest.max(sum / effective_cores.max(1e-3)),
        serialised_stages: ss,
        peak_staging_bytes: peak,
        staged_bytes: piped_report.staged_bytes,
        direct_bytes: piped_report.direct_bytes,
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
        assert_eq!(r.mix.iter().map(|m| m.tasks).sum::<u32>(), 3);
        let source: u64 = r
            .mix
            .iter()
            .map(|m| m.tasks as u64 * 256 * 384 * m.kind.source_dtype().size() as u64)
            .sum();
        assert_eq!(r.source_bytes, source);
        assert!(r.written_bytes >= 3 * 256 * 384);
        assert!(r.pieces >= 3);
        // The calibration measured every kind's WRITE, and a copy has the least prepare work.
        assert!(r.mix.iter().all(|m| m.per_task.write > 0.0));
        assert!(r.cpu_bound_ceiling <= r.ideal_speedup + 1e-9);
        assert!(r.cpu_bound_ceiling <= r.cores as f64 + 1e-9);
        assert!(r.effective_cores > 0.0 && r.effective_cores <= r.cores as f64 * 1.1);
        assert!(r.cpu_bound_ceiling_effective <= r.ideal_speedup + 1e-9);
    }

    #[test]
    fn best_mix_evens_out_the_stages() {
        let s = |h2d, prepare, write| StageSeconds {
            h2d,
            prepare,
            write,
        };
        // Prepare-heavy, H2D-heavy, WRITE-heavy kinds: one of each is perfectly balanced.
        let per_task = [s(1.0, 3.0, 1.0), s(3.0, 1.0, 1.0), s(1.0, 1.0, 3.0)];
        let (counts, imbalance) = best_mix(&per_task, 6);
        assert_eq!(counts, [2, 2, 2]);
        assert!((imbalance - 1.0).abs() < 1e-12);
        // With only the first kind useful the search still returns a split of all tasks.
        let per_task = [s(1.0, 1.0, 1.0), s(0.0, 5.0, 0.0), s(0.0, 0.0, 5.0)];
        let (counts, imbalance) = best_mix(&per_task, 4);
        assert_eq!(counts, [4, 0, 0]);
        assert!((imbalance - 1.0).abs() < 1e-12);
    }

    #[test]
    fn interleave_spreads_each_kind_evenly() {
        let order = interleave(&[4, 2, 2]);
        assert_eq!(order.len(), 8);
        for (k, &want) in Kind::ALL.iter().zip(&[4, 2, 2]) {
            assert_eq!(order.iter().filter(|&&x| x == *k).count(), want);
        }
        // Every half of the sequence holds half of each kind.
        let first = &order[..4];
        assert_eq!(first.iter().filter(|&&x| x == Kind::Fp8FromF32).count(), 2);
        assert_eq!(first.iter().filter(|&&x| x == Kind::CopyBf16).count(), 1);
        assert!(interleave(&[0, 0, 0]).is_empty());
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
