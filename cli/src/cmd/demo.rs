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
use std::process::{Child, Command, Stdio};
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

async fn demo(args: Args) -> anyhow::Result<()> {
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
    let dashboard = format!("http://{http_addr}/");
    let state = AppState::new(cfg, Box::new(SchedulesPlanner));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(weightsync_controller::run(
        http,
        control,
        state.clone(),
        async {
            let _ = stop_rx.await;
        },
    ));

    eprintln!(
        "weightsync demo: {} ({} weights), {} trainers [{}] -> {} rollouts [{}]\n  dashboard: {dashboard}",
        world.model, dtype, trainers, world.train, rollouts, world.infer
    );

    // Worker processes: this binary, `worker trainer|rollout`.
    let exe = std::env::current_exe().context("locating the weightsync binary")?;
    let logs = std::env::temp_dir().join(format!("weightsync-demo-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    let mut workers = Workers {
        children: Vec::new(),
    };
    for (role, n) in [("trainer", trainers), ("rollout", rollouts)] {
        for rank in 0..n {
            let name = format!("{role}-{rank}");
            let log = logs.join(format!("{name}.log"));
            let out = std::fs::File::create(&log)?;
            let mut cmd = Command::new(&exe);
            cmd.arg("worker")
                .arg(role)
                .args(["--controller", &control_addr.to_string()])
                .args(["--rank", &rank.to_string()])
                .args(["--model", &world.model, "--train", &world.train])
                .args(["--infer", &world.infer, "--dtype", &args.dtype])
                .args(["--lanes", &args.lanes.to_string()])
                .args(["--reconnect-s", "30"])
                .env("WEIGHTSYNC_JOB_TOKEN", &job_token)
                .env_remove("RANK")
                .env_remove("SLURM_PROCID")
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out);
            if role == "trainer" {
                cmd.args(["--source", &format!("demo:{}", args.seed)])
                    .args(["--watermark-mib", &args.watermark_mib.to_string()]);
            } else {
                cmd.args(["--demo-check-seed", &args.seed.to_string()]);
            }
            let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
            workers.children.push((name, child, log));
        }
    }

    let pb = spinner(format!(
        "starting {} workers (planning, allocating and registering memory)",
        trainers + rollouts
    ));
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        workers.check_alive()?;
        let (registered, planned, plan_error) = state.read(|c| {
            (
                c.workers(Now::wall()).len(),
                c.plan().is_some(),
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
            "starting workers: {registered} of {} registered",
            trainers + rollouts
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
    let plan = state
        .read(|c| c.plan().map(|p| p.summary.clone()))
        .unwrap_or_default();
    eprintln!(
        "  planned: {} bytes per sync in {} writes (fp8 gathers: {} bytes)",
        plan["bytes_to_move"], plan["work_requests"], plan["gather_bytes"]
    );

    let pb = spinner("measuring one plain TCP stream on loopback (the yardstick)".into());
    let tcp_gbps = {
        let mut runs: Vec<f64> = Vec::new();
        for _ in 0..3 {
            runs.push(tokio::task::spawn_blocking(|| plain_tcp_gbps(256 << 20)).await??);
        }
        runs.sort_by(f64::total_cmp);
        runs[1]
    };
    pb.finish_and_clear();
    eprintln!("  plain TCP stream: {tcp_gbps:.2} GB/s");

    let addr = http_addr.to_string();
    let mut results: Vec<Value> = Vec::new();
    let mut failed = Vec::new();
    for version in 1..=args.syncs {
        let pb = spinner(format!("sync {version}/{}: triggering", args.syncs));
        let post = {
            let (addr, token) = (addr.clone(), api_token.clone());
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
            let msg = state.read(|c| {
                c.active().and_then(|id| c.sync(id)).map(|s| {
                    let waiting = s.waiting_on();
                    format!(
                        "sync {version}/{}: {:?}, waiting for {} worker(s){}",
                        args.syncs,
                        s.state,
                        waiting.len(),
                        if s.verify_sent_ns.is_some() {
                            " (verifying every byte)"
                        } else {
                            ""
                        }
                    )
                })
            });
            if let Some(m) = msg {
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
        if v["state"] == "committed" {
            eprintln!(
                "  sync {version}: committed in {total_s:.2} s (writes landed in {land_s:.2} s: {gbps:.2} GB/s, {:.2}x one TCP stream), verified: {}",
                gbps / tcp_gbps,
                v["verified"]
            );
        } else {
            eprintln!("  sync {version}: {} : {}", v["state"], v["failure"]);
            failed.push(version);
        }
        results.push(v);
    }

    let committed: Vec<&Value> = results
        .iter()
        .filter(|v| v["state"] == "committed")
        .collect();
    let verified = !committed.is_empty()
        && failed.is_empty()
        && committed.iter().all(|v| v["verified"] == true);
    let secs: Vec<f64> = results
        .iter()
        .map(|v| v["stages"]["total_ms"].as_f64().unwrap_or(0.0) / 1e3)
        .collect();
    let transfer: Vec<f64> = results
        .iter()
        .map(|v| v["stages"]["land_ms"].as_f64().unwrap_or(0.0) / 1e3)
        .collect();
    let gbps: Vec<f64> = results
        .iter()
        .map(|v| v["gbps"].as_f64().unwrap_or(0.0))
        .collect();
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len().max(1) as f64;
    let bytes_per_sync = results
        .first()
        .and_then(|v| v["bytes"].as_u64())
        .unwrap_or(0);
    let summary = json!({
        "model": world.model,
        "train": world.train,
        "infer": world.infer,
        "dtype": dtype.name(),
        "trainers": trainers,
        "rollouts": rollouts,
        "syncs": args.syncs,
        "committed": committed.len(),
        "bytes_per_sync": bytes_per_sync,
        "seconds_per_sync": secs,
        "transfer_seconds_per_sync": transfer,
        "gbps_per_sync": gbps,
        "mean_seconds_per_sync": mean(&secs),
        "mean_gbps": mean(&gbps),
        "tcp_gbps": tcp_gbps,
        "ratio_vs_tcp": mean(&gbps) / tcp_gbps,
        "verified": verified,
        "dashboard": dashboard,
    });
    if args.json {
        println!("{summary}");
    } else {
        eprintln!(
            "\nsummary: {} of {} syncs committed and verified byte for byte; {:.1} MB per sync;\n  \
             {:.2} s per sync end to end, writes landed at {:.2} GB/s = {:.2}x one plain TCP stream ({tcp_gbps:.2} GB/s)",
            committed.len(),
            args.syncs,
            bytes_per_sync as f64 / 1e6,
            mean(&secs),
            mean(&gbps),
            mean(&gbps) / tcp_gbps,
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
    let _ = stop_tx.send(());
    let _ = server.await;
    tokio::task::block_in_place(|| workers.wait_all(Duration::from_secs(10)));
    drop(workers);
    if !failed.is_empty() || !verified {
        bail!("syncs {failed:?} failed; worker logs in {}", logs.display());
    }
    let _ = std::fs::remove_dir_all(&logs);
    Ok(())
}
