//! The drain gate (rule 5 of the protocol): after a sync failed while trainers were writing, no
//! `Prepare` goes out until every such trainer still registered confirmed with `Drained` that
//! nothing of the failed sync can still land. A trigger meanwhile is queued and starts the
//! moment the gate opens (or fails, naming why, if membership or the plan changed meanwhile).

use std::collections::BTreeSet;
use std::time::Instant;

use weightsync_common::protocol::{Failure, FailureKind, ToWorker, WorkerId};

use super::{Coordinator, Effects, Now};

/// Trainers of an aborted sync that have not yet confirmed they drained it.
#[derive(Debug, Clone)]
pub(super) struct Drain {
    /// The aborted sync.
    pub sync_id: u64,
    /// Trainers still to report `Drained`.
    pub waiting: BTreeSet<WorkerId>,
    /// When the abort went out.
    pub since: Instant,
}

impl Coordinator {
    /// The aborted sync whose drain gates the next one, and the trainers still draining it.
    pub fn draining(&self) -> Option<(u64, Vec<WorkerId>)> {
        self.drain
            .as_ref()
            .map(|d| (d.sync_id, d.waiting.iter().copied().collect()))
    }

    /// `Drained` from `id` for the aborted sync `sync_id`.
    pub(super) fn on_drained(&mut self, id: WorkerId, sync_id: u64, now: Now) -> Effects {
        if self.drain.as_ref().is_none_or(|d| d.sync_id != sync_id) {
            return Effects::default();
        }
        self.drained_by(id, now)
    }

    /// `id` no longer holds anything of the drained sync (it drained, or it left): the last
    /// one opens the gate.
    pub(super) fn drained_by(&mut self, id: WorkerId, now: Now) -> Effects {
        let Some(d) = self.drain.as_mut() else {
            return Effects::default();
        };
        if !d.waiting.remove(&id) {
            return Effects::default();
        }
        let drained = d.waiting.is_empty();
        self.refresh_queued();
        if drained {
            self.end_drain(now)
        } else {
            Effects::default()
        }
    }

    /// Copies the drain gate's waiting set into the queued sync's record (for its status).
    fn refresh_queued(&mut self) {
        let waiting = self
            .drain
            .as_ref()
            .map(|d| d.waiting.clone())
            .unwrap_or_default();
        if let Some(s) = self.active.and_then(|id| self.syncs.get_mut(&id))
            && s.queued_behind.is_some()
        {
            s.awaiting_drain = waiting;
        }
    }

    /// Every trainer drained (or left): opens the gate and starts the queued sync, if any.
    fn end_drain(&mut self, now: Now) -> Effects {
        let Some(d) = self.drain.take() else {
            return Effects::default();
        };
        self.note(
            format!(
                "sync {} drained: no write of it can land any more",
                d.sync_id
            ),
            now,
        );
        self.dispatch_queued(now)
    }

    /// Sends `Prepare` for the queued sync (once the drain gate opened), or fails it when the
    /// world it was triggered for is gone.
    fn dispatch_queued(&mut self, now: Now) -> Effects {
        let mut fx = Effects::default();
        let Some(sid) = self.active else {
            return fx;
        };
        let Some(s) = self.syncs.get(&sid).filter(|s| s.queued_behind.is_some()) else {
            return fx;
        };
        let (members, planned) = (s.members.clone(), s.plan_id);
        let current: BTreeSet<WorkerId> = self.members.keys().copied().collect();
        let plan_id = self.plan.as_ref().map(|p| p.id);
        if !self.plan_valid() || current != members || plan_id != Some(planned) {
            let gone: Vec<String> = members
                .symmetric_difference(&current)
                .map(ToString::to_string)
                .collect();
            let failure = Failure {
                worker: members
                    .symmetric_difference(&current)
                    .next()
                    .copied()
                    .unwrap_or(WorkerId::trainer(0)),
                // A member that left is the likelier cause; a re-plan alone is no worker's.
                kind: if members.is_subset(&current) {
                    FailureKind::Other
                } else {
                    FailureKind::PeerLost
                },
                tensor: None,
                cause: format!(
                    "membership or plan changed while the sync waited for a drain ({})",
                    if gone.is_empty() {
                        "re-planned".to_string()
                    } else {
                        gone.join(", ")
                    }
                ),
            };
            return self.fail(sid, failure, now);
        }
        let Some(s) = self.syncs.get_mut(&sid) else {
            return fx;
        };
        s.queued_behind = None;
        s.awaiting_drain.clear();
        s.drain_wait_ms = Some(now.at.saturating_duration_since(s.created).as_secs_f64() * 1e3);
        // The sync starts now: its timeout and its timeline count from here.
        s.created = now.at;
        s.created_unix_ms = now.unix_ms;
        let (id, version, run) = (s.id, s.version, s.run);
        self.send_to(&mut fx, current, |_| ToWorker::Prepare {
            sync_id: id,
            version,
            run,
        });
        tracing::info!(sync_id = id, version, "queued sync started after the drain");
        fx
    }
}
