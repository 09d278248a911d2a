//! The demo's summary: the `--json` object (its keys are the demo's interface) and the lines a
//! person reads. Sync figures are the controller's (trigger to commit, and the writes' landing
//! window); the demo's own work (weights, independent check) is summed apart.

use serde_json::{Value, json};

use super::syncs::SyncResult;
use super::yardsticks::Yardsticks;
use super::{Args, ServedDemo};

/// The summary, and whether every sync committed verified (and, unless `--no-recompute`,
/// every byte equalled its recomputation).
pub(super) fn summarise(
    args: &Args,
    ctl: &ServedDemo,
    results: &[SyncResult],
    yardsticks: Yardsticks,
    dashboard: &str,
) -> (Value, bool) {
    let Yardsticks {
        tcp_gbps,
        fabric_gbps,
    } = yardsticks;
    let views: Vec<&Value> = results.iter().map(|r| &r.view).collect();
    let committed = views.iter().filter(|v| v["state"] == "committed").count();
    let checked = args.no_recompute
        || results
            .iter()
            .all(|r| r.demo.check_s.is_some() && r.demo.check_failures.is_empty());
    let verified = committed > 0
        && committed == results.len()
        && views.iter().all(|v| v["verified"] == true)
        && checked;
    let per_sync = |f: &dyn Fn(&Value) -> f64| views.iter().map(|v| f(v)).collect::<Vec<f64>>();
    let stage = |key: &'static str| {
        per_sync(&move |v: &Value| v["stages"][key].as_f64().unwrap_or(0.0) / 1e3)
    };
    let secs = stage("total_ms");
    let transfer = stage("land_ms");
    let after_landing = stage("after_landing_ms");
    let gbps = per_sync(&|v| v["gbps"].as_f64().unwrap_or(0.0));
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len().max(1) as f64;
    let split_sum = |key: &'static str| {
        mean(&per_sync(&move |v: &Value| {
            v["time_split"]["sum"][key].as_f64().unwrap_or(0.0)
        }))
    };
    let first = |k: &str| views.first().and_then(|v| v[k].as_u64()).unwrap_or(0);
    let bytes_per_sync = first("bytes");
    let sync_gbps: Vec<f64> = secs
        .iter()
        .map(|s| bytes_per_sync as f64 / s.max(1e-9) / 1e9)
        .collect();
    let mean_sync_gbps = bytes_per_sync as f64 / mean(&secs).max(1e-9) / 1e9;
    let w = &ctl.world;
    let summary = json!({
        "model": w.model,
        "train": w.train,
        "infer": w.infer,
        "dtype": w.dtype.name(),
        "trainers": ctl.trainers,
        "rollouts": ctl.rollouts,
        "syncs": args.syncs,
        "committed": committed,
        "bytes_per_sync": bytes_per_sync,
        "staged_bytes_per_sync": first("staged_bytes"),
        "direct_bytes_per_sync": first("direct_bytes"),
        "seconds_per_sync": secs,
        "sync_gbps_per_sync": sync_gbps,
        "transfer_seconds_per_sync": transfer,
        "after_landing_seconds_per_sync": after_landing,
        "after_landing_ratio": mean(&after_landing) / mean(&transfer).max(f64::MIN_POSITIVE),
        "after_landing_split_seconds_per_sync": {
            "wait": stage("after_landing_wait_ms"),
            "check": stage("after_landing_check_ms"),
            "control": stage("after_landing_control_ms"),
        },
        "time_split_per_sync": views.iter().map(|v| v["time_split"].clone()).collect::<Vec<_>>(),
        "time_split_sum_mean_seconds": {
            "wall_s": split_sum("wall_s"),
            "wire_s": split_sum("wire_s"),
            "idle_s": split_sum("idle_s"),
            "overhead_s": split_sum("overhead_s"),
        },
        "recompute": !args.no_recompute,
        "demo_weights_seconds_per_sync": results.iter().map(|r| r.demo.weights_s).collect::<Vec<_>>(),
        "demo_check_seconds_per_sync": results.iter().map(|r| r.demo.check_s).collect::<Vec<_>>(),
        "demo_checked_bytes_per_sync": results.iter().map(|r| r.demo.checked_bytes).collect::<Vec<_>>(),
        "demo_checked_every_byte_per_sync": results.iter().map(|r| r.demo.every_byte).collect::<Vec<_>>(),
        "demo_check_sample": args.check_sample,
        "demo_check_failures": results.iter().flat_map(|r| r.demo.check_failures.iter().map(move |f| format!("v{}: {f}", r.version))).collect::<Vec<_>>(),
        "gbps_per_sync": gbps,
        "mean_seconds_per_sync": mean(&secs),
        "mean_sync_gbps": mean_sync_gbps,
        "mean_gbps": mean(&gbps),
        "tcp_gbps": tcp_gbps,
        "sync_ratio_vs_tcp": mean_sync_gbps / tcp_gbps,
        "ratio_vs_tcp": mean(&gbps) / tcp_gbps,
        "fabric_gbps": fabric_gbps,
        "fabric_lanes": args.lanes,
        "sync_ratio_vs_fabric": mean_sync_gbps / fabric_gbps,
        "ratio_vs_fabric": mean(&gbps) / fabric_gbps,
        "verified": verified,
        "dashboard": dashboard,
    });
    (summary, verified)
}

/// The summary for a person.
pub(super) fn print(args: &Args, s: &Value, results: &[SyncResult]) {
    let f = |k: &str| s[k].as_f64().unwrap_or(0.0);
    eprintln!(
        "\nsummary: {} of {} syncs committed, checksums verified; {:.1} MB per sync\n  \
         sync, trigger -> commit: {:.3} s mean, {:.2} GB/s = {:.2}x the fabric limit ({:.2} GB/s, {} lanes) = {:.2}x one plain TCP stream ({:.2} GB/s)\n  \
         writes landed at {:.2} GB/s = {:.2}x the fabric limit; commit {:.1}% of the landing time after it",
        s["committed"],
        args.syncs,
        f("bytes_per_sync") / 1e6,
        f("mean_seconds_per_sync"),
        f("mean_sync_gbps"),
        f("sync_ratio_vs_fabric"),
        f("fabric_gbps"),
        args.lanes,
        f("sync_ratio_vs_tcp"),
        f("tcp_gbps"),
        f("mean_gbps"),
        f("ratio_vs_fabric"),
        100.0 * f("after_landing_ratio"),
    );
    if args.no_recompute {
        eprintln!("  independent check: skipped (--no-recompute)");
        return;
    }
    let failures: Vec<&String> = results
        .iter()
        .flat_map(|r| &r.demo.check_failures)
        .collect();
    let checks: Vec<f64> = results.iter().filter_map(|r| r.demo.check_s).collect();
    let bytes: u64 = results.iter().map(|r| r.demo.checked_bytes).sum();
    let full = results.iter().filter(|r| r.demo.every_byte).count();
    let coverage = if full == results.len() {
        format!("every landed byte of all {} versions", results.len())
    } else {
        format!(
            "a sample (one piece in {}) of {} versions and every byte of {full} (the last)",
            args.check_sample,
            results.len() - full
        )
    };
    if failures.is_empty() && checks.len() == results.len() {
        eprintln!(
            "  independent check (the demo's, after each commit, outside the syncs): {coverage} \
             recomputed from the seed and equal, {:.1} MB compared, {:.2} s per version",
            bytes as f64 / 1e6,
            checks.iter().sum::<f64>() / checks.len().max(1) as f64
        );
    } else {
        eprintln!(
            "  independent check FAILED ({} of {} versions checked): {}",
            checks.len(),
            results.len(),
            failures
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
}
