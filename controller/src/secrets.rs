//! The controller's credentials, one per role, and what each one allows.
//!
//! - **trainer**: registers a trainer rank (and so learns every engine's rkeys and commits
//!   versions); a compromised inference host must not hold it.
//! - **rollout** (engine): registers an engine rank; it never lets its holder register as a
//!   trainer (the proof is bound to the role, see `weightsync_common::protocol::auth`).
//! - **api**: the bearer token of mutating HTTP calls (triggering a sync).
//! - **read** (optional): when set, the dashboard, the JSON views and `/metrics` need it (or the
//!   API token); when unset they are open, as before. `/healthz` is always open.
//!
//! One secret for both worker roles (the job token of earlier versions) still works, and the
//! controller says at start that it gives every worker both roles.

use weightsync_common::protocol::WorkerRole;
use weightsync_common::secret::{Secret, SecretError};

/// The variable of the trainers' secret.
pub const TRAINER_VAR: &str = "WEIGHTSYNC_TRAINER_TOKEN";
/// The variable of the engines' (rollouts') secret.
pub const ENGINE_VAR: &str = "WEIGHTSYNC_ENGINE_TOKEN";
/// The variable of the one secret of both worker roles, where no role has its own.
pub const JOB_VAR: &str = "WEIGHTSYNC_JOB_TOKEN";
/// The variable of the API token.
pub const API_VAR: &str = "WEIGHTSYNC_API_TOKEN";
/// The variable of the optional read-only token.
pub const READ_VAR: &str = "WEIGHTSYNC_READ_TOKEN";

/// The credentials the controller checks.
#[derive(Debug, Clone)]
pub struct ControllerSecrets {
    /// Workers registering as trainers prove this.
    pub trainer: Secret,
    /// Workers registering as rollouts (engines) prove this.
    pub rollout: Secret,
    /// Bearer token of the mutating HTTP endpoints.
    pub api: Secret,
    /// Bearer token of the read-only views, when they are not open.
    pub read: Option<Secret>,
}

impl ControllerSecrets {
    /// One secret for both worker roles (the job token), and the API token.
    pub fn shared(job: Secret, api: Secret) -> Self {
        ControllerSecrets {
            trainer: job.clone(),
            rollout: job,
            api,
            read: None,
        }
    }

    /// Reads the secrets as an operator gives them (each variable, or the file its `_FILE`
    /// names; each at least [`weightsync_common::secret::MIN_SECRET_LEN`] characters):
    /// [`TRAINER_VAR`] and [`ENGINE_VAR`], each falling back to [`JOB_VAR`]; [`API_VAR`]
    /// (required); [`READ_VAR`] (optional).
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, SecretError> {
        let job = Secret::from_env_or_file(JOB_VAR, env)?;
        let role = |var: &str| -> Result<Secret, SecretError> {
            match Secret::from_env_or_file(var, env)? {
                Some(s) => Ok(s),
                None => job.clone().ok_or_else(|| SecretError::Missing {
                    name: format!("{var} (or {JOB_VAR} for both roles)"),
                }),
            }
        };
        Ok(ControllerSecrets {
            trainer: role(TRAINER_VAR)?,
            rollout: role(ENGINE_VAR)?,
            api: Secret::required(API_VAR, env)?,
            read: Secret::from_env_or_file(READ_VAR, env)?,
        })
    }

    /// The secret a worker of `role` proves.
    pub fn for_role(&self, role: WorkerRole) -> &Secret {
        match role {
            WorkerRole::Trainer => &self.trainer,
            WorkerRole::Rollout => &self.rollout,
        }
    }

    /// Whether the two worker roles share one secret (then any worker may take either role).
    pub fn roles_shared(&self) -> bool {
        self.trainer.same_as(&self.rollout)
    }

    /// What an operator should hear about these secrets at start (warnings), if anything.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.roles_shared() {
            out.push(
                "trainers and engines share one secret: an engine host can register as a trainer \
                 (set WEIGHTSYNC_TRAINER_TOKEN and WEIGHTSYNC_ENGINE_TOKEN for one per role)"
                    .into(),
            );
        }
        if self.api.same_as(&self.trainer) || self.api.same_as(&self.rollout) {
            out.push("the API token equals a worker secret: every worker can trigger syncs".into());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn from_env_takes_role_secrets_over_the_job_token_and_names_what_is_missing() {
        let long = |c: &str| c.repeat(20);
        let mut m: HashMap<&str, String> = HashMap::new();
        fn env(m: &HashMap<&str, String>) -> impl Fn(&str) -> Option<String> + use<> {
            let m: HashMap<String, String> =
                m.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
            move |k| m.get(k).cloned()
        }
        let err = ControllerSecrets::from_env(&env(&m)).unwrap_err();
        assert!(err.to_string().contains(TRAINER_VAR), "{err}");
        m.insert(JOB_VAR, long("j"));
        let err = ControllerSecrets::from_env(&env(&m)).unwrap_err();
        assert!(err.to_string().contains(API_VAR), "{err}");
        m.insert(API_VAR, long("a"));
        let s = ControllerSecrets::from_env(&env(&m)).unwrap();
        assert!(s.roles_shared() && s.read.is_none());
        m.insert(ENGINE_VAR, long("e"));
        m.insert(READ_VAR, long("r"));
        let s = ControllerSecrets::from_env(&env(&m)).unwrap();
        assert_eq!(s.trainer.expose(), long("j"));
        assert_eq!(s.rollout.expose(), long("e"));
        assert!(s.read.is_some() && !s.roles_shared());
        m.insert(TRAINER_VAR, "short".into());
        let err = ControllerSecrets::from_env(&env(&m)).unwrap_err();
        assert!(matches!(err, SecretError::TooShort { .. }), "{err}");
    }

    #[test]
    fn shared_secrets_warn_and_role_secrets_do_not() {
        let s = ControllerSecrets::shared("j".repeat(20).into(), "a".repeat(20).into());
        assert!(s.roles_shared());
        assert_eq!(s.warnings().len(), 1);
        let s = ControllerSecrets {
            trainer: "t".repeat(20).into(),
            rollout: "r".repeat(20).into(),
            api: "a".repeat(20).into(),
            read: None,
        };
        assert!(s.warnings().is_empty());
        assert_eq!(s.for_role(WorkerRole::Trainer).expose(), "t".repeat(20));
        assert!(!format!("{s:?}").contains("tttt"));
    }
}
