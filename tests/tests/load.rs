//! Load: back-to-back syncs with verification, as real processes on loopback; every sync must
//! commit, and the resident memory and open file descriptors of every process must stay flat.
//!
//! Ignored by default (minutes on a 2-core machine). Run:
//! `cargo test -p weightsync-tests --release --test load -- --ignored --nocapture`
//! (`WEIGHTSYNC_LOAD_SYNCS=N` changes the count, default 100).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use weightsync_tests::proc_stats::{self, ProcSample};
use weightsync_tests::process_cluster::{JobSpec, ProcessCluster, assert_committed_and_verified};

fn sample_all(c: &ProcessCluster) -> BTreeMap<String, ProcSample> {
    c.pids()
        .into_iter()
        .map(|(name, pid)| {
            let s = proc_stats::sample(pid).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, s)
        })
        .collect()
}

#[test]
#[ignore = "load test: run with --ignored (100 syncs take minutes on 2 cores)"]
fn back_to_back_syncs_all_commit_and_memory_and_fds_stay_flat() {
    let syncs: u64 = std::env::var("WEIGHTSYNC_LOAD_SYNCS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let c = ProcessCluster::start(JobSpec::tiny());
    assert!(
        c.wait_ready(Duration::from_secs(60)),
        "never ready\n{}",
        c.logs()
    );
    // Sync 1 warms every process up (first plan, first lanes, first staging); "first" is after it.
    assert_committed_and_verified(&c.sync(1, Duration::from_secs(60)), "warm-up sync", &|| {
        c.logs()
    });
    let first = sample_all(&c);
    let started = Instant::now();
    let mut mid = None;
    for v in 2..=syncs + 1 {
        let view = c.sync(v, Duration::from_secs(60));
        assert_committed_and_verified(&view, &format!("sync of version {v}"), &|| c.logs());
        if v == syncs / 2 {
            mid = Some(sample_all(&c));
        }
    }
    let took = started.elapsed();
    let last = sample_all(&c);
    println!(
        "{syncs} syncs committed and verified in {took:?} ({:?} per sync)",
        took / syncs as u32
    );
    println!(
        "{:<16} {:>12} {:>12} {:>12} {:>6} {:>6} {:>8} {:>8}",
        "process", "rss first", "rss mid", "rss last", "fds 1", "fds n", "thr 1", "thr n"
    );
    let mut figures = Vec::new();
    for (name, f) in &first {
        let l = &last[name];
        let m = mid
            .as_ref()
            .and_then(|m| m.get(name))
            .map_or(0, |s| s.rss_kib);
        println!(
            "{name:<16} {:>9} KiB {:>9} KiB {:>9} KiB {:>6} {:>6} {:>8} {:>8}",
            f.rss_kib, m, l.rss_kib, f.fds, l.fds, f.threads, l.threads
        );
        figures.push(serde_json::json!({
            "process": name, "rss_kib_first": f.rss_kib, "rss_kib_last": l.rss_kib,
            "fds_first": f.fds, "fds_last": l.fds, "threads_first": f.threads, "threads_last": l.threads,
        }));
    }
    println!(
        "{}",
        serde_json::json!({"syncs": syncs, "seconds": took.as_secs_f64(), "processes": figures})
    );
    for (name, f) in &first {
        let l = &last[name];
        assert!(
            l.fds <= f.fds + 4,
            "{name}: open fds grew from {} to {}",
            f.fds,
            l.fds
        );
        assert!(
            l.threads <= f.threads + 4,
            "{name}: threads grew from {} to {}",
            f.threads,
            l.threads
        );
        assert!(
            l.rss_kib <= f.rss_kib + f.rss_kib / 5 + 16 * 1024,
            "{name}: RSS grew from {} KiB to {} KiB over {syncs} syncs",
            f.rss_kib,
            l.rss_kib
        );
    }
}
