//! The demo's training loop: for each version, wait until the trainers hold its weights (the
//! demo's training step, done by the trainers after the previous commit), trigger the sync with
//! `POST /v1/syncs?wait=true`, print what the controller measured, then wait until every rollout
//! checked the committed version against its recomputation from the seed. The training step and
//! the check are the demo's and happen between syncs, so the time a sync line shows is the
//! sync's alone; they are reported on a line of their own.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::Value;
use weightsync_agent::api_client::request_over;
use weightsync_controller::AppState;
use weightsync_demo::progress::{DemoEvent, read_all};

use super::workers::Workers;
use super::yardsticks::Yardsticks;
use super::{Args, ServedDemo, spinner};

/// What the demo did outside one sync: the slowest trainer's weights and rollout's check.
#[derive(Debug, Clone, Default)]
pub(super) struct DemoWork {
    /// Seconds the slowest trainer took to write the version's weights.
    pub weights_s: f64,
    /// Seconds the slowest rollout took to check the version (`None`: not checked).
    pub check_s: Option<f64>,
    /// Bytes compared over all rollouts.
    pub checked_bytes: u64,
    /// Whether every rollout compared every byte (else some compared a sample).
    pub every_byte: bool,
    /// Why a rollout's check failed.
    pub check_failures: Vec<String>,
}

/// One sync: the controller's view of it and the demo's work around it.
#[derive(Debug, Clone)]
pub(super) struct SyncResult {
    pub version: u64,
    pub view: Value,
    pub demo: DemoWork,
}

/// Waits until `pred` holds for the events read from `progress` (every worker reported), or
/// fails after `within`.
async fn wait_events<T>(
    workers: &mut Workers,
    progress: &Path,
    what: &str,
    within: Duration,
    pred: impl Fn(&[DemoEvent]) -> Option<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(t) = pred(&read_all(progress)) {
            return Ok(t);
        }
        workers.check_alive()?;
        if Instant::now() > deadline {
            bail!("{what}: not reported within {} s", within.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The slowest trainer's seconds for `version`'s weights, once all `trainers` wrote them.
fn weights_written(events: &[DemoEvent], version: u64, trainers: u32) -> Option<f64> {
    let done: Vec<f64> = events
        .iter()
        .filter_map(|e| match e {
            DemoEvent::Weights {
                version: v,
                seconds,
                ..
            } if *v == version => Some(*seconds),
            _ => None,
        })
        .collect();
    (done.len() >= trainers as usize).then(|| done.iter().copied().fold(0.0, f64::max))
}

/// Every rollout's check of `version`, once all `rollouts` reported.
fn checks_done(events: &[DemoEvent], version: u64, rollouts: u32) -> Option<DemoWork> {
    let mut work = DemoWork {
        every_byte: true,
        ..DemoWork::default()
    };
    let mut n = 0;
    let mut slowest = 0f64;
    for e in events {
        if let DemoEvent::Checked {
            worker,
            version: v,
            bytes,
            every_byte,
            seconds,
            failure,
        } = e
        {
            if *v != version {
                continue;
            }
            work.every_byte &= *every_byte;
            n += 1;
            slowest = slowest.max(*seconds);
            work.checked_bytes += bytes;
            if let Some(f) = failure {
                work.check_failures.push(format!("{worker}: {f}"));
            }
        }
    }
    work.check_s = Some(slowest);
    (n >= rollouts as usize).then_some(work)
}

/// Runs `args.syncs` syncs; each sync's result, in order.
pub(super) async fn run_syncs(
    args: &Args,
    ctl: &ServedDemo,
    workers: &mut Workers,
    progress: &Path,
    yardsticks: Yardsticks,
) -> anyhow::Result<Vec<SyncResult>> {
    let addr = ctl.http_addr.to_string();
    let mut results: Vec<SyncResult> = Vec::new();
    let long = Duration::from_secs(600);
    for version in 1..=args.syncs {
        let what = format!("the trainers' weights for version {version}");
        let weights_s = wait_events(workers, progress, &what, long, |e| {
            weights_written(e, version, ctl.trainers)
        })
        .await?;
        let pb = spinner(format!("sync {version}/{}: triggering", args.syncs));
        let post = {
            let (addr, token) = (addr.clone(), ctl.api_token.clone());
            let tls = ctl.tls.as_ref().map(|t| t.api.clone());
            tokio::spawn(async move {
                request_over(
                    &addr,
                    tls.as_ref(),
                    "POST",
                    "/v1/syncs?wait=true",
                    Some(&token),
                    Some(&format!("{{\"version\": {version}}}")),
                    Duration::from_secs(700),
                )
                .await
            })
        };
        while !post.is_finished() {
            workers.check_alive()?;
            if let Some(m) = running(&ctl.state, version, args.syncs) {
                pb.set_message(m.to_lowercase());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        pb.finish_and_clear();
        let resp = post.await??;
        if resp.status != 200 {
            bail!("POST /v1/syncs answered {}: {}", resp.status, resp.body);
        }
        let view = resp.json();
        let committed = view["state"] == "committed";
        print_sync(version, &view, yardsticks);
        let mut demo = DemoWork {
            weights_s,
            ..Default::default()
        };
        if committed && !args.no_recompute {
            let pb = spinner(format!(
                "version {version}: every rollout recomputes what it holds from the seed and compares"
            ));
            let what = format!("the rollouts' checks of version {version}");
            let checked = wait_events(workers, progress, &what, long, |e| {
                checks_done(e, version, ctl.rollouts)
            })
            .await?;
            pb.finish_and_clear();
            demo = DemoWork {
                weights_s,
                ..checked
            };
        }
        print_demo_work(version, &demo, args.no_recompute || !committed);
        results.push(SyncResult {
            version,
            view,
            demo,
        });
    }
    Ok(results)
}

fn secs(v: &Value, key: &str) -> f64 {
    v["stages"][key].as_f64().unwrap_or(0.0) / 1e3
}

/// The sync line: the controller's trigger-to-commit time and its rate beside the yardsticks.
fn print_sync(version: u64, v: &Value, y: Yardsticks) {
    if v["state"] != "committed" {
        eprintln!("  sync {version}: {} : {}", v["state"], v["failure"]);
        return;
    }
    let total_s = secs(v, "total_ms");
    let bytes = v["bytes"].as_f64().unwrap_or(0.0);
    let gbps = bytes / total_s.max(1e-9) / 1e9;
    eprintln!(
        "  sync {version}: {total_s:.3} s trigger -> commit, {:.1} MB at {gbps:.2} GB/s = {:.2}x the fabric limit, {:.2}x one TCP stream \
         (writes landed in {:.3} s, committed {:.3} s after; checksums verified: {})",
        bytes / 1e6,
        gbps / y.fabric_gbps,
        gbps / y.tcp_gbps,
        secs(v, "land_ms"),
        secs(v, "after_landing_ms"),
        v["verified"]
    );
}

/// The demo's line: its own work around the sync, outside it.
fn print_demo_work(version: u64, d: &DemoWork, unchecked: bool) {
    let check = if unchecked {
        "not checked".to_string()
    } else if d.check_failures.is_empty() {
        format!(
            "{} recomputed from the seed and equal ({:.1} MB, {:.2} s)",
            if d.every_byte {
                "every landed byte"
            } else {
                "a sample of the landed pieces"
            },
            d.checked_bytes as f64 / 1e6,
            d.check_s.unwrap_or(0.0)
        )
    } else {
        format!("CHECK FAILED: {}", d.check_failures.join("; "))
    };
    eprintln!(
        "    the demo's own work, outside the sync: weights of v{version} written by the trainers beforehand ({:.2} s); \
         independent check of v{version}: {check}",
        d.weights_s
    );
}

/// What the running sync waits for, for the spinner.
fn running(state: &AppState, version: u64, syncs: u64) -> Option<String> {
    state.read(|c| {
        c.active().and_then(|id| c.sync(id)).map(|s| {
            format!(
                "sync {version}/{syncs}: {:?}, waiting for {} worker(s)",
                s.state,
                s.waiting_on().len(),
            )
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights(worker: &str, version: u64, seconds: f64) -> DemoEvent {
        DemoEvent::Weights {
            worker: worker.into(),
            version,
            bytes: 1,
            seconds,
        }
    }

    fn checked(worker: &str, version: u64, failure: Option<&str>) -> DemoEvent {
        DemoEvent::Checked {
            worker: worker.into(),
            version,
            bytes: 10,
            every_byte: true,
            seconds: 0.5,
            failure: failure.map(str::to_string),
        }
    }

    #[test]
    fn the_loop_waits_for_every_worker_of_the_version() {
        let e = vec![weights("trainer-0", 2, 0.3), weights("trainer-1", 1, 0.9)];
        assert_eq!(
            weights_written(&e, 2, 2),
            None,
            "trainer-1 has not written v2"
        );
        let mut e = e;
        e.push(weights("trainer-1", 2, 0.4));
        assert_eq!(weights_written(&e, 2, 2), Some(0.4));
        let c = vec![checked("rollout-0", 1, None), checked("rollout-1", 2, None)];
        assert!(checks_done(&c, 1, 2).is_none());
        // An earlier version's sample does not make a later full check look sampled.
        let sampled = DemoEvent::Checked {
            worker: "rollout-0".into(),
            version: 1,
            bytes: 3,
            every_byte: false,
            seconds: 0.1,
            failure: None,
        };
        let c = vec![
            sampled,
            checked("rollout-0", 2, None),
            checked("rollout-1", 2, None),
        ];
        let w = checks_done(&c, 2, 2).unwrap();
        assert!(w.every_byte && w.checked_bytes == 20);
        let c = vec![
            checked("rollout-0", 1, None),
            checked("rollout-1", 1, Some("byte 3 differs")),
        ];
        let w = checks_done(&c, 1, 2).unwrap();
        assert_eq!(w.checked_bytes, 20);
        assert_eq!(w.check_failures, vec!["rollout-1: byte 3 differs"]);
    }
}
