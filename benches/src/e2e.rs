//! `weightsync bench e2e`: whole syncs on loopback with a real model's shapes, beside the
//! plain-TCP limit and the broadcast baseline executed for real, in the same run.
//!
//! Why these two baselines: the plain-TCP limit (the same bytes between the same pairs over bare
//! sockets, nothing else to do) is the most any transport could land on this machine, so
//! `ratio_vs_tcp_limit` says how close weightsync gets to the wire. The broadcast baseline
//! (gather to rank 0, broadcast to every inference rank, each reloads its part: what verl and
//! OpenRLHF do with NCCL) runs through the *same* fabric, so `speedup_vs_broadcast` isolates
//! the method, not the transport. The three are interleaved sync by sync and the median of each
//! is reported, because this machine is shared and noisy: only ratios measured side by side mean
//! anything.
//!
//! # Layout
//! - this file: [`Config`], [`Report`], [`run`], [`E2eError`], and planning a configuration;
//! - `loopback`: a whole deployment (fabrics, trainers, rollouts) in one process;
//! - `registered_source`: trainers' weights registered with their fabric, as the Python package
//!   registers a training job's tensors (zero-copy writes of what needs no preparing);
//! - [`split`]: where each trainer's sync went (wire, idle, overhead);
//! - the CPU seconds each method spends per sync (what bounds a sync beside its fabric on a
//!   machine whose cores do the copies a NIC and a GPU would do), read with `crate::cpu_clock`;
//! - `tcp_limit`: the plain-TCP limit; `fabric_limit`: the fabric alone on the same pairs and
//!   lanes; `broadcast`: the broadcast baseline;
//! - [`calibrate`]: the simulator's calibration against these real syncs;
//! - [`delta`]: delta syncs beside full ones (`--changed`), over sockets and same-host pulls.

mod broadcast;
pub mod calibrate;
pub mod delta;
mod fabric_limit;
mod loopback;
mod registered_source;
pub mod split;
mod tcp_limit;

use serde::Serialize;

use crate::cpu_clock;
use weightsync_schedules::{
    InferDType, InferSpec, InferenceLayout, Model, RoutingTable, TrainSpec, TrainingLayout, plan,
};

pub use broadcast::BroadcastBaseline;
pub use loopback::{AddressTraffic, LoopbackCluster, MAX_ADDRESSES, SyncTime, WorkerOptions};

/// Why an end-to-end run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum E2eError {
    /// The model, layouts or plan were refused.
    #[error("planning {what}: {reason}")]
    Plan {
        /// Which configuration.
        what: String,
        /// The planner's error.
        reason: String,
    },
    /// Setting up fabrics or workers failed.
    #[error("setting up: {0}")]
    Setup(String),
    /// A sync failed.
    #[error("sync failed: {0}")]
    Sync(String),
    /// Bad bench options.
    #[error("bad option: {0}")]
    Options(String),
}

/// One configuration: a model and two layouts.
#[derive(Debug, Clone, Serialize)]
pub struct Setup {
    /// Preset name.
    pub model: String,
    /// Training layout.
    pub train: String,
    /// Inference layout.
    pub infer: String,
    /// `bf16` or `fp8`.
    pub dtype: String,
}

impl Setup {
    /// A configuration from its four strings.
    pub fn new(model: &str, train: &str, infer: &str, dtype: &str) -> Setup {
        Setup {
            model: model.into(),
            train: train.into(),
            infer: infer.into(),
            dtype: dtype.into(),
        }
    }

    /// The profiling examples' arguments (`sync_only`, `limit_only`): model preset, training
    /// layout, inference layout, dtype and a count of timed runs, each optional, in that order
    /// after the program name (defaults: `qwen3-0.6b fsdp=4 tp=2,dp=2 fp8 10`).
    pub fn from_example_args(args: &[String]) -> Result<(Setup, usize), E2eError> {
        fn arg<'a>(args: &'a [String], i: usize, default: &'a str) -> &'a str {
            args.get(i).map_or(default, String::as_str)
        }
        let setup = Setup::new(
            arg(args, 1, "qwen3-0.6b"),
            arg(args, 2, "fsdp=4"),
            arg(args, 3, "tp=2,dp=2"),
            arg(args, 4, "fp8"),
        );
        let runs = arg(args, 5, "10")
            .parse()
            .map_err(|e| E2eError::Options(format!("timed runs must be a count: {e}")))?;
        Ok((setup, runs))
    }

    /// `model train -> infer dtype`.
    pub fn label(&self) -> String {
        format!(
            "{} {} -> {} {}",
            self.model, self.train, self.infer, self.dtype
        )
    }

    /// Plans the routing table.
    pub fn plan(&self, cost: &weightsync_schedules::CostModel) -> Result<RoutingTable, E2eError> {
        let err = |e: weightsync_schedules::PlanError| E2eError::Plan {
            what: self.label(),
            reason: e.to_string(),
        };
        let train: TrainSpec = self.train.parse().map_err(err)?;
        let mut infer: InferSpec = self.infer.parse().map_err(err)?;
        infer.dtype = self.dtype.parse::<InferDType>().map_err(err)?;
        let model = Model::preset(&self.model, train.experts).map_err(err)?;
        let tl = TrainingLayout::build(&model, &train).map_err(err)?;
        let il = InferenceLayout::build(&model, &infer).map_err(err)?;
        plan(&model, &tl, &il, cost).map_err(err)
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// The configuration (default: Qwen3-0.6B, 4 FSDP trainers to 2 engines of tp=2, fp8).
    pub setup: Setup,
    /// Timed syncs of each method (the median is reported), after one untimed warm-up each.
    pub syncs: usize,
    /// Workers.
    pub workers: WorkerOptions,
    /// Bucket size of the broadcast baseline, bytes.
    pub bucket_bytes: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            setup: Setup::new("qwen3-0.6b", "fsdp=4", "tp=2,dp=2", "fp8"),
            syncs: 3,
            workers: WorkerOptions::default(),
            bucket_bytes: 64 << 20,
        }
    }
}

/// One method's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Method {
    /// Median seconds per sync.
    pub seconds_per_sync: f64,
    /// Landed bytes (what the rollouts must hold) per second, GB/s.
    pub gbps: f64,
    /// Every timed sync, seconds.
    pub all_seconds: Vec<f64>,
    /// Median CPU seconds the whole process (every thread) spent per sync, `None` where the
    /// process's CPU time cannot be read.
    pub cpu_s_per_sync: Option<f64>,
}

impl Method {
    fn of(mut secs: Vec<f64>, cpu: &[Option<f64>], landed: u64) -> Method {
        let all = secs.clone();
        secs.sort_by(f64::total_cmp);
        let med = secs[secs.len() / 2];
        Method {
            seconds_per_sync: med,
            gbps: landed as f64 / med / 1e9,
            all_seconds: all,
            cpu_s_per_sync: cpu_clock::median(cpu),
        }
    }
}

/// Runs `f` and returns its result with the process CPU seconds it took (`None`: no reading).
async fn with_cpu<T, F: std::future::Future<Output = T>>(f: F) -> (T, Option<f64>) {
    let before = cpu_clock::process_cpu_s();
    let out = f.await;
    let cpu = cpu_clock::process_cpu_s()
        .zip(before)
        .map(|(after, before)| after - before);
    (out, cpu)
}

/// The whole report (the `--json` object).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Always "e2e".
    pub bench: &'static str,
    /// The configuration.
    pub setup: Setup,
    /// Training ranks.
    pub trainers: u32,
    /// Inference ranks.
    pub rollouts: u32,
    /// Bytes landed in rollouts per sync.
    pub landed_bytes: u64,
    /// Timed syncs per method.
    pub syncs: usize,
    /// weightsync.
    pub weightsync: Method,
    /// The same pair bytes over bare TCP.
    pub tcp_limit: Method,
    /// The same pair bytes written by the same fabric (same lanes) in large blocks, nothing else.
    pub fabric_limit: Method,
    /// Gather + broadcast + reload through the same fabric.
    pub broadcast: Method,
    /// Bytes the broadcast baseline moves over the fabric per sync.
    pub broadcast_fabric_bytes: u64,
    /// weightsync GB/s over the plain-TCP GB/s (same landed bytes).
    pub ratio_vs_tcp_limit: f64,
    /// weightsync GB/s over the fabric limit's GB/s (same landed bytes, same lanes, same run):
    /// what the pipeline between the table and the wire keeps of the fabric's rate.
    pub ratio_vs_fabric: f64,
    /// Broadcast seconds over weightsync seconds.
    pub speedup_vs_broadcast: f64,
    /// Cores this process may run on.
    pub cores: usize,
    /// weightsync's CPU seconds per sync over the fabric limit's (same landed bytes): the CPU
    /// work a sync adds to the fabric's (staging, preparation, checksums, scheduling).
    pub cpu_vs_fabric: Option<f64>,
    /// The highest `ratio_vs_fabric` weightsync's CPU seconds allow on `cores` cores: the fabric
    /// limit's seconds over (weightsync's CPU seconds / `cores`). On loopback both are bound by
    /// the cores; where `ratio_vs_fabric` is near this, what is left of the gap is CPU work,
    /// which a GPU and a NIC take off the host on a real deployment.
    pub cpu_ceiling_vs_fabric: Option<f64>,
    /// Local addresses (NICs) per fabric.
    pub addresses: usize,
    /// Trainers' weights registered with their fabric (zero-copy writes of what needs no
    /// preparing), as the Python package does; `false`: a plain arena, all staged.
    pub registered_sources: bool,
    /// What each local address carried during weightsync's timed syncs, summed over every
    /// worker (with several addresses: how the sync striped over the NICs).
    pub address_traffic: Vec<AddressTraffic>,
    /// Where each trainer's wall went in the median weightsync sync (wire, idle, overhead).
    pub split: split::SplitReport,
}

impl Report {
    /// Human-readable summary.
    pub fn human(&self) -> String {
        let mut s = format!(
            "e2e: {} ({} trainers -> {} rollouts), {:.1} MB landed per sync, median of {}\n",
            self.setup.label(),
            self.trainers,
            self.rollouts,
            self.landed_bytes as f64 / 1e6,
            self.syncs
        );
        for (name, m) in [
            ("weightsync", &self.weightsync),
            ("plain TCP limit", &self.tcp_limit),
            ("fabric limit", &self.fabric_limit),
            ("broadcast", &self.broadcast),
        ] {
            s += &format!(
                "  {:<16} {:>8.3} s/sync  {:>6.2} GB/s landed\n",
                name, m.seconds_per_sync, m.gbps
            );
        }
        s += &format!(
            "  ratio_vs_tcp_limit {:.2}   ratio_vs_fabric {:.2}   speedup_vs_broadcast {:.2}\n",
            self.ratio_vs_tcp_limit, self.ratio_vs_fabric, self.speedup_vs_broadcast
        );
        if let (Some(cpu), Some(ceiling)) = (self.cpu_vs_fabric, self.cpu_ceiling_vs_fabric) {
            s += &format!(
                "  cpu_vs_fabric {cpu:.2} (CPU seconds per sync over the fabric limit's)   \
                 cpu_ceiling_vs_fabric {ceiling:.2} (on {} cores)\n",
                self.cores
            );
        }
        if self.address_traffic.len() > 1 {
            let sent: u64 = self.address_traffic.iter().map(|a| a.bytes_sent).sum();
            for a in &self.address_traffic {
                s += &format!(
                    "  address {:<12} {:>9.1} MB sent ({:>4.1}%)  {:>9.1} MB received\n",
                    a.ip,
                    a.bytes_sent as f64 / 1e6,
                    100.0 * a.bytes_sent as f64 / sent.max(1) as f64,
                    a.bytes_received as f64 / 1e6
                );
            }
        }
        s += &self.split.human();
        s
    }
}

/// A multi-threaded runtime for the driver (the fabrics run their own threads).
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, E2eError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| E2eError::Setup(format!("starting the runtime: {e}")))
}

/// Runs the bench.
pub fn run(cfg: &Config) -> Result<Report, E2eError> {
    if cfg.syncs == 0 {
        return Err(E2eError::Options("syncs must be at least 1".into()));
    }
    let table = cfg
        .setup
        .plan(&weightsync_schedules::CostModel::default())?;
    run_table(&table, cfg)
}

/// Runs the bench on an already planned table (`cfg.setup` only labels the report).
pub fn run_table(table: &RoutingTable, cfg: &Config) -> Result<Report, E2eError> {
    if cfg.syncs == 0 {
        return Err(E2eError::Options("syncs must be at least 1".into()));
    }
    cfg.workers.check()?;
    let table = table.clone();
    let landed = loopback::landed_bytes(&table);
    let pairs = tcp_limit::pair_bytes(&table)?;
    let rt = runtime()?;
    rt.block_on(async {
        let mut ws = LoopbackCluster::start(&table, &cfg.workers).await?;
        let bc =
            BroadcastBaseline::start(&table, cfg.bucket_bytes, cfg.workers.lanes_per_peer).await?;
        let fl = fabric_limit::FabricLimit::start(&pairs, &cfg.workers.fabric_config()).await?;
        // Warm-up: lanes connect lazily, pages fault in.
        ws.sync().await?;
        bc.sync().await?;
        fl.sync().await?;
        let before = ws.address_traffic();
        let (mut a, mut b, mut c, mut d) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // CPU seconds per sync of each method, in the same order.
        let mut cpu: [Vec<Option<f64>>; 4] = Default::default();
        let mut splits = Vec::new();
        for _ in 0..cfg.syncs {
            let (s, t) = with_cpu(ws.sync()).await;
            let s = s?;
            a.push(s.seconds);
            cpu[0].push(t);
            splits.push(s);
            let p = pairs.clone();
            let (s, t) = with_cpu(tokio::task::spawn_blocking(move || tcp_limit::run(&p))).await;
            b.push(s.map_err(|e| E2eError::Sync(format!("plain TCP panicked: {e}")))??);
            cpu[1].push(t);
            let (s, t) = with_cpu(bc.sync()).await;
            c.push(s?);
            cpu[2].push(t);
            let (s, t) = with_cpu(fl.sync()).await;
            d.push(s?);
            cpu[3].push(t);
        }
        let address_traffic = ws
            .address_traffic()
            .into_iter()
            .zip(before)
            .map(|(end, start)| AddressTraffic {
                ip: end.ip,
                bytes_sent: end.bytes_sent - start.bytes_sent,
                bytes_received: end.bytes_received - start.bytes_received,
            })
            .collect();
        // The median sync's split (the one `Method::of` reports).
        splits.sort_by(|x, y| x.seconds.total_cmp(&y.seconds));
        let median = splits.swap_remove(splits.len() / 2);
        let split = split::SplitReport::of(median.seconds, median.trainers);
        let weightsync = Method::of(a, &cpu[0], landed);
        let tcp_limit = Method::of(b, &cpu[1], landed);
        let broadcast = Method::of(c, &cpu[2], landed);
        let fabric_limit = Method::of(d, &cpu[3], landed);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpu_vs_fabric = weightsync
            .cpu_s_per_sync
            .zip(fabric_limit.cpu_s_per_sync)
            .filter(|&(_, f)| f > 0.0)
            .map(|(w, f)| w / f);
        let cpu_ceiling_vs_fabric = weightsync
            .cpu_s_per_sync
            .filter(|&w| w > 0.0)
            .map(|w| fabric_limit.seconds_per_sync / (w / cores as f64));
        Ok(Report {
            bench: "e2e",
            setup: cfg.setup.clone(),
            trainers: table.trainers.len() as u32,
            rollouts: table.rollouts.len() as u32,
            landed_bytes: landed,
            syncs: cfg.syncs,
            ratio_vs_tcp_limit: weightsync.gbps / tcp_limit.gbps,
            ratio_vs_fabric: weightsync.gbps / fabric_limit.gbps,
            speedup_vs_broadcast: broadcast.seconds_per_sync / weightsync.seconds_per_sync,
            cores,
            cpu_vs_fabric,
            cpu_ceiling_vs_fabric,
            broadcast_fabric_bytes: bc.fabric_bytes(),
            addresses: cfg.workers.addresses,
            registered_sources: cfg.workers.registered_sources,
            address_traffic,
            weightsync,
            tcp_limit,
            fabric_limit,
            broadcast,
            split,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightsync_schedules::ExpertForm;

    /// A tiny Qwen3 (two layers, hidden 256): the same code paths as a real one, in milliseconds.
    fn tiny_table() -> RoutingTable {
        let json = r#"{
          "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
          "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
          "vocab_size": 1024, "tie_word_embeddings": false, "attention_bias": false,
          "rms_norm_eps": 1e-06, "rope_theta": 1000000
        }"#;
        let model = Model::from_config_json("tiny", json, ExpertForm::PerExpert).unwrap();
        let train = TrainingLayout::build(&model, &"fsdp=4".parse().unwrap()).unwrap();
        let infer =
            InferenceLayout::build(&model, &"tp=2,dp=2,dtype=fp8".parse().unwrap()).unwrap();
        plan(
            &model,
            &train,
            &infer,
            &weightsync_schedules::CostModel::default(),
        )
        .unwrap()
    }

    #[test]
    fn all_three_methods_run_and_move_the_bytes_they_should() {
        let table = tiny_table();
        let cfg = Config {
            syncs: 1,
            workers: WorkerOptions {
                watermark_bytes: 1 << 20,
                ..Default::default()
            },
            bucket_bytes: 256 << 10,
            ..Default::default()
        };
        let r = run_table(&table, &cfg).unwrap();
        assert_eq!(r.trainers, 4);
        assert_eq!(r.rollouts, 4);
        let held: u64 = table
            .rollout_plans()
            .flat_map(|r| r.tensors)
            .map(|t| t.len)
            .sum();
        assert_eq!(
            r.landed_bytes, held,
            "every destination byte lands exactly once"
        );
        // Gather: the three other trainers' quarters; broadcast: the whole model to 4 ranks.
        let (model_bytes, gathered) = tiny_model_bytes(&table);
        assert_eq!(r.broadcast_fabric_bytes, gathered + 4 * model_bytes);
        for m in [&r.weightsync, &r.tcp_limit, &r.broadcast] {
            assert!(m.seconds_per_sync > 0.0 && m.gbps > 0.0);
        }
        assert!(r.ratio_vs_tcp_limit > 0.0 && r.speedup_vs_broadcast > 0.0);
        assert!(r.fabric_limit.seconds_per_sync > 0.0 && r.ratio_vs_fabric > 0.0);
        // CPU per sync is read for every method wherever /proc is (zero is possible for a tiny
        // sync under the 10 ms tick); the ratios need both readings.
        if std::path::Path::new("/proc/self/stat").exists() {
            for m in [&r.weightsync, &r.tcp_limit, &r.broadcast, &r.fabric_limit] {
                assert!(m.cpu_s_per_sync.is_some_and(|c| c >= 0.0), "{m:?}");
            }
        }
        assert!(r.cores >= 1);
        // Registered sources (the default): what needs no preparing (the bf16 norms, whole
        // rows of each trainer's shard) is written straight from the weights.
        assert!(r.registered_sources);
        let direct: u64 = r.split.per_trainer.iter().map(|t| t.direct_bytes).sum();
        let staged: u64 = r.split.per_trainer.iter().map(|t| t.staged_bytes).sum();
        assert!(direct > 0 && staged > 0, "direct {direct}, staged {staged}");
        // The split: every trainer, its parts adding up to its wall, bytes on the wire.
        assert_eq!(r.split.per_trainer.len(), 4);
        for t in &r.split.per_trainer {
            assert!(
                (t.wire_s + t.idle_s + t.overhead_s - t.wall_s).abs() < 1e-6,
                "{t:?}"
            );
            assert!(t.wire_s > 0.0 && t.bytes > 0 && t.wire_gbps > 0.0, "{t:?}");
            assert!(t.wall_s <= r.split.sync_seconds + 1e-6, "{t:?}");
        }
        let s = &r.split.sum;
        assert!(
            (s.wire_s + s.idle_s + s.overhead_s - s.wall_s).abs() < 1e-6,
            "{s:?}"
        );
        let pairs = tcp_limit::pair_bytes(&table).unwrap();
        assert_eq!(pairs.iter().map(|p| p.2).sum::<u64>(), r.landed_bytes);
    }

    /// (whole model bytes, bytes held by trainers other than rank 0, replicas once).
    fn tiny_model_bytes(table: &RoutingTable) -> (u64, u64) {
        let mut seen = std::collections::BTreeSet::new();
        let (mut all, mut others) = (0, 0);
        for t in &table.trainer_plans().unwrap() {
            for s in &t.shards {
                let id = t.params[s.param as usize].id;
                if seen.insert((id, s.global)) {
                    all += s.bytes();
                    if t.rank != 0 {
                        others += s.bytes();
                    }
                }
            }
        }
        (all, others)
    }

    #[test]
    fn a_sync_over_two_addresses_stripes_across_both() {
        let table = tiny_table();
        let cfg = Config {
            syncs: 2,
            workers: WorkerOptions {
                watermark_bytes: 1 << 20,
                lanes_per_peer: 2,
                addresses: 2,
                ..Default::default()
            },
            bucket_bytes: 256 << 10,
            ..Default::default()
        };
        let r = run_table(&table, &cfg).unwrap();
        let ips: Vec<&str> = r.address_traffic.iter().map(|a| a.ip.as_str()).collect();
        assert_eq!(ips, ["127.0.0.1", "127.0.0.2"]);
        // Every landed byte came in through one of the two addresses (trainers' gather writes
        // come on top), and neither address was left idle.
        let received: u64 = r.address_traffic.iter().map(|a| a.bytes_received).sum();
        assert!(
            received >= r.landed_bytes * cfg.syncs as u64,
            "{received} received over both addresses < {} landed",
            r.landed_bytes * cfg.syncs as u64
        );
        for a in &r.address_traffic {
            assert!(
                a.bytes_sent * 10 >= received && a.bytes_received * 10 >= received,
                "address {} carried under a tenth of the sync: {:?}",
                a.ip,
                r.address_traffic
            );
        }
        assert!(r.human().contains("address 127.0.0.2"));
    }

    #[test]
    fn addresses_without_a_lane_each_are_refused() {
        let cfg = Config {
            workers: WorkerOptions {
                lanes_per_peer: 1,
                addresses: 2,
                ..Default::default()
            },
            ..Default::default()
        };
        let err = run_table(&tiny_table(), &cfg).unwrap_err().to_string();
        assert!(err.contains("addresses 2") && err.contains("lane"), "{err}");
        let cfg = Config {
            workers: WorkerOptions {
                addresses: 0,
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(
            run_table(&tiny_table(), &cfg)
                .unwrap_err()
                .to_string()
                .contains("addresses 0")
        );
    }

    #[test]
    fn bad_options_are_refused() {
        let cfg = Config {
            syncs: 0,
            ..Default::default()
        };
        assert!(matches!(
            run_table(&tiny_table(), &cfg),
            Err(E2eError::Options(_))
        ));
    }
}
