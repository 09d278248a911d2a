//! The clock tick: every timeout of the protocol, checked against the time the service passes
//! in. A silent worker is dropped (heartbeat timeout); a trainer that does not confirm a drain
//! within the same timeout is dropped so it cannot block the job; a failure report held for the
//! grace period fails its sync; a sync not committed within the sync timeout fails, naming who
//! it waited for.

use weightsync_common::protocol::{Failure, FailureKind, WorkerId};

use super::{ConnId, Coordinator, Effects, Now};
use crate::sync_record::SyncState;

impl Coordinator {
    /// Clock tick: drops silent workers and fails a sync past its timeout.
    pub fn tick(&mut self, now: Now) -> Effects {
        let mut fx = self.drop_silent(now);
        fx.merge(self.drop_undrained(now));
        fx.merge(self.fail_reported(now));
        fx.merge(self.fail_overdue(now));
        fx.merge(self.start_pushed(now));
        fx
    }

    /// Drops every worker silent for longer than the heartbeat timeout.
    fn drop_silent(&mut self, now: Now) -> Effects {
        let mut fx = Effects::default();
        let timeout = self.cfg.heartbeat_timeout;
        let silent: Vec<(ConnId, u64)> = self
            .members
            .values()
            .filter(|m| now.at.saturating_duration_since(m.last_seen) > timeout)
            .map(|m| {
                let ms = now.at.saturating_duration_since(m.last_seen).as_millis() as u64;
                (m.conn, ms)
            })
            .collect();
        for (conn, ms) in silent {
            let why = format!(
                "silent for {ms} ms (heartbeat timeout {} ms)",
                timeout.as_millis()
            );
            fx.merge(self.disconnect(conn, &why, now));
            fx.close.push(conn);
        }
        fx
    }

    /// Drops the trainers that did not confirm the drain within the heartbeat timeout.
    fn drop_undrained(&mut self, now: Now) -> Effects {
        let mut fx = Effects::default();
        let timeout = self.cfg.heartbeat_timeout;
        let Some(d) = self
            .drain
            .as_ref()
            .filter(|d| now.at.saturating_duration_since(d.since) > timeout)
        else {
            return fx;
        };
        let (failed, late) = (d.sync_id, d.waiting.clone());
        for w in late {
            let Some(conn) = self.members.get(&w).map(|m| m.conn) else {
                continue;
            };
            let why = format!(
                "did not confirm within {} ms (the heartbeat timeout) that it drained aborted \
                 sync {failed}; dropped so that it cannot block the next sync",
                timeout.as_millis()
            );
            fx.merge(self.disconnect(conn, &why, now));
            fx.close.push(conn);
        }
        fx
    }

    /// Fails the running sync with the failure report held past the grace period.
    fn fail_reported(&mut self, now: Now) -> Effects {
        let Some(sid) = self.active else {
            return Effects::default();
        };
        let reported = self.syncs.get(&sid).and_then(|s| s.reported.clone());
        match reported {
            Some((failure, at))
                if now.at.saturating_duration_since(at) >= self.cfg.failure_grace =>
            {
                self.fail(sid, failure, now)
            }
            _ => Effects::default(),
        }
    }

    /// Fails the running sync when it is past the sync timeout. (A queued sync has not
    /// started: the drain gate's own timeout bounds its wait.)
    fn fail_overdue(&mut self, now: Now) -> Effects {
        let Some(sid) = self.active else {
            return Effects::default();
        };
        let timeout = self.cfg.sync_timeout;
        let Some(s) = self.syncs.get(&sid).filter(|s| {
            s.queued_behind.is_none() && now.at.saturating_duration_since(s.created) > timeout
        }) else {
            return Effects::default();
        };
        let waiting = s.waiting_on();
        let stage = match s.state {
            SyncState::Pending => "prepared",
            _ => "written/landed",
        };
        let failure = Failure {
            worker: waiting.first().copied().unwrap_or(WorkerId::trainer(0)),
            kind: FailureKind::Timeout,
            tensor: None,
            cause: format!(
                "sync timed out after {} ms waiting for {stage} from {}",
                timeout.as_millis(),
                waiting
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        self.fail(sid, failure, now)
    }
}
