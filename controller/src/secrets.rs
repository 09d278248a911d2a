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
use weightsync_common::secret::Secret;

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
