//! `weightsync demo`: the whole system on one machine, as a newcomer first sees it.
//!
//! It starts a controller (in this process) and one worker *process* per training rank and per
//! inference rank (this same binary, `weightsync worker ...`, on loopback), then acts as a
//! training loop: for each version it waits for the trainers to hold that version's weights,
//! posts `{"version": N}` to the HTTP API and waits for the sync to commit.
//!
//! What it prints is the truth about weightsync alone. Each sync line is the controller's
//! measure (trigger to commit) beside two yardsticks measured in the same run: the fabric limit
//! (this job's bytes between its pairs over the same fabric, nothing else) and one plain TCP
//! stream. What the demo adds to a job happens between syncs and is reported on its own line:
//! the trainers write the next version's weights after a commit (as an optimizer step would),
//! and every rollout recomputes every byte it holds from the seed and compares (the independent
//! check, `weightsync-demo`), in parallel, piece by piece. The dashboard keeps serving until
//! Ctrl-C (`--exit` stops).
//!
//! # Layout
//! - `workers`: the worker processes and the wait until the plan is in force.
//! - `yardsticks`: one plain TCP stream, and the fabric limit.
//! - `syncs`: the training loop and the per-sync lines.
//! - `summary`: the `--json` object and the closing lines.

mod summary;
mod syncs;
mod throwaway_ca;
mod workers;
mod yardsticks;

use std::time::Duration;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use weightsync_common::DType;
use weightsync_common::protocol::WorldSpec;

use weightsync_controller::{AppState, ControllerConfig, SchedulesPlanner};

/// The demo's own model name, written out as [`DEMO_MODEL_CONFIG`] for the workers.
const DEMO_MODEL: &str = "qwen3-demo";

/// `qwen3-demo`: Qwen3-0.6B's attention and MLP shapes (hidden 1024, 16 query heads and 8 KV
/// heads of 128, MLP 3072), 4 layers instead of 28, a vocabulary of 16384 instead of 151936.
const DEMO_MODEL_CONFIG: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
  "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 4,
  "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
  "vocab_size": 16384, "tie_word_embeddings": false
}"#;

/// Arguments of `weightsync demo`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model: a preset (qwen3-0.6b, qwen3-8b, ...), a config.json path, or the default
    /// `qwen3-demo`, a Qwen3 of 0.1B parameters shaped like the real ones (fp8 blocks, tp
    /// slicing, fused projections) but small enough that the whole demo, with its independent
    /// check, runs in well under 30 s on two cores.
    #[arg(long, default_value = DEMO_MODEL)]
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
    /// The independent check compares one piece in N of each version but the last (a different
    /// piece each version), and every byte of the last; 1 compares every byte of every version.
    #[arg(long, default_value_t = 4)]
    pub check_sample: u32,
    /// Skip the demo's independent check (every landed byte recomputed from the seed after each
    /// commit, outside the sync); the trainers' checksums are verified either way.
    #[arg(long)]
    pub no_recompute: bool,
    /// Run the control channel and the HTTP API over mutual TLS, with a CA made for this run
    /// (its PEM files in the run's log folder; the dashboard is then https:// and signed by it).
    #[arg(long)]
    pub tls: bool,
}

fn random_token() -> String {
    let bytes: [u8; 16] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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
    // The fabric limit's fabrics live in this process; closing them after the measurement
    // resets their lanes, which a fabric logs as a warning. The workers log to their own files.
    crate::logging::init("warn,weightsync_common::fabric=error");
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
    /// `--tls`: the throwaway CA's certificates.
    tls: Option<throwaway_ca::DemoTls>,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn demo(args: Args) -> anyhow::Result<()> {
    let logs = std::env::temp_dir().join(format!("weightsync-demo-{}", std::process::id()));
    let progress = logs.join("progress");
    std::fs::create_dir_all(&progress)?;
    let ctl = start_controller(&args, &logs).await?;
    let scheme = if ctl.tls.is_some() { "https" } else { "http" };
    let dashboard = format!("{scheme}://{}/", ctl.http_addr);
    let w = &ctl.world;
    eprintln!(
        "weightsync demo: {} ({} weights), {} trainers [{}] -> {} rollouts [{}]\n  dashboard: {dashboard}",
        if args.model == DEMO_MODEL {
            "qwen3-demo (Qwen3-0.6B's layer shapes, 4 layers, 0.1B parameters; --model qwen3-0.6b for the real one)"
        } else {
            &args.model
        },
        w.dtype,
        ctl.trainers,
        w.train,
        ctl.rollouts,
        w.infer
    );
    let mut workers = workers::spawn_workers(&args, &ctl, &logs, &progress)?;
    workers::wait_planned(&ctl, &mut workers, &logs).await?;
    let yardsticks = yardsticks::Yardsticks {
        tcp_gbps: yardsticks::measure_tcp().await?,
        fabric_gbps: yardsticks::measure_fabric_limit(&ctl.world, args.lanes).await?,
    };
    let results = syncs::run_syncs(&args, &ctl, &mut workers, &progress, yardsticks).await?;
    let (summary, verified) = summary::summarise(&args, &ctl, &results, yardsticks, &dashboard);
    if args.json {
        println!("{summary}");
    }
    summary::print(&args, &summary, &results);
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
    if !verified {
        let failed: Vec<u64> = results
            .iter()
            .filter(|r| r.view["state"] != "committed")
            .map(|r| r.version)
            .collect();
        bail!(
            "not every sync committed verified (failed: {failed:?}; see the lines above); worker logs in {}",
            logs.display()
        );
    }
    let _ = std::fs::remove_dir_all(&logs);
    Ok(())
}

/// Serves a controller for the demo's job on loopback (the dashboard on `--http`, or a free port
/// if that is taken).
async fn start_controller(args: &Args, logs: &std::path::Path) -> anyhow::Result<ServedDemo> {
    let model = if args.model == DEMO_MODEL {
        let path = logs.join(format!("{DEMO_MODEL}.json"));
        std::fs::write(&path, DEMO_MODEL_CONFIG)?;
        path.display().to_string()
    } else {
        args.model.clone()
    };
    let dtype: DType = args.dtype.parse().map_err(anyhow::Error::msg)?;
    let world = WorldSpec {
        model,
        train: args.train.clone(),
        infer: args.infer.clone(),
        dtype,
        verify: true,
    };
    let (job_token, api_token) = (random_token(), random_token());
    let mut cfg = ControllerConfig::for_job(
        world.clone(),
        job_token.clone().into(),
        api_token.clone().into(),
        Duration::from_secs(10),
        Duration::from_secs(600),
        200,
    )?;
    cfg.shutdown_workers = true;
    let tls = args
        .tls
        .then(|| throwaway_ca::make(logs))
        .transpose()
        .context("making the demo's throwaway CA")?;
    if let Some(t) = &tls {
        eprintln!(
            "TLS: control channel and HTTP API over mutual TLS, throwaway CA {}",
            t.worker.ca.display()
        );
        cfg.tls = Some(t.server.clone());
    }
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
        tls,
        stop,
        server,
    })
}
