//! `weightsync bench controller`: a real `weightsync controller` process under N simulated
//! workers that register over the control channel and heartbeat at the interval the controller
//! asks for, beside the same process idle.
//!
//! Why: the controller serves heartbeats, HTTP reads and its timeout clock from one state; at
//! thousands of workers a slow path there stalls `/healthz` (what orchestrators probe) or drops
//! workers whose heartbeats queue past the timeout. Reported: `/healthz` latency (p50, p99, max;
//! each request a fresh connection, sequential) idle and loaded, measured in the same run, and
//! their ratio; the controller's resident memory idle, loaded and at its peak; seconds until
//! every worker is registered; and how many are still registered at the end (none may be
//! dropped). Goal: loaded p99 under 50 ms at 2,000 workers.
//!
//! The job is sized so that it never completes (one trainer more than are simulated): nothing
//! is planned, so what is measured is registration and heartbeats alone.

mod fake_worker;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;
use weightsync_common::program::Program;

/// The loaded `/healthz` p99 goal, milliseconds.
pub const GOAL_P99_MS: f64 = 50.0;

/// What to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// The `weightsync` program (started as `controller`).
    pub exe: Program,
    /// Simulated workers (half trainers, half rollouts).
    pub workers: u32,
    /// Seconds of heartbeats measured once every worker is registered.
    pub seconds: f64,
}

/// Latency figures of one phase, milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Requests timed.
    pub samples: usize,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Slowest.
    pub max_ms: f64,
}

/// The result.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `"controller"`.
    pub bench: &'static str,
    /// Simulated workers.
    pub workers: u32,
    /// Heartbeat interval the controller asked for, ms.
    pub heartbeat_ms: u64,
    /// Seconds from the first connection until every worker was registered.
    pub registration_s: f64,
    /// Workers the controller listed at the end of the loaded phase.
    pub still_registered: usize,
    /// `/healthz` with no worker.
    pub healthz_idle: Latency,
    /// `/healthz` while every worker heartbeats.
    pub healthz_loaded: Latency,
    /// Loaded p99 over idle p99 (same run).
    pub p99_ratio: f64,
    /// Controller resident memory with no worker, KiB.
    pub rss_idle_kib: u64,
    /// Controller resident memory at the end of the loaded phase, KiB.
    pub rss_loaded_kib: u64,
    /// Controller peak resident memory (VmHWM), KiB.
    pub rss_peak_kib: u64,
    /// The goal, ms.
    pub goal_p99_ms: f64,
    /// Whether the loaded p99 is under the goal and no worker was dropped.
    pub meets_goal: bool,
}

impl Report {
    /// A few lines for a terminal.
    pub fn human(&self) -> String {
        let l = |x: &Latency| {
            format!(
                "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} requests)",
                x.p50_ms, x.p99_ms, x.max_ms, x.samples
            )
        };
        format!(
            "controller under {} simulated workers (heartbeat every {} ms)\n\
             registration: {:.2} s; still registered at the end: {}\n\
             /healthz idle:   {}\n/healthz loaded: {}\n\
             loaded/idle p99: {:.2}x; goal p99 < {} ms: {}\n\
             controller RSS: idle {} KiB, loaded {} KiB, peak {} KiB\n",
            self.workers,
            self.heartbeat_ms,
            self.registration_s,
            self.still_registered,
            l(&self.healthz_idle),
            l(&self.healthz_loaded),
            self.p99_ratio,
            self.goal_p99_ms,
            if self.meets_goal { "met" } else { "MISSED" },
            self.rss_idle_kib,
            self.rss_loaded_kib,
            self.rss_peak_kib
        )
    }
}

/// Kills the controller when the bench ends, however it ends.
struct Controller(Child);

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// Runs the bench.
pub fn run(cfg: &Config) -> anyhow::Result<Report> {
    if cfg.workers < 2 {
        bail!("--workers must be at least 2 (half trainers, half rollouts)");
    }
    if let Err(e) = weightsync_common::open_files::raise_open_file_limit() {
        tracing::warn!("cannot raise the open-file limit: {e}");
    }
    let rollouts = cfg.workers / 2;
    let trainers = cfg.workers - rollouts;
    let job = fake_worker::Job::new(trainers + 1, rollouts);
    let (http, control) = (free_addr()?, free_addr()?);
    let token = format!("bench-controller-{}", std::process::id());
    let mut cmd = cfg.exe.command();
    cmd.args(["controller", "--http", &http.to_string()])
        .args(["--control", &control.to_string()])
        .args(["--model", &job.world.model, "--train", &job.world.train])
        .args(["--infer", &job.world.infer, "--dtype", "bf16"])
        .env("WEIGHTSYNC_JOB_TOKEN", &token)
        .env("WEIGHTSYNC_API_TOKEN", format!("{token}-api"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let ctl = Controller(
        cmd.spawn()
            .with_context(|| format!("starting {}", cfg.exe))?,
    );
    let pid = ctl.0.id();
    let deadline = Instant::now() + Duration::from_secs(60);
    while get(http, "/healthz").is_err() {
        if Instant::now() > deadline {
            bail!("the controller never answered /healthz on {http}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }

    let samples = ((cfg.seconds * 100.0) as usize).clamp(100, 5000);
    let idle = time_healthz(http, samples, None)?;
    let rss_idle = vm_kib(pid, "VmRSS")?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let t0 = Instant::now();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<u64>();
    let ids = (0..trainers)
        .map(weightsync_common::protocol::WorkerId::trainer)
        .chain((0..rollouts).map(weightsync_common::protocol::WorkerId::rollout));
    let handshakes =
        std::sync::Arc::new(tokio::sync::Semaphore::new(fake_worker::HANDSHAKES_AT_ONCE));
    let (fail_tx, fail_rx) = std::sync::mpsc::channel::<String>();
    for id in ids {
        let (job, token, tx) = (job.clone(), token.clone(), ready_tx.clone());
        let (permits, fail) = (handshakes.clone(), fail_tx.clone());
        rt.spawn(async move {
            if let Err(e) = fake_worker::run(control, &job, &token, id, permits, tx).await {
                let _ = fail.send(format!("{id}: {e}"));
            }
        });
    }
    drop(ready_tx);
    let mut heartbeat_ms = 0;
    for _ in 0..cfg.workers {
        heartbeat_ms = match ready_rx.recv_timeout(Duration::from_secs(120)) {
            Ok(ms) => ms,
            Err(_) => match fail_rx.try_recv() {
                Ok(why) => bail!("a simulated worker failed: {why}"),
                Err(_) => bail!("a simulated worker never got its Welcome in 120 s"),
            },
        };
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while registered(http)? < cfg.workers as usize {
        if Instant::now() > deadline {
            bail!("the controller never listed all {} workers", cfg.workers);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let registration_s = t0.elapsed().as_secs_f64();

    let loaded = time_healthz(http, samples, Some(Duration::from_secs_f64(cfg.seconds)))?;
    let rss_loaded = vm_kib(pid, "VmRSS")?;
    let rss_peak = vm_kib(pid, "VmHWM")?;
    let still = registered(http)?;
    drop(ctl);
    rt.shutdown_timeout(Duration::from_secs(1));
    let p99_ratio = loaded.p99_ms / idle.p99_ms.max(1e-6);
    Ok(Report {
        bench: "controller",
        workers: cfg.workers,
        heartbeat_ms,
        registration_s,
        still_registered: still,
        meets_goal: loaded.p99_ms < GOAL_P99_MS && still == cfg.workers as usize,
        healthz_idle: idle,
        healthz_loaded: loaded,
        p99_ratio,
        rss_idle_kib: rss_idle,
        rss_loaded_kib: rss_loaded,
        rss_peak_kib: rss_peak,
        goal_p99_ms: GOAL_P99_MS,
    })
}

/// Times `samples` sequential `GET /healthz`, spread over `over` when given.
fn time_healthz(
    http: SocketAddr,
    samples: usize,
    over: Option<Duration>,
) -> anyhow::Result<Latency> {
    let gap = over.map_or(Duration::ZERO, |d| d / samples as u32);
    let mut ms = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        get(http, "/healthz")?;
        let took = t.elapsed();
        ms.push(took.as_secs_f64() * 1e3);
        if let Some(rest) = gap.checked_sub(took) {
            std::thread::sleep(rest);
        }
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 * q).ceil() as usize).clamp(1, ms.len()) - 1];
    Ok(Latency {
        samples,
        p50_ms: at(0.50),
        p99_ms: at(0.99),
        max_ms: at(1.0),
    })
}

/// `GET path` (a fresh connection): the body of a 200 answer.
fn get(http: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut s = TcpStream::connect_timeout(&http, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("a response without a header end")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("GET {path}: {}", head.lines().next().unwrap_or(""));
    }
    Ok(body.to_string())
}

/// Workers the controller lists.
fn registered(http: SocketAddr) -> anyhow::Result<usize> {
    let v: serde_json::Value = serde_json::from_str(&get(http, "/v1/workers")?)?;
    Ok(v["workers"].as_array().map_or(0, |a| a.len()))
}

/// A `/proc/PID/status` field in KiB.
fn vm_kib(pid: u32, field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}
