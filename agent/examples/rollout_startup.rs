//! What a rollout sidecar of the Kimi-K2 anchor job (`pp=2,ep=8,fsdp=16` -> `tp=8,ep=32,dp=4`,
//! fp8) computes before it can register its memory, one way per process run:
//!
//! - `own`: what the rollout driver does now: its tensors from the inference layout alone;
//! - `whole`: what it did before the plan round: plan the whole job and take its rank's row of
//!   the routing table.
//!
//! Prints CPU seconds, wall seconds and peak RSS (`VmHWM`) as one JSON line. A real Kimi-K2
//! rollout then allocates and registers 34.6 GB for its tensors, which this machine cannot, so
//! the sidecar process itself is measured only for trainers (`tests/tests/sidecar_startup.rs`).
//!
//! ```text
//! cargo run --release -p weightsync-agent --example rollout_startup -- own
//! cargo run --release -p weightsync-agent --example rollout_startup -- whole
//! ```

use std::time::Instant;

use weightsync_common::DType;
use weightsync_common::protocol::WorldSpec;
use weightsync_schedules::job::{inference_layout, plan_job, rollout_layout};

/// (user + system) CPU seconds and peak RSS in MiB of this process, from /proc.
fn cpu_s_and_peak_mib() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |x| x.1);
    let f: Vec<f64> = after
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    let cpu = (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / 100.0;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    (cpu, kib / 1024.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "own".into());
    let world = WorldSpec {
        model: "kimi-k2".into(),
        train: "pp=2,ep=8,fsdp=16".into(),
        infer: "tp=8,ep=32,dp=4".into(),
        dtype: DType::F8E4M3,
        verify: true,
    };
    let t = Instant::now();
    let layout = match mode.as_str() {
        "own" => rollout_layout(&inference_layout(&world, None)?.1, 0)?,
        "whole" => plan_job(&world, None)?
            .table
            .rollout(0)
            .ok_or("the table has no inference rank 0")?,
        other => return Err(format!("unknown mode {other:?} (own or whole)").into()),
    };
    let wall = t.elapsed().as_secs_f64();
    let (cpu, peak) = cpu_s_and_peak_mib();
    println!(
        "{}",
        serde_json::json!({
            "mode": mode,
            "cpu_s": cpu,
            "wall_s": wall,
            "peak_rss_mib": peak,
            "tensors": layout.tensors.len(),
            "mr_bytes": layout.mr_bytes,
        })
    );
    Ok(())
}
