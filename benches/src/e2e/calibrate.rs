//! Calibrating the simulator against real syncs on this machine (`weightsync simulate
//! --calibrate`).
//!
//! Why: the simulator's cluster-scale predictions are only worth something if the same model of
//! stages, NICs and sharing predicts what can be measured. Here every worker runs on one host, so
//! the cluster model is one node with one NIC (the loopback fabric) and a shared host CPU that
//! every stage draws on. The rates are measured first, each on its own, with nothing fitted to
//! the end-to-end runs:
//! - the loopback fabric: every trainer writing to every rollout at once through `TcpFabric`
//!   (GB/s landed while it owns the machine);
//! - H2D (a memcpy on one thread: the CPU build's stand-in for the copy engine);
//! - fp8 block quantisation and casts over the whole rayon pool.
//!
//! Then, for several configurations, the simulator predicts a sync from those rates alone, the
//! same sync runs for real ([`LoopbackCluster`]), and the report gives predicted vs measured and
//! the relative error (the check: within 20%).

use std::time::Instant;

use serde::Serialize;
use weightsync_common::fabric::{Access, FabricBackend, FabricConfig, TcpFabric, WriteOp};
use weightsync_common::DType;
use weightsync_schedules::simulate::{simulate, ClusterModel, HostModel, Placement, PrepRates};
use weightsync_schedules::CostModel;
use weightsync_worker::prepare::{cast, quantise_fp8, Fp8Shape, Threads};

use super::loopback::{weights, LoopbackCluster, WorkerOptions, TOKEN};
use super::{runtime, E2eError, Setup};

/// What to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Configurations predicted and measured.
    pub setups: Vec<Setup>,
    /// Timed syncs per configuration (median), after one warm-up.
    pub syncs: usize,
    /// Workers.
    pub workers: WorkerOptions,
    /// Bytes per (writer, reader) pair in the fabric measurement.
    pub fabric_pair_bytes: u64,
    /// Bytes per kernel measurement.
    pub kernel_bytes: u64,
    /// Fixed cost per task (scheduling hops), seconds (an assumption, not measured).
    pub task_overhead_s: f64,
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
            syncs: 3,
            workers: WorkerOptions::default(),
            fabric_pair_bytes: 48 << 20,
            kernel_bytes: 64 << 20,
            task_overhead_s: 20e-6,
            tolerance: 0.20,
        }
    }
}

/// Rates measured on this machine (bytes per second).
#[derive(Debug, Clone, Serialize)]
pub struct Rates {
    /// Cores the host has.
    pub cores: usize,
    /// Loopback fabric, all writers to all readers at once, bytes landed per second.
    pub fabric_bytes_per_s: f64,
    /// memcpy on one thread.
    pub memcpy_1t_bytes_per_s: f64,
    /// fp8 block quantisation over the pool, bf16 input bytes per second.
    pub fp8_all_bytes_per_s: f64,
    /// f32 -> bf16 cast over the pool, input bytes per second.
    pub cast_all_bytes_per_s: f64,
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
    /// Simulated seconds.
    pub predicted_s: f64,
    /// Measured seconds (median).
    pub measured_s: f64,
    /// Every measured sync.
    pub all_measured_s: Vec<f64>,
    /// `(predicted - measured) / measured`.
    pub error: f64,
    /// `|error| <= tolerance`.
    pub within_tolerance: bool,
    /// What the simulator says dominates.
    pub dominated_by: String,
    /// The rates measured just before this configuration ran.
    pub rates: Rates,
}

/// The calibration report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Always "calibrate".
    pub bench: &'static str,
    /// Rates measured before the first configuration (each check has its own).
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
             fp8 quantise(all) {:.2} GB/s, cast(all) {:.2} GB/s\n{:<44} {:>10} {:>10} {:>8}\n",
            r.cores,
            r.fabric_bytes_per_s / 1e9,
            r.memcpy_1t_bytes_per_s / 1e9,
            r.fp8_all_bytes_per_s / 1e9,
            r.cast_all_bytes_per_s / 1e9,
            "configuration",
            "predicted",
            "measured",
            "error"
        );
        s = s.replacen(" error\n", " error  (fabric GB/s then)\n", 1);
        for c in &self.checks {
            s += &format!(
                "{:<44} {:>9.3}s {:>9.3}s {:>+7.1}% {} ({:.2})\n",
                c.setup.label(),
                c.predicted_s,
                c.measured_s,
                c.error * 100.0,
                if c.within_tolerance { "ok" } else { "OFF" },
                c.rates.fabric_bytes_per_s / 1e9
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

fn best_of<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Kernel rates: memcpy on one thread, fp8 and cast over the pool.
fn kernel_rates(bytes: u64) -> Result<(f64, f64, f64), E2eError> {
    let n = bytes as usize;
    let src = weights(bytes, 7);
    let mut dst = vec![0u8; n];
    let memcpy = n as f64 / best_of(3, || dst.copy_from_slice(&src));
    let cols = 4096usize;
    let shape = Fp8Shape {
        rows: n / 2 / cols,
        cols,
    };
    let mut values = vec![0u8; shape.rows * shape.cols];
    let mut scales = vec![0u8; shape.row_blocks() * shape.col_blocks() * 4];
    let input = &src[..shape.rows * shape.cols * 2];
    let mut err = None;
    let fp8 = input.len() as f64
        / best_of(3, || {
            if let Err(e) = quantise_fp8(
                input,
                DType::BF16,
                shape,
                &mut values,
                &mut scales,
                Threads::All,
            ) {
                err = Some(e);
            }
        });
    // f32 -> bf16 over `n` input bytes.
    let f32_in: Vec<u8> = src
        .chunks_exact(2)
        .flat_map(|b| {
            let x = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            x.to_le_bytes()
        })
        .take(n)
        .collect();
    let mut out = vec![0u8; f32_in.len() / 2];
    let castr = f32_in.len() as f64
        / best_of(3, || {
            if let Err(e) = cast(&f32_in, DType::F32, &mut out, DType::BF16, Threads::All) {
                err = Some(e);
            }
        });
    if let Some(e) = err {
        return Err(E2eError::Setup(format!("measuring kernels: {e}")));
    }
    Ok((memcpy, fp8, castr))
}

/// Loopback fabric rate: `writers` fabrics each writing `pair_bytes` to each of `readers`
/// fabrics, all at once; bytes landed per second (best of three after a warm-up).
async fn fabric_rate(
    writers: usize,
    readers: usize,
    pair_bytes: u64,
    lanes: usize,
) -> Result<f64, E2eError> {
    let err = |e: weightsync_common::fabric::FabricError| E2eError::Setup(format!("fabric: {e}"));
    let cfg = FabricConfig::loopback(TOKEN, lanes);
    let mut srcs = Vec::new();
    for i in 0..writers {
        let f = TcpFabric::start(&cfg).await.map_err(err)?;
        let r = f.alloc(pair_bytes as usize, Access::SOURCE).map_err(err)?;
        r.write_at(0, &weights(pair_bytes, i as u64)).map_err(err)?;
        srcs.push((f, r));
    }
    let mut dsts = Vec::new();
    for _ in 0..readers {
        let f = TcpFabric::start(&cfg).await.map_err(err)?;
        let r = f
            .alloc((pair_bytes * writers as u64) as usize, Access::RECEIVE)
            .map_err(err)?;
        dsts.push((f, r));
    }
    let mut best = f64::INFINITY;
    for rep in 0..4 {
        let t = Instant::now();
        let mut jobs = tokio::task::JoinSet::new();
        for (w, (f, src)) in srcs.iter().enumerate() {
            let ops: Vec<WriteOp> = dsts
                .iter()
                .map(|(_, d)| {
                    WriteOp::new(src, 0, d.descriptor(), w as u64 * pair_bytes, pair_bytes)
                })
                .collect();
            jobs.spawn(f.write_batch(ops));
        }
        while let Some(j) = jobs.join_next().await {
            j.map_err(|e| E2eError::Setup(format!("fabric writer panicked: {e}")))?
                .map_err(err)?;
        }
        if rep > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    Ok((writers * readers) as f64 * pair_bytes as f64 / best)
}

/// The one-node host model built from measured rates.
pub fn host_cluster(
    rates: &Rates,
    workers: &WorkerOptions,
    gpus: u32,
    task_overhead_s: f64,
) -> ClusterModel {
    let cores = rates.cores.max(1) as f64;
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
    c.host = Some(HostModel {
        h2d_s_per_byte: 1.0 / (rates.memcpy_1t_bytes_per_s * cores),
        prep_s_per_byte: PrepRates {
            copy: 0.0,
            cast: 1.0 / rates.cast_all_bytes_per_s,
            fp8: 1.0 / rates.fp8_all_bytes_per_s,
        },
        net_s_per_byte: 1.0 / rates.fabric_bytes_per_s,
    });
    c
}

/// Runs the calibration.
pub fn run(cfg: &Config) -> Result<Report, E2eError> {
    if cfg.setups.is_empty() || cfg.syncs == 0 {
        return Err(E2eError::Options(
            "calibration needs at least one configuration and one sync".into(),
        ));
    }
    let rt = runtime()?;
    // Rates are measured again right before each configuration runs: the machine is shared and
    // its load drifts, and a prediction is only fair against rates of the same moment.
    let measure = |rt: &tokio::runtime::Runtime| -> Result<Rates, E2eError> {
        let (memcpy, fp8, castr) = kernel_rates(cfg.kernel_bytes)?;
        let fabric = rt.block_on(fabric_rate(
            4,
            4,
            cfg.fabric_pair_bytes,
            cfg.workers.lanes_per_peer,
        ))?;
        Ok(Rates {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            fabric_bytes_per_s: fabric,
            memcpy_1t_bytes_per_s: memcpy,
            fp8_all_bytes_per_s: fp8,
            cast_all_bytes_per_s: castr,
        })
    };
    let mut checks = Vec::new();
    let mut last_cluster = None;
    let mut first_rates = None;
    for setup in &cfg.setups {
        let table = setup.plan(&CostModel::default())?;
        let rates = measure(&rt)?;
        let gpus = (table.trainers.len() + table.rollouts.len()) as u32;
        let cluster = host_cluster(&rates, &cfg.workers, gpus, cfg.task_overhead_s);
        let sim = simulate(&table, &cluster)
            .map_err(|e| E2eError::Setup(format!("simulating {}: {e}", setup.label())))?;
        let mut secs = rt.block_on(async {
            let mut c = LoopbackCluster::start(&table, &cfg.workers).await?;
            c.sync().await?;
            let mut v = Vec::new();
            for _ in 0..cfg.syncs {
                v.push(c.sync().await?.seconds);
            }
            Ok::<_, E2eError>(v)
        })?;
        let all = secs.clone();
        secs.sort_by(f64::total_cmp);
        let measured = secs[secs.len() / 2];
        let error = (sim.predicted_s - measured) / measured;
        checks.push(Check {
            setup: setup.clone(),
            trainers: table.trainers.len() as u32,
            rollouts: table.rollouts.len() as u32,
            landed_bytes: super::loopback::landed_bytes(&table),
            predicted_s: sim.predicted_s,
            measured_s: measured,
            all_measured_s: all,
            error,
            within_tolerance: error.abs() <= cfg.tolerance,
            dominated_by: sim.dominated_by.clone(),
            rates: rates.clone(),
        });
        first_rates.get_or_insert(rates);
        last_cluster = Some(cluster);
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
