//! `weightsync simulate`: predict a sync at cluster scale, beside the broadcast baselines.
//!
//! Plans the routing table exactly as `weightsync plan` does, runs the discrete-event simulator
//! (`weightsync_schedules::simulate`) on a cluster model (400 Gb/s per GPU by default), plans
//! and simulates the two broadcast baselines on the same model, and prints the predicted time,
//! the bound, weightsync's ratio against each baseline, per-NIC utilisation, the critical path
//! and what dominates it. `--trace out.json` writes the simulated timeline as the same Chrome
//! trace the dashboard serves for a real sync.
//!
//! `--changed F` also predicts a delta sync (`weightsync_schedules::simulate::delta`): every
//! engine holds the previous version and a fraction `F` of the elements changed; it prints the
//! delta sync beside the full one, held against the full-transfer bound and the delta bound (the
//! delta bytes over the links), with the encode and apply at `--delta-scan-gbs` per GPU.
//!
//! `--calibrate` checks the simulator against reality on this machine: it measures the loopback
//! fabric, the preparation kernels and the per-sync and per-task fixed costs (from near-empty
//! syncs), predicts several end-to-end loopback syncs with a host model built from those figures
//! alone, runs the same syncs for real, and prints predicted vs measured (each must be within
//! 10%). At cluster scale the fixed costs are inputs: `--sync-start-us`, `--after-landing-us`,
//! `--task-overhead-us`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use serde_json::json;
use weightsync_schedules::baseline::{Baseline, BaselineOptions, simulate_baseline};
use weightsync_schedules::simulate::{
    ClusterModel, DeltaModel, DeltaReport, SimReport, simulate, simulate_delta,
};

use super::plan;

/// Arguments of `weightsync simulate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A preset (qwen3-0.6b, qwen3-8b, qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, kimi-k2) or
    /// the path of a Hugging Face config.json. Required unless `--calibrate`.
    #[arg(long, required_unless_present = "calibrate")]
    pub model: Option<String>,
    /// Training layout, e.g. `pp=2,ep=8,fsdp=16`.
    #[arg(long, default_value = "fsdp=8")]
    pub train: String,
    /// Inference layout, e.g. `tp=8,ep=32,dp=4`.
    #[arg(long, default_value = "tp=8")]
    pub infer: String,
    /// Inference weight format: bf16 or fp8.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write the simulated timeline as a Chrome trace (the dashboard's trace format).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Bandwidth of one NIC, Gb/s (a GPU with several NICs stripes over them: see
    /// --nics-per-node).
    #[arg(long, default_value_t = 400.0)]
    pub nic_gbps: f64,
    /// Cost of one work request, microseconds.
    #[arg(long, default_value_t = 0.5)]
    pub per_wr_us: f64,
    /// Host-to-device rate per GPU, GB/s.
    #[arg(long, default_value_t = 50.0)]
    pub h2d_gbs: f64,
    /// Preparation rate per GPU, GB/s of input.
    #[arg(long, default_value_t = 1000.0)]
    pub prep_gbs: f64,
    /// Barrier latency, microseconds.
    #[arg(long, default_value_t = 100.0)]
    pub barrier_us: f64,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: u32,
    /// NICs per node (fewer than GPUs: GPUs share NICs; a whole multiple of the GPUs: each GPU
    /// stripes over its own, e.g. 16 for 2 x 200 Gb/s per GPU on 8-GPU nodes).
    #[arg(long, default_value_t = 8)]
    pub nics_per_node: u32,
    /// Staging watermark per trainer, MiB.
    #[arg(long, default_value_t = 2048)]
    pub watermark_mib: u64,
    /// Fixed cost per task in the prepare stage, microseconds.
    #[arg(long, default_value_t = 10.0)]
    pub task_overhead_us: f64,
    /// Fixed cost of starting a sync (until every trainer begins), microseconds.
    #[arg(long, default_value_t = 0.0)]
    pub sync_start_us: f64,
    /// Fixed cost after the last write landed (landing notices, barrier and commit round
    /// trips, verification), microseconds; added to --barrier-us.
    #[arg(long, default_value_t = 0.0)]
    pub after_landing_us: f64,
    /// Bucket size of the bucketed-broadcast baseline, MiB.
    #[arg(long, default_value_t = 2048)]
    pub bucket_mib: u64,
    /// The goal the predicted time is checked against, seconds.
    #[arg(long, default_value_t = 0.8)]
    pub target_s: f64,
    /// Also predict a delta sync where this fraction of the elements changed since the version
    /// every engine holds (e.g. 0.02), beside the full sync.
    #[arg(long, value_parser = parse_fraction)]
    pub changed: Option<f64>,
    /// Memory bandwidth of a delta sync's encode (trainer) and apply (engine), GB/s per GPU
    /// (default: --prep-gbs, the GPU's memory-bound kernel rate; about 50 for a CPU's share of
    /// a node's host memory).
    #[arg(long)]
    pub delta_scan_gbs: Option<f64>,
    /// Each engine's delta inbox as a fraction of its weights' bytes (the worker's default).
    #[arg(long, default_value_t = 0.25, value_parser = parse_fraction)]
    pub delta_inbox_fraction: f64,
    /// Instead: calibrate the simulator against real loopback syncs on this machine.
    #[arg(long)]
    pub calibrate: bool,
    /// Calibration: rounds per configuration (rates, a prediction and one timed sync each; the
    /// medians are compared).
    #[arg(long, default_value_t = 5)]
    pub syncs: usize,
}

/// A fraction in [0, 1].
fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number (expected a fraction such as 0.02)"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{v} is not a fraction in [0, 1] (e.g. 0.02 for 2%)"
        ))
    }
}

impl Args {
    /// The delta sync `--changed` asks for.
    fn delta_model(&self) -> Option<DeltaModel> {
        self.changed.map(|f| DeltaModel {
            inbox_fraction: self.delta_inbox_fraction,
            ..DeltaModel::new(f, self.delta_scan_gbs.unwrap_or(self.prep_gbs) * 1e9)
        })
    }

    fn plan_args(&self, model: &str) -> plan::Args {
        plan::Args {
            model: model.to_string(),
            train: self.train.clone(),
            infer: self.infer.clone(),
            dtype: self.dtype.clone(),
            json: true,
            out: None,
            // The planner balances per GPU: a GPU's NICs together.
            nic_gbps: self.nic_gbps * self.nics_per_gpu() as f64,
            per_wr_us: self.per_wr_us,
            h2d_gbs: self.h2d_gbs,
            prep_gbs: self.prep_gbs,
        }
    }

    /// NICs each GPU stripes over (1 when GPUs share NICs).
    fn nics_per_gpu(&self) -> u32 {
        if self.gpus_per_node > 0 && self.nics_per_node > self.gpus_per_node {
            self.nics_per_node / self.gpus_per_node
        } else {
            1
        }
    }

    /// The cluster model these arguments describe.
    pub fn cluster(&self, cost: weightsync_schedules::CostModel) -> ClusterModel {
        let mut c = ClusterModel::from_cost(weightsync_schedules::CostModel {
            barrier_s: self.barrier_us * 1e-6,
            ..cost
        });
        // The planner's cost is per GPU (its NICs together); the cluster's is per NIC.
        c.cost.nic_bytes_per_s = self.nic_gbps * 1e9 / 8.0;
        c.gpus_per_node = self.gpus_per_node;
        c.nics_per_node = self.nics_per_node;
        c.watermark_bytes = self.watermark_mib << 20;
        c.task_overhead_s = self.task_overhead_us * 1e-6;
        c.fixed = weightsync_schedules::simulate::FixedCosts {
            start_s: self.sync_start_us * 1e-6,
            after_landing_s: self.after_landing_us * 1e-6,
        };
        c
    }
}

/// Runs `weightsync simulate`.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.calibrate {
        return calibrate(&args);
    }
    let model = args.model.clone().context("--model is required")?;
    let pargs = args.plan_args(&model);
    let t0 = Instant::now();
    let planned = plan::build(&pargs, &mut |_, _| {})?;
    let plan_s = t0.elapsed().as_secs_f64();
    let cluster = args.cluster(pargs.cost_model());
    let t1 = Instant::now();
    let ws = simulate(&planned.table, &cluster)?;
    let delta = args
        .delta_model()
        .map(|m| simulate_delta(&planned.table, &cluster, &m))
        .transpose()?;
    let simulate_s = t1.elapsed().as_secs_f64();
    let opts = BaselineOptions {
        bucket_bytes: args.bucket_mib << 20,
        ..BaselineOptions::default()
    };
    let baselines: Vec<SimReport> = Baseline::ALL
        .iter()
        .map(|&b| simulate_baseline(&planned.table, &cluster, b, &opts))
        .collect::<Result<_, _>>()?;
    if let Some(path) = &args.trace {
        let text = serde_json::to_string(&ws.chrome_trace())?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    let report = Report {
        args: &args,
        model: &model,
        plan_s,
        simulate_s,
        ws: &ws,
        delta: delta.as_ref(),
        baselines: &baselines,
        cluster: &cluster,
        summary: &planned.summary,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report.json())?);
    } else {
        print!("{}", report.human());
    }
    Ok(())
}

struct Report<'a> {
    args: &'a Args,
    model: &'a str,
    plan_s: f64,
    simulate_s: f64,
    ws: &'a SimReport,
    delta: Option<&'a DeltaReport>,
    baselines: &'a [SimReport],
    cluster: &'a ClusterModel,
    summary: &'a weightsync_schedules::Summary,
}

impl Report<'_> {
    fn speedup(&self, b: &SimReport) -> f64 {
        b.predicted_s / self.ws.predicted_s.max(f64::MIN_POSITIVE)
    }

    fn json(&self) -> serde_json::Value {
        let ws = self.ws;
        let baselines: Vec<_> = Baseline::ALL
            .iter()
            .zip(self.baselines)
            .map(|(b, r)| {
                json!({
                    "name": b.name(), "as_in": b.as_in(), "predicted_s": r.predicted_s,
                    "bound_s": r.bound_s, "network_bytes": r.network_bytes,
                    "dominated_by": r.dominated_by,
                    "weightsync_speedup": self.speedup(r),
                })
            })
            .collect();
        let mut out = json!({
            "model": self.model,
            "train": self.args.train,
            "infer": self.args.infer,
            "dtype": self.args.dtype,
            "trainers": ws.trainers,
            "rollouts": ws.rollouts,
            "bytes_to_move": self.summary.bytes_to_move,
            "predicted_s": ws.predicted_s,
            "bound_s": ws.bound_s,
            "bound_nic": ws.bound_nic,
            "ratio_to_bound": ws.ratio_to_bound,
            "target_s": self.args.target_s,
            "meets_target": ws.predicted_s <= self.args.target_s,
            "dominated_by": ws.dominated_by,
            "critical_breakdown": ws.critical_breakdown,
            "critical_path": ws.critical_path,
            "baselines": baselines,
            "nic_utilisation": {
                "send": ws.send, "receive": ws.receive, "per_nic": ws.nics,
            },
            "stages": ws.stages,
            "network_bytes": ws.network_bytes,
            "writes": ws.writes,
            "pieces": ws.pieces,
            "events": ws.events,
            "plan_s": self.plan_s,
            "simulate_s": self.simulate_s,
            "cluster": self.cluster,
        });
        for (b, r) in Baseline::ALL.iter().zip(self.baselines) {
            out[format!("{}_s", b.name())] = json!(r.predicted_s);
            out[format!("speedup_vs_{}", b.name())] = json!(self.speedup(r));
        }
        if let Some(d) = self.delta {
            out["delta"] = json!({
                "changed": d.model.changed,
                "predicted_s": d.sync.predicted_s,
                "delta_bound_s": d.sync.bound_s,
                "delta_bound_nic": d.sync.bound_nic,
                "full_bound_s": ws.bound_s,
                "full_predicted_s": ws.predicted_s,
                "speedup_vs_full": ws.predicted_s / d.sync.predicted_s.max(f64::MIN_POSITIVE),
                "meets_target": d.sync.predicted_s <= self.args.target_s,
                "dense_bytes": d.dense_bytes,
                "wire_bytes": d.wire_bytes,
                "wire_fraction": d.wire_fraction,
                "delta_writes": d.delta_writes,
                "dense_writes": d.dense_writes,
                "encode_bytes": d.encode_bytes,
                "max_encode_s": d.max_encode_s,
                "apply_bytes": d.apply_bytes,
                "max_apply_s": d.max_apply_s,
                "scan_gbs": d.model.scan_bytes_per_s / 1e9,
                "inbox_fraction": d.model.inbox_fraction,
                "max_fraction": d.model.max_fraction,
                "dominated_by": d.sync.dominated_by,
                "critical_breakdown": d.sync.critical_breakdown,
                "network_bytes": d.sync.network_bytes,
            });
        }
        out
    }

    /// The delta sync's lines of the text report.
    fn human_delta(&self, s: &mut String, d: &DeltaReport) {
        use std::fmt::Write;
        let ws = self.ws;
        let _ = writeln!(
            s,
            "Delta sync, {:.1}% of elements changed (every engine holds the previous version)",
            d.model.changed * 100.0
        );
        let _ = writeln!(
            s,
            "  predicted {:>8.4} s   delta bound {:.4} s ({})   full-transfer bound {:.3} s   \
             {:.1}x faster than the full sync",
            d.sync.predicted_s,
            d.sync.bound_s,
            d.sync.bound_nic,
            ws.bound_s,
            ws.predicted_s / d.sync.predicted_s.max(f64::MIN_POSITIVE)
        );
        let _ = writeln!(
            s,
            "  to engines {:.2} GB of {:.2} GB ({:.2}%); {} writes as deltas, {} dense",
            d.wire_bytes as f64 / 1e9,
            d.dense_bytes as f64 / 1e9,
            d.wire_fraction * 100.0,
            d.delta_writes,
            d.dense_writes
        );
        let _ = writeln!(
            s,
            "  encode {:.1} ms on the busiest trainer, apply {:.1} ms on the busiest engine \
             (memory at {:.0} GB/s per GPU{})",
            d.max_encode_s * 1e3,
            d.max_apply_s * 1e3,
            d.model.scan_bytes_per_s / 1e9,
            if self.args.delta_scan_gbs.is_some() {
                ", --delta-scan-gbs"
            } else {
                ", as --prep-gbs"
            }
        );
        let _ = writeln!(s, "  critical path: mostly {}", d.sync.dominated_by);
    }

    fn human(&self) -> String {
        use std::fmt::Write;
        let ws = self.ws;
        let gb = |b: f64| b / 1e9;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} {} -> {} {} ({} training GPUs -> {} inference GPUs, {:.0} Gb/s per GPU NIC)",
            self.model,
            self.args.train,
            self.args.infer,
            self.args.dtype,
            ws.trainers,
            ws.rollouts,
            self.cluster.cost.nic_bytes_per_s * 8.0 / 1e9
        );
        let _ = writeln!(
            s,
            "  planned in {:.2} s, simulated in {:.2} s ({} pieces, {} events)",
            self.plan_s, self.simulate_s, ws.pieces, ws.events
        );
        let _ = writeln!(
            s,
            "  weightsync   predicted {:>8.3} s   bound {:.3} s ({})   {:.2}x the bound",
            ws.predicted_s, ws.bound_s, ws.bound_nic, ws.ratio_to_bound
        );
        for (b, r) in Baseline::ALL.iter().zip(self.baselines) {
            let _ = writeln!(
                s,
                "  {:<18} predicted {:>8.3} s   weightsync is {:.1}x faster   ({})",
                b.name(),
                r.predicted_s,
                self.speedup(r),
                b.as_in()
            );
        }
        let _ = writeln!(s, "NICs");
        for (name, side) in [("send", &ws.send), ("receive", &ws.receive)] {
            let _ = writeln!(
                s,
                "  {:<8} {:>4} NICs  max {:>8.2} GB  mean {:>8.2} GB  utilisation max {:>5.1}%  mean {:>5.1}%",
                name,
                side.nics,
                gb(side.max_bytes as f64),
                gb(side.mean_bytes),
                side.max_util * 100.0,
                side.mean_util * 100.0
            );
        }
        let _ = writeln!(s, "Critical path ({} steps)", ws.critical_path.len());
        let steps = &ws.critical_path;
        let show: Vec<_> = if steps.len() > 12 {
            steps[..6].iter().chain(&steps[steps.len() - 6..]).collect()
        } else {
            steps.iter().collect()
        };
        for (i, c) in show.iter().enumerate() {
            if steps.len() > 12 && i == 6 {
                let _ = writeln!(s, "  ... {} more steps", steps.len() - 12);
            }
            let _ = writeln!(
                s,
                "  {:>8.4} - {:>8.4} s  {:<14} {:<12} x{:<4} limited by {}",
                c.start_s,
                c.end_s,
                c.worker,
                c.stage.name(),
                c.ops,
                c.limited_by
            );
        }
        let _ = writeln!(s, "Critical path by limit");
        for c in &ws.critical_breakdown {
            let _ = writeln!(
                s,
                "  {:<36} {:>8.4} s  {:>5.1}%",
                c.class,
                c.seconds,
                c.share * 100.0
            );
        }
        if ws.predicted_s > self.args.target_s {
            let _ = writeln!(
                s,
                "Above the {:.2} s goal: dominated by {}",
                self.args.target_s, ws.dominated_by
            );
        } else {
            let _ = writeln!(
                s,
                "Within the {:.2} s goal; the critical path is mostly {}",
                self.args.target_s, ws.dominated_by
            );
        }
        if let Some(d) = self.delta {
            self.human_delta(&mut s, d);
        }
        if let Some(p) = &self.args.trace {
            let _ = writeln!(s, "Trace written to {}", p.display());
        }
        s
    }
}

fn calibrate(args: &Args) -> anyhow::Result<()> {
    let cfg = weightsync_benches::e2e::calibrate::Config {
        syncs: args.syncs.max(1),
        ..Default::default()
    };
    let report = weightsync_benches::e2e::calibrate::run(&cfg)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.human());
    }
    if !report.all_within_tolerance {
        anyhow::bail!(
            "calibration: at least one configuration is off by more than {:.0}%",
            report.tolerance * 100.0
        );
    }
    Ok(())
}
