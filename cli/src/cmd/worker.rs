//! `weightsync worker trainer|rollout`: a worker agent beside one training rank or one
//! inference rank.
//!
//! Settings come from flags (or their `WEIGHTSYNC_*` env vars), then `--config FILE.toml` (same
//! keys), then the launcher's variables (torchrun `RANK`/`WORLD_SIZE`/`LOCAL_RANK`, Slurm
//! `SLURM_PROCID`/`SLURM_NTASKS`). The secret is read from the environment only (or the file a
//! `_FILE` variable names), never from the command line (which other users can read in `ps`):
//! `WEIGHTSYNC_TRAINER_TOKEN` or `WEIGHTSYNC_ENGINE_TOKEN` by role, else `WEIGHTSYNC_JOB_TOKEN`,
//! and `WEIGHTSYNC_FABRIC_TOKEN` with per-role secrets. The flags are this binary's
//! ([`WorkerFlags`]), converted into the agent's [`WorkerSettings`]; the demo's own (`--source
//! demo:SEED`, `--demo-check-seed`, `--demo-progress`) wrap the agent's drivers with
//! `weightsync-demo` and never reach the agent.

use std::path::PathBuf;

use anyhow::{Context, bail};
use weightsync_common::protocol::{WorkerId, WorkerRole};

use weightsync_agent::config::{
    ResolvedWorker, SAME_HOST_ENV, WorkerSettings, resolve_with_source,
};
use weightsync_agent::rollout::RolloutDriver;
use weightsync_agent::run_agent;
use weightsync_agent::trainer::{SourceSpec, TrainerDriver};
use weightsync_demo::check::{CheckPlan, CheckWhen, CheckedRollout, Coverage};
use weightsync_demo::progress::ProgressFile;
use weightsync_demo::source::{DemoSource, DemoTrainer};

/// Arguments of `weightsync worker`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// `trainer` (beside a training rank) or `rollout` (beside an inference rank).
    #[arg(value_parser = ["trainer", "rollout"])]
    pub role: String,
    /// TOML file with any of the settings below (flags win).
    #[arg(long, env = "WEIGHTSYNC_WORKER_CONFIG")]
    pub config: Option<PathBuf>,
    /// End this worker (SIGTERM) when the process that started it exits (Linux
    /// `PR_SET_PDEATHSIG`): for a sidecar started by its training rank, so that a rank killed
    /// with `kill -9` leaves no orphan holding its rank.
    #[arg(long, env = "WEIGHTSYNC_DIE_WITH_PARENT", value_parser = clap::builder::BoolishValueParser::new(), default_value_t = false)]
    pub die_with_parent: bool,
    /// Settings.
    #[command(flatten)]
    pub flags: WorkerFlags,
}

/// The worker's flags: the agent's settings, and the demo's.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerFlags {
    /// Controller's control-channel address, host:port.
    #[arg(long, env = "WEIGHTSYNC_CONTROLLER")]
    pub controller: Option<String>,
    /// Rank (training rank, or global inference rank). Default: RANK / SLURM_PROCID.
    #[arg(long, env = "WEIGHTSYNC_RANK")]
    pub rank: Option<u32>,
    /// Model preset or config.json path.
    #[arg(long)]
    pub model: Option<String>,
    /// Training layout, e.g. fsdp=4.
    #[arg(long)]
    pub train: Option<String>,
    /// Inference layout, e.g. tp=2,dp=2.
    #[arg(long)]
    pub infer: Option<String>,
    /// Inference dtype: bf16 or fp8.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Verify checksums of what landed (true/false).
    #[arg(long)]
    pub verify: Option<bool>,
    /// Fabric listen address (the address peers write to), e.g. 10.0.0.5:0.
    #[arg(long)]
    pub fabric_listen: Option<String>,
    /// Fabric lanes (connections / QPs) per peer.
    #[arg(long)]
    pub lanes: Option<usize>,
    /// Same-host pulls (true/false, default true): a fabric peer on this machine copies large
    /// frames out of the writer's memory itself, once, instead of through the sockets.
    #[arg(long, env = SAME_HOST_ENV, value_parser = clap::builder::BoolishValueParser::new())]
    pub same_host: Option<bool>,
    /// Trainer: staging watermark in MiB.
    #[arg(long)]
    pub watermark_mib: Option<u64>,
    /// Trainer: where the weights are: `shm:/dev/shm/FILE`, `safetensors:PATH`, or the demo's
    /// `demo:SEED` (generated, the next version written after each commit).
    #[arg(long)]
    pub source: Option<String>,
    /// Rollout: recompute every byte from this demo seed and compare (before each version
    /// commits, or after it with --demo-progress).
    #[arg(long)]
    pub demo_check_seed: Option<u64>,
    /// Rollout, with --demo-check-seed: compare one piece in N of each version (rotating, so N
    /// versions cover every piece); 1 compares every byte.
    #[arg(long, default_value_t = 1)]
    pub demo_check_sample: u32,
    /// Rollout, with --demo-check-seed: compare every byte of this version whatever the sample.
    #[arg(long)]
    pub demo_check_full_version: Option<u64>,
    /// Demo: do the demo's work (the next version's weights, the check) after each commit,
    /// outside the sync, and append what it did to DIR/<worker>.jsonl.
    #[arg(long)]
    pub demo_progress: Option<PathBuf>,
    /// Rollout: seconds to wait for a version to land once armed.
    #[arg(long)]
    pub land_timeout_s: Option<u64>,
    /// Keep trying to reach the controller for this many seconds.
    #[arg(long)]
    pub reconnect_s: Option<u64>,
    /// Host name to report (default: $HOSTNAME).
    #[arg(long)]
    pub host: Option<String>,
    /// TLS to the controller: this worker's client certificate (PEM); with --tls-key and
    /// --tls-ca, or none of the three (plain TCP, for loopback and tests).
    #[arg(long, env = "WEIGHTSYNC_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// TLS: the key of --tls-cert (PEM).
    #[arg(long, env = "WEIGHTSYNC_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// TLS: the CA the controller's certificate must chain to (PEM).
    #[arg(long, env = "WEIGHTSYNC_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// TLS: certificate revocation list(s) of that CA (PEM); refuses a controller whose
    /// certificate it lists [default: none].
    #[arg(long, env = "WEIGHTSYNC_TLS_CRL")]
    pub tls_crl: Option<PathBuf>,
    /// TLS: the name expected in the controller's certificate (default: the host of
    /// --controller).
    #[arg(long, env = "WEIGHTSYNC_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
}

impl From<WorkerFlags> for WorkerSettings {
    fn from(f: WorkerFlags) -> WorkerSettings {
        WorkerSettings {
            controller: f.controller,
            rank: f.rank,
            model: f.model,
            train: f.train,
            infer: f.infer,
            dtype: f.dtype,
            verify: f.verify,
            fabric_listen: f.fabric_listen,
            lanes: f.lanes,
            same_host: f.same_host,
            watermark_mib: f.watermark_mib,
            source: f.source,
            land_timeout_s: f.land_timeout_s,
            reconnect_s: f.reconnect_s,
            host: f.host,
            tls_cert: f.tls_cert,
            tls_key: f.tls_key,
            tls_ca: f.tls_ca,
            tls_crl: f.tls_crl,
            tls_server_name: f.tls_server_name,
        }
    }
}

/// The demo's part of a worker, taken out of its settings before the agent resolves them.
#[derive(Debug)]
struct DemoParts {
    /// `--source demo:SEED`.
    source_seed: Option<u64>,
    /// `--demo-check-seed`.
    check_seed: Option<u64>,
    /// `--demo-progress`.
    progress: Option<PathBuf>,
    /// `--demo-check-sample` and `--demo-check-full-version`.
    check_plan: CheckPlan,
}

/// Splits the demo's flags from the agent's settings (a `demo:` source may also come from the
/// TOML file's `source`).
fn split_demo(
    flags: WorkerFlags,
    file: Option<WorkerSettings>,
) -> anyhow::Result<(WorkerSettings, DemoParts)> {
    let mut demo = DemoParts {
        source_seed: None,
        check_seed: flags.demo_check_seed,
        progress: flags.demo_progress.clone(),
        check_plan: CheckPlan {
            coverage: Coverage::Sample {
                n: flags.demo_check_sample,
            },
            full_at: flags.demo_check_full_version,
        },
    };
    if flags.demo_check_sample == 0 {
        bail!("--demo-check-sample 0: say 1 to compare every byte, or N for one piece in N");
    }
    let mut settings = WorkerSettings::from(flags).or(file.unwrap_or_default());
    if let Some(rest) = settings
        .source
        .as_deref()
        .and_then(|s| s.strip_prefix("demo:"))
    {
        let seed = if rest.is_empty() {
            1
        } else {
            rest.parse()
                .with_context(|| format!("bad demo seed in --source demo:{rest}"))?
        };
        demo.source_seed = Some(seed);
        settings.source = None;
    } else if settings.source.as_deref() == Some("demo") {
        demo.source_seed = Some(1);
        settings.source = None;
    }
    Ok((settings, demo))
}

/// Runs `weightsync worker`.
pub fn run(args: Args) -> anyhow::Result<()> {
    crate::logging::init("info");
    if args.die_with_parent {
        crate::parent_death::die_with_parent()?;
    }
    let role: WorkerRole = args.role.parse().map_err(anyhow::Error::msg)?;
    let file = args
        .config
        .as_deref()
        .map(WorkerSettings::from_toml_file)
        .transpose()?;
    let (settings, demo) = split_demo(args.flags, file)?;
    if role == WorkerRole::Rollout && demo.source_seed.is_some() {
        bail!("--source is a trainer's setting, not a rollout's");
    }
    if role == WorkerRole::Trainer && demo.check_seed.is_some() {
        bail!("--demo-check-seed is a rollout's setting, not a trainer's");
    }
    let demo_source = demo.source_seed.map(DemoSource::new);
    if let Err(e) = weightsync_common::open_files::raise_open_file_limit() {
        tracing::warn!("cannot raise the open-file limit: {e}");
    }
    let token = weightsync_agent::config::role_secret(role, &|k| std::env::var(k).ok())?;
    let resolved = resolve_with_source(
        role,
        settings,
        &|k| std::env::var(k).ok(),
        token,
        demo_source
            .clone()
            .map(|s| SourceSpec::Provided(s as std::sync::Arc<_>)),
    )?;
    let progress = |id: WorkerId| {
        demo.progress
            .as_deref()
            .map(|dir| ProgressFile::new(dir, &id.to_string()))
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let mut resolved = resolved;
        let (agent, fabric) = match &mut resolved {
            ResolvedWorker::Trainer(agent, cfg) => (&*agent, &mut cfg.fabric),
            ResolvedWorker::Rollout(agent, cfg) => (&*agent, &mut cfg.fabric),
        };
        if agent.tls.is_some() {
            // With TLS the controller hands out the fabric key: learn it before the fabric
            // starts, so only peers that came through mutual TLS can open a lane to this one.
            let job = weightsync_agent::learn_job(agent).await?;
            if let Some(key) = job.fabric_key {
                fabric.job_token = key.token();
                tracing::info!(
                    "{}: fabric lanes keyed by the controller over TLS (payload not encrypted)",
                    agent.id
                );
            }
        } else {
            tracing::info!(
                "{}: plain TCP to the controller, no TLS (for loopback and tests)",
                agent.id
            );
        }
        match resolved {
            ResolvedWorker::Trainer(agent, cfg) => {
                let id = agent.id;
                let driver = TrainerDriver::new(cfg)
                    .await
                    .with_context(|| format!("starting {id}"))?;
                match demo_source {
                    Some(source) => {
                        let demo = DemoTrainer::new(driver, source, id.rank, progress(id));
                        run_agent(agent, demo).await?;
                    }
                    None => run_agent(agent, driver).await?,
                }
            }
            ResolvedWorker::Rollout(agent, cfg) => {
                let id = agent.id;
                let world = cfg.world.clone();
                let driver = RolloutDriver::new(cfg)
                    .await
                    .with_context(|| format!("starting {id}"))?;
                match demo.check_seed {
                    Some(seed) => {
                        let when =
                            progress(id).map_or(CheckWhen::BeforeCommit, CheckWhen::AfterCommit);
                        let checked = CheckedRollout::new(
                            driver,
                            &world,
                            id.rank,
                            seed,
                            when,
                            demo.check_plan,
                        )
                        .with_context(|| format!("starting {id}'s demo check"))?;
                        run_agent(agent, checked).await?;
                    }
                    None => run_agent(agent, driver).await?,
                }
            }
        }
        anyhow::Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        flags: WorkerFlags,
    }

    #[test]
    fn the_same_host_flag_reads_the_words_the_agents_variable_does() {
        for (word, on) in [("0", false), ("off", false), ("yes", true), ("true", true)] {
            let f = Flags::try_parse_from(["worker", "--same-host", word]).unwrap();
            assert_eq!(f.flags.same_host, Some(on), "{word}");
            let s = WorkerSettings::from(f.flags);
            assert_eq!(s.same_host, Some(on), "{word}");
        }
    }

    #[test]
    fn demo_flags_are_taken_out_before_the_agent_sees_them() {
        let f = Flags::try_parse_from([
            "worker",
            "--source",
            "demo:9",
            "--demo-check-seed",
            "4",
            "--demo-progress",
            "/tmp/p",
            "--rank",
            "2",
        ])
        .unwrap();
        let (s, demo) = split_demo(f.flags, None).unwrap();
        assert_eq!((demo.source_seed, demo.check_seed), (Some(9), Some(4)));
        assert_eq!(
            demo.progress.as_deref(),
            Some(std::path::Path::new("/tmp/p"))
        );
        assert_eq!((s.source, s.rank), (None, Some(2)));
        assert!(demo.check_plan.coverage.is_every() && demo.check_plan.full_at.is_none());
        let f = Flags::try_parse_from(["worker", "--demo-check-sample", "0"]).unwrap();
        assert!(split_demo(f.flags, None).is_err());
        // From the TOML file too; a real source passes through.
        let file: WorkerSettings = toml::from_str("source = \"demo:3\"").unwrap();
        let none = Flags::try_parse_from(["worker"]).unwrap().flags;
        let (s, demo) = split_demo(none, Some(file)).unwrap();
        assert_eq!((s.source, demo.source_seed), (None, Some(3)));
        let f = Flags::try_parse_from(["worker", "--source", "shm:/dev/shm/w"]).unwrap();
        let (s, demo) = split_demo(f.flags, None).unwrap();
        assert_eq!(
            (s.source.as_deref(), demo.source_seed),
            (Some("shm:/dev/shm/w"), None)
        );
        let f = Flags::try_parse_from(["worker", "--source", "demo:x"]).unwrap();
        assert!(split_demo(f.flags, None).is_err());
    }
}
