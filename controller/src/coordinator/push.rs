//! Pushed versions: in-process trainers say "my tensors hold version N" (`Push N`) instead of
//! an external driver calling `POST /v1/syncs`. The sync of N starts once every trainer of the
//! world pushed N and a sync can start (the plan is in force, no other sync runs); until then
//! the pushes wait, and every input that may unblock them (a message, a clock tick) tries again.
//! A push is idempotent like the HTTP trigger: a version already committed is answered with its
//! `Commit` at once, one running answers when it ends, and one that cannot be synced (not newer
//! than the last committed) with an `Abort` of sync 0 naming the reason.

use weightsync_common::protocol::{ToWorker, WorkerId, WorkerRole};

use super::version::Triggered;
use super::{Coordinator, Effects, Now};
use crate::sync_record::SyncState;

impl Coordinator {
    /// `Push N` from `id`.
    pub(super) fn on_push(&mut self, id: WorkerId, version: u64, now: Now) -> Effects {
        let mut fx = Effects::default();
        if id.role != WorkerRole::Trainer {
            tracing::warn!("{id} pushed version {version}, but only trainers push; ignored");
            return fx;
        }
        let existing = self
            .by_version
            .get(&version)
            .and_then(|sid| self.syncs.get(sid))
            .map(|s| (s.id, s.state));
        match existing {
            Some((sync_id, SyncState::Committed)) => {
                self.send_to(&mut fx, [id], |_| ToWorker::Commit { sync_id, version });
                return fx;
            }
            Some((_, SyncState::Pending | SyncState::Running)) => return fx,
            _ => {}
        }
        self.pushed.entry(version).or_default().insert(id);
        self.start_pushed(now)
    }

    /// Starts the sync of the oldest version every trainer pushed, when a sync can start.
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
            .find(|(_, by)| by.len() >= trainers)
            .map(|(v, _)| *v)
        else {
            return fx;
        };
        let pushers = self.pushed.remove(&version).unwrap_or_default();
        match self.trigger(version, now) {
            Ok((Triggered::Created(_), started)) => fx.merge(started),
            Ok((Triggered::Existing(sync_id), _)) => {
                let committed = self
                    .syncs
                    .get(&sync_id)
                    .is_some_and(|s| s.state == SyncState::Committed);
                if committed {
                    self.send_to(&mut fx, pushers, |_| ToWorker::Commit { sync_id, version });
                }
            }
            Err(e) => {
                let reason = format!("pushed version {version} cannot be synced: {e}");
                self.note(reason.clone(), now);
                self.send_to(&mut fx, pushers, |_| ToWorker::Abort {
                    sync_id: 0,
                    version,
                    reason: reason.clone(),
                    failure: None,
                });
            }
        }
        fx
    }
}
