//! `weightsync demo`: the whole system on one machine, as a newcomer first sees it.
//!
//! It starts a controller (in this process) and one worker *process* per training rank and per
//! inference rank (this same binary, `weightsync worker ...`, on loopback), then acts as a
//! training loop: for each step it posts `{"version": N}` to the HTTP API and waits for the sync
//! to commit. Trainers regenerate their shards from `(seed, N)` before writing, as an optimizer
//! step would change them; every rollout checks the trainers' checksums and then recomputes
//! every tensor from the seed independently and compares every byte. The summary gives time per
//! sync, GB/s and the ratio to one plain TCP stream measured in the same run (the loopback
//! limit on this machine), then the dashboard keeps serving until Ctrl-C (`--exit` stops).

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use weightsync_common::protocol::WorldSpec;
use weightsync_common::DType;

use weightsync_agent::api_client::request;
use weightsync_controller::coordinator::Now;
use weightsync_controller::{AppState, ControllerConfig, SchedulesPlanner};

/// Arguments of `weightsync demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model preset (or config.json path).
    #[arg(long, default_value = "qwen3-0.6b")]
    pub model: String,
    /// Training layout: one trainer process per rank.
    #[arg(long, default_value = "fsdp=4")]
    pub train: String,
    /// Inference layout: one rollout process per inference rank (2 engines of tp=2 by default).
    #[arg(long, default_value = "tp=2,dp=2")]
    pub infer: String,
    /// Inference dtype: fp8 or bf16.
    #[arg(long, default_value = "fp8")]
    pub dtype: String,
    /// Syncs (training steps) to run.
    #[arg(long, default_value_t = 3)]
    pub syncs: u64,
    /// Seed of the demo weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Dashboard / HTTP API address (falls back to a free port if taken).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub http: String,
    /// Fabric lanes per peer.
    #[arg(long, default_value_t = 2)]
    pub lanes: usize,
    /// Trainers' staging watermark, MiB.
    #[arg(long, default_value_t = 128)]
    pub watermark_mib: u64,
    /// Stop when the syncs are done instead of serving the dashboard until Ctrl-C.
    #[arg(long)]
    pub exit: bool,
    /// Print one JSON summary on stdout (progress and logs go to stderr).
    #[arg(long)]
    pub json: bool,
    /// Rollouts skip the independent recomputation of every tensor after each sync (the
    /// trainers' checksums are still verified): what a production sync's commit costs.
    #[arg(long)]
    pub no_recompute: bool,
}

/// Worker processes, killed on drop.
struct Workers {
    children: Vec<(String, Child, PathBuf)>,
}

impl Workers {
    fn check_alive(&mut self) -> anyhow::Result<()> {
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

    fn wait_all(&mut self, within: Duration) {
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

fn tail(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

fn random_token() -> String {
    let bytes: [u8; 16] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One plain TCP stream over loopback moving `bytes`: the yardstick of the run, GB/s.
pub fn plain_tcp_gbps(bytes: usize) -> std::io::Result<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<Duration> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0usize;
        let mut start = None;
        while got < bytes {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            start.get_or_insert_with(Instant::now);
            got += n;
        }
        Ok(start.map_or(Duration::ZERO, |s| s.elapsed()))
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    let chunk = vec![7u8; 1 << 20];
    let mut sent = 0;
    while sent < bytes {
        let n = chunk.len().min(bytes - sent);
        s.write_all(&chunk[..n])?;
        sent += n;
    }
    drop(s);
    let took = reader
        .join()
        .map_err(|_| std::io::Error::other("reader thread panicked"))??;
    Ok(bytes as f64 / took.as_secs_f64().max(1e-9) / 1e9)
}

fn spinner(msg: String) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    pb.enable_steady_tick(Duration::from_millis(120));
    pb.set_message(msg);
    pb
}

/// Runs `weightsync demo`.
pub fn run(args: Args) -> anyhow::Result<()> {
    crate::logging::init("warn");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(demo(args))
}

/// The controller of the demo, served in this process.
struct ServedDemo {
    state: AppState,
    world: WorldSpec,
    trainers: u32,
    rollouts: u32,
    job_token: String,
    api_token: String,
    http_addr: std::net::SocketAddr,
    control_addr: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn demo(args: Args) -> anyhow::Result<()> {
    let ctl = start_controller(&args).await?;
    let dashboard = format!("http://{}/", ctl.http_addr);
    let w = &ctl.world;
    eprintln!(
        "weightsync demo: {} ({} weights), {} trainers [{}] -> {} rollouts [{}]\n  dashboard: {dashboard}",
        w.model, w.dtype, ctl.trainers, w.train, ctl.rollouts, w.infer
    );
    let logs = std::env::temp_dir().join(format!("weightsync-demo-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    let mut workers = spawn_workers(&args, &ctl, &logs)?;
    wait_planned(&ctl, &mut workers, &logs).await?;
    let tcp_gbps = measure_tcp().await?;
    let fabric_gbps = measure_fabric(args.lanes).await?;
    let (results, failed) = run_syncs(&args, &ctl, &mut workers, tcp_gbps).await?;
    let yardsticks = Yardsticks {
        tcp_gbps,
        fabric_gbps,
    };
    let (summary, verified) = summarise(&args, &ctl, &results, &failed, yardsticks, &dashboard);
    if args.json {
        println!("{summary}");
    } else {
        eprintln!(
            "\nsummary: {} of {} syncs committed and verified byte for byte; {:.1} MB per sync;\n  \
             {:.2} s per sync end to end, writes landed at {:.2} GB/s = {:.2}x one plain TCP stream ({tcp_gbps:.2} GB/s)\n  \
             = {:.2}x the fabric's best rate with {} lanes ({fabric_gbps:.2} GB/s)",
            summary["committed"],
            args.syncs,
            summary["bytes_per_sync"].as_f64().unwrap_or(0.0) / 1e6,
            summary["mean_seconds_per_sync"].as_f64().unwrap_or(0.0),
            summary["mean_gbps"].as_f64().unwrap_or(0.0),
            summary["ratio_vs_tcp"].as_f64().unwrap_or(0.0),
            summary["ratio_vs_fabric"].as_f64().unwrap_or(0.0),
            args.lanes,
        );
    }
    if !args.exit {
        eprintln!("\ndashboard: {dashboard}  (Ctrl-C to stop)");
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    let _ = ctl.stop.send(());
    let _ = ctl.server.await;
    tokio::task::block_in_place(|| workers.wait_all(Duration::from_secs(10)));
    drop(workers);
    if !failed.is_empty() || !verified {
        bail!("syncs {failed:?} failed; worker logs in {}", logs.display());
    }
    let _ = std::fs::remove_dir_all(&logs);
    Ok(())
}

/// Serves a controller for the demo's job on loopback (the dashboard on `--http`, or a free port
/// if that is taken).
async fn start_controller(args: &Args) -> anyhow::Result<ServedDemo> {
    let dtype: DType = args.dtype.parse().map_err(anyhow::Error::msg)?;
    let world = WorldSpec {
        model: args.model.clone(),
        train: args.train.clone(),
        infer: args.infer.clone(),
        dtype,
        verify: true,
    };
    let (job_token, api_token) = (random_token(), random_token());
    let mut cfg = ControllerConfig::for_job(
        world.clone(),
        job_token.clone(),
        api_token.clone(),
        Duration::from_secs(10),
        Duration::from_secs(600),
        200,
    )?;
    cfg.shutdown_workers = true;
    let (trainers, rollouts) = (cfg.coordinator.trainers, cfg.coordinator.rollouts);
    let http = match tokio::net::TcpListener::bind(&args.http).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("note: {} is taken ({e}); using a free port", args.http);
            tokio::net::TcpListener::bind("127.0.0.1:0").await?
        }
    };
    let control = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let (http_addr, control_addr) = (http.local_addr()?, control.local_addr()?);
    let state = AppState::new(cfg, Box::new(SchedulesPlanner));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(weightsync_controller::run(
        http,
        control,
        state.clone(),
        async {
            let _ = stopped.await;
        },
    ));
    Ok(ServedDemo {
        state,
        world,
        trainers,
        rollouts,
        job_token,
        api_token,
        http_addr,
        control_addr,
        stop,
        server,
    })
}

/// One process per trainer and rollout: this binary, `worker trainer|rollout`, logs in `logs`.
fn spawn_workers(args: &Args, ctl: &ServedDemo, logs: &std::path::Path) -> anyhow::Result<Workers> {
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
                .env("WEIGHTSYNC_JOB_TOKEN", &ctl.job_token)
                .env_remove("RANK")
                .env_remove("SLURM_PROCID")
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out);
            if role == "trainer" {
                cmd.args(["--source", &format!("demo:{}", args.seed)])
                    .args(["--watermark-mib", &args.watermark_mib.to_string()]);
            } else if !args.no_recompute {
                cmd.args(["--demo-check-seed", &args.seed.to_string()]);
            }
            let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
            workers.children.push((name, child, log));
        }
    }
    Ok(workers)
}

/// Waits until every worker registered, the controller planned, and every worker accepted its
/// part (the plan is in force).
async fn wait_planned(
    ctl: &ServedDemo,
    workers: &mut Workers,
    logs: &std::path::Path,
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

/// The median of three plain TCP streams of 256 MiB on loopback, GB/s.
async fn measure_tcp() -> anyhow::Result<f64> {
    let pb = spinner("measuring one plain TCP stream on loopback (the yardstick)".into());
    let mut runs: Vec<f64> = Vec::new();
    for _ in 0..3 {
        runs.push(tokio::task::spawn_blocking(|| plain_tcp_gbps(256 << 20)).await??);
    }
    runs.sort_by(f64::total_cmp);
    pb.finish_and_clear();
    eprintln!("  plain TCP stream: {:.2} GB/s", runs[1]);
    Ok(runs[1])
}

/// The fabric bench's best rate for the demo's lanes, measured in this process before the
/// syncs (`weightsync_benches::fabric::best_rate_gbps`), GB/s: the yardstick of
/// `ratio_vs_fabric`.
async fn measure_fabric(lanes: usize) -> anyhow::Result<f64> {
    let pb = spinner(format!(
        "measuring the fabric alone with {lanes} lanes (the other yardstick)"
    ));
    let gbps = weightsync_benches::fabric::best_rate_gbps(lanes, 3).await?;
    pb.finish_and_clear();
    eprintln!("  fabric, {lanes} lanes: {gbps:.2} GB/s");
    Ok(gbps)
}

/// What the syncs' landing rate is compared with, measured in the same run.
#[derive(Debug, Clone, Copy)]
struct Yardsticks {
    /// One plain TCP stream on loopback, GB/s.
    tcp_gbps: f64,
    /// The fabric bench's best rate for the demo's lanes, GB/s.
    fabric_gbps: f64,
}

/// The training loop: one `POST /v1/syncs?wait=true` per version; each sync's view, and the
/// versions that did not commit.
async fn run_syncs(
    args: &Args,
    ctl: &ServedDemo,
    workers: &mut Workers,
    tcp_gbps: f64,
) -> anyhow::Result<(Vec<Value>, Vec<u64>)> {
    let addr = ctl.http_addr.to_string();
    let mut results: Vec<Value> = Vec::new();
    let mut failed = Vec::new();
    for version in 1..=args.syncs {
        let pb = spinner(format!("sync {version}/{}: triggering", args.syncs));
        let post = {
            let (addr, token) = (addr.clone(), ctl.api_token.clone());
            tokio::spawn(async move {
                request(
                    &addr,
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
            if let Some(m) = progress(&ctl.state, version, args.syncs) {
                pb.set_message(m.to_lowercase());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        pb.finish_and_clear();
        let resp = post.await??;
        let v = resp.json();
        if resp.status != 200 {
            bail!("POST /v1/syncs answered {}: {}", resp.status, resp.body);
        }
        let total_s = v["stages"]["total_ms"].as_f64().unwrap_or(0.0) / 1e3;
        let land_s = v["stages"]["land_ms"].as_f64().unwrap_or(0.0) / 1e3;
        let gbps = v["gbps"].as_f64().unwrap_or(0.0);
        let after_s = v["stages"]["after_landing_ms"].as_f64().unwrap_or(0.0) / 1e3;
        let check_s = v["stages"]["after_landing_check_ms"]
            .as_f64()
            .unwrap_or(0.0)
            / 1e3;
        if v["state"] == "committed" {
            eprintln!(
                "  sync {version}: committed in {total_s:.2} s (writes landed in {land_s:.2} s: {gbps:.2} GB/s, {:.2}x one TCP stream; committed {after_s:.3} s after landing, {check_s:.3} s of it checking), verified: {}",
                gbps / tcp_gbps,
                v["verified"]
            );
            let sum = &v["time_split"]["sum"];
            let sec = |k: &str| sum[k].as_f64().unwrap_or(0.0);
            eprintln!(
                "    trainers' wall {:.2} s = wire {:.2} + idle {:.2} + overhead {:.2} (summed over trainers)",
                sec("wall_s"),
                sec("wire_s"),
                sec("idle_s"),
                sec("overhead_s")
            );
        } else {
            eprintln!("  sync {version}: {} : {}", v["state"], v["failure"]);
            failed.push(version);
        }
        results.push(v);
    }
    Ok((results, failed))
}

/// What the running sync waits for, for the spinner.
fn progress(state: &AppState, version: u64, syncs: u64) -> Option<String> {
    state.read(|c| {
        c.active().and_then(|id| c.sync(id)).map(|s| {
            format!(
                "sync {version}/{syncs}: {:?}, waiting for {} worker(s){}",
                s.state,
                s.waiting_on().len(),
                if s.verify_sent_ns.is_some() {
                    " (verifying every byte)"
                } else {
                    ""
                }
            )
        })
    })
}

/// The `--json` summary (its keys are the demo's interface), and whether every sync committed
/// verified.
fn summarise(
    args: &Args,
    ctl: &ServedDemo,
    results: &[Value],
    failed: &[u64],
    yardsticks: Yardsticks,
    dashboard: &str,
) -> (Value, bool) {
    let Yardsticks {
        tcp_gbps,
        fabric_gbps,
    } = yardsticks;
    let committed: Vec<&Value> = results
        .iter()
        .filter(|v| v["state"] == "committed")
        .collect();
    let verified = !committed.is_empty()
        && failed.is_empty()
        && committed.iter().all(|v| v["verified"] == true);
    let per_sync = |f: &dyn Fn(&Value) -> f64| results.iter().map(f).collect::<Vec<f64>>();
    let secs = per_sync(&|v| v["stages"]["total_ms"].as_f64().unwrap_or(0.0) / 1e3);
    let transfer = per_sync(&|v| v["stages"]["land_ms"].as_f64().unwrap_or(0.0) / 1e3);
    let after_landing =
        per_sync(&|v| v["stages"]["after_landing_ms"].as_f64().unwrap_or(0.0) / 1e3);
    let part = |key: &'static str| {
        per_sync(&move |v: &Value| v["stages"][key].as_f64().unwrap_or(0.0) / 1e3)
    };
    let gbps = per_sync(&|v| v["gbps"].as_f64().unwrap_or(0.0));
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len().max(1) as f64;
    let split_sum = |key: &'static str| {
        mean(&per_sync(&move |v: &Value| {
            v["time_split"]["sum"][key].as_f64().unwrap_or(0.0)
        }))
    };
    let first = |k: &str| results.first().and_then(|v| v[k].as_u64()).unwrap_or(0);
    let bytes_per_sync = first("bytes");
    let w = &ctl.world;
    let summary = json!({
        "model": w.model,
        "train": w.train,
        "infer": w.infer,
        "dtype": w.dtype.name(),
        "trainers": ctl.trainers,
        "rollouts": ctl.rollouts,
        "syncs": args.syncs,
        "committed": committed.len(),
        "bytes_per_sync": bytes_per_sync,
        "staged_bytes_per_sync": first("staged_bytes"),
        "direct_bytes_per_sync": first("direct_bytes"),
        "seconds_per_sync": secs,
        "transfer_seconds_per_sync": transfer,
        "after_landing_seconds_per_sync": after_landing,
        "after_landing_ratio": mean(&after_landing) / mean(&transfer).max(f64::MIN_POSITIVE),
        "after_landing_split_seconds_per_sync": {
            "wait": part("after_landing_wait_ms"),
            "check": part("after_landing_check_ms"),
            "control": part("after_landing_control_ms"),
        },
        "time_split_per_sync": results.iter().map(|v| v["time_split"].clone()).collect::<Vec<_>>(),
        "time_split_sum_mean_seconds": {
            "wall_s": split_sum("wall_s"),
            "wire_s": split_sum("wire_s"),
            "idle_s": split_sum("idle_s"),
            "overhead_s": split_sum("overhead_s"),
        },
        "recompute": !args.no_recompute,
        "gbps_per_sync": gbps,
        "mean_seconds_per_sync": mean(&secs),
        "mean_gbps": mean(&gbps),
        "tcp_gbps": tcp_gbps,
        "ratio_vs_tcp": mean(&gbps) / tcp_gbps,
        "fabric_gbps": fabric_gbps,
        "fabric_lanes": args.lanes,
        "ratio_vs_fabric": mean(&gbps) / fabric_gbps,
        "verified": verified,
        "dashboard": dashboard,
    });
    (summary, verified)
}
