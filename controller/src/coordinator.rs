//! The controller's core: membership, planning and the version protocol, as a state machine
//! without I/O.
//!
//! Like raft-rs's core, it takes inputs (a registration, a message from a connection, a
//! disconnect, a trigger, a clock tick) and returns [`Effects`]: which messages to send to which
//! connection, which connections to close, which syncs ended. The service ([`crate::service`])
//! does the I/O. This keeps every rule of the protocol testable deterministically:
//!
//! 1. `POST /v1/syncs` creates a sync (pending) and sends `Prepare N` to every worker: rollouts
//!    arm their counters for N (an engine pauses or switches buffers), trainers make their source
//!    hold N.
//! 2. When every worker answered `Prepared`, the sync is running and trainers get `Start N`.
//! 3. The sync commits only when every trainer reported `Written` and every rollout `Landed`
//!    (verified, when on, and with checksums matching the trainers'); then everybody gets
//!    `Commit N` and rollouts may use N.
//! 4. A failure report, a disconnect, a silent worker (heartbeat timeout) or the sync timeout
//!    fails the sync with a cause naming the worker (and tensor); everybody gets `Abort N`, and
//!    the next trigger proceeds.
//! 5. The drain gate: if trainers of the failed sync had been told to `Start`, their writes may
//!    still sit in queues (a partitioned link holds them; once it heals, TCP would deliver them
//!    while the next sync runs, over its bytes). Each trainer answers `Abort` with `Drained` once
//!    it stopped and reset its fabric lanes. No `Prepare` goes out before every such trainer
//!    still registered has; a trigger meanwhile is accepted and queued (its status names the
//!    trainers still draining) and starts the moment the last one reports. A trainer that does
//!    not report within the heartbeat timeout is dropped, as a silent one would be (its agent
//!    reconnects and drains on the way), so it never blocks the job for longer.
//!
//! Membership: the world is complete when every expected (role, rank) is registered; the
//! coordinator then plans once. It re-plans only when membership changes (a worker left and
//! registered again) and logs why.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use weightsync_common::protocol::{
    Failure, FromWorker, Registration, RunChecksum, ToWorker, WorkerId, WorkerRole, WorldSpec,
};

use crate::planning::Planner;
use crate::sync_record::{SyncRecord, SyncState, SyncView};

/// Identifies one control connection (a worker that reconnects gets a new one).
pub type ConnId = u64;

/// Coordinator settings.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// What the job is; registrations must state the same.
    pub world: WorldSpec,
    /// Expected trainers (ranks 0..trainers).
    pub trainers: u32,
    /// Expected rollouts (ranks 0..rollouts).
    pub rollouts: u32,
    /// Heartbeat interval workers are asked to keep.
    pub heartbeat_interval: Duration,
    /// A worker silent for this long is dropped, failing the running sync.
    pub heartbeat_timeout: Duration,
    /// A sync not committed within this is failed.
    pub sync_timeout: Duration,
    /// How long a worker's failure report waits for a peer's disconnect (the likelier root
    /// cause) before it fails the sync; zero fails at once.
    pub failure_grace: Duration,
    /// Syncs kept in history.
    pub history: usize,
}

/// What the service must do after an input.
#[derive(Debug, Default)]
pub struct Effects {
    /// Messages to send.
    pub send: Vec<(ConnId, ToWorker)>,
    /// Connections to close (after sending what is queued for them).
    pub close: Vec<ConnId>,
    /// Syncs that ended (committed or failed) during this input.
    pub finished: Vec<u64>,
}

impl Effects {
    fn merge(&mut self, other: Effects) {
        self.send.extend(other.send);
        self.close.extend(other.close);
        self.finished.extend(other.finished);
    }
}

/// A registration the coordinator refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

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
    /// Not every worker has registered, or planning failed.
    #[error("the world is not ready: {0}")]
    NotReady(String),
    /// The version is not newer than the last committed one.
    #[error("version {version} is not newer than the last committed version {latest}")]
    Stale {
        /// Requested.
        version: u64,
        /// Last committed.
        latest: u64,
    },
}

#[derive(Debug, Clone)]
struct Member {
    reg: Registration,
    conn: ConnId,
    last_seen: Instant,
    joined_unix_ms: u64,
}

/// The current plan.
#[derive(Debug, Clone, Serialize)]
pub struct PlanRecord {
    /// Plan id (increments on every re-plan).
    pub id: u64,
    /// When it was made, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// Why it was made (first plan, or which membership change).
    pub reason: String,
    /// Planner's summary.
    pub summary: serde_json::Value,
    /// Workers it covers.
    pub members: Vec<String>,
    #[serde(skip)]
    conns: BTreeMap<WorkerId, ConnId>,
}

/// A worker, for JSON (no endpoint, no rkeys).
#[derive(Debug, Clone, Serialize)]
pub struct WorkerView {
    /// e.g. `trainer-0`.
    pub id: String,
    /// Role.
    pub role: WorkerRole,
    /// Rank.
    pub rank: u32,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Registration time, ms since the Unix epoch.
    pub joined_unix_ms: u64,
    /// Milliseconds since its last message.
    pub last_seen_ms_ago: u64,
    /// Tensors it holds.
    pub tensors: usize,
    /// Bytes it holds.
    pub bytes: u64,
    /// Its rate in the last sync it took part in, GB/s.
    pub last_gbps: Option<f64>,
}

/// A line in the membership log (`GET /v1/plan` shows the recent ones).
#[derive(Debug, Clone, Serialize)]
pub struct LogLine {
    /// ms since the Unix epoch.
    pub unix_ms: u64,
    /// What happened.
    pub message: String,
}

/// The state machine.
#[derive(Debug)]
pub struct Coordinator {
    cfg: CoordinatorConfig,
    planner: Box<dyn Planner>,
    members: BTreeMap<WorkerId, Member>,
    plan: Option<PlanRecord>,
    plan_error: Option<String>,
    next_plan_id: u64,
    syncs: BTreeMap<u64, SyncRecord>,
    by_version: BTreeMap<u64, u64>,
    active: Option<u64>,
    next_sync_id: u64,
    latest_committed: Option<u64>,
    log: VecDeque<LogLine>,
    departed: BTreeSet<WorkerId>,
    drain: Option<Drain>,
}

/// Trainers of an aborted sync that have not yet confirmed they drained it.
#[derive(Debug, Clone)]
struct Drain {
    /// The aborted sync.
    sync_id: u64,
    /// Trainers still to report `Drained`.
    waiting: BTreeSet<WorkerId>,
    /// When the abort went out.
    since: Instant,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn describe_world(w: &WorldSpec) -> String {
    format!(
        "model={} train={} infer={} dtype={} verify={}",
        w.model, w.train, w.infer, w.dtype, w.verify
    )
}

impl Coordinator {
    /// A coordinator with no members.
    pub fn new(cfg: CoordinatorConfig, planner: Box<dyn Planner>) -> Self {
        Coordinator {
            cfg,
            planner,
            members: BTreeMap::new(),
            plan: None,
            plan_error: None,
            next_plan_id: 1,
            syncs: BTreeMap::new(),
            by_version: BTreeMap::new(),
            active: None,
            next_sync_id: 1,
            latest_committed: None,
            log: VecDeque::new(),
            departed: BTreeSet::new(),
            drain: None,
        }
    }

    /// Settings.
    pub fn config(&self) -> &CoordinatorConfig {
        &self.cfg
    }

    fn note(&mut self, message: String) {
        tracing::info!("{message}");
        self.log.push_back(LogLine {
            unix_ms: unix_ms(),
            message,
        });
        while self.log.len() > 64 {
            self.log.pop_front();
        }
    }

    fn expected(&self, role: WorkerRole) -> u32 {
        match role {
            WorkerRole::Trainer => self.cfg.trainers,
            WorkerRole::Rollout => self.cfg.rollouts,
        }
    }

    /// Whether every expected worker is registered.
    pub fn world_complete(&self) -> bool {
        let count = |role| self.members.keys().filter(|w| w.role == role).count() as u32;
        count(WorkerRole::Trainer) == self.cfg.trainers
            && count(WorkerRole::Rollout) == self.cfg.rollouts
    }

    fn missing(&self) -> Vec<String> {
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

    /// A worker registers on connection `conn`.
    pub fn register(
        &mut self,
        conn: ConnId,
        reg: Registration,
        now: Instant,
    ) -> Result<Effects, Refused> {
        let id = reg.id;
        if reg.world != self.cfg.world {
            return Err(Refused(format!(
                "{id} states a different job ({}) than the controller ({})",
                describe_world(&reg.world),
                describe_world(&self.cfg.world)
            )));
        }
        let expected = self.expected(id.role);
        if id.rank >= expected {
            return Err(Refused(format!(
                "{id}: rank {} is outside the expected {} {}s (ranks 0..{})",
                id.rank, expected, id.role, expected
            )));
        }
        if let Some((other, _)) = self.members.iter().find(|(_, m)| m.conn == conn) {
            return Err(Refused(format!(
                "this connection already registered as {other}"
            )));
        }
        if let Some(m) = self.members.get(&id) {
            return Err(Refused(format!(
                "{id} is already registered (host {}, pid {}); a second registration is refused \
                 until that one disconnects or goes silent",
                m.reg.host, m.reg.pid
            )));
        }
        let mut fx = Effects::default();
        fx.send.push((
            conn,
            ToWorker::Welcome {
                heartbeat_ms: self.cfg.heartbeat_interval.as_millis() as u64,
            },
        ));
        let rejoined = self.departed.remove(&id);
        self.note(format!(
            "{id} registered from {} (pid {}){}",
            reg.host,
            reg.pid,
            if rejoined { ", rejoining" } else { "" }
        ));
        self.members.insert(
            id,
            Member {
                reg,
                conn,
                last_seen: now,
                joined_unix_ms: unix_ms(),
            },
        );
        if self.world_complete() {
            let reason = match &self.plan {
                None => "first plan: every expected worker registered".to_string(),
                Some(p) => {
                    let changed: Vec<String> = self
                        .members
                        .iter()
                        .filter(|(w, m)| p.conns.get(w) != Some(&m.conn))
                        .map(|(w, _)| w.to_string())
                        .collect();
                    format!(
                        "re-plan: membership changed ({} re-registered)",
                        changed.join(", ")
                    )
                }
            };
            fx.merge(self.replan(reason));
        }
        Ok(fx)
    }

    fn replan(&mut self, reason: String) -> Effects {
        let mut fx = Effects::default();
        let plan_id = self.next_plan_id;
        self.next_plan_id += 1;
        let regs: BTreeMap<WorkerId, Registration> = self
            .members
            .iter()
            .map(|(w, m)| (*w, m.reg.clone()))
            .collect();
        match self.planner.plan(plan_id, &self.cfg.world, &regs) {
            Ok(out) => {
                for (w, m) in &self.members {
                    match out.assignments.get(w) {
                        Some(a) => fx.send.push((m.conn, ToWorker::Assign(a.clone()))),
                        None => {
                            let msg = format!("planner produced no assignment for {w}");
                            self.plan = None;
                            self.plan_error = Some(msg.clone());
                            self.note(msg);
                            return Effects::default();
                        }
                    }
                }
                self.note(format!("plan {plan_id}: {reason}"));
                self.plan_error = None;
                self.plan = Some(PlanRecord {
                    id: plan_id,
                    created_unix_ms: unix_ms(),
                    reason,
                    summary: out.summary,
                    members: self.members.keys().map(ToString::to_string).collect(),
                    conns: self.members.iter().map(|(w, m)| (*w, m.conn)).collect(),
                });
            }
            Err(e) => {
                self.plan = None;
                self.plan_error = Some(e.to_string());
                self.note(format!("plan {plan_id} failed: {e}"));
            }
        }
        fx
    }

    /// Whether a plan is in force for the current membership.
    fn plan_valid(&self) -> bool {
        match &self.plan {
            Some(p) => {
                self.world_complete()
                    && self
                        .members
                        .iter()
                        .all(|(w, m)| p.conns.get(w) == Some(&m.conn))
            }
            None => false,
        }
    }

    /// A connection closed or was found silent. Drops its worker and fails the sync it was in.
    pub fn disconnect(&mut self, conn: ConnId, reason: &str, now: Instant) -> Effects {
        let mut fx = Effects::default();
        let Some(id) = self
            .members
            .iter()
            .find(|(_, m)| m.conn == conn)
            .map(|(w, _)| *w)
        else {
            return fx;
        };
        self.members.remove(&id);
        self.departed.insert(id);
        self.note(format!("{id} left: {reason}"));
        if let Some(sid) = self.active {
            let stage = self.syncs.get(&sid).map(|s| (s.state, s.queued_behind));
            if self
                .syncs
                .get(&sid)
                .is_some_and(|s| s.members.contains(&id))
            {
                let stage = match stage {
                    Some((SyncState::Pending, Some(failed))) => {
                        format!("while the sync waited for sync {failed} to drain")
                    }
                    Some((SyncState::Pending, None)) => "while preparing".to_string(),
                    _ => "while the sync was running".to_string(),
                };
                let also = self
                    .syncs
                    .get(&sid)
                    .and_then(|s| s.reported.as_ref())
                    .map(|(f, _)| format!("; before that {} reported: {}", f.worker, f.cause))
                    .unwrap_or_default();
                fx.merge(self.fail(
                    sid,
                    Failure {
                        worker: id,
                        tensor: None,
                        cause: format!("{reason} {stage}{also}"),
                    },
                    now,
                ));
            }
        }
        // A departed trainer no longer blocks the drain gate: whatever it still held went with
        // its process or is discarded by the reset its agent does when it reconnects.
        let drained = self
            .drain
            .as_mut()
            .is_some_and(|d| d.waiting.remove(&id) && d.waiting.is_empty());
        self.refresh_queued();
        if drained {
            fx.merge(self.end_drain(now));
        }
        fx
    }

    /// Copies the drain gate's waiting set into the queued sync's record (for its status).
    fn refresh_queued(&mut self) {
        let waiting = self
            .drain
            .as_ref()
            .map(|d| d.waiting.clone())
            .unwrap_or_default();
        if let Some(s) = self.active.and_then(|id| self.syncs.get_mut(&id)) {
            if s.queued_behind.is_some() {
                s.awaiting_drain = waiting;
            }
        }
    }

    /// Every trainer drained (or left): opens the gate and starts the queued sync, if any.
    fn end_drain(&mut self, now: Instant) -> Effects {
        let Some(d) = self.drain.take() else {
            return Effects::default();
        };
        self.note(format!(
            "sync {} drained: no write of it can land any more",
            d.sync_id
        ));
        self.dispatch_queued(now)
    }

    /// Sends `Prepare` for the queued sync (once the drain gate opened).
    fn dispatch_queued(&mut self, now: Instant) -> Effects {
        let mut fx = Effects::default();
        let Some(sid) = self.active else {
            return fx;
        };
        if self
            .syncs
            .get(&sid)
            .is_none_or(|s| s.queued_behind.is_none())
        {
            return fx;
        }
        let current: BTreeSet<WorkerId> = self.members.keys().copied().collect();
        let plan_id = self.plan.as_ref().map(|p| p.id);
        let (members, planned) = match self.syncs.get(&sid) {
            Some(s) => (s.members.clone(), Some(s.plan_id)),
            None => return fx,
        };
        if !self.plan_valid() || current != members || plan_id != planned {
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
        s.drain_wait_ms = Some(now.saturating_duration_since(s.created).as_secs_f64() * 1e3);
        // The sync starts now: its timeout and its timeline count from here.
        s.created = now;
        s.created_unix_ms = unix_ms();
        let (id, version) = (s.id, s.version);
        for m in self.members.values() {
            fx.send.push((
                m.conn,
                ToWorker::Prepare {
                    sync_id: id,
                    version,
                },
            ));
        }
        tracing::info!(sync_id = id, version, "queued sync started after the drain");
        fx
    }

    /// A message from a registered connection.
    pub fn message(&mut self, conn: ConnId, msg: FromWorker, now: Instant) -> Effects {
        let mut fx = Effects::default();
        let Some(id) = self
            .members
            .iter()
            .find(|(_, m)| m.conn == conn)
            .map(|(w, _)| *w)
        else {
            return fx;
        };
        if let Some(m) = self.members.get_mut(&id) {
            m.last_seen = now;
        }
        match msg {
            FromWorker::Heartbeat { seq } => fx.send.push((conn, ToWorker::Heartbeat { seq })),
            FromWorker::Drained { sync_id, .. } => {
                let Some(d) = self.drain.as_mut().filter(|d| d.sync_id == sync_id) else {
                    return fx;
                };
                if !d.waiting.remove(&id) {
                    return fx;
                }
                let drained = d.waiting.is_empty();
                self.refresh_queued();
                if drained {
                    fx.merge(self.end_drain(now));
                }
            }
            FromWorker::Hello { .. } | FromWorker::Register(_) => {
                fx.merge(self.disconnect(conn, "protocol error: registered twice", now));
                fx.close.push(conn);
            }
            FromWorker::Prepared {
                sync_id, report, ..
            } => {
                let Some(s) = self.active_sync(sync_id) else {
                    return fx;
                };
                if s.state != SyncState::Pending || !s.awaiting_prepared.remove(&id) {
                    return fx;
                }
                let t = s.since(now);
                let origin = s.prepare_sent_ns;
                if !report.events.is_empty() {
                    s.add_report(id, origin, &report, t);
                    // Preparation is not the worker's whole part: clear its done mark.
                    if let Some(l) = s.lanes.get_mut(&id) {
                        l.done_ns = None;
                    }
                }
                if s.awaiting_prepared.is_empty() {
                    s.state = SyncState::Running;
                    s.start_sent_ns = Some(t);
                    let (sid, version) = (s.id, s.version);
                    for w in s.members.clone() {
                        if w.role == WorkerRole::Trainer {
                            if let Some(m) = self.members.get(&w) {
                                fx.send.push((
                                    m.conn,
                                    ToWorker::Start {
                                        sync_id: sid,
                                        version,
                                    },
                                ));
                            }
                        }
                    }
                }
            }
            FromWorker::Written {
                sync_id, report, ..
            } => {
                let Some(s) = self.active_sync(sync_id) else {
                    return fx;
                };
                if s.state != SyncState::Running || !s.awaiting_written.remove(&id) {
                    return fx;
                }
                s.add_part_report(id, &report, now);
                s.sent_checksums.extend(report.checksums);
                fx.merge(self.maybe_commit(sync_id, now));
            }
            FromWorker::Landed {
                sync_id,
                verified,
                report,
                ..
            } => {
                let Some(s) = self.active_sync(sync_id) else {
                    return fx;
                };
                if s.state != SyncState::Running || !s.awaiting_landed.remove(&id) {
                    return fx;
                }
                s.add_part_report(id, &report, now);
                if verified == Some(false) {
                    fx.merge(self.fail(
                        sync_id,
                        Failure {
                            worker: id,
                            tensor: None,
                            cause: "verification of what landed failed".into(),
                        },
                        now,
                    ));
                } else {
                    fx.merge(self.maybe_commit(sync_id, now));
                }
            }
            FromWorker::Verified {
                sync_id, report, ..
            } => {
                let Some(s) = self.active_sync(sync_id) else {
                    return fx;
                };
                if s.verify_sent_ns.is_none() || !s.awaiting_verified.remove(&id) {
                    return fx;
                }
                let t = s.since(now);
                let origin = s.prepare_sent_ns;
                let bytes = s.lanes.get(&id).map_or(0, |l| l.bytes);
                s.add_report(id, origin, &report, t);
                if let Some(l) = s.lanes.get_mut(&id) {
                    l.bytes = bytes;
                }
                fx.merge(self.maybe_commit(sync_id, now));
            }
            FromWorker::Failed {
                sync_id,
                mut failure,
                ..
            } => {
                if failure.worker.rank == u32::MAX {
                    failure.worker = id;
                }
                let grace = self.cfg.failure_grace;
                let Some(s) = self.active_sync(sync_id) else {
                    if sync_id == 0 {
                        self.note(format!("{id} reported: {}", failure.cause));
                    }
                    return fx;
                };
                if grace.is_zero() {
                    fx.merge(self.fail(sync_id, failure, now));
                } else if s.reported.is_none() {
                    // A writer's error is often the symptom of a peer that just died; give the
                    // peer's disconnect a moment to arrive so the sync names the root cause.
                    s.reported = Some((failure, now));
                }
            }
        }
        fx
    }

    /// The running sync `sync_id` (not one still queued behind a drain: nobody has heard of it).
    fn active_sync(&mut self, sync_id: u64) -> Option<&mut SyncRecord> {
        if self.active != Some(sync_id) {
            return None;
        }
        self.syncs
            .get_mut(&sync_id)
            .filter(|s| s.queued_behind.is_none())
    }

    fn maybe_commit(&mut self, sync_id: u64, now: Instant) -> Effects {
        let verify = self.cfg.world.verify;
        let mut fx = Effects::default();
        let Some(s) = self.syncs.get_mut(&sync_id) else {
            return fx;
        };
        if !(s.awaiting_written.is_empty() && s.awaiting_landed.is_empty()) {
            return fx;
        }
        if verify && s.verify_sent_ns.is_none() {
            // Every byte is in place: hand each rollout the trainers' checksums of its units.
            s.verify_sent_ns = Some(s.since(now));
            s.awaiting_verified = s
                .members
                .iter()
                .copied()
                .filter(|w| w.role == WorkerRole::Rollout)
                .collect();
            let mut per_rollout: BTreeMap<u32, Vec<RunChecksum>> = BTreeMap::new();
            for c in &s.sent_checksums {
                per_rollout.entry(c.rollout).or_default().push(c.clone());
            }
            let (version, targets) = (s.version, s.awaiting_verified.clone());
            for w in targets {
                if let Some(m) = self.members.get(&w) {
                    fx.send.push((
                        m.conn,
                        ToWorker::Verify {
                            sync_id,
                            version,
                            checksums: per_rollout.remove(&w.rank).unwrap_or_default(),
                        },
                    ));
                }
            }
            return fx;
        }
        if !s.awaiting_verified.is_empty() {
            return fx;
        }
        if verify {
            s.verified = Some(true);
        }
        s.state = SyncState::Committed;
        s.ended_ns = Some(s.since(now));
        s.mark_critical();
        let (version, members) = (s.version, s.members.clone());
        self.latest_committed = Some(self.latest_committed.map_or(version, |v| v.max(version)));
        self.active = None;
        for w in members {
            if let Some(m) = self.members.get(&w) {
                fx.send
                    .push((m.conn, ToWorker::Commit { sync_id, version }));
            }
        }
        fx.finished.push(sync_id);
        tracing::info!(sync_id, version, "sync committed");
        fx
    }

    fn fail(&mut self, sync_id: u64, failure: Failure, now: Instant) -> Effects {
        let mut fx = Effects::default();
        let Some(s) = self.syncs.get_mut(&sync_id) else {
            return fx;
        };
        if s.state.is_terminal() {
            return fx;
        }
        tracing::warn!(sync_id, version = s.version, "sync failed: {failure}");
        s.state = SyncState::Failed;
        s.ended_ns = Some(s.since(now));
        s.mark_critical();
        let reason = failure.to_string();
        s.failure = Some(failure);
        let queued = s.queued_behind.take().is_some();
        s.awaiting_drain.clear();
        let (version, members, started) = (s.version, s.members.clone(), s.start_sent_ns.is_some());
        self.active = None;
        fx.finished.push(sync_id);
        if queued {
            // Never announced to anyone: nothing to abort, nothing to drain.
            return fx;
        }
        for w in &members {
            if let Some(m) = self.members.get(w) {
                fx.send.push((
                    m.conn,
                    ToWorker::Abort {
                        sync_id,
                        version,
                        reason: reason.clone(),
                    },
                ));
            }
        }
        // Trainers write only after `Start`: before it, nothing of this sync can be in flight.
        let writers: BTreeSet<WorkerId> = members
            .into_iter()
            .filter(|w| w.role == WorkerRole::Trainer && self.members.contains_key(w))
            .collect();
        if started && !writers.is_empty() {
            self.note(format!(
                "sync {sync_id} failed after trainers started writing: the next sync waits until {} \
                 confirmed they drained it",
                writers
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            self.drain = Some(Drain {
                sync_id,
                waiting: writers,
                since: now,
            });
        }
        fx
    }

    /// The aborted sync whose drain gates the next one, and the trainers still draining it.
    pub fn draining(&self) -> Option<(u64, Vec<WorkerId>)> {
        self.drain
            .as_ref()
            .map(|d| (d.sync_id, d.waiting.iter().copied().collect()))
    }

    /// `POST /v1/syncs`: start a sync for `version` (idempotent per version, except that a
    /// failed version can be retried).
    pub fn trigger(
        &mut self,
        version: u64,
        now: Instant,
    ) -> Result<(Triggered, Effects), TriggerError> {
        if let Some(&id) = self.by_version.get(&version) {
            // Idempotent while that sync is pending, running or committed; a failed version may
            // be retried with a new attempt.
            if self
                .syncs
                .get(&id)
                .is_some_and(|s| s.state != SyncState::Failed)
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
            let why = if !self.world_complete() {
                format!(
                    "{} of {} workers registered; missing {}",
                    self.members.len(),
                    self.cfg.trainers + self.cfg.rollouts,
                    self.missing().join(", ")
                )
            } else {
                self.plan_error
                    .clone()
                    .unwrap_or_else(|| "no plan for the current membership".into())
            };
            return Err(TriggerError::NotReady(why));
        }
        if let Some(latest) = self.latest_committed {
            if version <= latest {
                return Err(TriggerError::Stale { version, latest });
            }
        }
        let id = self.next_sync_id;
        self.next_sync_id += 1;
        let members: BTreeSet<WorkerId> = self.members.keys().copied().collect();
        let plan_id = self.plan.as_ref().map_or(0, |p| p.id);
        let rec = SyncRecord {
            id,
            version,
            plan_id,
            state: SyncState::Pending,
            created_unix_ms: unix_ms(),
            created: now,
            awaiting_prepared: members.clone(),
            awaiting_written: members
                .iter()
                .copied()
                .filter(|w| w.role == WorkerRole::Trainer)
                .collect(),
            awaiting_landed: members
                .iter()
                .copied()
                .filter(|w| w.role == WorkerRole::Rollout)
                .collect(),
            members,
            awaiting_verified: BTreeSet::new(),
            verify_sent_ns: None,
            prepare_sent_ns: 0,
            start_sent_ns: None,
            ended_ns: None,
            lanes: BTreeMap::new(),
            sent_checksums: Vec::new(),
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
        };
        let mut fx = Effects::default();
        if let Some(d) = &self.drain {
            tracing::info!(
                sync_id = id,
                version,
                "sync queued until the trainers of sync {} drained it",
                d.sync_id
            );
        } else {
            for m in self.members.values() {
                fx.send.push((
                    m.conn,
                    ToWorker::Prepare {
                        sync_id: id,
                        version,
                    },
                ));
            }
        }
        self.syncs.insert(id, rec);
        self.by_version.insert(version, id);
        self.active = Some(id);
        while self.syncs.len() > self.cfg.history.max(1) {
            if let Some((&old, _)) = self.syncs.iter().next() {
                if let Some(s) = self.syncs.remove(&old) {
                    if self.by_version.get(&s.version) == Some(&old) {
                        self.by_version.remove(&s.version);
                    }
                }
            }
        }
        tracing::info!(sync_id = id, version, "sync triggered");
        Ok((Triggered::Created(id), fx))
    }

    /// Clock tick: drops silent workers and fails a sync past its timeout.
    pub fn tick(&mut self, now: Instant) -> Effects {
        let mut fx = Effects::default();
        let silent: Vec<(ConnId, u64)> = self
            .members
            .values()
            .filter(|m| now.saturating_duration_since(m.last_seen) > self.cfg.heartbeat_timeout)
            .map(|m| {
                (
                    m.conn,
                    now.saturating_duration_since(m.last_seen).as_millis() as u64,
                )
            })
            .collect();
        for (conn, ms) in silent {
            fx.merge(self.disconnect(
                conn,
                &format!(
                    "silent for {ms} ms (heartbeat timeout {} ms)",
                    self.cfg.heartbeat_timeout.as_millis()
                ),
                now,
            ));
            fx.close.push(conn);
        }
        if let Some(d) = &self.drain {
            if now.saturating_duration_since(d.since) > self.cfg.heartbeat_timeout {
                let (failed, late) = (d.sync_id, d.waiting.clone());
                for w in late {
                    let Some(conn) = self.members.get(&w).map(|m| m.conn) else {
                        continue;
                    };
                    fx.merge(self.disconnect(
                        conn,
                        &format!(
                            "did not confirm within {} ms (the heartbeat timeout) that it drained \
                             aborted sync {failed}; dropped so that it cannot block the next sync",
                            self.cfg.heartbeat_timeout.as_millis()
                        ),
                        now,
                    ));
                    fx.close.push(conn);
                }
            }
        }
        if let Some(sid) = self.active {
            let reported = self.syncs.get(&sid).and_then(|s| s.reported.clone());
            if let Some((failure, at)) = reported {
                if now.saturating_duration_since(at) >= self.cfg.failure_grace {
                    fx.merge(self.fail(sid, failure, now));
                }
            }
        }
        if let Some(sid) = self.active {
            // A queued sync has not started: the drain gate's own timeout bounds its wait.
            if let Some(s) = self.syncs.get(&sid).filter(|s| s.queued_behind.is_none()) {
                if now.saturating_duration_since(s.created) > self.cfg.sync_timeout {
                    let waiting = s.waiting_on();
                    let stage = match s.state {
                        SyncState::Pending => "prepared",
                        _ => "written/landed",
                    };
                    let failure = Failure {
                        worker: waiting.first().copied().unwrap_or(WorkerId::trainer(0)),
                        tensor: None,
                        cause: format!(
                            "sync timed out after {} ms waiting for {stage} from {}",
                            self.cfg.sync_timeout.as_millis(),
                            waiting
                                .iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    };
                    fx.merge(self.fail(sid, failure, now));
                }
            }
        }
        fx
    }

    /// A sync by id.
    pub fn sync(&self, id: u64) -> Option<&SyncRecord> {
        self.syncs.get(&id)
    }

    /// Syncs, newest first.
    pub fn history(&self) -> Vec<SyncView> {
        self.syncs.values().rev().map(|s| s.view(false)).collect()
    }

    /// Id of the running sync.
    pub fn active(&self) -> Option<u64> {
        self.active
    }

    /// The plan in force (or the last one).
    pub fn plan(&self) -> Option<&PlanRecord> {
        self.plan.as_ref()
    }

    /// Why the last planning attempt failed.
    pub fn plan_error(&self) -> Option<&str> {
        self.plan_error.as_deref()
    }

    /// Recent membership and planning events.
    pub fn log(&self) -> Vec<LogLine> {
        self.log.iter().cloned().collect()
    }

    /// Workers still missing for the world to be complete.
    pub fn missing_workers(&self) -> Vec<String> {
        self.missing()
    }

    /// Registered workers, for JSON.
    pub fn workers(&self, now: Instant) -> Vec<WorkerView> {
        let last_sync = self.syncs.values().rev().find(|s| s.state.is_terminal());
        self.members
            .iter()
            .map(|(w, m)| WorkerView {
                id: w.to_string(),
                role: w.role,
                rank: w.rank,
                host: m.reg.host.clone(),
                pid: m.reg.pid,
                joined_unix_ms: m.joined_unix_ms,
                last_seen_ms_ago: now.saturating_duration_since(m.last_seen).as_millis() as u64,
                tensors: m.reg.tensors.len(),
                bytes: m.reg.tensors.iter().map(|t| t.bytes).sum(),
                last_gbps: last_sync.and_then(|s| crate::sync_record::lane_gbps(s, w)),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planning::NullPlanner;
    use weightsync_common::protocol::{Blob, WorkerReport};
    use weightsync_common::DType;

    fn world() -> WorldSpec {
        WorldSpec {
            model: "m".into(),
            train: "fsdp=1".into(),
            infer: "tp=1".into(),
            dtype: DType::BF16,
            verify: false,
        }
    }

    fn coordinator(grace_ms: u64) -> Coordinator {
        let cfg = CoordinatorConfig {
            world: world(),
            trainers: 1,
            rollouts: 1,
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_secs(1),
            sync_timeout: Duration::from_secs(5),
            failure_grace: Duration::from_millis(grace_ms),
            history: 3,
        };
        let mut c = Coordinator::new(cfg, Box::new(NullPlanner));
        let now = Instant::now();
        for (conn, id) in [(1, WorkerId::trainer(0)), (2, WorkerId::rollout(0))] {
            let reg = Registration {
                id,
                host: "h".into(),
                pid: 1,
                world: world(),
                fabric_endpoint: Blob::default(),
                regions: Vec::new(),
                tensors: Vec::new(),
            };
            c.register(conn, reg, now).unwrap();
        }
        c
    }

    /// A `Failed` report of sync `id` (version 1), as the worker on `conn` sends it.
    fn failed(c: &mut Coordinator, conn: u64, id: u64, cause: &str, now: Instant) -> Effects {
        c.message(
            conn,
            FromWorker::Failed {
                sync_id: id,
                version: 1,
                failure: Failure {
                    worker: WorkerId::trainer(u32::MAX),
                    tensor: None,
                    cause: cause.into(),
                },
            },
            now,
        )
    }

    fn failed_by_trainer(c: &mut Coordinator, id: u64, now: Instant) {
        failed(c, 1, id, "write to rollout-0 failed: disconnected", now);
    }

    /// Triggers `version`, which must create a new sync; its id.
    fn created(c: &mut Coordinator, version: u64, t: Instant) -> u64 {
        let (Triggered::Created(id), _) = c.trigger(version, t).unwrap() else {
            panic!("not created")
        };
        id
    }

    fn registration(id: WorkerId) -> Registration {
        Registration {
            id,
            host: "h".into(),
            pid: 1,
            world: world(),
            fabric_endpoint: Blob::default(),
            regions: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Triggers `version` and answers `Prepared` from both workers: trainers got `Start`.
    fn running(c: &mut Coordinator, version: u64, t: Instant) -> u64 {
        let id = created(c, version, t);
        let mut starts = 0;
        for conn in [1, 2] {
            let fx = c.message(
                conn,
                FromWorker::Prepared {
                    sync_id: id,
                    version,
                    report: WorkerReport::default(),
                },
                t,
            );
            starts += fx
                .send
                .iter()
                .filter(|(_, m)| matches!(m, ToWorker::Start { .. }))
                .count();
        }
        assert_eq!(starts, 1, "Start went to the trainer");
        assert_eq!(c.sync(id).unwrap().state, SyncState::Running);
        id
    }

    fn prepares(fx: &Effects) -> usize {
        fx.send
            .iter()
            .filter(|(_, m)| matches!(m, ToWorker::Prepare { .. }))
            .count()
    }

    fn drained(sync_id: u64, version: u64) -> FromWorker {
        FromWorker::Drained { sync_id, version }
    }

    #[test]
    fn a_trigger_during_the_drain_is_queued_and_starts_once_every_trainer_drained() {
        let mut c = coordinator(0);
        let t = Instant::now();
        let id = running(&mut c, 1, t);
        failed_by_trainer(&mut c, id, t);
        assert_eq!(c.sync(id).unwrap().state, SyncState::Failed);
        assert_eq!(c.draining(), Some((id, vec![WorkerId::trainer(0)])));

        // Accepted, but nothing goes out while trainer-0 may still hold writes of sync 1.
        let (Triggered::Created(next), fx) = c.trigger(2, t).unwrap() else {
            panic!("not created")
        };
        assert_eq!(prepares(&fx), 0, "{fx:?}");
        let v = c.sync(next).unwrap().view(false);
        assert_eq!(v.state, SyncState::Pending);
        assert_eq!(v.waiting_for_drain_of, Some(id));
        assert_eq!(v.waiting_on, vec!["trainer-0".to_string()]);
        // The queued sync holds the slot: another version is refused, the same one is idempotent.
        assert!(
            matches!(c.trigger(3, t), Err(TriggerError::Busy { running, .. }) if running == next)
        );
        assert!(matches!(c.trigger(2, t), Ok((Triggered::Existing(x), _)) if x == next));
        // Reports about the queued sync are ignored: nobody was told about it yet.
        c.message(
            2,
            FromWorker::Prepared {
                sync_id: next,
                version: 2,
                report: WorkerReport::default(),
            },
            t,
        );
        assert!(c
            .sync(next)
            .unwrap()
            .awaiting_prepared
            .contains(&WorkerId::rollout(0)));
        // A rollout's Drained, or a trainer's for another sync, does not open the gate.
        assert_eq!(prepares(&c.message(2, drained(id, 1), t)), 0);
        assert_eq!(prepares(&c.message(1, drained(next, 2), t)), 0);
        assert!(c.draining().is_some());

        let fx = c.message(1, drained(id, 1), t + Duration::from_millis(20));
        assert_eq!(prepares(&fx), 2, "the queued sync starts at once: {fx:?}");
        assert!(c.draining().is_none());
        let v = c.sync(next).unwrap().view(false);
        assert_eq!(v.waiting_for_drain_of, None);
        assert!(v.drain_wait_ms.is_some_and(|ms| ms >= 20.0), "{v:?}");
        assert_eq!(v.waiting_on.len(), 2, "now waiting for Prepared: {v:?}");
    }

    #[test]
    fn a_sync_that_failed_before_start_needs_no_drain() {
        let mut c = coordinator(0);
        let t = Instant::now();
        let id = created(&mut c, 1, t);
        failed_by_trainer(&mut c, id, t);
        assert!(c.draining().is_none(), "no trainer was told to write");
        let (_, fx) = c.trigger(2, t).unwrap();
        assert_eq!(prepares(&fx), 2);
    }

    #[test]
    fn a_trainer_that_never_drains_is_dropped_after_the_heartbeat_timeout() {
        let mut c = coordinator(0);
        let t0 = Instant::now();
        let id = running(&mut c, 1, t0);
        failed_by_trainer(&mut c, id, t0);
        let next = created(&mut c, 2, t0);
        // Both stay alive (heartbeats), but trainer-0 never answers the abort.
        let late = t0 + Duration::from_millis(900);
        c.message(1, FromWorker::Heartbeat { seq: 1 }, late);
        c.message(2, FromWorker::Heartbeat { seq: 1 }, late);
        assert!(c.tick(late).close.is_empty(), "within the timeout");
        let fx = c.tick(t0 + Duration::from_millis(1100));
        assert_eq!(fx.close, vec![1], "trainer-0 dropped");
        assert!(c.draining().is_none(), "no longer blocks");
        let s = c.sync(next).unwrap();
        assert_eq!(s.state, SyncState::Failed);
        let f = s.failure.clone().unwrap();
        assert_eq!(f.worker, WorkerId::trainer(0));
        assert!(f.cause.contains("drained aborted sync"), "{f}");
        assert!(
            f.cause.contains(&format!("waited for sync {id} to drain")),
            "{f}"
        );
        // Its agent reconnects (draining on the way): the next trigger goes out at once.
        c.register(
            3,
            registration(WorkerId::trainer(0)),
            t0 + Duration::from_secs(2),
        )
        .unwrap();
        let (_, fx) = c.trigger(2, t0 + Duration::from_secs(2)).unwrap();
        assert_eq!(prepares(&fx), 2);
    }

    #[test]
    fn a_trainer_that_dies_while_draining_no_longer_blocks() {
        let mut c = coordinator(0);
        let t = Instant::now();
        let id = running(&mut c, 1, t);
        // The rollout fails the sync; then trainer-0's connection drops before it drained.
        failed(&mut c, 2, id, "landing timed out", t);
        assert!(c.draining().is_some());
        c.disconnect(1, "connection closed", t);
        assert!(c.draining().is_none());
        c.register(3, registration(WorkerId::trainer(0)), t)
            .unwrap();
        let (_, fx) = c.trigger(2, t).unwrap();
        assert_eq!(prepares(&fx), 2, "started at once");
    }

    #[test]
    fn a_peer_disconnect_within_the_grace_period_is_named_as_the_cause() {
        let mut c = coordinator(300);
        let t0 = Instant::now();
        let id = created(&mut c, 1, t0);
        failed_by_trainer(&mut c, id, t0);
        assert_eq!(
            c.sync(id).unwrap().state,
            SyncState::Pending,
            "held for the grace period"
        );
        c.disconnect(2, "connection closed", t0 + Duration::from_millis(50));
        let f = c.sync(id).unwrap().failure.clone().unwrap();
        assert_eq!(f.worker, WorkerId::rollout(0));
        assert!(f.cause.contains("trainer-0 reported"), "{f}");
    }

    #[test]
    fn a_failure_report_stands_after_the_grace_period_and_a_failed_version_can_be_retried() {
        let mut c = coordinator(300);
        let t0 = Instant::now();
        let id = created(&mut c, 1, t0);
        failed_by_trainer(&mut c, id, t0);
        c.tick(t0 + Duration::from_millis(400));
        let s = c.sync(id).unwrap();
        assert_eq!(s.state, SyncState::Failed);
        assert_eq!(s.failure.as_ref().unwrap().worker, WorkerId::trainer(0));
        let (again, fx) = c.trigger(1, t0 + Duration::from_millis(500)).unwrap();
        assert!(matches!(again, Triggered::Created(n) if n != id));
        assert_eq!(fx.send.len(), 2, "prepare to both workers");
    }

    #[test]
    fn committed_versions_are_idempotent_and_history_is_bounded() {
        let mut c = coordinator(0);
        let mut t = Instant::now();
        for v in 1..=5u64 {
            let id = created(&mut c, v, t);
            for conn in [1, 2] {
                c.message(
                    conn,
                    FromWorker::Prepared {
                        sync_id: id,
                        version: v,
                        report: WorkerReport::default(),
                    },
                    t,
                );
            }
            c.message(
                1,
                FromWorker::Written {
                    sync_id: id,
                    version: v,
                    report: WorkerReport::default(),
                },
                t,
            );
            let fx = c.message(
                2,
                FromWorker::Landed {
                    sync_id: id,
                    version: v,
                    verified: None,
                    report: WorkerReport::default(),
                },
                t,
            );
            assert!(fx.finished.contains(&id));
            assert_eq!(c.sync(id).unwrap().state, SyncState::Committed);
            assert!(matches!(c.trigger(v, t), Ok((Triggered::Existing(x), _)) if x == id));
            t += Duration::from_millis(10);
        }
        assert_eq!(c.history().len(), 3);
        assert!(matches!(c.trigger(2, t), Err(TriggerError::Stale { .. })));
    }

    #[test]
    fn the_sync_timeout_names_who_it_waited_for() {
        let mut c = coordinator(0);
        let t0 = Instant::now();
        let id = created(&mut c, 1, t0);
        c.message(
            1,
            FromWorker::Heartbeat { seq: 1 },
            t0 + Duration::from_secs(5),
        );
        c.message(
            2,
            FromWorker::Heartbeat { seq: 1 },
            t0 + Duration::from_secs(5),
        );
        c.tick(t0 + Duration::from_millis(5100));
        let f = c.sync(id).unwrap().failure.clone().unwrap();
        assert!(
            f.cause.contains("timed out") && f.cause.contains("trainer-0, rollout-0"),
            "{f}"
        );
    }
}
