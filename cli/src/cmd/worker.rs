//! `weightsync worker trainer|rollout`: a worker agent beside one training rank or one
//! inference rank.
//!
//! Settings come from flags (or their `WEIGHTSYNC_*` env vars), then `--config FILE.toml` (same
//! keys), then the launcher's variables (torchrun `RANK`/`WORLD_SIZE`/`LOCAL_RANK`, Slurm
//! `SLURM_PROCID`/`SLURM_NTASKS`). The job token is read from `WEIGHTSYNC_JOB_TOKEN` only, never
//! from the command line (which other users can read in `ps`).

use std::path::PathBuf;

use anyhow::Context;
use weightsync_common::protocol::WorkerRole;

use weightsync_agent::config::{resolve, ResolvedWorker, WorkerSettings};
use weightsync_agent::rollout::RolloutDriver;
use weightsync_agent::run_agent;
use weightsync_agent::trainer::TrainerDriver;

/// Arguments of `weightsync worker`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// `trainer` (beside a training rank) or `rollout` (beside an inference rank).
    #[arg(value_parser = ["trainer", "rollout"])]
    pub role: String,
    /// TOML file with any of the settings below (flags win).
    #[arg(long, env = "WEIGHTSYNC_WORKER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Settings.
    #[command(flatten)]
    pub settings: WorkerSettings,
}

/// Runs `weightsync worker`.
pub fn run(args: Args) -> anyhow::Result<()> {
    crate::logging::init("info");
    let role: WorkerRole = args.role.parse().map_err(anyhow::Error::msg)?;
    let file = args
        .config
        .as_deref()
        .map(WorkerSettings::from_toml_file)
        .transpose()?;
    let token = std::env::var("WEIGHTSYNC_JOB_TOKEN").ok();
    let resolved = resolve(role, args.settings, file, &|k| std::env::var(k).ok(), token)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        match resolved {
            ResolvedWorker::Trainer(agent, cfg) => {
                let id = agent.id;
                let driver = TrainerDriver::new(cfg)
                    .await
                    .with_context(|| format!("starting {id}"))?;
                run_agent(agent, driver).await?;
            }
            ResolvedWorker::Rollout(agent, cfg) => {
                let id = agent.id;
                let driver = RolloutDriver::new(cfg)
                    .await
                    .with_context(|| format!("starting {id}"))?;
                run_agent(agent, driver).await?;
            }
        }
        anyhow::Ok(())
    })
}
