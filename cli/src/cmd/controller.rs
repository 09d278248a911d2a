//! `weightsync controller`: the controller of one job, for real deployments.
//!
//! It serves the HTTP API and dashboard on `--http` and the workers' control channel on
//! `--control`, expects the workers the job's layouts imply, plans once they are all registered,
//! and runs a sync whenever the training loop posts to `/v1/syncs`. Secrets come from the
//! environment (or the file each `_FILE` variable names), never the command line:
//! `WEIGHTSYNC_TRAINER_TOKEN` and `WEIGHTSYNC_ENGINE_TOKEN` (one per worker role; either falls
//! back to `WEIGHTSYNC_JOB_TOKEN`, one secret for both), `WEIGHTSYNC_API_TOKEN` (mutating HTTP
//! calls) and optionally `WEIGHTSYNC_READ_TOKEN` (then the views need a token too); see
//! `docs/security.md`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use serde::Deserialize;
use weightsync_common::DType;
use weightsync_common::protocol::WorldSpec;

use weightsync_controller::{
    AppState, ControllerConfig, ControllerSecrets, DeltaMode, SchedulesPlanner,
};

/// `delta` in the TOML file: `"auto"`, `"on"`, `"off"`, or `true` / `false` (what it took
/// before it had modes).
fn delta_mode<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<DeltaMode>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Given {
        Flag(bool),
        Mode(String),
    }
    Ok(Some(match Given::deserialize(d)? {
        Given::Flag(true) => DeltaMode::On,
        Given::Flag(false) => DeltaMode::Off,
        Given::Mode(m) => m.parse().map_err(serde::de::Error::custom)?,
    }))
}

/// Arguments of `weightsync controller` (the TOML file takes the same keys).
#[derive(Debug, Clone, Default, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// HTTP API and dashboard address [default: 127.0.0.1:8080].
    #[arg(long, env = "WEIGHTSYNC_HTTP")]
    pub http: Option<String>,
    /// Control-channel address workers connect to [default: 127.0.0.1:7070].
    #[arg(long, env = "WEIGHTSYNC_CONTROL")]
    pub control: Option<String>,
    /// Model preset or config.json path.
    #[arg(long)]
    pub model: Option<String>,
    /// Training layout, e.g. fsdp=4.
    #[arg(long)]
    pub train: Option<String>,
    /// Inference layout, e.g. tp=2,dp=2.
    #[arg(long)]
    pub infer: Option<String>,
    /// Inference dtype: bf16 or fp8 [default: bf16].
    #[arg(long)]
    pub dtype: Option<String>,
    /// Verify checksums of what landed [default: true].
    #[arg(long)]
    pub verify: Option<bool>,
    /// A worker silent this long fails the running sync [default: 5000].
    #[arg(long)]
    pub heartbeat_timeout_ms: Option<u64>,
    /// A sync not committed within this fails [default: 300].
    #[arg(long)]
    pub sync_timeout_s: Option<u64>,
    /// Syncs kept in history [default: 200].
    #[arg(long)]
    pub history: Option<usize>,
    /// Delta syncs: send engines only what changed since the version they hold. `auto` offers
    /// deltas while a measured delta sync beats the last full one (probing again every 16 full
    /// syncs), `on` always, `off` never; `--delta` alone means `on`. Under auto and on, trainers
    /// keep the bytes they last wrote (host memory: their share of the inference weights) and
    /// engines register an inbox (a quarter of their weights' bytes); needs verification on
    /// (see docs/delta.md) [default: auto].
    #[arg(
        long,
        env = "WEIGHTSYNC_DELTA",
        num_args = 0..=1,
        default_missing_value = "on",
        value_name = "auto|on|off"
    )]
    #[serde(default, deserialize_with = "delta_mode")]
    pub delta: Option<DeltaMode>,
    /// Force full syncs, whatever `delta` says (e.g. over a config file): like `--delta=off`
    /// [default: false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub full_syncs: Option<bool>,
    /// File that keeps what must survive the controller's own crash (the run, the last
    /// committed version, the next sync id): a restarted controller carries on from it, so
    /// epochs never repeat and engines never go back. Written atomically [default: none].
    #[arg(long, env = "WEIGHTSYNC_STATE_FILE")]
    pub state_file: Option<PathBuf>,
    /// TLS on the control channel and the HTTP API: the controller's certificate chain (PEM);
    /// with --tls-key and --tls-ca, or none of the three (plain TCP, for loopback and tests).
    #[arg(long, env = "WEIGHTSYNC_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// TLS: the key of --tls-cert (PEM).
    #[arg(long, env = "WEIGHTSYNC_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// TLS: the CA that signs the workers' client certificates (PEM); a worker without one is
    /// refused before it can prove a secret.
    #[arg(long, env = "WEIGHTSYNC_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// TLS: certificate revocation list(s) of that CA (PEM `X509 CRL`); a worker whose
    /// certificate it lists is refused. Read at start [default: none].
    #[arg(long, env = "WEIGHTSYNC_TLS_CRL")]
    pub tls_crl: Option<PathBuf>,
}

/// Arguments of `weightsync controller`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// TOML file with any of the settings (flags win).
    #[arg(long, env = "WEIGHTSYNC_CONTROLLER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Settings.
    #[command(flatten)]
    pub settings: Settings,
}

/// Runs `weightsync controller`.
pub fn run(args: Args) -> anyhow::Result<()> {
    crate::logging::init("info");
    let file: Settings = match &args.config {
        Some(p) => toml::from_str(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        )
        .with_context(|| format!("parsing {}", p.display()))?,
        None => Settings::default(),
    };
    let s = args.settings;
    let need = |a: Option<String>, b: Option<String>, what: &str| {
        a.or(b).with_context(|| format!("{what} is required"))
    };
    let world = WorldSpec {
        model: need(s.model, file.model, "--model")?,
        train: need(s.train, file.train, "--train")?,
        infer: need(s.infer, file.infer, "--infer")?,
        dtype: s
            .dtype
            .or(file.dtype)
            .as_deref()
            .unwrap_or("bf16")
            .parse::<DType>()
            .map_err(anyhow::Error::msg)?,
        verify: s.verify.or(file.verify).unwrap_or(true),
    };
    match weightsync_common::open_files::raise_open_file_limit() {
        Ok(n) => tracing::info!("open-file limit {n}"),
        Err(e) => tracing::warn!("cannot raise the open-file limit: {e}"),
    }
    let secrets = ControllerSecrets::from_env(&|k| std::env::var(k).ok())?;
    for warning in secrets.warnings() {
        tracing::warn!("{warning}");
    }
    let mut cfg = ControllerConfig::for_job(
        world,
        secrets.trainer.clone(),
        secrets.api.clone(),
        Duration::from_millis(
            s.heartbeat_timeout_ms
                .or(file.heartbeat_timeout_ms)
                .unwrap_or(5000),
        ),
        Duration::from_secs(s.sync_timeout_s.or(file.sync_timeout_s).unwrap_or(300)),
        s.history.or(file.history).unwrap_or(200),
    )?;
    let full_syncs = s.full_syncs.or(file.full_syncs).unwrap_or(false);
    cfg.delta = if full_syncs {
        DeltaMode::Off
    } else {
        s.delta.or(file.delta).unwrap_or_default()
    };
    tracing::info!("delta syncs: {}", cfg.delta);
    cfg.state_file = s.state_file.or(file.state_file);
    let tls = weightsync_common::tls::TlsFiles::from_parts_with_crl(
        s.tls_cert.or(file.tls_cert),
        s.tls_key.or(file.tls_key),
        s.tls_ca.or(file.tls_ca),
        s.tls_crl.or(file.tls_crl),
    )?;
    cfg.tls = tls
        .map(|files| weightsync_common::tls::TlsServer::new(&files))
        .transpose()?;
    cfg.secrets = secrets;
    let http = s
        .http
        .or(file.http)
        .unwrap_or_else(|| "127.0.0.1:8080".into());
    let control = s
        .control
        .or(file.control)
        .unwrap_or_else(|| "127.0.0.1:7070".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let h = tokio::net::TcpListener::bind(&http)
            .await
            .with_context(|| format!("binding the HTTP address {http}"))?;
        let c = tokio::net::TcpListener::bind(&control)
            .await
            .with_context(|| format!("binding the control address {control}"))?;
        tracing::info!(
            "controller for {} trainers and {} rollouts: dashboard http://{}/ , workers connect to {}",
            cfg.coordinator.trainers,
            cfg.coordinator.rollouts,
            h.local_addr()?,
            c.local_addr()?
        );
        let state = AppState::open(cfg, Box::new(SchedulesPlanner))?;
        weightsync_controller::run(h, c, state, stop_signal()?)
        .await?;
        anyhow::Ok(())
    })
}

/// Resolves on Ctrl-C or SIGTERM (what Kubernetes and Slurm send), so either stops the
/// controller cleanly.
fn stop_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    Ok(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupted: stopping"),
            _ = term.recv() => tracing::info!("SIGTERM: stopping"),
        }
    })
}
