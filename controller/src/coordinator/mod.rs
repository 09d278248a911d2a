//! The controller's core: membership, planning and the version protocol, as a state machine
//! without I/O and without a clock of its own.
//!
//! Like raft-rs's core, it takes inputs (a registration, a message from a connection, a
//! disconnect, a plan result, a trigger, a clock tick), each with the time it happened
//! ([`Now`]), and returns [`Effects`]: which messages to send to which connection, which
//! connections to close, which syncs ended, and which plan to compute. The service
//! ([`crate::service`]) does the I/O, reads the clocks, and runs the planner on a thread of its
//! own, outside the coordinator's lock, feeding the result back with [`Coordinator::planned`].
//! This keeps every rule of the protocol testable deterministically:
//!
//! 0. The plan round. When every expected worker is registered, the coordinator asks for a plan
//!    ([`Effects::plan`]); a result for a plan that a later membership change superseded is
//!    dropped. Each worker gets its `Assign` (a trainer its slice of the routing table, a rollout
//!    what to expect) and answers `Ready` once it built what the slice needs: a trainer attaches
//!    its source and registers its staging and gather arenas (whose size only the slice says),
//!    and sends the gather arena's descriptor. When every worker is ready, trainers get `Peers`
//!    (every rollout's regions from its registration, every trainer's gather arena from its
//!    `Ready`) and the plan is in force.
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
//!
//! # Layout
//! - this file: the state, its settings, [`Now`] and [`Effects`].
//! - [`membership`]: registration, disconnection, who is missing.
//! - [`plan_round`]: asking for a plan, its result, `Ready` and `Peers`.
//! - [`messages`]: one handler per worker message.
//! - [`engine_stages`]: an engine's own stages (pause, load, resume), checked and added to its
//!   lane of a sync, also after the sync ended.
//! - [`version`]: triggers, commit and failure of a sync.
//! - [`delta`]: which engines take deltas (the version each holds, as this controller knows).
//! - [`delta_policy`]: whether a sync offers deltas (`auto`, `on`, `off`; under `auto`, from
//!   what syncs measured).
//! - `push`: versions pushed by in-process trainers (`Push N`), started once every trainer did;
//!   runs (a job restarted from a checkpoint declares a new one).
//! - [`durable`]: what survives a controller restart (run, last committed version, the next
//!   sync id, the incarnation), restored at start and saved whenever it changes.
//! - [`drain`]: the drain gate between a failed sync and the next.
//! - [`timeouts`]: the clock tick: silent workers, slow drains, held failure reports, the sync
//!   timeout.
//! - [`views`]: what the HTTP API reads (workers, history, the membership log).
//!
//! # Invariants
//! Checked on random interleavings of registrations, pushes, landings, failures, disconnects,
//! timeouts and restarts by the property test (`model_tests`):
//! - no sync commits without every trainer's `Written` and every rollout's `Landed` (and, with
//!   verification on, every `Verified`) from workers registered when it was created;
//! - sync ids (the immediates' epochs) strictly increase, also across a restart from the durable
//!   state;
//! - the committed `(run, version)` never goes backwards, also across a restart;
//! - a version pushed by trainers starts only once every trainer pushed it on its current
//!   connection; a push is dropped with the connection that made it;
//! - a superseded or failed sync never commits; at most one sync is active.

mod delta;
pub mod delta_policy;
mod drain;
pub mod durable;
mod engine_stages;
mod membership;
mod messages;
mod plan_round;
mod push;
mod timeouts;
mod version;
mod views;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod engine_stages_tests;

#[cfg(test)]
mod after_landing_tests;

#[cfg(test)]
mod model_tests;

#[cfg(test)]
mod push_tests;

#[cfg(test)]
mod delta_policy_tests;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use weightsync_common::protocol::{Registration, ToWorker, WorkerId, WorkerRole, WorldSpec};

use crate::sync_record::SyncRecord;

pub use delta_policy::{BadDeltaMode, DeltaMode, REPROBE_EVERY};
pub use engine_stages::EngineStagesRefused;
pub use membership::Refused;
pub use plan_round::{PlanRecord, PlanRequest};
pub use push::RunError;
pub use version::{TriggerError, Triggered};
pub use views::{LogLine, VersionView, WorkerView};

/// Identifies one control connection (a worker that reconnects gets a new one).
pub type ConnId = u64;

/// When an input happened: the monotonic instant (timeouts, durations) and the wall clock (what
/// the views show). The service reads both clocks; tests pass whatever they need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Monotonic time.
    pub at: Instant,
    /// Milliseconds since the Unix epoch.
    pub unix_ms: u64,
}

impl Now {
    /// Both clocks, read now.
    pub fn wall() -> Now {
        Now {
            at: Instant::now(),
            unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
        }
    }

    /// This moment advanced by `d` on both clocks.
    pub fn after(self, d: Duration) -> Now {
        Now {
            at: self.at + d,
            unix_ms: self.unix_ms + d.as_millis() as u64,
        }
    }
}

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
    /// A plan to compute (off the coordinator's lock) and hand back to
    /// [`Coordinator::planned`].
    pub plan: Option<PlanRequest>,
    /// The durable state changed ([`Coordinator::durable`]): save it before the messages go
    /// out (a `Prepare` must never carry a sync id a restarted controller could reuse).
    pub persist: bool,
}

impl Effects {
    fn merge(&mut self, other: Effects) {
        self.send.extend(other.send);
        self.close.extend(other.close);
        self.finished.extend(other.finished);
        if other.plan.is_some() {
            self.plan = other.plan;
        }
        self.persist |= other.persist;
    }

    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.send.is_empty()
            && self.close.is_empty()
            && self.finished.is_empty()
            && self.plan.is_none()
            && !self.persist
    }
}

#[derive(Debug, Clone)]
struct Member {
    reg: Registration,
    conn: ConnId,
    last_seen: Instant,
    joined_unix_ms: u64,
}

/// The state machine.
#[derive(Debug)]
pub struct Coordinator {
    cfg: CoordinatorConfig,
    members: BTreeMap<WorkerId, Member>,
    /// The newest plan (in force once every worker is ready for it).
    plan: Option<PlanRecord>,
    plan_error: Option<String>,
    /// The plan being computed, if any: its id and why it was asked for.
    planning: Option<(u64, String)>,
    next_plan_id: u64,
    syncs: BTreeMap<u64, SyncRecord>,
    by_version: BTreeMap<u64, u64>,
    active: Option<u64>,
    next_sync_id: u64,
    /// The newest committed `(run, version)`; never goes backwards.
    latest_committed: Option<(u64, u64)>,
    /// The job's current run: versions are compared within it.
    run: u64,
    /// This controller process's random id (a restart gets a new one).
    incarnation: u64,
    log: VecDeque<LogLine>,
    departed: BTreeSet<WorkerId>,
    drain: Option<drain::Drain>,
    /// Versions pushed by trainers in the current run and not yet started, with who pushed
    /// them on which connection (dropped when that connection goes).
    pushed: BTreeMap<u64, BTreeMap<WorkerId, ConnId>>,
    /// Which worker is registered on which connection.
    by_conn: HashMap<ConnId, WorkerId>,
    /// Per engine, the `(run, version)` committed on it that it still holds (see [`delta`]).
    engine_bases: BTreeMap<WorkerId, (u64, u64)>,
    /// Whether syncs offer deltas (see [`Coordinator::set_delta_mode`]); `auto` by default.
    delta_policy: delta_policy::DeltaPolicy,
}

impl Coordinator {
    /// A coordinator with no members, starting afresh (incarnation 0, run 0, sync id 1).
    pub fn new(cfg: CoordinatorConfig) -> Self {
        Coordinator::restore(cfg, &durable::Durable::default(), 0)
    }

    /// A coordinator with no members that carries on from `state` (what a previous controller
    /// saved) as incarnation `incarnation`: the run and the last committed version stay, and
    /// sync ids go on above every id the previous one may have handed out.
    pub fn restore(cfg: CoordinatorConfig, state: &durable::Durable, incarnation: u64) -> Self {
        Coordinator {
            cfg,
            members: BTreeMap::new(),
            plan: None,
            plan_error: None,
            planning: None,
            next_plan_id: 1,
            syncs: BTreeMap::new(),
            by_version: BTreeMap::new(),
            active: None,
            next_sync_id: state.next_sync_id.max(1),
            latest_committed: state.committed,
            run: state.run,
            incarnation,
            log: VecDeque::new(),
            departed: BTreeSet::new(),
            drain: None,
            pushed: BTreeMap::new(),
            by_conn: HashMap::new(),
            engine_bases: BTreeMap::new(),
            delta_policy: delta_policy::DeltaPolicy::default(),
        }
    }

    /// What must survive a restart, as it stands now.
    pub fn durable(&self) -> durable::Durable {
        durable::Durable {
            incarnation: self.incarnation,
            run: self.run,
            committed: self.latest_committed,
            next_sync_id: self.next_sync_id,
        }
    }

    /// The job's current run.
    pub fn run(&self) -> u64 {
        self.run
    }

    /// This controller's incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The newest committed `(run, version)`.
    pub fn latest_committed(&self) -> Option<(u64, u64)> {
        self.latest_committed
    }

    /// The newest version committed in the current run.
    pub fn latest_in_run(&self) -> Option<u64> {
        self.latest_committed
            .filter(|(r, _)| *r == self.run)
            .map(|(_, v)| v)
    }

    /// Settings.
    pub fn config(&self) -> &CoordinatorConfig {
        &self.cfg
    }

    fn note(&mut self, message: String, now: Now) {
        tracing::info!("{message}");
        self.log.push_back(LogLine {
            unix_ms: now.unix_ms,
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

    /// The worker registered on connection `conn`.
    fn member_on(&self, conn: ConnId) -> Option<WorkerId> {
        self.by_conn.get(&conn).copied()
    }

    /// Sends `msg` to every registered worker of `workers` (by id).
    fn send_to(
        &self,
        fx: &mut Effects,
        workers: impl IntoIterator<Item = WorkerId>,
        msg: impl Fn(WorkerId) -> ToWorker,
    ) {
        for w in workers {
            if let Some(m) = self.members.get(&w) {
                fx.send.push((m.conn, msg(w)));
            }
        }
    }

    /// A sync by id.
    pub fn sync(&self, id: u64) -> Option<&SyncRecord> {
        self.syncs.get(&id)
    }

    /// Id of the running sync.
    pub fn active(&self) -> Option<u64> {
        self.active
    }
}
