//! The coordinator's property test: random interleavings of registrations, disconnects, plans,
//! pushes, HTTP triggers, workers' answers (prepared, written, landed, verified, failed,
//! drained), clock ticks, new runs and controller restarts (a coordinator restored from the
//! previous one's durable state, every worker gone), driven through the pure state machine.
//!
//! Why a property test: the reliability review found each of its version bugs in an
//! interleaving nobody had written down (a restarted rank's push completing a version with its
//! predecessor's, a restart reusing epochs). The invariants, checked after every step:
//! 1. **No commit without every landing**: a `Commit` of sync S goes out only once every trainer
//!    of S sent `Written` for S and every rollout of S sent `Landed` (and `Verified`, when the job
//!    verifies).
//! 2. **Epochs strictly increase**: a sync id first seen in a `Prepare` is larger than every id
//!    seen before, across restarts, and an id never names two versions.
//! 3. **The committed `(run, version)` never goes backwards**: neither the coordinator's newest
//!    committed (across restarts) nor what any rollout is told in a `Commit`.
//! 4. **A superseded or failed sync never commits**: no `Commit` of a sync that was aborted or
//!    failed; no sync is created for a version superseded for a trainer that did not push it
//!    again.
//! 5. **Versions bound to bytes**: a sync started by pushes is of the `(run, version)` that every
//!    trainer pushed last, on the connection it is registered on now.
//! 6. At most one sync is not ended.
//!
//! The runner counts what the cases did (commits, supersessions, restarts followed by a commit)
//! and fails if the generator stopped reaching them, so the test cannot pass by exploring
//! nothing.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use weightsync_common::DType;
use weightsync_common::protocol::{
    FailureKind, Fault, FromWorker, Registration, ToWorker, WorkerId, WorkerReport, WorldSpec,
};

use super::*;
use crate::planning::{NullPlanner, Planner};
use crate::sync_record::SyncState;

/// Worker index: 0 and 1 are trainers, 2 is the rollout.
const WORKERS: usize = 3;

fn worker_id(w: usize) -> WorkerId {
    if w < 2 {
        WorkerId::trainer(w as u32)
    } else {
        WorkerId::rollout(0)
    }
}

#[derive(Debug, Clone)]
enum Op {
    Register(usize),
    Disconnect(usize),
    /// The planner answers the plan asked for, if any.
    Plan,
    /// Worker `w` sends its next natural message (ready, drained, prepared, written, landed,
    /// verified), if it has one.
    Respond(usize),
    /// Every registered worker responds, a few rounds.
    Settle,
    /// A training step of the whole job: every trainer pushes the job's next version in its
    /// run.
    Step,
    /// One trainer pushes any version, in its run or (`bump`) a newer one.
    Push {
        trainer: usize,
        version: u64,
        bump: bool,
    },
    /// The job restarts from a checkpoint two versions back, under a new run.
    Rollback,
    Trigger(u64),
    Failed(usize),
    Tick(u64),
    BeginRun(u64),
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..WORKERS).prop_map(Op::Register),
        1 => (0..WORKERS).prop_map(Op::Disconnect),
        3 => Just(Op::Plan),
        8 => (0..WORKERS).prop_map(Op::Respond),
        8 => Just(Op::Settle),
        6 => Just(Op::Step),
        2 => (0..2usize, 1..8u64, prop::bool::weighted(0.1)).prop_map(|(trainer, version, bump)| {
            Op::Push {
                trainer,
                version,
                bump,
            }
        }),
        1 => Just(Op::Rollback),
        1 => (1..8u64).prop_map(Op::Trigger),
        3 => (0..WORKERS).prop_map(Op::Failed),
        2 => (0..1500u64).prop_map(Op::Tick),
        1 => (0..4u64).prop_map(Op::BeginRun),
        1 => Just(Op::Restart),
    ]
}

/// What one worker process knows from the messages it received.
#[derive(Debug, Default, Clone)]
struct Known {
    conn: Option<ConnId>,
    /// The plan it was assigned and has not answered `Ready` for.
    assigned: Option<u64>,
    /// The sync it was told to prepare, and how far it got.
    sync: Option<(u64, u64)>,
    stage: Stage,
    /// An aborted sync to answer with `Drained`.
    abort: Option<(u64, u64)>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Stage {
    #[default]
    None,
    Prepare,
    Prepared,
    Start,
    Done,
    Verify,
}

/// What the cases did, summed over the run.
#[derive(Default)]
struct Reached {
    commits: Cell<u32>,
    superseded: Cell<u32>,
    commit_after_restart: Cell<u32>,
    failed: Cell<u32>,
}

struct Model {
    cfg: CoordinatorConfig,
    c: Coordinator,
    now: Now,
    incarnation: u64,
    next_conn: ConnId,
    known: [Known; WORKERS],
    plan: Option<PlanRequest>,
    /// Syncs each worker sent Written / Landed / Verified for (as a registered member).
    written: BTreeSet<(u64, usize)>,
    landed: BTreeSet<(u64, usize)>,
    verified: BTreeSet<(u64, usize)>,
    /// Every sync id seen in a `Prepare`, with its (run, version).
    seen: BTreeMap<u64, (u64, u64)>,
    /// Syncs aborted or failed.
    dead: BTreeSet<u64>,
    committed_syncs: BTreeSet<u64>,
    /// What each rollout was last told was committed.
    engine: Option<(u64, u64)>,
    latest: Option<(u64, u64)>,
    /// Each trainer's last push: on which connection, of what (run, version).
    last_push: [Option<(ConnId, u64, u64)>; 2],
    superseded: BTreeSet<(usize, u64, u64)>,
    /// Each trainer's pushes not known to have ended superseded, as (run, version).
    pushes: [BTreeSet<(u64, u64)>; 2],
    /// Syncs created by an HTTP trigger (the pushes say nothing about them).
    triggered: BTreeSet<u64>,
    restarted: bool,
    /// The job's training step and each trainer's run.
    job_version: u64,
    runs: [u64; 2],
    /// Failed syncs counted.
    counted_failed: BTreeSet<u64>,
}

impl Model {
    fn new(verify: bool) -> Model {
        let cfg = CoordinatorConfig {
            world: WorldSpec {
                model: "m".into(),
                train: "fsdp=2".into(),
                infer: "tp=1".into(),
                dtype: DType::BF16,
                verify,
            },
            trainers: 2,
            rollouts: 1,
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_secs(1),
            sync_timeout: Duration::from_secs(3),
            failure_grace: Duration::from_millis(200),
            history: 1000,
        };
        Model {
            c: Coordinator::new(cfg.clone()),
            cfg,
            now: Now::wall(),
            incarnation: 0,
            next_conn: 1,
            known: Default::default(),
            plan: None,
            written: BTreeSet::new(),
            landed: BTreeSet::new(),
            verified: BTreeSet::new(),
            seen: BTreeMap::new(),
            dead: BTreeSet::new(),
            committed_syncs: BTreeSet::new(),
            engine: None,
            latest: None,
            last_push: [None; 2],
            superseded: BTreeSet::new(),
            pushes: Default::default(),
            triggered: BTreeSet::new(),
            restarted: false,
            job_version: 0,
            runs: [0; 2],
            counted_failed: BTreeSet::new(),
        }
    }

    fn registration(&self, w: usize) -> Registration {
        let id = worker_id(w);
        Registration {
            id,
            host: "h".into(),
            pid: 1,
            world: self.cfg.world.clone(),
            fabric_endpoint: weightsync_common::protocol::Blob(id.to_string().into_bytes()),
            regions: Vec::new(),
            tensors: Vec::new(),
            placement: None,
            skip: Vec::new(),
        }
    }

    fn worker_on(&self, conn: ConnId) -> Option<usize> {
        self.known.iter().position(|k| k.conn == Some(conn))
    }

    /// Sends `msg` from worker `w` (if it is connected); records what the invariants need.
    fn send(&mut self, w: usize, msg: FromWorker, r: &Reached) -> Result<(), TestCaseError> {
        let Some(conn) = self.known[w].conn else {
            return Ok(());
        };
        match &msg {
            FromWorker::Written { sync_id, .. } => {
                self.written.insert((*sync_id, w));
            }
            FromWorker::Landed { sync_id, .. } => {
                self.landed.insert((*sync_id, w));
            }
            FromWorker::Verified { sync_id, .. } => {
                self.verified.insert((*sync_id, w));
            }
            FromWorker::Push { version, run } => {
                self.last_push[w] = Some((conn, *run, *version));
                self.pushes[w].insert((*run, *version));
                self.superseded.remove(&(w, *run, *version));
            }
            _ => {}
        }
        let fx = self.c.message(conn, msg, self.now);
        self.effects(fx, r)
    }

    fn report() -> WorkerReport {
        WorkerReport::default()
    }

    /// Worker `w`'s next natural message.
    fn respond(&mut self, w: usize, r: &Reached) -> Result<(), TestCaseError> {
        let k = self.known[w].clone();
        if k.conn.is_none() {
            return Ok(());
        }
        if let Some(plan_id) = k.assigned {
            self.known[w].assigned = None;
            return self.send(
                w,
                FromWorker::Ready {
                    plan_id,
                    regions: Vec::new(),
                    tensors: Vec::new(),
                },
                r,
            );
        }
        if let Some((sync_id, version)) = k.abort {
            self.known[w].abort = None;
            return self.send(w, FromWorker::Drained { sync_id, version }, r);
        }
        let Some((sync_id, version)) = k.sync else {
            return Ok(());
        };
        let trainer = w < 2;
        let (next, msg) = match k.stage {
            Stage::Prepare => (
                Stage::Prepared,
                FromWorker::Prepared {
                    sync_id,
                    version,
                    report: Self::report(),
                },
            ),
            Stage::Start if trainer => (
                Stage::Done,
                FromWorker::Written {
                    sync_id,
                    version,
                    report: Self::report(),
                },
            ),
            Stage::Prepared if !trainer => (
                Stage::Done,
                FromWorker::Landed {
                    sync_id,
                    version,
                    verified: None,
                    report: Self::report(),
                },
            ),
            Stage::Verify if !trainer => (
                Stage::Done,
                FromWorker::Verified {
                    sync_id,
                    version,
                    report: Self::report(),
                },
            ),
            _ => return Ok(()),
        };
        self.known[w].stage = next;
        self.send(w, msg, r)
    }

    /// Applies what the coordinator asked for and checks the invariants about messages.
    fn effects(&mut self, fx: Effects, r: &Reached) -> Result<(), TestCaseError> {
        if let Some(req) = fx.plan {
            self.plan = Some(req);
        }
        for (conn, msg) in fx.send {
            let Some(w) = self.worker_on(conn) else {
                continue;
            };
            match msg {
                ToWorker::Assign(a) => self.known[w].assigned = Some(a.plan_id()),
                ToWorker::Prepare {
                    sync_id,
                    version,
                    run,
                } => {
                    match self.seen.get(&sync_id) {
                        Some(&rv) => prop_assert_eq!(
                            rv,
                            (run, version),
                            "sync {} named two versions",
                            sync_id
                        ),
                        None => {
                            let max = self.seen.keys().next_back().copied().unwrap_or(0);
                            prop_assert!(
                                sync_id > max,
                                "epoch {} after {} (invariant 2)",
                                sync_id,
                                max
                            );
                            self.seen.insert(sync_id, (run, version));
                        }
                    }
                    self.known[w].sync = Some((sync_id, version));
                    self.known[w].stage = Stage::Prepare;
                }
                ToWorker::Start { sync_id, .. }
                    if self.known[w].sync.map(|s| s.0) == Some(sync_id) =>
                {
                    self.known[w].stage = Stage::Start;
                }
                ToWorker::Verify { sync_id, .. }
                    if self.known[w].sync.map(|s| s.0) == Some(sync_id) =>
                {
                    self.known[w].stage = Stage::Verify;
                }
                ToWorker::Commit {
                    sync_id,
                    version,
                    run,
                } => self.on_commit(w, sync_id, version, run, r)?,
                ToWorker::Abort {
                    sync_id,
                    version,
                    failure,
                    ..
                } => {
                    if sync_id == 0 {
                        if failure.as_ref().map(|f| f.kind) == Some(FailureKind::Superseded) {
                            r.superseded.set(r.superseded.get() + 1);
                            // An Abort names no run: it ends the oldest-run push of that
                            // version (a new run supersedes the old run's pushes; a push of
                            // an old run is superseded at once).
                            let run = self.pushes[w.min(1)]
                                .iter()
                                .filter(|p| p.1 == version)
                                .map(|p| p.0)
                                .min();
                            if let (true, Some(run)) = (w < 2, run) {
                                self.pushes[w].remove(&(run, version));
                                self.superseded.insert((w, run, version));
                            }
                        }
                    } else {
                        prop_assert!(
                            !self.committed_syncs.contains(&sync_id),
                            "sync {} aborted after it committed",
                            sync_id
                        );
                        self.dead.insert(sync_id);
                        self.known[w].abort = Some((sync_id, version));
                        if self.known[w].sync.map(|s| s.0) == Some(sync_id) {
                            self.known[w].sync = None;
                        }
                    }
                }
                _ => {}
            }
        }
        for conn in fx.close {
            if let Some(w) = self.worker_on(conn) {
                self.known[w] = Known::default();
            }
            let fx = self.c.disconnect(conn, "closed", self.now);
            self.effects(fx, r)?;
        }
        Ok(())
    }

    fn on_commit(
        &mut self,
        w: usize,
        sync_id: u64,
        version: u64,
        run: u64,
        r: &Reached,
    ) -> Result<(), TestCaseError> {
        prop_assert!(
            !self.dead.contains(&sync_id),
            "failed or aborted sync {} committed (invariant 4)",
            sync_id
        );
        let s = self.c.sync(sync_id);
        prop_assert!(s.is_some(), "commit of unknown sync {}", sync_id);
        let s = s.unwrap();
        prop_assert_eq!((s.run, s.version), (run, version));
        for m in &s.members {
            let i = (0..WORKERS).find(|&i| worker_id(i) == *m).unwrap();
            if i < 2 {
                prop_assert!(
                    self.written.contains(&(sync_id, i)),
                    "sync {} committed without {}'s Written (invariant 1)",
                    sync_id,
                    m
                );
            } else {
                prop_assert!(
                    self.landed.contains(&(sync_id, i)),
                    "sync {} committed without {}'s Landed (invariant 1)",
                    sync_id,
                    m
                );
                if self.cfg.world.verify {
                    prop_assert!(
                        self.verified.contains(&(sync_id, i)),
                        "sync {} committed without {}'s Verified (invariant 1)",
                        sync_id,
                        m
                    );
                }
            }
        }
        if self.committed_syncs.insert(sync_id) {
            r.commits.set(r.commits.get() + 1);
            if self.restarted {
                r.commit_after_restart.set(r.commit_after_restart.get() + 1);
            }
        }
        if w == 2 {
            if let Some(e) = self.engine {
                prop_assert!(
                    (run, version) > e,
                    "the engine was told {:?} after {:?} (invariant 3)",
                    (run, version),
                    e
                );
            }
            self.engine = Some((run, version));
        }
        if self.known[w].sync.map(|s| s.0) == Some(sync_id) {
            self.known[w].sync = None;
        }
        Ok(())
    }

    /// Invariants about the coordinator's state after a step.
    fn check_state(&mut self, created_from: u64, r: &Reached) -> Result<(), TestCaseError> {
        let latest = self.c.latest_committed();
        if let Some(old) = self.latest {
            prop_assert!(
                latest.is_some_and(|l| l >= old),
                "latest committed went from {:?} to {:?} (invariant 3)",
                old,
                latest
            );
        }
        self.latest = latest;
        let open = self
            .c
            .history()
            .iter()
            .filter(|s| !s.state.is_terminal())
            .count();
        prop_assert!(open <= 1, "{} syncs not ended (invariant 6)", open);
        for s in self.c.history() {
            if s.state == SyncState::Failed {
                self.dead.insert(s.id);
                if self.counted_failed.insert(s.id) {
                    r.failed.set(r.failed.get() + 1);
                }
            }
        }
        // Syncs created by this step from pushes (invariants 4, 5).
        let next = self.c.durable().next_sync_id;
        for id in created_from..next {
            if self.triggered.contains(&id) {
                continue;
            }
            let Some(s) = self.c.sync(id) else { continue };
            let (run, version) = (s.run, s.version);
            for t in 0..2 {
                let conn = self.known[t].conn;
                prop_assert!(
                    conn.is_some() && self.last_push[t] == Some((conn.unwrap(), run, version)),
                    "sync {} of (run {}, version {}) started but trainer-{} last pushed {:?} \
                     and is on connection {:?} (invariant 5)",
                    id,
                    run,
                    version,
                    t,
                    self.last_push[t],
                    conn
                );
                prop_assert!(
                    !self.superseded.contains(&(t, run, version)),
                    "superseded version {} started (invariant 4)",
                    version
                );
            }
        }
        Ok(())
    }

    fn step(&mut self, op: Op, r: &Reached) -> Result<(), TestCaseError> {
        let created_from = self.c.durable().next_sync_id;
        match op {
            Op::Register(w) => {
                if self.known[w].conn.is_none() {
                    let conn = self.next_conn;
                    self.next_conn += 1;
                    let reg = self.registration(w);
                    if let Ok(fx) = self.c.register(conn, reg, self.now) {
                        self.known[w] = Known {
                            conn: Some(conn),
                            ..Known::default()
                        };
                        self.effects(fx, r)?;
                    }
                }
            }
            Op::Disconnect(w) => {
                if let Some(conn) = self.known[w].conn {
                    self.known[w] = Known::default();
                    let fx = self.c.disconnect(conn, "gone", self.now);
                    self.effects(fx, r)?;
                }
            }
            Op::Plan => {
                if let Some(req) = self.plan.take() {
                    let out = NullPlanner.plan(req.plan_id, &req.world, &req.workers);
                    let fx = self.c.planned(req.plan_id, out, self.now);
                    self.effects(fx, r)?;
                }
            }
            Op::Respond(w) => self.respond(w, r)?,
            Op::Settle => {
                for _ in 0..6 {
                    if let Some(req) = self.plan.take() {
                        let out = NullPlanner.plan(req.plan_id, &req.world, &req.workers);
                        let fx = self.c.planned(req.plan_id, out, self.now);
                        self.effects(fx, r)?;
                    }
                    for w in 0..WORKERS {
                        self.respond(w, r)?;
                    }
                }
            }
            Op::Step => {
                self.job_version += 1;
                for t in 0..2 {
                    let (version, run) = (self.job_version, self.runs[t]);
                    self.send(t, FromWorker::Push { version, run }, r)?;
                }
            }
            Op::Push {
                trainer,
                version,
                bump,
            } => {
                if bump {
                    self.runs[trainer] += 1;
                }
                let run = self.runs[trainer];
                self.send(trainer, FromWorker::Push { version, run }, r)?;
            }
            Op::Rollback => {
                self.job_version = self.job_version.saturating_sub(2);
                let run = self.runs.iter().copied().max().unwrap_or(0) + 1;
                self.runs = [run; 2];
            }
            Op::Trigger(version) => {
                if let Ok((Triggered::Created(id), fx)) = self.c.trigger(version, self.now) {
                    self.triggered.insert(id);
                    self.effects(fx, r)?;
                }
            }
            Op::Failed(w) => {
                if let Some((sync_id, version)) = self.known[w].sync {
                    let fault = Fault {
                        kind: FailureKind::Fabric,
                        tensor: None,
                        cause: "boom".into(),
                    };
                    self.send(
                        w,
                        FromWorker::Failed {
                            sync_id,
                            version,
                            failure: fault,
                        },
                        r,
                    )?;
                }
            }
            Op::Tick(ms) => {
                self.now = self.now.after(Duration::from_millis(ms));
                // Connected workers heartbeat (the tick must not drop live ones every time).
                for w in 0..WORKERS {
                    if ms < 900 {
                        self.send(w, FromWorker::Heartbeat { seq: 1 }, r)?;
                    }
                }
                let fx = self.c.tick(self.now);
                self.effects(fx, r)?;
            }
            Op::BeginRun(run) => {
                if let Ok(fx) = self.c.begin_run(run, self.now) {
                    self.effects(fx, r)?;
                }
            }
            Op::Restart => {
                // kill -9: only the durable state survives; every worker reconnects.
                let saved = self.c.durable();
                self.incarnation += 1;
                self.c = Coordinator::restore(self.cfg.clone(), &saved, self.incarnation);
                self.known = Default::default();
                self.plan = None;
                self.restarted = true;
                let after = self.c.latest_committed();
                prop_assert_eq!(
                    after,
                    self.latest,
                    "the restart forgot the committed version"
                );
                return Ok(());
            }
        }
        self.check_state(created_from, r)
    }
}

#[test]
fn random_interleavings_keep_every_invariant() {
    let reached = Reached::default();
    let mut runner = TestRunner::new(Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (any::<bool>(), prop::collection::vec(op(), 1..160));
    let result = runner.run(&strategy, |(verify, ops)| {
        let mut m = Model::new(verify);
        for op in ops {
            m.step(op, &reached)?;
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // The generator must keep reaching what the invariants are about.
    let (commits, superseded, after_restart, failed) = (
        reached.commits.get(),
        reached.superseded.get(),
        reached.commit_after_restart.get(),
        reached.failed.get(),
    );
    eprintln!(
        "commits {commits}, superseded {superseded}, commits after a restart {after_restart}, \
         failed {failed}"
    );
    assert!(commits >= 20, "only {commits} commits in all cases");
    assert!(superseded >= 20, "only {superseded} supersessions");
    assert!(
        after_restart >= 10,
        "only {after_restart} commits after a restart"
    );
    assert!(failed >= 2, "only {failed} failed syncs");
}
