//! Worker configuration from flags, environment variables and a TOML file.
//!
//! Precedence: a flag (or its `WEIGHTSYNC_*` env var) beats the TOML file, which beats the
//! launcher's variables, which beat defaults. The flags themselves are the CLI's (`weightsync
//! worker` derives them and converts them into [`WorkerSettings`]): this crate is embedded in
//! engines and the Python package, which have their own ways of being told. Launchers already say who a process is:
//! torchrun sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`; Slurm sets `SLURM_PROCID`, `SLURM_NTASKS`.
//! A trainer launched beside a training rank takes its rank from them, and a world size that
//! contradicts the job's training layout is refused at start rather than at the first sync.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use weightsync_common::DType;
use weightsync_common::fabric::{FabricConfig, JobToken};
use weightsync_common::protocol::{WorkerId, WorkerRole, WorldSpec};
use weightsync_common::secret::Secret;
use weightsync_common::tls::{TlsClient, TlsFiles};

use crate::control::AgentConfig;
use crate::rollout::RolloutDriverConfig;
use crate::trainer::{SourceSpec, TrainerDriverConfig};

/// The environment variable that turns same-host pulls off (`false`) for a worker, and for the
/// Python package's trainers and engines.
pub const SAME_HOST_ENV: &str = "WEIGHTSYNC_SAME_HOST";

/// Reads [`SAME_HOST_ENV`]: `None` when unset, else true (`true`, `1`, `yes`, `on`) or false
/// (`false`, `0`, `no`, `off`), as the worker's flag reads it; anything else is an error naming
/// the variable.
pub fn same_host_from_env() -> Result<Option<bool>, ConfigError> {
    same_host_from(std::env::var(SAME_HOST_ENV).ok())
}

fn same_host_from(value: Option<String>) -> Result<Option<bool>, ConfigError> {
    match value {
        None => Ok(None),
        Some(v) => match v.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(Some(true)),
            "false" | "0" | "no" | "off" => Ok(Some(false)),
            _ => Err(ConfigError(format!(
                "{SAME_HOST_ENV} is {v:?}: say true or false"
            ))),
        },
    }
}

/// Everything a worker can be told, each optional (the TOML file has the same keys).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSettings {
    /// Controller's control-channel address, host:port.
    pub controller: Option<String>,
    /// Rank (training rank, or global inference rank). Default: RANK / SLURM_PROCID.
    pub rank: Option<u32>,
    /// Model preset or config.json path.
    pub model: Option<String>,
    /// Training layout, e.g. fsdp=4.
    pub train: Option<String>,
    /// Inference layout, e.g. tp=2,dp=2.
    pub infer: Option<String>,
    /// Inference dtype: bf16 or fp8.
    pub dtype: Option<String>,
    /// Verify checksums of what landed (true/false).
    pub verify: Option<bool>,
    /// Fabric listen address (the address peers write to), e.g. 10.0.0.5:0.
    pub fabric_listen: Option<String>,
    /// Fabric lanes (connections / QPs) per peer.
    pub lanes: Option<usize>,
    /// Same-host pulls (true/false, default true): a fabric peer on this machine copies large
    /// frames out of the writer's memory itself, once, instead of through the sockets.
    pub same_host: Option<bool>,
    /// Trainer: staging watermark in MiB.
    pub watermark_mib: Option<u64>,
    /// Trainer: where the weights are: `shm:/dev/shm/FILE` or `safetensors:PATH`.
    pub source: Option<String>,
    /// Rollout: seconds to wait for a version to land once armed.
    pub land_timeout_s: Option<u64>,
    /// Keep trying to reach the controller for this many seconds.
    pub reconnect_s: Option<u64>,
    /// Host name to report (default: $HOSTNAME).
    pub host: Option<String>,
    /// TLS: this worker's client certificate (PEM); with `tls_key` and `tls_ca`, or none of
    /// them (plain TCP). Default: `WEIGHTSYNC_TLS_CERT`.
    pub tls_cert: Option<PathBuf>,
    /// TLS: the key of `tls_cert`. Default: `WEIGHTSYNC_TLS_KEY`.
    pub tls_key: Option<PathBuf>,
    /// TLS: the CA the controller's certificate must chain to. Default: `WEIGHTSYNC_TLS_CA`.
    pub tls_ca: Option<PathBuf>,
    /// TLS: the CA's certificate revocation list(s): a controller certificate listed there is
    /// refused. Default: `WEIGHTSYNC_TLS_CRL`, else none.
    pub tls_crl: Option<PathBuf>,
    /// TLS: the name expected in the controller's certificate (default: the controller
    /// address's host; `WEIGHTSYNC_TLS_SERVER_NAME`).
    pub tls_server_name: Option<String>,
}

impl WorkerSettings {
    /// Fills unset fields from `other`.
    pub fn or(self, other: WorkerSettings) -> WorkerSettings {
        WorkerSettings {
            controller: self.controller.or(other.controller),
            rank: self.rank.or(other.rank),
            model: self.model.or(other.model),
            train: self.train.or(other.train),
            infer: self.infer.or(other.infer),
            dtype: self.dtype.or(other.dtype),
            verify: self.verify.or(other.verify),
            fabric_listen: self.fabric_listen.or(other.fabric_listen),
            lanes: self.lanes.or(other.lanes),
            same_host: self.same_host.or(other.same_host),
            watermark_mib: self.watermark_mib.or(other.watermark_mib),
            source: self.source.or(other.source),
            land_timeout_s: self.land_timeout_s.or(other.land_timeout_s),
            reconnect_s: self.reconnect_s.or(other.reconnect_s),
            host: self.host.or(other.host),
            tls_cert: self.tls_cert.or(other.tls_cert),
            tls_key: self.tls_key.or(other.tls_key),
            tls_ca: self.tls_ca.or(other.tls_ca),
            tls_crl: self.tls_crl.or(other.tls_crl),
            tls_server_name: self.tls_server_name.or(other.tls_server_name),
        }
    }

    /// Reads a TOML file of the same keys.
    pub fn from_toml_file(path: &std::path::Path) -> Result<WorkerSettings, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| ConfigError(format!("{}: {e}", path.display())))
    }
}

/// A configuration that cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
#[error("worker configuration: {0}")]
pub struct ConfigError(pub String);

/// The variable that holds the secret of `role`'s workers.
pub fn role_secret_variable(role: WorkerRole) -> &'static str {
    match role {
        WorkerRole::Trainer => "WEIGHTSYNC_TRAINER_TOKEN",
        WorkerRole::Rollout => "WEIGHTSYNC_ENGINE_TOKEN",
    }
}

/// The secret a worker of `role` proves to the controller, from an environment lookup:
/// `WEIGHTSYNC_TRAINER_TOKEN` or `WEIGHTSYNC_ENGINE_TOKEN` (or the file their `_FILE` names),
/// else the one job token `WEIGHTSYNC_JOB_TOKEN` (or `_FILE`). `Ok(None)` when none is set.
pub fn role_secret(
    role: WorkerRole,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Secret>, ConfigError> {
    let err = |e: weightsync_common::secret::SecretError| ConfigError(e.to_string());
    match Secret::from_env_or_file(role_secret_variable(role), env).map_err(err)? {
        Some(s) => Ok(Some(s)),
        None => Secret::from_env_or_file("WEIGHTSYNC_JOB_TOKEN", env).map_err(err),
    }
}

/// The fabric's secret: `WEIGHTSYNC_FABRIC_TOKEN` (or `_FILE`) when set, else `control` (the
/// worker's own secret, right when one secret serves both roles). With one secret per role,
/// trainers and engines must share a fabric token, since each lane proves it both ways: a
/// worker given a role variable and no fabric token is refused, naming both.
pub fn fabric_secret(
    env: &dyn Fn(&str) -> Option<String>,
    control: &Secret,
) -> Result<Secret, ConfigError> {
    if let Some(s) =
        Secret::from_env_or_file(FABRIC_VAR, env).map_err(|e| ConfigError(e.to_string()))?
    {
        return Ok(s);
    }
    let set = |k: &str| env(k).is_some_and(|v| !v.is_empty());
    let role_vars = [WorkerRole::Trainer, WorkerRole::Rollout].map(role_secret_variable);
    if let Some(var) = role_vars
        .iter()
        .find(|v| set(v) || set(&format!("{v}_FILE")))
    {
        return Err(ConfigError(format!(
            "{var} is set but {FABRIC_VAR} is not: with one secret per role, trainers and \
             engines need a fabric secret they share (set {FABRIC_VAR} or {FABRIC_VAR}_FILE)"
        )));
    }
    Ok(control.clone())
}

/// The worker's TLS to the controller: the settings' `tls_*` files, each else its
/// `WEIGHTSYNC_TLS_*` variable; `None` (plain TCP) when none is given; an error naming the one
/// missing, or the file that cannot be used.
pub fn tls_client(
    s: &WorkerSettings,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<TlsClient>, ConfigError> {
    use weightsync_common::tls;
    let var = |k: &str| env(k).filter(|v| !v.is_empty());
    let err = |e: tls::TlsError| ConfigError(e.to_string());
    let files = TlsFiles::from_parts_with_crl(
        s.tls_cert
            .clone()
            .or_else(|| var(tls::CERT_VAR).map(PathBuf::from)),
        s.tls_key
            .clone()
            .or_else(|| var(tls::KEY_VAR).map(PathBuf::from)),
        s.tls_ca
            .clone()
            .or_else(|| var(tls::CA_VAR).map(PathBuf::from)),
        s.tls_crl
            .clone()
            .or_else(|| var(tls::CRL_VAR).map(PathBuf::from)),
    )
    .map_err(err)?;
    let Some(files) = files else {
        return Ok(None);
    };
    let name = s
        .tls_server_name
        .clone()
        .or_else(|| var(tls::SERVER_NAME_VAR));
    TlsClient::new(&files, name.as_deref())
        .map(Some)
        .map_err(err)
}

/// The variable of the fabric's secret.
pub const FABRIC_VAR: &str = "WEIGHTSYNC_FABRIC_TOKEN";

/// Reads a launcher's rank and world size from an environment lookup.
pub fn launcher_rank(
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(Option<u32>, Option<u32>), ConfigError> {
    let num = |k: &str| -> Result<Option<u32>, ConfigError> {
        env(k)
            .map(|v| {
                v.trim()
                    .parse::<u32>()
                    .map_err(|_| ConfigError(format!("{k}={v:?} is not a number")))
            })
            .transpose()
    };
    let rank = match num("RANK")? {
        Some(r) => Some(r),
        None => num("SLURM_PROCID")?,
    };
    let world = match num("WORLD_SIZE")? {
        Some(w) => Some(w),
        None => num("SLURM_NTASKS")?,
    };
    Ok((rank, world))
}

/// A fully resolved worker.
#[derive(Debug, Clone)]
pub enum ResolvedWorker {
    /// A trainer.
    Trainer(AgentConfig, TrainerDriverConfig),
    /// A rollout.
    Rollout(AgentConfig, RolloutDriverConfig),
}

/// Resolves settings for `role`: flags first, then the TOML file, then launcher variables. A
/// trainer reads its weights from the `source` setting.
pub fn resolve(
    role: WorkerRole,
    flags: WorkerSettings,
    file: Option<WorkerSettings>,
    env: &dyn Fn(&str) -> Option<String>,
    job_token: Option<Secret>,
) -> Result<ResolvedWorker, ConfigError> {
    resolve_with_source(
        role,
        flags.or(file.unwrap_or_default()),
        env,
        job_token,
        None,
    )
}

/// [`resolve`] for settings already merged, a trainer's weights coming from `source` when it
/// is given (a program's own [`SourceSpec::Provided`]), else from the `source` setting.
pub fn resolve_with_source(
    role: WorkerRole,
    s: WorkerSettings,
    env: &dyn Fn(&str) -> Option<String>,
    job_token: Option<Secret>,
    source: Option<SourceSpec>,
) -> Result<ResolvedWorker, ConfigError> {
    let need =
        |v: Option<String>, what: &str| v.ok_or_else(|| ConfigError(format!("{what} is required")));
    let (env_rank, env_world) = launcher_rank(env)?;
    let rank = s.rank.or(env_rank).ok_or_else(|| {
        ConfigError("no rank: pass --rank, set WEIGHTSYNC_RANK, or launch with torchrun (RANK) or Slurm (SLURM_PROCID)".into())
    })?;
    let job_token = job_token.filter(|t| !t.is_empty()).ok_or_else(|| {
        ConfigError(format!(
            "no secret: set {} (or WEIGHTSYNC_JOB_TOKEN when one secret serves both roles)",
            role_secret_variable(role)
        ))
    })?;
    let tls = tls_client(&s, env)?;
    // With TLS the controller hands out the fabric key ([`crate::learn_job`]): no shared fabric
    // token is needed.
    let fabric_token = match fabric_secret(env, &job_token) {
        Ok(t) => t,
        Err(_) if tls.is_some() => job_token.clone(),
        Err(e) => return Err(e),
    };
    let dtype: DType = s
        .dtype
        .as_deref()
        .unwrap_or("bf16")
        .parse()
        .map_err(ConfigError)?;
    let world = WorldSpec {
        model: need(s.model, "--model")?,
        train: need(s.train, "--train")?,
        infer: need(s.infer, "--infer")?,
        dtype,
        verify: s.verify.unwrap_or(true),
    };
    let (trainers, rollouts) =
        weightsync_schedules::job::world_size(&world).map_err(|e| ConfigError(e.to_string()))?;
    let expected = match role {
        WorkerRole::Trainer => trainers,
        WorkerRole::Rollout => rollouts,
    };
    if rank >= expected {
        return Err(ConfigError(format!(
            "{role} rank {rank} is outside the job's {expected} {role}s"
        )));
    }
    if role == WorkerRole::Trainer
        && let Some(w) = env_world.filter(|_| s.rank.is_none())
        && w != trainers
    {
        return Err(ConfigError(format!(
            "the launcher's world size is {w} but the training layout {} has {trainers} ranks",
            world.train
        )));
    }
    let mut fabric = FabricConfig::loopback(fabric_token.expose(), s.lanes.unwrap_or(2));
    if let Some(l) = s.fabric_listen {
        fabric.listen = l;
    }
    if let Some(on) = s.same_host {
        fabric.same_host = on;
    }
    let host = s
        .host
        .or_else(|| env("HOSTNAME"))
        .unwrap_or_else(|| "localhost".into());
    let host = match env("LOCAL_RANK") {
        Some(l) => format!("{host}/local{l}"),
        None => host,
    };
    let agent = AgentConfig {
        controller: need(s.controller, "--controller")?,
        job_token: job_token.clone(),
        id: WorkerId { role, rank },
        host,
        world: world.clone(),
        reconnect_for: Duration::from_secs(s.reconnect_s.unwrap_or(60)),
        max_frame: crate::AGENT_MAX_FRAME,
        tls,
    };
    fabric.job_token = JobToken(fabric_token.expose().to_string());
    Ok(match role {
        WorkerRole::Trainer => {
            let source = match (source, s.source.as_deref()) {
                (Some(given), _) => given,
                (None, Some(text)) => parse_source(text)?,
                (None, None) => {
                    return Err(ConfigError(
                        "a trainer needs a source: --source shm:PATH or safetensors:PATH".into(),
                    ));
                }
            };
            ResolvedWorker::Trainer(
                agent,
                TrainerDriverConfig {
                    world,
                    rank,
                    fabric,
                    watermark_bytes: s.watermark_mib.unwrap_or(256) << 20,
                    source,
                },
            )
        }
        WorkerRole::Rollout => ResolvedWorker::Rollout(
            agent,
            RolloutDriverConfig {
                world,
                rank,
                fabric,
                land_timeout: Duration::from_secs(s.land_timeout_s.unwrap_or(120)),
            },
        ),
    })
}

/// Parses `shm:PATH` or `safetensors:PATH`.
pub fn parse_source(s: &str) -> Result<SourceSpec, ConfigError> {
    let (kind, rest) = s.split_once(':').unwrap_or((s, ""));
    match kind {
        "shm" if !rest.is_empty() => Ok(SourceSpec::Shm(PathBuf::from(rest))),
        "safetensors" if !rest.is_empty() => Ok(SourceSpec::Safetensors(PathBuf::from(rest))),
        _ => Err(ConfigError(format!(
            "bad --source {s:?}: expected shm:PATH or safetensors:PATH"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_secrets_fall_back_to_the_job_token_and_need_a_fabric_token() {
        let m = |pairs: &[(&str, &str)]| {
            let v: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            move |k: &str| v.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        };
        let job = m(&[("WEIGHTSYNC_JOB_TOKEN", "job-token-0123456789")]);
        let s = role_secret(WorkerRole::Rollout, &job).unwrap().unwrap();
        assert_eq!(s.expose(), "job-token-0123456789");
        assert_eq!(fabric_secret(&job, &s).unwrap(), s);
        let roles = m(&[
            ("WEIGHTSYNC_JOB_TOKEN", "job-token-0123456789"),
            ("WEIGHTSYNC_ENGINE_TOKEN", "engine-token-0123456789"),
        ]);
        let s = role_secret(WorkerRole::Rollout, &roles).unwrap().unwrap();
        assert_eq!(s.expose(), "engine-token-0123456789");
        let err = fabric_secret(&roles, &s).unwrap_err().to_string();
        assert!(
            err.contains("WEIGHTSYNC_ENGINE_TOKEN is set but WEIGHTSYNC_FABRIC_TOKEN is not"),
            "{err}"
        );
        let short = m(&[("WEIGHTSYNC_TRAINER_TOKEN", "short")]);
        let err = role_secret(WorkerRole::Trainer, &short)
            .unwrap_err()
            .to_string();
        assert!(err.contains("at least 16"), "{err}");
    }

    #[test]
    fn tls_files_come_from_settings_or_env_all_three_or_none() {
        let none = |_: &str| None;
        assert!(
            tls_client(&WorkerSettings::default(), &none)
                .unwrap()
                .is_none()
        );
        // The certificate from TOML, the CA from the environment, no key: named.
        let partial = WorkerSettings {
            tls_cert: Some("/etc/ws/worker.pem".into()),
            ..Default::default()
        };
        let ca = |k: &str| (k == "WEIGHTSYNC_TLS_CA").then(|| "/etc/ws/ca.pem".to_string());
        let err = tls_client(&partial, &ca).unwrap_err().to_string();
        assert!(err.contains("WEIGHTSYNC_TLS_KEY"), "{err}");
        // All three given: a missing file is named.
        let all = WorkerSettings {
            tls_key: Some("/etc/ws/worker-key.pem".into()),
            ..partial
        };
        let err = tls_client(&all, &ca).unwrap_err().to_string();
        assert!(err.contains("/etc/ws/"), "{err}");
        // A CRL alone (from TOML) is refused naming it, not ignored.
        let crl_only = WorkerSettings {
            tls_crl: Some("/etc/ws/crl.pem".into()),
            ..Default::default()
        };
        let err = tls_client(&crl_only, &none).unwrap_err().to_string();
        assert!(err.contains("/etc/ws/crl.pem"), "{err}");
        // With TLS, per-role secrets need no fabric secret (the controller hands out the key).
        let env = |k: &str| match k {
            "WEIGHTSYNC_TRAINER_TOKEN" => Some("trainer-token-0123456789".to_string()),
            _ => None,
        };
        let plain = resolve(
            WorkerRole::Trainer,
            WorkerSettings {
                rank: Some(0),
                ..flags()
            },
            None,
            &env,
            Some("trainer-token-0123456789".into()),
        );
        assert!(
            plain
                .unwrap_err()
                .to_string()
                .contains("WEIGHTSYNC_FABRIC_TOKEN")
        );
    }

    fn flags() -> WorkerSettings {
        WorkerSettings {
            controller: Some("127.0.0.1:7000".into()),
            model: Some("qwen3-0.6b".into()),
            train: Some("fsdp=4".into()),
            infer: Some("tp=2,dp=2".into()),
            dtype: Some("fp8".into()),
            source: Some("shm:/dev/shm/weights".into()),
            ..Default::default()
        }
    }

    #[test]
    fn rank_comes_from_torchrun_or_slurm_and_world_size_is_checked() {
        let torchrun = |k: &str| match k {
            "RANK" => Some("3".to_string()),
            "WORLD_SIZE" => Some("4".to_string()),
            "LOCAL_RANK" => Some("1".to_string()),
            _ => None,
        };
        let r = resolve(
            WorkerRole::Trainer,
            flags(),
            None,
            &torchrun,
            Some("t".into()),
        )
        .unwrap();
        let ResolvedWorker::Trainer(a, _) = r else {
            panic!()
        };
        assert_eq!(a.id, WorkerId::trainer(3));
        assert!(a.host.ends_with("/local1"));
        let slurm = |k: &str| match k {
            "SLURM_PROCID" => Some("2".to_string()),
            "SLURM_NTASKS" => Some("8".to_string()),
            _ => None,
        };
        let e = resolve(WorkerRole::Trainer, flags(), None, &slurm, Some("t".into())).unwrap_err();
        assert!(e.0.contains("world size is 8"), "{e}");
    }

    #[test]
    fn flags_beat_the_file_and_missing_things_are_named() {
        let file: WorkerSettings = toml::from_str(
            "controller = \"10.0.0.1:7000\"\nrank = 1\nmodel = \"qwen3-0.6b\"\ntrain = \"fsdp=4\"\ninfer = \"tp=2,dp=2\"\nsource = \"shm:/dev/shm/w\"\n",
        )
        .unwrap();
        let f = WorkerSettings {
            rank: Some(2),
            ..Default::default()
        };
        let r = resolve(
            WorkerRole::Rollout,
            f,
            Some(file),
            &|_| None,
            Some("t".into()),
        )
        .unwrap();
        let ResolvedWorker::Rollout(a, _) = r else {
            panic!()
        };
        assert_eq!(a.id, WorkerId::rollout(2));
        assert_eq!(a.controller, "10.0.0.1:7000");
        let e = resolve(
            WorkerRole::Trainer,
            WorkerSettings::default(),
            None,
            &|_| None,
            Some("t".into()),
        )
        .unwrap_err();
        assert!(e.0.contains("rank"), "{e}");
        let e = resolve(WorkerRole::Trainer, flags(), None, &|_| None, None).unwrap_err();
        assert!(e.0.contains("rank") || e.0.contains("token"), "{e}");
        assert!(toml::from_str::<WorkerSettings>("bogus = 1").is_err());
        assert!(parse_source("nfs:/x").is_err());
        assert!(
            parse_source("demo:5").is_err(),
            "the demo's source is the CLI's"
        );
        let no_source = WorkerSettings {
            rank: Some(0),
            source: None,
            ..flags()
        };
        let e = resolve(
            WorkerRole::Trainer,
            no_source,
            None,
            &|_| None,
            Some("t".into()),
        )
        .unwrap_err();
        assert!(e.0.contains("source"), "{e}");
    }

    #[test]
    fn same_host_pulls_are_on_unless_turned_off_and_bad_values_are_named() {
        let resolved = |settings: WorkerSettings| match resolve(
            WorkerRole::Trainer,
            settings,
            None,
            &|_| None,
            Some("t".into()),
        )
        .unwrap()
        {
            ResolvedWorker::Trainer(_, c) => c.fabric.same_host,
            ResolvedWorker::Rollout(..) => unreachable!("asked for a trainer"),
        };
        let ranked = WorkerSettings {
            rank: Some(0),
            ..flags()
        };
        assert!(resolved(ranked.clone()));
        let off = WorkerSettings {
            same_host: Some(false),
            ..ranked
        };
        assert!(!resolved(off));
        let file: WorkerSettings = toml::from_str("same_host = false").unwrap();
        assert_eq!(file.same_host, Some(false));
        assert_eq!(same_host_from(None).unwrap(), None);
        assert_eq!(same_host_from(Some("0".into())).unwrap(), Some(false));
        assert_eq!(same_host_from(Some(" TRUE ".into())).unwrap(), Some(true));
        assert_eq!(same_host_from(Some("off".into())).unwrap(), Some(false));
        let e = same_host_from(Some("maybe".into())).unwrap_err();
        assert!(e.0.contains(SAME_HOST_ENV) && e.0.contains("maybe"), "{e}");
    }
}
