//! The version protocol's ends: a trigger creates a sync (or finds the one of that version), the
//! last report commits it (after verification, when on), and a failure fails it, aborts it
//! everywhere and, when trainers had started writing, closes the drain gate behind it.

use std::collections::{BTreeMap, BTreeSet};

use weightsync_common::protocol::{
    DeltaRecord, Failure, RunChecksum, ToWorker, WorkerId, WorkerRole,
};

use super::drain::Drain;
use super::{Coordinator, Effects, Now};
use crate::sync_record::{SyncRecord, SyncState};

/// Ended syncs whose full timeline (every span) is kept; older ones keep a summary.
pub const FULL_TIMELINES: usize = 8;

/// Result of a trigger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Triggered {
    /// A new sync was created.
    Created(u64),
    /// A sync for this version already exists (idempotent trigger).
    Existing(u64),
}

/// Why a trigger was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TriggerError {
    /// Another sync is running.
    #[error("sync {running} (version {version}) is still running")]
    Busy {
        /// Its id.
        running: u64,
        /// Its version.
        version: u64,
    },
    /// Not every worker has registered, or the plan is not (yet) in force.
    #[error("the world is not ready: {0}")]
    NotReady(String),
    /// The version is not newer than the last committed one of the run.
    #[error(
        "version {version} is not newer than the last committed version {latest} of this run \
         (a job restarted from an older checkpoint declares a new run: POST /v1/runs)"
    )]
    Stale {
        /// Requested.
        version: u64,
        /// Last committed.
        latest: u64,
    },
}

impl Coordinator {
    /// `POST /v1/syncs`: start a sync for `version` (idempotent per version, except that a
    /// failed version can be retried).
    pub fn trigger(
        &mut self,
        version: u64,
        now: Now,
    ) -> Result<(Triggered, Effects), TriggerError> {
        if let Some(&id) = self.by_version.get(&version) {
            // Idempotent while that sync is pending, running or committed; a failed version may
            // be retried with a new attempt.
            if self
                .syncs
                .get(&id)
                .is_some_and(|s| s.state != SyncState::Failed && s.run == self.run)
            {
                return Ok((Triggered::Existing(id), Effects::default()));
            }
        }
        if let Some(running) = self.active {
            let v = self.syncs.get(&running).map_or(0, |s| s.version);
            return Err(TriggerError::Busy {
                running,
                version: v,
            });
        }
        if !self.plan_valid() {
            return Err(TriggerError::NotReady(self.not_ready_reason()));
        }
        if let Some(latest) = self.latest_in_run()
            && version <= latest
        {
            return Err(TriggerError::Stale { version, latest });
        }
        let id = self.next_sync_id;
        self.next_sync_id += 1;
        let rec = self.new_sync(id, version, now);
        let mut fx = Effects {
            persist: true,
            ..Effects::default()
        };
        let run = self.run;
        if let Some(d) = &self.drain {
            tracing::info!(
                sync_id = id,
                version,
                "sync queued until the trainers of sync {} drained it",
                d.sync_id
            );
        } else {
            let everyone: Vec<WorkerId> = self.members.keys().copied().collect();
            self.send_to(&mut fx, everyone, |_| ToWorker::Prepare {
                sync_id: id,
                version,
                run,
            });
        }
        self.syncs.insert(id, rec);
        self.by_version.insert(version, id);
        self.active = Some(id);
        self.trim_history();
        tracing::info!(sync_id = id, version, "sync triggered");
        Ok((Triggered::Created(id), fx))
    }

    /// A new sync's record: every current member takes part; queued behind the drain gate if
    /// it is closed.
    fn new_sync(&self, id: u64, version: u64, now: Now) -> SyncRecord {
        let members: BTreeSet<WorkerId> = self.members.keys().copied().collect();
        let of_role = |role| {
            members
                .iter()
                .copied()
                .filter(|w: &WorkerId| w.role == role)
                .collect()
        };
        SyncRecord {
            id,
            version,
            run: self.run,
            plan_id: self.plan.as_ref().map_or(0, |p| p.id),
            state: SyncState::Pending,
            created_unix_ms: now.unix_ms,
            created: now.at,
            awaiting_prepared: members.clone(),
            awaiting_written: of_role(WorkerRole::Trainer),
            awaiting_landed: of_role(WorkerRole::Rollout),
            members,
            awaiting_verified: BTreeSet::new(),
            verify_sent_ns: None,
            prepare_sent_ns: 0,
            start_sent_ns: None,
            ended_ns: None,
            lanes: BTreeMap::new(),
            sent_checksums: Vec::new(),
            delta_base: None,
            sent_deltas: Vec::new(),
            delta: Default::default(),
            delta_apply_ns: 0,
            delta_policy: None,
            verified: None,
            failure: None,
            reported: None,
            queued_behind: self.drain.as_ref().map(|d| d.sync_id),
            awaiting_drain: self
                .drain
                .as_ref()
                .map(|d| d.waiting.clone())
                .unwrap_or_default(),
            drain_wait_ms: None,
        }
    }

    /// Keeps at most `history` syncs, and the full timeline only of the newest
    /// [`FULL_TIMELINES`] ended ones (older ones are summarised, see
    /// [`SyncRecord::summarise`]).
    fn trim_history(&mut self) {
        let ended: Vec<u64> = self
            .syncs
            .iter()
            .rev()
            .filter(|(_, s)| s.state.is_terminal())
            .skip(FULL_TIMELINES)
            .map(|(id, _)| *id)
            .collect();
        for id in ended.into_iter().take(FULL_TIMELINES) {
            if let Some(s) = self.syncs.get_mut(&id) {
                s.summarise();
            }
        }
        while self.syncs.len() > self.cfg.history.max(1) {
            let Some((&old, _)) = self.syncs.iter().next() else {
                return;
            };
            if let Some(s) = self.syncs.remove(&old)
                && self.by_version.get(&s.version) == Some(&old)
            {
                self.by_version.remove(&s.version);
            }
        }
    }

    /// Commits sync `sync_id` once every trainer wrote and every rollout landed, after sending
    /// `Verify` and collecting every `Verified` when verification is on.
    pub(super) fn maybe_commit(&mut self, sync_id: u64, now: Now) -> Effects {
        let verify = self.cfg.world.verify;
        let Some(s) = self.syncs.get_mut(&sync_id) else {
            return Effects::default();
        };
        if !(s.awaiting_written.is_empty() && s.awaiting_landed.is_empty()) {
            return Effects::default();
        }
        // Deltas are applied on `Verify` (they are offered only with verification on).
        let verify = verify || !s.sent_deltas.is_empty();
        if verify && s.verify_sent_ns.is_none() {
            return self.send_verify(sync_id, now);
        }
        if !s.awaiting_verified.is_empty() {
            return Effects::default();
        }
        if verify {
            s.verified = Some(true);
        }
        s.state = SyncState::Committed;
        s.ended_ns = Some(s.since(now.at));
        s.mark_critical();
        // What only verification needed, and the spans of old syncs, need not stay.
        s.sent_checksums = Vec::new();
        let (version, run, members) = (s.version, s.run, s.members.clone());
        let sample = Coordinator::delta_sample(s);
        self.delta_measured(sample);
        let committed = (run, version);
        self.latest_committed = Some(
            self.latest_committed
                .map_or(committed, |c| c.max(committed)),
        );
        self.engines_hold(committed, &members);
        self.active = None;
        let mut fx = Effects {
            persist: true,
            ..Effects::default()
        };
        self.send_to(&mut fx, members, |_| ToWorker::Commit {
            sync_id,
            version,
            run,
        });
        fx.finished.push(sync_id);
        tracing::info!(sync_id, version, "sync committed");
        fx
    }

    /// Every byte is in place: hands each rollout the trainers' checksums of its runs.
    fn send_verify(&mut self, sync_id: u64, now: Now) -> Effects {
        let mut fx = Effects::default();
        let Some(s) = self.syncs.get_mut(&sync_id) else {
            return fx;
        };
        s.verify_sent_ns = Some(s.since(now.at));
        s.awaiting_verified = s
            .members
            .iter()
            .copied()
            .filter(|w| w.role == WorkerRole::Rollout)
            .collect();
        let mut per_rollout: BTreeMap<u32, Vec<RunChecksum>> = BTreeMap::new();
        for c in &s.sent_checksums {
            per_rollout.entry(c.rollout).or_default().push(*c);
        }
        let mut deltas: BTreeMap<u32, Vec<DeltaRecord>> = BTreeMap::new();
        for d in &s.sent_deltas {
            deltas.entry(d.rollout).or_default().push(*d);
        }
        let (version, targets) = (s.version, s.awaiting_verified.clone());
        self.send_to(&mut fx, targets, |w| ToWorker::Verify {
            sync_id,
            version,
            checksums: per_rollout.get(&w.rank).cloned().unwrap_or_default(),
            deltas: deltas.get(&w.rank).cloned().unwrap_or_default(),
        });
        fx
    }

    /// Fails sync `sync_id`: everybody gets `Abort`, and when trainers had been told to write,
    /// the drain gate closes until they confirm they drained it.
    pub(super) fn fail(&mut self, sync_id: u64, failure: Failure, now: Now) -> Effects {
        let mut fx = Effects::default();
        let Some(s) = self.syncs.get_mut(&sync_id) else {
            return fx;
        };
        if s.state.is_terminal() {
            return fx;
        }
        tracing::warn!(sync_id, version = s.version, "sync failed: {failure}");
        s.state = SyncState::Failed;
        s.ended_ns = Some(s.since(now.at));
        s.mark_critical();
        let reason = failure.to_string();
        s.failure = Some(failure.clone());
        s.sent_checksums = Vec::new();
        let queued = s.queued_behind.take().is_some();
        s.awaiting_drain.clear();
        let (version, members, started) = (s.version, s.members.clone(), s.start_sent_ns.is_some());
        self.active = None;
        // Its engines may hold half a version: the next sync is full for them.
        self.engines_lost(&members);
        fx.finished.push(sync_id);
        if queued {
            // Never announced to anyone: nothing to abort, nothing to drain.
            return fx;
        }
        self.send_to(&mut fx, members.iter().copied(), |_| ToWorker::Abort {
            sync_id,
            version,
            reason: reason.clone(),
            failure: Some(failure.clone()),
        });
        // Trainers write only after `Start`: before it, nothing of this sync can be in flight.
        let writers: BTreeSet<WorkerId> = members
            .into_iter()
            .filter(|w| w.role == WorkerRole::Trainer && self.members.contains_key(w))
            .collect();
        if started && !writers.is_empty() {
            self.note(
                format!(
                    "sync {sync_id} failed after trainers started writing: the next sync waits \
                     until {} confirmed they drained it",
                    writers
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                now,
            );
            self.drain = Some(Drain {
                sync_id,
                waiting: writers,
                since: now.at,
            });
        }
        fx
    }
}
