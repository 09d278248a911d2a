//! Who is in the world: registration (refused when it contradicts the job, the expected ranks
//! or a live registration), disconnection (which fails the sync the worker was part of and frees
//! the drain gate of it), and who is still missing.

use weightsync_common::protocol::{
    Failure, FailureKind, Registration, ToWorker, WorkerId, WorkerRole, WorldSpec,
};

use super::{ConnId, Coordinator, Effects, Member, Now};
use crate::sync_record::SyncState;

/// A registration the coordinator refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

fn describe_world(w: &WorldSpec) -> String {
    format!(
        "model={} train={} infer={} dtype={} verify={}",
        w.model, w.train, w.infer, w.dtype, w.verify
    )
}

impl Coordinator {
    /// Workers still missing for the world to be complete, e.g. `["trainer-3"]`.
    pub fn missing_workers(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (role, n) in [
            (WorkerRole::Trainer, self.cfg.trainers),
            (WorkerRole::Rollout, self.cfg.rollouts),
        ] {
            for rank in 0..n {
                let id = WorkerId { role, rank };
                if !self.members.contains_key(&id) {
                    out.push(id.to_string());
                }
            }
        }
        out
    }

    /// Why `reg` on `conn` cannot join, if it cannot.
    fn refusal(&self, conn: ConnId, reg: &Registration) -> Option<Refused> {
        let id = reg.id;
        if !weightsync_schedules::job::same_job(&reg.world, &self.cfg.world) {
            return Some(Refused(format!(
                "{id} states a different job ({}) than the controller ({})",
                describe_world(&reg.world),
                describe_world(&self.cfg.world)
            )));
        }
        let expected = self.expected(id.role);
        if id.rank >= expected {
            return Some(Refused(format!(
                "{id}: rank {} is outside the expected {} {}s (ranks 0..{})",
                id.rank, expected, id.role, expected
            )));
        }
        if let Some(other) = self.member_on(conn) {
            return Some(Refused(format!(
                "this connection already registered as {other}"
            )));
        }
        self.members.get(&id).map(|m| {
            Refused(format!(
                "{id} is already registered (host {}, pid {}); a second registration is refused \
                 until that one disconnects or goes silent",
                m.reg.host, m.reg.pid
            ))
        })
    }

    /// A worker registers on connection `conn`. When that completes the world, a plan is asked
    /// for ([`Effects::plan`]).
    pub fn register(
        &mut self,
        conn: ConnId,
        reg: Registration,
        now: Now,
    ) -> Result<Effects, Refused> {
        if let Some(refused) = self.refusal(conn, &reg) {
            return Err(refused);
        }
        let id = reg.id;
        let mut fx = Effects::default();
        fx.send.push((
            conn,
            ToWorker::Welcome {
                heartbeat_ms: self.cfg.heartbeat_interval.as_millis() as u64,
            },
        ));
        let rejoined = self.departed.remove(&id);
        // A (re)started engine holds nothing this controller committed.
        self.engines_lost([&id]);
        self.note(
            format!(
                "{id} registered from {} (pid {}){}",
                reg.host,
                reg.pid,
                if rejoined { ", rejoining" } else { "" }
            ),
            now,
        );
        // A re-registration never inherits the pushes of the process it replaces.
        self.drop_pushes_of(id);
        self.by_conn.insert(conn, id);
        self.members.insert(
            id,
            Member {
                reg,
                conn,
                last_seen: now.at,
                joined_unix_ms: now.unix_ms,
            },
        );
        if self.world_complete() {
            let reason = match &self.plan {
                None => "first plan: every expected worker registered".to_string(),
                Some(p) => {
                    let changed: Vec<String> = self
                        .members
                        .iter()
                        .filter(|(w, m)| p.conn_of(w) != Some(m.conn))
                        .map(|(w, _)| w.to_string())
                        .collect();
                    format!(
                        "re-plan: membership changed ({} re-registered)",
                        changed.join(", ")
                    )
                }
            };
            fx.merge(self.request_plan(reason, now));
        }
        Ok(fx)
    }

    /// A connection closed or was found silent. Drops its worker and fails the sync it was in.
    pub fn disconnect(&mut self, conn: ConnId, reason: &str, now: Now) -> Effects {
        let mut fx = Effects::default();
        let Some(id) = self.member_on(conn) else {
            return fx;
        };
        self.members.remove(&id);
        self.by_conn.remove(&conn);
        // What it pushed was a statement about the bytes of a process that is gone.
        self.drop_pushes_of(id);
        self.departed.insert(id);
        self.engines_lost([&id]);
        self.note(format!("{id} left: {reason}"), now);
        if let Some((plan_id, _)) = self.planning.take() {
            // Its result would be for a world that no longer exists.
            self.note(
                format!("plan {plan_id} superseded before it was made: {id} left"),
                now,
            );
        }
        if let Some(sid) = self.active
            && let Some(failure) = self.departure_failure(sid, id, reason)
        {
            fx.merge(self.fail(sid, failure, now));
        }
        // A departed trainer no longer blocks the drain gate: whatever it still held went with
        // its process or is discarded by the reset its agent does when it reconnects.
        fx.merge(self.drained_by(id, now));
        fx
    }

    /// The failure of sync `sid` that `id` leaving causes, if `id` takes part in it.
    fn departure_failure(&self, sid: u64, id: WorkerId, reason: &str) -> Option<Failure> {
        let s = self.syncs.get(&sid).filter(|s| s.members.contains(&id))?;
        let stage = match (s.state, s.queued_behind) {
            (SyncState::Pending, Some(failed)) => {
                format!("while the sync waited for sync {failed} to drain")
            }
            (SyncState::Pending, None) => "while preparing".to_string(),
            _ => "while the sync was running".to_string(),
        };
        let also = s
            .reported
            .as_ref()
            .map(|(f, _)| format!("; before that {} reported: {}", f.worker, f.cause))
            .unwrap_or_default();
        Some(Failure {
            worker: id,
            kind: FailureKind::PeerLost,
            tensor: None,
            cause: format!("{reason} {stage}{also}"),
        })
    }
}
