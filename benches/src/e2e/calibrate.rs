//! Calibrating the simulator against real syncs on this machine (`weightsync simulate
//! --calibrate`).
//!
//! Why: the simulator's cluster-scale predictions are only worth something if the same model of
//! stages, NICs and sharing predicts what can be measured. Here every worker runs on one host, so
//! the cluster model is one node with one NIC (the loopback fabric) and a shared host CPU that
//! every stage draws on. The rates are measured first, each on its own, with nothing fitted to
//! the end-to-end runs:
//! - the loopback fabric in the configuration's own shape: every trainer writing to every
//!   rollout at once through `TcpFabric`, same lanes, as many bytes as the sync lands (GB/s
//!   landed, and the CPU-seconds per byte it burns: loopback TCP does not keep both cores busy,
//!   so a WRITE's share of the host is its CPU time, not the whole host for `1 / rate`);
//! - H2D (a memcpy on one thread: the CPU build's stand-in for the copy engine; its host share
//!   from a memcpy on every core at once, since memory bandwidth does not scale with cores);
//! - fp8 block quantisation (on the configuration's own fp8 task shapes, up to 64 MiB of them:
//!   a layer's tensors quantise slower than one large grid) and casts over the whole rayon
//!   pool;
//!
//! - what the host's concurrent stages get of it ([`overlap`]): the fabric pass run beside the
//!   configuration's own kernel looping on the pool; every host cost per byte is divided by
//!   that share (a lossless host would give 1);
//! - the per-sync fixed costs and the per-task cost, from near-empty syncs on the same loopback
//!   cluster shape ([`fixed`]: a regression over two task counts of a synthetic table of tiny
//!   tasks), never from the syncs being checked.
//!
//! Then, for several configurations, the simulator predicts a sync from those figures alone
//! (the fixed costs as the cluster model's `FixedCosts` and `task_overhead_s`), the same sync
//! runs for real ([`LoopbackCluster`]), and the report gives predicted vs measured and the
//! relative error (the check: within 10%). The machine is shared and its load drifts, so rates
//! and syncs are interleaved: the rates are measured before the first sync and again after
//! every sync, each sync's prediction is the mean of the predictions from the measurements on
//! either side of it (the load it met lies between them), and the check compares the median
//! prediction with the median sync. Kernel
//! rates are medians of five timed runs after a warm-up (a best-of peak is what a loaded
//! machine rarely holds), each run on a window of memory the cache no longer holds ([`cold`]:
//! a sync's kernels run from memory, not from a cache a small buffer timed again and again
//! stays in).

use std::time::Instant;

use serde::Serialize;
use weightsync_schedules::simulate::{
    ClusterModel, FixedCosts, HostModel, Placement, PrepRates, simulate,
};
use weightsync_schedules::table::Transform;
use weightsync_schedules::{CostModel, RoutingTable};
use weightsync_worker::{Fp8Shape, Threads};

use super::fabric_limit::FabricLimit;
use super::loopback::{LoopbackCluster, WorkerOptions, weights};
use super::{E2eError, Setup, runtime, tcp_limit};
use crate::cpu_clock::process_cpu_s;
use kernel_loop::KernelLoop;

pub mod cold;
pub mod fixed;
mod kernel_loop;
pub mod overlap;

pub use fixed::Fixed;
pub use overlap::Overlap;

/// What to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Configurations predicted and measured.
    pub setups: Vec<Setup>,
    /// Timed syncs per configuration, each between two measurements of the rates (medians),
    /// after one warm-up sync.
    pub syncs: usize,
    /// Workers.
    pub workers: WorkerOptions,
    /// Bytes per kernel measurement.
    pub kernel_bytes: u64,
    /// Allowed relative error.
    pub tolerance: f64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            setups: vec![
                Setup::new("qwen3-0.6b", "fsdp=4", "tp=2,dp=2", "fp8"),
                Setup::new("qwen3-0.6b", "fsdp=4", "tp=2,dp=1", "fp8"),
                Setup::new("qwen3-0.6b", "fsdp=2", "tp=1,dp=1", "bf16"),
                Setup::new("qwen3-0.6b", "fsdp=2", "tp=2,dp=2", "bf16"),
            ],
            syncs: 5,
            // The simulator stages every task (H2D, prepare, WRITE), so the syncs it is checked
            // against do too: no zero-copy writes from registered sources.
            workers: WorkerOptions {
                registered_sources: false,
                ..WorkerOptions::default()
            },
            kernel_bytes: 64 << 20,
            tolerance: 0.10,
        }
    }
}

/// Rates measured on this machine (bytes per second).
#[derive(Debug, Clone, Serialize)]
pub struct Rates {
    /// Cores the host has.
    pub cores: usize,
    /// Loopback fabric moving the configuration's own (trainer, rollout) bytes, every pair at
    /// once in 4 MiB writes (the `bench e2e` fabric limit), bytes landed per second.
    pub fabric_bytes_per_s: f64,
    /// CPU seconds (all threads, user + system) the loopback fabric burns per byte landed:
    /// the host share a WRITE takes, which on loopback is less than the whole host for
    /// `1 / fabric_bytes_per_s` (sockets wait on each other, leaving cores for other stages).
    pub fabric_cpu_s_per_byte: f64,
    /// memcpy on one thread.
    pub memcpy_1t_bytes_per_s: f64,
    /// memcpy over the whole pool at once.
    pub memcpy_all_bytes_per_s: f64,
    /// fp8 block quantisation over the pool on the configuration's fp8 task shapes (one large
    /// tensor when it has none), bf16 input bytes per second.
    pub fp8_all_bytes_per_s: f64,
    /// f32 -> bf16 cast over the pool, input bytes per second.
    pub cast_all_bytes_per_s: f64,
    /// The last-level cache the kernels' buffers reach past ([`cold`]), where sysfs says.
    pub last_level_cache_bytes: Option<u64>,
    /// Windows the copy kernel cycles through to do so (1: no cache known).
    pub copy_windows: usize,
    /// The fabric beside the configuration's own kernel: the share of the host concurrent
    /// stages get ([`overlap`]).
    pub overlap: Overlap,
}

/// One configuration's check.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// The configuration.
    pub setup: Setup,
    /// Training ranks.
    pub trainers: u32,
    /// Inference ranks.
    pub rollouts: u32,
    /// Bytes landed per sync.
    pub landed_bytes: u64,
    /// Simulated seconds (median over the rounds).
    pub predicted_s: f64,
    /// The same without the fixed costs (per sync, per task and per write at 0): what they add.
    pub predicted_without_fixed_s: f64,
    /// Measured seconds (median).
    pub measured_s: f64,
    /// Every sync's prediction (from the rates measured before and after it).
    pub all_predicted_s: Vec<f64>,
    /// Every measured sync (round by round, beside `all_predicted_s`).
    pub all_measured_s: Vec<f64>,
    /// The fixed costs measured for this configuration's shape.
    pub fixed: Fixed,
    /// `(predicted - measured) / measured`.
    pub error: f64,
    /// `|error| <= tolerance`.
    pub within_tolerance: bool,
    /// What the simulator says dominates.
    pub dominated_by: String,
    /// The rates measured before the first timed sync.
    pub rates: Rates,
}

/// The calibration report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Always "calibrate".
    pub bench: &'static str,
    /// Rates of the first configuration's first round (each check has its own).
    pub rates: Rates,
    /// The cluster model built from them.
    pub cluster: ClusterModel,
    /// One check per configuration.
    pub checks: Vec<Check>,
    /// Allowed relative error.
    pub tolerance: f64,
    /// Every check within tolerance.
    pub all_within_tolerance: bool,
}

impl Report {
    /// Human-readable table.
    pub fn human(&self) -> String {
        let r = &self.rates;
        let mut s = format!(
            "calibration on this machine ({} cores): fabric {:.2} GB/s, memcpy(1t) {:.2} GB/s, \
             fp8 quantise(all) {:.2} GB/s, cast(all) {:.2} GB/s, host share beside the \
             fabric {:.2}\n{:<44} {:>10} {:>10} {:>8}\n",
            r.cores,
            r.fabric_bytes_per_s / 1e9,
            r.memcpy_1t_bytes_per_s / 1e9,
            r.fp8_all_bytes_per_s / 1e9,
            r.cast_all_bytes_per_s / 1e9,
            r.overlap.efficiency,
            "configuration",
            "predicted",
            "measured",
            "error"
        );
        s = s.replacen(
            " error\n",
            " error  (fabric GB/s, fixed costs per sync / task / write)\n",
            1,
        );
        for c in &self.checks {
            s += &format!(
                "{:<44} {:>9.3}s {:>9.3}s {:>+7.1}% {} ({:.2}, {:.1} ms / {:.0} us / {:.0} us)\n",
                c.setup.label(),
                c.predicted_s,
                c.measured_s,
                c.error * 100.0,
                if c.within_tolerance { "ok" } else { "OFF" },
                c.rates.fabric_bytes_per_s / 1e9,
                (c.fixed.costs.start_s + c.fixed.costs.after_landing_s) * 1e3,
                c.fixed.task_overhead_s * 1e6,
                c.fixed.write_s * 1e6
            );
        }
        s += &format!(
            "{} within {:.0}%\n",
            if self.all_within_tolerance {
                "all"
            } else {
                "NOT all"
            },
            self.tolerance * 100.0
        );
        s
    }
}

/// Median time of `reps` runs after one warm-up. The median, not the best: the syncs it is
/// compared with are reported as a median too, and a best-of rate is a peak the loaded machine
/// rarely holds.
fn median_of<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    f();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Timed runs per kernel rate (median), after a warm-up: a 64 MiB copy takes a few
/// milliseconds, which one scheduling hiccup of the shared machine can double.
const KERNEL_REPS: usize = 5;

/// The shapes of a configuration's fp8 tasks, in table order on trainer 0, until `bytes` of
/// input: the fp8 rate is measured on them, since a layer's tensors quantise slower than one
/// large block grid (each call fans out over the pool and waits for it).
fn fp8_task_shapes(table: &RoutingTable, bytes: u64) -> Result<Vec<Fp8Shape>, E2eError> {
    let plan = table
        .trainer_plan(0)
        .map_err(|e| E2eError::Setup(format!("trainer 0's slice: {e}")))?;
    let mut shapes = Vec::new();
    let mut total = 0u64;
    for t in &plan.tasks {
        let n = t.region.ndim as usize;
        if !matches!(t.transform, Transform::Fp8Block { .. }) || n < 2 {
            continue;
        }
        let cols = t.region.len[n - 1] as usize;
        let rows = (t.region.numel() / cols.max(1) as u64) as usize;
        let input = t.source_bytes();
        if total + input > bytes {
            break;
        }
        total += input;
        shapes.push(Fp8Shape { rows, cols });
    }
    Ok(shapes)
}

/// The kernels a configuration's rates are measured with: built once per configuration, each
/// cycling through copies of its window that reach past the last-level cache ([`cold`]), and
/// reused by every measurement.
struct Kernels {
    copy: KernelLoop,
    cast: KernelLoop,
    /// The configuration's fp8 tasks (one large tensor when it has none).
    fp8: KernelLoop,
    /// Whether the configuration has fp8 tasks: then fp8 loops beside the fabric, else the copy
    /// (its staging copies).
    fp8_beside: bool,
    /// The last-level cache the windows reach past, as sysfs gave it.
    cache: Option<u64>,
}

impl Kernels {
    /// Kernels over windows of `bytes` of input; fp8 over `fp8_tasks` one after another when
    /// there are any (see [`fp8_task_shapes`]), else over one tensor of `bytes`; `cache` the
    /// last-level cache their windows reach past.
    fn new(bytes: u64, fp8_tasks: &[Fp8Shape], cache: Option<u64>) -> Kernels {
        let n = bytes as usize;
        let src = weights(bytes, 7);
        // f32 -> bf16 over `n` input bytes.
        let f32_in: Vec<u8> = src
            .chunks_exact(2)
            .flat_map(|b| {
                let x = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                x.to_le_bytes()
            })
            .take(n)
            .collect();
        let cols = 4096usize;
        let whole = [Fp8Shape {
            rows: n / 2 / cols,
            cols,
        }];
        let shapes = if fp8_tasks.is_empty() {
            &whole[..]
        } else {
            fp8_tasks
        };
        Kernels {
            fp8: KernelLoop::fp8(src.clone(), shapes).past_cache(cache),
            copy: KernelLoop::copy(src).past_cache(cache),
            cast: KernelLoop::cast(f32_in).past_cache(cache),
            fp8_beside: !fp8_tasks.is_empty(),
            cache,
        }
    }

    /// Kernel rates now: memcpy on one thread and over the pool, fp8 and cast over the pool.
    fn rates(&mut self) -> Result<KernelRates, E2eError> {
        let mut err = None;
        let memcpy = rate(&mut self.copy, Threads::One, &mut err);
        let castr = rate(&mut self.cast, Threads::All, &mut err);
        // Every core copying at once: what the host pays per byte when several trainers stage
        // at the same time (memory bandwidth does not grow with the cores the way one core's
        // copy rate times the core count would suggest).
        let memcpy_all = rate(&mut self.copy, Threads::All, &mut err);
        let fp8 = rate(&mut self.fp8, Threads::All, &mut err);
        match err {
            Some(e) => Err(e),
            None => Ok(KernelRates {
                memcpy,
                memcpy_all,
                fp8,
                castr,
            }),
        }
    }

    /// The kernel to loop beside the fabric ([`overlap`]), taken out until
    /// [`Kernels::put_back`], and its rate alone.
    fn beside_fabric(&mut self, rates: &KernelRates) -> (KernelLoop, f64) {
        let (slot, rate) = if self.fp8_beside {
            (&mut self.fp8, rates.fp8)
        } else {
            (&mut self.copy, rates.memcpy_all)
        };
        (std::mem::replace(slot, KernelLoop::copy(Vec::new())), rate)
    }

    /// The kernel [`Kernels::beside_fabric`] took out.
    fn put_back(&mut self, kernel: KernelLoop) {
        if self.fp8_beside {
            self.fp8 = kernel;
        } else {
            self.copy = kernel;
        }
    }
}

/// Input bytes per second of `kernel` on `threads` (median of [`KERNEL_REPS`] passes after a
/// warm-up); a pass's error goes to `err`.
fn rate(kernel: &mut KernelLoop, threads: Threads, err: &mut Option<E2eError>) -> f64 {
    let bytes = kernel.pass_bytes() as f64;
    bytes
        / median_of(KERNEL_REPS, || {
            if let Err(e) = kernel.pass(threads) {
                *err = Some(e);
            }
        })
}

/// What [`Kernels::rates`] measured, bytes per second.
struct KernelRates {
    memcpy: f64,
    memcpy_all: f64,
    fp8: f64,
    castr: f64,
}

/// The loopback fabric in the configuration's shape: one pass of `limit` (its own pairs and
/// bytes, every pair at once), wall-clock rate and the CPU it burns per byte.
async fn fabric_rate(limit: &FabricLimit, landed: u64) -> Result<FabricRate, E2eError> {
    let cpu0 = cpu_s();
    let secs = limit.sync().await?;
    let cpu_s = cpu_s() - cpu0;
    let bytes = landed.max(1) as f64;
    Ok(FabricRate {
        bytes_per_s: bytes / secs,
        cpu_s_per_byte: cpu_s / bytes,
    })
}

/// The loopback fabric as measured: wall-clock rate, and the CPU it burns per byte.
struct FabricRate {
    bytes_per_s: f64,
    cpu_s_per_byte: f64,
}

/// This process's CPU seconds so far ([`process_cpu_s`]; 0 where there is no reading, which
/// makes the fabric's CPU per byte 0: no host share).
fn cpu_s() -> f64 {
    process_cpu_s().unwrap_or(0.0)
}

/// The host share of one byte landed: the host is `cores` CPU-seconds per second; a WRITE
/// takes what it burns, never more than the whole host for as long as the fabric needs.
fn net_s_per_byte(cpu_s_per_byte: f64, bytes_per_s: f64, cores: usize) -> f64 {
    (cpu_s_per_byte / cores.max(1) as f64).min(1.0 / bytes_per_s)
}

/// The one-node host model built from measured rates.
pub fn host_cluster(
    rates: &Rates,
    workers: &WorkerOptions,
    gpus: u32,
    task_overhead_s: f64,
    write_s: f64,
    fixed: FixedCosts,
) -> ClusterModel {
    let cost = CostModel {
        nic_bytes_per_s: rates.fabric_bytes_per_s,
        per_wr_s: 0.0,
        h2d_bytes_per_s: rates.memcpy_1t_bytes_per_s,
        prep_bytes_per_s: rates.fp8_all_bytes_per_s,
        barrier_s: 0.0,
    };
    let mut c = ClusterModel::from_cost(cost);
    c.prep = PrepRates {
        // A Copy task is written straight from its staged input: nothing to prepare.
        copy: 1e18,
        cast: rates.cast_all_bytes_per_s,
        fp8: rates.fp8_all_bytes_per_s,
    };
    c.gpus_per_node = gpus.max(1);
    c.nics_per_node = 1;
    c.placement = Placement::Colocated;
    c.watermark_bytes = workers.watermark_bytes;
    c.piece_bytes = None;
    c.task_overhead_s = task_overhead_s;
    c.fixed = fixed;
    // What concurrent stages get of the host: every host cost per byte is divided by it.
    let share = rates.overlap.efficiency.clamp(0.25, 1.0);
    c.host = Some(HostModel {
        h2d_s_per_byte: 1.0 / rates.memcpy_all_bytes_per_s / share,
        prep_s_per_byte: PrepRates {
            copy: 0.0,
            cast: 1.0 / rates.cast_all_bytes_per_s / share,
            fp8: 1.0 / rates.fp8_all_bytes_per_s / share,
        },
        net_s_per_byte: net_s_per_byte(
            rates.fabric_cpu_s_per_byte,
            rates.fabric_bytes_per_s,
            rates.cores,
        ) / share,
        // Measured from near-empty syncs (see `fixed`).
        net_s_per_write: write_s,
    });
    c
}

/// Kernel rates now, and the fabric's from one pass of `limit`; the kernels come back for the
/// next measurement.
async fn measure(
    kernels: Kernels,
    limit: &FabricLimit,
    landed: u64,
) -> Result<(Rates, Kernels), E2eError> {
    let (mut k, rates) = tokio::task::spawn_blocking(move || {
        let mut k = kernels;
        let rates = k.rates();
        (k, rates)
    })
    .await
    .map_err(|e| E2eError::Setup(format!("measuring kernels panicked: {e}")))?;
    let rates = rates?;
    let (kernel, kernel_rate) = k.beside_fabric(&rates);
    let fabric = fabric_rate(limit, landed).await?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (overlap, kernel) = overlap::measure(
        limit,
        landed,
        net_s_per_byte(fabric.cpu_s_per_byte, fabric.bytes_per_s, cores),
        kernel,
        kernel_rate,
    )
    .await?;
    k.put_back(kernel);
    let measured = Rates {
        cores,
        fabric_bytes_per_s: fabric.bytes_per_s,
        fabric_cpu_s_per_byte: fabric.cpu_s_per_byte,
        memcpy_1t_bytes_per_s: rates.memcpy,
        memcpy_all_bytes_per_s: rates.memcpy_all,
        fp8_all_bytes_per_s: rates.fp8,
        cast_all_bytes_per_s: rates.castr,
        last_level_cache_bytes: k.cache,
        copy_windows: k.copy.windows(),
        overlap,
    };
    Ok((measured, k))
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// Runs the calibration.
pub fn run(cfg: &Config) -> Result<Report, E2eError> {
    if cfg.setups.is_empty() || cfg.syncs == 0 {
        return Err(E2eError::Options(
            "calibration needs at least one configuration and one sync".into(),
        ));
    }
    let rt = runtime()?;
    let mut checks = Vec::new();
    let mut last_cluster = None;
    let mut first_rates = None;
    for setup in &cfg.setups {
        let table = setup.plan(&CostModel::default())?;
        let (nt, nr) = (table.trainers.len() as u32, table.rollouts.len() as u32);
        let landed = super::loopback::landed_bytes(&table);
        let pairs = tcp_limit::pair_bytes(&table)?;
        let shapes = fp8_task_shapes(&table, cfg.kernel_bytes)?;
        let gpus = nt + nr;
        let mut max_tasks = 0u32;
        for t in 0..nt {
            let plan = table
                .trainer_plan(t)
                .map_err(|e| E2eError::Setup(format!("trainer {t}'s slice: {e}")))?;
            max_tasks = max_tasks.max(plan.tasks.len() as u32);
        }
        let label = setup.label();
        let sim = |cluster: &ClusterModel| {
            simulate(&table, cluster)
                .map_err(|e| E2eError::Setup(format!("simulating {label}: {e}")))
        };
        let (fixed, rates_at, secs) = rt.block_on(async {
            // The fixed costs first, on the same cluster shape with nothing else running.
            let near_empty = fixed::measure_syncs(nt, nr, max_tasks, &cfg.workers).await?;
            let limit = FabricLimit::start(&pairs, &cfg.workers.fabric_config()).await?;
            let mut c = LoopbackCluster::start(&table, &cfg.workers).await?;
            // Warm-up: lanes connect lazily, pages fault in.
            c.sync().await?;
            limit.sync().await?;
            let cache = cold::last_level_cache_bytes();
            let (bytes, tasks) = (cfg.kernel_bytes, shapes.clone());
            let kernels = tokio::task::spawn_blocking(move || Kernels::new(bytes, &tasks, cache))
                .await
                .map_err(|e| E2eError::Setup(format!("building the kernels panicked: {e}")))?;
            let (rates, mut kernels) = measure(kernels, &limit, landed).await?;
            let fixed = near_empty.derive(&host_cluster(
                &rates,
                &cfg.workers,
                gpus,
                0.0,
                0.0,
                FixedCosts::default(),
            ))?;
            // Rates are measured before the first sync and after every sync, so each sync
            // lies between two measurements of the load around it (`rates[i]` before sync i,
            // `rates[i + 1]` after it).
            let mut rates_at = Vec::with_capacity(cfg.syncs + 1);
            rates_at.push(rates);
            let mut secs = Vec::with_capacity(cfg.syncs);
            for _ in 0..cfg.syncs {
                secs.push(c.sync().await?.seconds);
                let (rates, k) = measure(kernels, &limit, landed).await?;
                rates_at.push(rates);
                kernels = k;
            }
            Ok::<_, E2eError>((fixed, rates_at, secs))
        })?;
        let mut predicted = Vec::with_capacity(secs.len());
        let mut without = Vec::with_capacity(secs.len());
        let mut dominated_by = String::new();
        let mut cluster = None;
        // A sync's prediction is the mean of the predictions from the rates measured just
        // before and just after it: the machine's load drifts, and the two bracket the load the
        // sync met.
        for pair in rates_at.windows(2) {
            let mut with = 0.0;
            let mut bare = 0.0;
            for rates in pair {
                let c = host_cluster(
                    rates,
                    &cfg.workers,
                    gpus,
                    fixed.task_overhead_s,
                    fixed.write_s,
                    fixed.costs,
                );
                let r = sim(&c)?;
                with += r.predicted_s / 2.0;
                dominated_by = r.dominated_by;
                bare += sim(&host_cluster(
                    rates,
                    &cfg.workers,
                    gpus,
                    0.0,
                    0.0,
                    FixedCosts::default(),
                ))?
                .predicted_s
                    / 2.0;
                cluster = Some(c);
            }
            predicted.push(with);
            without.push(bare);
        }
        let all = secs;
        let measured = median(&all);
        let predicted_s = median(&predicted);
        let error = (predicted_s - measured) / measured;
        let rates = rates_at[0].clone();
        checks.push(Check {
            setup: setup.clone(),
            trainers: nt,
            rollouts: nr,
            landed_bytes: landed,
            predicted_s,
            predicted_without_fixed_s: median(&without),
            measured_s: measured,
            all_predicted_s: predicted,
            all_measured_s: all,
            fixed,
            error,
            within_tolerance: error.abs() <= cfg.tolerance,
            dominated_by,
            rates: rates.clone(),
        });
        first_rates.get_or_insert(rates);
        last_cluster = cluster;
    }
    let all_within_tolerance = checks.iter().all(|c| c.within_tolerance);
    Ok(Report {
        bench: "calibrate",
        rates: first_rates.expect("at least one setup"),
        cluster: last_cluster.expect("at least one setup"),
        checks,
        tolerance: cfg.tolerance,
        all_within_tolerance,
    })
}
