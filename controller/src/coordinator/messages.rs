//! One handler per message a registered worker sends. A message about a sync other than the
//! running one (a late answer, a sync still queued behind a drain that nobody was told of) is
//! ignored; so is an answer the sync is not waiting for. (An engine's own stages may name an
//! ended sync: see `engine_stages`.)

use weightsync_common::protocol::{
    Failure, FailureKind, Fault, FromWorker, ToWorker, WorkerId, WorkerReport, WorkerRole,
};

use super::{ConnId, Coordinator, Effects, Now};
use crate::sync_record::{SyncRecord, SyncState};

impl Coordinator {
    /// A message from a registered connection.
    pub fn message(&mut self, conn: ConnId, msg: FromWorker, now: Now) -> Effects {
        let Some(id) = self.member_on(conn) else {
            return Effects::default();
        };
        if let Some(m) = self.members.get_mut(&id) {
            m.last_seen = m.last_seen.max(now.at);
        }
        let mut fx = self.handle(id, conn, msg, now);
        // Whatever this changed may let a pushed version start.
        fx.merge(self.start_pushed(now));
        fx
    }

    fn handle(&mut self, id: WorkerId, conn: ConnId, msg: FromWorker, now: Now) -> Effects {
        match msg {
            FromWorker::Heartbeat { seq } => Effects {
                send: vec![(conn, ToWorker::Heartbeat { seq })],
                ..Effects::default()
            },
            FromWorker::Hello { .. } | FromWorker::Register(_) => {
                let mut fx = self.disconnect(conn, "protocol error: registered twice", now);
                fx.close.push(conn);
                fx
            }
            FromWorker::Ready {
                plan_id,
                regions,
                tensors,
            } => self.on_ready(id, plan_id, regions, tensors, now),
            FromWorker::Drained { sync_id, .. } => self.on_drained(id, sync_id, now),
            FromWorker::Prepared {
                sync_id, report, ..
            } => self.on_prepared(id, sync_id, &report, now),
            FromWorker::Written {
                sync_id, report, ..
            } => self.on_written(id, sync_id, report, now),
            FromWorker::Landed {
                sync_id,
                verified,
                report,
                ..
            } => self.on_landed(id, sync_id, verified, &report, now),
            FromWorker::Verified {
                sync_id, report, ..
            } => self.on_verified(id, sync_id, &report, now),
            FromWorker::Failed {
                sync_id, failure, ..
            } => self.on_failed(id, sync_id, failure, now),
            FromWorker::Push { version, run } => self.on_push(id, conn, version, run, now),
            FromWorker::EngineStages {
                sync_id,
                version,
                events,
            } => self.on_engine_stages(id, sync_id, version, &events, now),
        }
    }

    /// The running sync `sync_id` (not one still queued behind a drain: nobody has heard of it).
    pub(super) fn active_sync(&mut self, sync_id: u64) -> Option<&mut SyncRecord> {
        if self.active != Some(sync_id) {
            return None;
        }
        self.syncs
            .get_mut(&sync_id)
            .filter(|s| s.queued_behind.is_none())
    }

    /// `Prepared`: the last one starts the sync (trainers get `Start`).
    fn on_prepared(
        &mut self,
        id: WorkerId,
        sync_id: u64,
        report: &WorkerReport,
        now: Now,
    ) -> Effects {
        let mut fx = Effects::default();
        let Some(s) = self.active_sync(sync_id) else {
            return fx;
        };
        if s.state != SyncState::Pending || !s.awaiting_prepared.remove(&id) {
            return fx;
        }
        let t = s.since(now.at);
        let origin = s.prepare_sent_ns;
        if !report.events.is_empty() {
            s.add_report(id, origin, report, t);
            // Preparation is not the worker's whole part: clear its done mark.
            if let Some(l) = s.lanes.get_mut(&id) {
                l.done_ns = None;
            }
        }
        if !s.awaiting_prepared.is_empty() {
            return fx;
        }
        s.state = SyncState::Running;
        s.start_sent_ns = Some(t);
        let (sid, version, run, members) = (s.id, s.version, s.run, s.members.clone());
        let trainers: Vec<WorkerId> = members
            .iter()
            .copied()
            .filter(|w| w.role == WorkerRole::Trainer)
            .collect();
        let (delta, decision) = self.delta_offer(run, &members);
        tracing::info!(sync_id = sid, version, "delta policy: {}", decision.reason);
        if let Some(s) = self.syncs.get_mut(&sync_id) {
            s.delta_base = delta.clone();
            s.delta_policy = Some((decision.kind, decision.reason));
        }
        self.send_to(&mut fx, trainers, |_| ToWorker::Start {
            sync_id: sid,
            version,
            delta: delta.clone(),
        });
        fx
    }

    /// `Written`: a trainer's part is done; its checksums are kept for verification.
    fn on_written(
        &mut self,
        id: WorkerId,
        sync_id: u64,
        report: WorkerReport,
        now: Now,
    ) -> Effects {
        let Some(s) = self.active_sync(sync_id) else {
            return Effects::default();
        };
        if s.state != SyncState::Running || !s.awaiting_written.remove(&id) {
            return Effects::default();
        }
        s.add_part_report(id, &report, now.at);
        s.delta.add(&report.delta);
        s.sent_checksums.extend(report.checksums);
        s.sent_deltas.extend(report.deltas);
        self.maybe_commit(sync_id, now)
    }

    /// `Landed`: a rollout counted every expected write (a local verification failure fails the
    /// sync).
    fn on_landed(
        &mut self,
        id: WorkerId,
        sync_id: u64,
        verified: Option<bool>,
        report: &WorkerReport,
        now: Now,
    ) -> Effects {
        let Some(s) = self.active_sync(sync_id) else {
            return Effects::default();
        };
        if s.state != SyncState::Running || !s.awaiting_landed.remove(&id) {
            return Effects::default();
        }
        s.add_part_report(id, report, now.at);
        if verified == Some(false) {
            let failure = Failure {
                worker: id,
                kind: FailureKind::Checksum,
                tensor: None,
                cause: "verification of what landed failed".into(),
            };
            return self.fail(sync_id, failure, now);
        }
        self.maybe_commit(sync_id, now)
    }

    /// `Verified`: what landed on a rollout matches the trainers' checksums.
    fn on_verified(
        &mut self,
        id: WorkerId,
        sync_id: u64,
        report: &WorkerReport,
        now: Now,
    ) -> Effects {
        let Some(s) = self.active_sync(sync_id) else {
            return Effects::default();
        };
        if s.verify_sent_ns.is_none() || !s.awaiting_verified.remove(&id) {
            return Effects::default();
        }
        let t = s.since(now.at);
        let origin = s.prepare_sent_ns;
        // The verification span's bytes are what was checked, not what landed.
        let bytes = s.lanes.get(&id).map_or(0, |l| l.bytes);
        s.delta_apply_ns = s.delta_apply_ns.max(report.delta.codec_ns);
        s.add_report(id, origin, report, t);
        if let Some(l) = s.lanes.get_mut(&id) {
            l.bytes = bytes;
        }
        self.maybe_commit(sync_id, now)
    }

    /// `Failed`: with sync id 0 the worker could not follow its plan; otherwise the sync fails,
    /// at once or after the failure grace (a peer's disconnect, the likelier root cause, may
    /// still arrive and is named instead).
    fn on_failed(&mut self, id: WorkerId, sync_id: u64, fault: Fault, now: Now) -> Effects {
        // The connection says who failed.
        let failure = fault.blame(id);
        if sync_id == 0 {
            self.plan_refused(id, &failure.cause, now);
            return Effects::default();
        }
        let grace = self.cfg.failure_grace;
        let Some(s) = self.active_sync(sync_id) else {
            return Effects::default();
        };
        if grace.is_zero() {
            return self.fail(sync_id, failure, now);
        }
        if s.reported.is_none() {
            s.reported = Some((failure, now.at));
        }
        Effects::default()
    }
}
