//! Pushed versions and runs: in-process trainers say "my tensors hold version N of run R"
//! (`Push N`) instead of an external driver calling `POST /v1/syncs`.
//!
//! Versions are bound to bytes: a push is a statement about the memory of the process that made
//! it, so it is kept with the connection it came on and dropped when that connection goes or its
//! worker registers again (a restarted rank's push never completes a version with its
//! predecessor's). The sync of N starts once every trainer of the world pushed N on its current
//! connection and a sync can start (the plan is in force, no other sync runs). The *newest*
//! fully-pushed version starts: older pending versions can no longer be what the trainers hold,
//! so they end as superseded (an `Abort` of sync 0 whose failure kind is `superseded`: not an
//! error, the embedding's `wait()` returns an outcome that says so). A trainer's own push of N
//! replaces its other pending pushes at once (they end superseded: its tensors no longer hold
//! them), whatever becomes of N.
//!
//! A push is idempotent like the HTTP trigger: the newest committed version is answered with its
//! `Commit` at once, one running answers when it ends, and one not newer than the last committed
//! in the run with an `Abort` of sync 0 of kind `stale`.
//!
//! Runs: a job restarted from a checkpoint declares a new run (a push with a newer run, or
//! `POST /v1/runs`); versions then compare within it, so they may restart below the last
//! committed one, while the committed `(run, version)` still only grows. A push of an older run
//! is superseded.

use weightsync_common::protocol::{Failure, FailureKind, ToWorker, WorkerId, WorkerRole};

use super::version::Triggered;
use super::{ConnId, Coordinator, Effects, Now};
use crate::sync_record::SyncState;

/// Why a new run was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    /// Runs only grow.
    #[error("run {requested} is not newer than the current run {current}")]
    NotNewer {
        /// Asked for.
        requested: u64,
        /// The job's run.
        current: u64,
    },
}

impl Coordinator {
    /// `Push N` of `run` from `id` on `conn`.
    pub(super) fn on_push(
        &mut self,
        id: WorkerId,
        conn: ConnId,
        version: u64,
        run: u64,
        now: Now,
    ) -> Effects {
        let mut fx = Effects::default();
        if id.role != WorkerRole::Trainer {
            tracing::warn!("{id} pushed version {version}, but only trainers push; ignored");
            return fx;
        }
        // Whatever this trainer pushed before, its tensors now hold this version instead.
        self.replace_pushes_of(id, version, &mut fx);
        if run < self.run {
            let cause = format!(
                "version {version} of run {run} superseded: the job is in run {}",
                self.run
            );
            self.send_to(&mut fx, [id], |w| {
                abort0(w, version, FailureKind::Superseded, &cause)
            });
            return fx;
        }
        if run > self.run {
            // Cannot fail: the run is newer.
            fx.merge(self.begin_run(run, now).unwrap_or_default());
        }
        let existing = self
            .by_version
            .get(&version)
            .and_then(|sid| self.syncs.get(sid))
            .filter(|s| s.run == self.run)
            .map(|s| (s.id, s.state));
        match existing {
            // Only the newest committed version is what the engines hold: a push of an older
            // committed one (a trainer restarted from an older checkpoint) is stale below.
            Some((sync_id, SyncState::Committed)) if self.latest_in_run() == Some(version) => {
                let run = self.run;
                self.send_to(&mut fx, [id], |_| ToWorker::Commit {
                    sync_id,
                    version,
                    run,
                });
                return fx;
            }
            Some((_, SyncState::Pending | SyncState::Running)) => return fx,
            _ => {}
        }
        if let Some(latest) = self.latest_in_run()
            && version <= latest
        {
            let cause = format!(
                "pushed version {version} is not newer than version {latest}, committed in run \
                 {}: a job restarted from an older checkpoint declares a new run",
                self.run
            );
            self.note(cause.clone(), now);
            self.send_to(&mut fx, [id], |w| {
                abort0(w, version, FailureKind::Stale, &cause)
            });
            return fx;
        }
        self.pushed.entry(version).or_default().insert(id, conn);
        fx.merge(self.start_pushed(now));
        fx
    }

    /// `POST /v1/runs` (or a push of a newer run): the job's run becomes `run`. Pending pushes of
    /// the old run end superseded; the running sync, if any, ends as it would (its
    /// `(run, version)` is older than anything of the new run).
    pub fn begin_run(&mut self, run: u64, now: Now) -> Result<Effects, RunError> {
        if run <= self.run {
            return Err(RunError::NotNewer {
                requested: run,
                current: self.run,
            });
        }
        let mut fx = Effects::default();
        let old = std::mem::replace(&mut self.run, run);
        for (version, by) in std::mem::take(&mut self.pushed) {
            let cause = format!("version {version} of run {old} superseded by run {run}");
            self.send_to(&mut fx, by.into_keys(), |w| {
                abort0(w, version, FailureKind::Superseded, &cause)
            });
        }
        // Versions restart: a version of the new run is not the sync of the old one's (not even
        // the running one's: it ends as it would, but a push or trigger of its version in the
        // new run is a new sync).
        self.by_version.clear();
        self.note(
            format!(
                "run {run} begins (was {old}); last committed {}",
                self.latest_committed.map_or_else(
                    || "nothing".to_string(),
                    |(r, v)| format!("run {r} version {v}")
                )
            ),
            now,
        );
        fx.persist = true;
        Ok(fx)
    }

    /// Ends every pending push of `id` but of `version` as superseded: its tensors hold `version`
    /// now (a newer version, or an older one pushed again: either way not what it pushed).
    fn replace_pushes_of(&mut self, id: WorkerId, version: u64, fx: &mut Effects) {
        let replaced: Vec<u64> = self
            .pushed
            .iter()
            .filter(|(v, by)| **v != version && by.contains_key(&id))
            .map(|(v, _)| *v)
            .collect();
        for v in replaced {
            if let Some(by) = self.pushed.get_mut(&v) {
                by.remove(&id);
                if by.is_empty() {
                    self.pushed.remove(&v);
                }
            }
            let cause = format!("version {v} superseded by version {version}, pushed by {id}");
            self.send_to(fx, [id], |w| abort0(w, v, FailureKind::Superseded, &cause));
        }
    }

    /// Forgets every push `id` made (its connection went or it registered again).
    pub(super) fn drop_pushes_of(&mut self, id: WorkerId) {
        self.pushed.retain(|_, by| {
            by.remove(&id);
            !by.is_empty()
        });
    }

    /// Starts the sync of the newest version every trainer pushed, when a sync can start; older
    /// pending versions end superseded.
    pub(super) fn start_pushed(&mut self, now: Now) -> Effects {
        let mut fx = Effects::default();
        if !self.pushed.is_empty() && self.plan_failed() {
            return self.abort_pushed_without_plan();
        }
        if self.pushed.is_empty() || self.active.is_some() || !self.plan_valid() {
            return fx;
        }
        let trainers = self.cfg.trainers as usize;
        let Some(version) = self
            .pushed
            .iter()
            .rev()
            .find(|(_, by)| {
                by.len() >= trainers
                    && by
                        .iter()
                        .all(|(w, c)| self.members.get(w).is_some_and(|m| m.conn == *c))
            })
            .map(|(v, _)| *v)
        else {
            return fx;
        };
        let older: Vec<u64> = self.pushed.range(..version).map(|(v, _)| *v).collect();
        for v in older {
            let by = self.pushed.remove(&v).unwrap_or_default();
            let cause = format!("version {v} superseded by version {version}");
            self.send_to(&mut fx, by.into_keys(), |w| {
                abort0(w, v, FailureKind::Superseded, &cause)
            });
        }
        let pushers: Vec<WorkerId> = self
            .pushed
            .remove(&version)
            .unwrap_or_default()
            .into_keys()
            .collect();
        match self.trigger(version, now) {
            Ok((Triggered::Created(_), started)) => fx.merge(started),
            Ok((Triggered::Existing(sync_id), _)) => {
                let committed = self
                    .syncs
                    .get(&sync_id)
                    .is_some_and(|s| s.state == SyncState::Committed);
                if committed {
                    let run = self.run;
                    self.send_to(&mut fx, pushers, |_| ToWorker::Commit {
                        sync_id,
                        version,
                        run,
                    });
                }
            }
            Err(e) => {
                let kind = match e {
                    super::TriggerError::Stale { .. } => FailureKind::Stale,
                    _ => FailureKind::Other,
                };
                let reason = format!("pushed version {version} cannot be synced: {e}");
                self.note(reason.clone(), now);
                self.send_to(&mut fx, pushers, |w| abort0(w, version, kind, &reason));
            }
        }
        fx
    }
}

/// The `Abort` of sync 0 (no sync started) telling pusher `w` why `version` ends.
fn abort0(w: WorkerId, version: u64, kind: FailureKind, cause: &str) -> ToWorker {
    ToWorker::Abort {
        sync_id: 0,
        version,
        reason: cause.to_string(),
        failure: Some(Failure {
            worker: w,
            kind,
            tensor: None,
            cause: cause.to_string(),
        }),
    }
}
