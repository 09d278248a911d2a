//! The demo's worker processes: one per training rank and per inference rank, this same binary
//! (`weightsync worker trainer|rollout`) on loopback, each logging to its own file; and the wait
//! until they registered and the controller's plan is in force.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use weightsync_controller::coordinator::Now;

use super::{Args, ServedDemo, spinner};

/// Worker processes, killed on drop.
pub(super) struct Workers {
    children: Vec<(String, Child, PathBuf)>,
}

impl Workers {
    /// Fails, with the end of its log, if a worker exited.
    pub(super) fn check_alive(&mut self) -> anyhow::Result<()> {
        for (name, child, log) in &mut self.children {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "{name} exited early ({status}); its log ({}):\n{}",
                    log.display(),
                    tail(log)
                );
            }
        }
        Ok(())
    }

    /// Waits up to `within` for every worker to exit.
    pub(super) fn wait_all(&mut self, within: Duration) {
        let deadline = Instant::now() + within;
        for (_, child, _) in &mut self.children {
            while Instant::now() < deadline {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for (_, child, _) in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// One process per trainer and rollout: this binary, `worker trainer|rollout`, logs in `logs`.
/// Trainers generate the demo's weights and rollouts check them (unless `--no-recompute`), both
/// after each commit, reporting to `progress`.
pub(super) fn spawn_workers(
    args: &Args,
    ctl: &ServedDemo,
    logs: &Path,
    progress: &Path,
) -> anyhow::Result<Workers> {
    let exe =
        weightsync_common::program::Program::this().context("locating the weightsync binary")?;
    let w = &ctl.world;
    let mut workers = Workers {
        children: Vec::new(),
    };
    for (role, n) in [("trainer", ctl.trainers), ("rollout", ctl.rollouts)] {
        for rank in 0..n {
            let name = format!("{role}-{rank}");
            let log = logs.join(format!("{name}.log"));
            let out = std::fs::File::create(&log)?;
            let mut cmd = exe.command();
            cmd.arg("worker")
                .arg(role)
                .args(["--controller", &ctl.control_addr.to_string()])
                .args(["--rank", &rank.to_string()])
                .args(["--model", &w.model, "--train", &w.train])
                .args(["--infer", &w.infer, "--dtype", &args.dtype])
                .args(["--lanes", &args.lanes.to_string()])
                .args(["--reconnect-s", "30"])
                .arg("--demo-progress")
                .arg(progress)
                .env("WEIGHTSYNC_JOB_TOKEN", &ctl.job_token)
                .env_remove("RANK")
                .env_remove("SLURM_PROCID")
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out);
            if let Some(tls) = &ctl.tls {
                cmd.arg("--tls-cert")
                    .arg(&tls.worker.cert)
                    .arg("--tls-key")
                    .arg(&tls.worker.key)
                    .arg("--tls-ca")
                    .arg(&tls.worker.ca);
            }
            if role == "trainer" {
                cmd.args(["--source", &format!("demo:{}", args.seed)])
                    .args(["--watermark-mib", &args.watermark_mib.to_string()]);
            } else if !args.no_recompute {
                cmd.args(["--demo-check-seed", &args.seed.to_string()])
                    .args(["--demo-check-sample", &args.check_sample.to_string()])
                    .args(["--demo-check-full-version", &args.syncs.to_string()]);
            }
            let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
            workers.children.push((name, child, log));
        }
    }
    Ok(workers)
}

/// Waits until every worker registered, the controller planned, and every worker accepted its
/// part (the plan is in force).
pub(super) async fn wait_planned(
    ctl: &ServedDemo,
    workers: &mut Workers,
    logs: &Path,
) -> anyhow::Result<()> {
    let total = ctl.trainers + ctl.rollouts;
    let pb = spinner(format!(
        "starting {total} workers (allocating and registering memory, planning)"
    ));
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        workers.check_alive()?;
        let (registered, planned, plan_error) = ctl.state.read(|c| {
            (
                c.workers(Now::wall()).len(),
                c.plan_ready(),
                c.plan_error().map(str::to_string),
            )
        });
        if let Some(e) = plan_error {
            bail!("the controller could not plan: {e}");
        }
        if planned {
            break;
        }
        pb.set_message(format!(
            "starting workers: {registered} of {total} registered"
        ));
        if Instant::now() > deadline {
            bail!(
                "workers did not register within 300 s; logs in {}",
                logs.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    pb.finish_and_clear();
    let plan = ctl
        .state
        .read(|c| c.plan().map(|p| p.summary.clone()))
        .unwrap_or_default();
    eprintln!(
        "  planned: {} bytes per sync in {} writes (fp8 gathers: {} bytes)",
        plan["bytes_to_move"], plan["work_requests"], plan["gather_bytes"]
    );
    Ok(())
}
