use std::time::Duration;

use weightsync_common::DType;
use weightsync_common::protocol::{
    Blob, FailureKind, Fault, FromWorker, Registration, ToWorker, WorkerId, WorkerReport, WorldSpec,
};

use super::*;
use crate::planning::{NullPlanner, Planner};
use crate::sync_record::SyncState;

pub(super) fn world(verify: bool) -> WorldSpec {
    WorldSpec {
        model: "m".into(),
        train: "fsdp=1".into(),
        infer: "tp=1".into(),
        dtype: DType::BF16,
        verify,
    }
}

pub(super) fn config(trainers: u32, grace_ms: u64) -> CoordinatorConfig {
    CoordinatorConfig {
        world: world(false),
        trainers,
        rollouts: 1,
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(1),
        sync_timeout: Duration::from_secs(5),
        failure_grace: Duration::from_millis(grace_ms),
        history: 3,
    }
}

/// Trainer-0 on connection 1 and rollout-0 on connection 2, with a plan in force.
pub(super) fn coordinator(grace_ms: u64) -> Coordinator {
    coordinator_with(config(1, grace_ms))
}

/// [`coordinator`] for a job that verifies what landed.
pub(super) fn verifying_coordinator() -> Coordinator {
    let mut cfg = config(1, 0);
    cfg.world = world(true);
    coordinator_with(cfg)
}

fn coordinator_with(cfg: CoordinatorConfig) -> Coordinator {
    let world = cfg.world.clone();
    let mut c = Coordinator::new(cfg);
    let now = Now::wall();
    let mut fx = Effects::default();
    for (conn, id) in [(1, WorkerId::trainer(0)), (2, WorkerId::rollout(0))] {
        let reg = Registration {
            world: world.clone(),
            ..registration(id)
        };
        fx.merge(c.register(conn, reg, now).unwrap());
    }
    plan_round(&mut c, fx, now);
    c
}

/// Plans what `fx` asks for (with the null planner), answers every assignment with `Ready`,
/// and returns what the last `Ready` caused (the trainers' `Peers`).
pub(super) fn plan_round(c: &mut Coordinator, fx: Effects, now: Now) -> Effects {
    let req = fx.plan.expect("a plan was asked for");
    let out = NullPlanner.plan(req.plan_id, &req.world, &req.workers);
    let assigned = c.planned(req.plan_id, out, now);
    let mut last = Effects::default();
    for (conn, msg) in assigned.send {
        let ToWorker::Assign(a) = msg else {
            panic!("expected an assignment, got {msg:?}")
        };
        last = c.message(conn, ready(a.plan_id(), Vec::new()), now);
    }
    last
}

pub(super) fn ready(plan_id: u64, regions: Vec<Blob>) -> FromWorker {
    FromWorker::Ready {
        plan_id,
        regions,
        tensors: Vec::new(),
    }
}

/// A `Failed` report of sync `id` (version 1), as the worker on `conn` sends it.
fn failed(c: &mut Coordinator, conn: u64, id: u64, cause: &str, now: Now) -> Effects {
    c.message(
        conn,
        FromWorker::Failed {
            sync_id: id,
            version: 1,
            failure: Fault {
                kind: FailureKind::Fabric,
                tensor: None,
                cause: cause.into(),
            },
        },
        now,
    )
}

pub(super) fn failed_by_trainer(c: &mut Coordinator, id: u64, now: Now) {
    failed(c, 1, id, "write to rollout-0 failed: disconnected", now);
}

/// Triggers `version`, which must create a new sync; its id.
pub(super) fn created(c: &mut Coordinator, version: u64, t: Now) -> u64 {
    let (Triggered::Created(id), _) = c.trigger(version, t).unwrap() else {
        panic!("not created")
    };
    id
}

pub(super) fn registration(id: WorkerId) -> Registration {
    Registration {
        id,
        host: "h".into(),
        pid: 1,
        world: world(false),
        fabric_endpoint: Blob(id.to_string().into_bytes()),
        regions: match id.role {
            WorkerRole::Rollout => vec![Blob(format!("{id} MR 0").into_bytes())],
            WorkerRole::Trainer => Vec::new(),
        },
        tensors: Vec::new(),
        placement: None,
        skip: Vec::new(),
    }
}

/// Triggers `version` and answers `Prepared` from both workers: trainers got `Start`.
pub(super) fn running(c: &mut Coordinator, version: u64, t: Now) -> u64 {
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

pub(super) fn prepares(fx: &Effects) -> usize {
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
    let t = Now::wall();
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
    assert!(matches!(c.trigger(3, t), Err(TriggerError::Busy { running, .. }) if running == next));
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
    assert!(
        c.sync(next)
            .unwrap()
            .awaiting_prepared
            .contains(&WorkerId::rollout(0))
    );
    // A rollout's Drained, or a trainer's for another sync, does not open the gate.
    assert_eq!(prepares(&c.message(2, drained(id, 1), t)), 0);
    assert_eq!(prepares(&c.message(1, drained(next, 2), t)), 0);
    assert!(c.draining().is_some());

    let fx = c.message(1, drained(id, 1), t.after(Duration::from_millis(20)));
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
    let t = Now::wall();
    let id = created(&mut c, 1, t);
    failed_by_trainer(&mut c, id, t);
    assert!(c.draining().is_none(), "no trainer was told to write");
    let (_, fx) = c.trigger(2, t).unwrap();
    assert_eq!(prepares(&fx), 2);
}

#[test]
fn a_trainer_that_never_drains_is_dropped_after_the_heartbeat_timeout() {
    let mut c = coordinator(0);
    let t0 = Now::wall();
    let id = running(&mut c, 1, t0);
    failed_by_trainer(&mut c, id, t0);
    let next = created(&mut c, 2, t0);
    // Both stay alive (heartbeats), but trainer-0 never answers the abort.
    let late = t0.after(Duration::from_millis(900));
    c.message(1, FromWorker::Heartbeat { seq: 1 }, late);
    c.message(2, FromWorker::Heartbeat { seq: 1 }, late);
    assert!(c.tick(late).close.is_empty(), "within the timeout");
    let fx = c.tick(t0.after(Duration::from_millis(1100)));
    assert_eq!(fx.close, vec![1], "trainer-0 dropped");
    assert!(c.draining().is_none(), "no longer blocks");
    let s = c.sync(next).unwrap();
    assert_eq!(s.state, SyncState::Failed);
    let f = s.failure.clone().unwrap();
    assert_eq!(f.worker, WorkerId::trainer(0));
    assert_eq!(f.kind, FailureKind::PeerLost);
    assert!(f.cause.contains("drained aborted sync"), "{f}");
    assert!(
        f.cause.contains(&format!("waited for sync {id} to drain")),
        "{f}"
    );
    // Its agent reconnects (draining on the way): once the re-plan is in force, the next
    // trigger goes out at once.
    let t2 = t0.after(Duration::from_secs(2));
    let fx = c
        .register(3, registration(WorkerId::trainer(0)), t2)
        .unwrap();
    plan_round(&mut c, fx, t2);
    let (_, fx) = c.trigger(2, t2).unwrap();
    assert_eq!(prepares(&fx), 2);
}

#[test]
fn a_trainer_that_dies_while_draining_no_longer_blocks() {
    let mut c = coordinator(0);
    let t = Now::wall();
    let id = running(&mut c, 1, t);
    // The rollout fails the sync; then trainer-0's connection drops before it drained.
    failed(&mut c, 2, id, "landing timed out", t);
    assert!(c.draining().is_some());
    c.disconnect(1, "connection closed", t);
    assert!(c.draining().is_none());
    let fx = c
        .register(3, registration(WorkerId::trainer(0)), t)
        .unwrap();
    plan_round(&mut c, fx, t);
    let (_, fx) = c.trigger(2, t).unwrap();
    assert_eq!(prepares(&fx), 2, "started at once");
}

#[test]
fn a_peer_disconnect_within_the_grace_period_is_named_as_the_cause() {
    let mut c = coordinator(300);
    let t0 = Now::wall();
    let id = created(&mut c, 1, t0);
    failed_by_trainer(&mut c, id, t0);
    assert_eq!(
        c.sync(id).unwrap().state,
        SyncState::Pending,
        "held for the grace period"
    );
    c.disconnect(2, "connection closed", t0.after(Duration::from_millis(50)));
    let f = c.sync(id).unwrap().failure.clone().unwrap();
    assert_eq!(f.worker, WorkerId::rollout(0));
    // The disconnect is named, with its own kind, over the report it explains.
    assert_eq!(f.kind, FailureKind::PeerLost);
    assert!(f.cause.contains("trainer-0 reported"), "{f}");
}

#[test]
fn a_failure_report_stands_after_the_grace_period_and_a_failed_version_can_be_retried() {
    let mut c = coordinator(300);
    let t0 = Now::wall();
    let id = created(&mut c, 1, t0);
    failed_by_trainer(&mut c, id, t0);
    c.tick(t0.after(Duration::from_millis(400)));
    let s = c.sync(id).unwrap();
    assert_eq!(s.state, SyncState::Failed);
    // The connection it came on names the worker; the kind is the one it reported.
    assert_eq!(s.failure.as_ref().unwrap().worker, WorkerId::trainer(0));
    assert_eq!(s.failure.as_ref().unwrap().kind, FailureKind::Fabric);
    let (again, fx) = c.trigger(1, t0.after(Duration::from_millis(500))).unwrap();
    assert!(matches!(again, Triggered::Created(n) if n != id));
    assert_eq!(fx.send.len(), 2, "prepare to both workers");
}

#[test]
fn committed_versions_are_idempotent_and_history_is_bounded() {
    let mut c = coordinator(0);
    let mut t = Now::wall();
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
        t = t.after(Duration::from_millis(10));
    }
    assert_eq!(c.history().len(), 3);
    assert!(matches!(c.trigger(2, t), Err(TriggerError::Stale { .. })));
}

#[test]
fn the_sync_timeout_names_who_it_waited_for() {
    let mut c = coordinator(0);
    let t0 = Now::wall();
    let id = created(&mut c, 1, t0);
    c.message(
        1,
        FromWorker::Heartbeat { seq: 1 },
        t0.after(Duration::from_secs(5)),
    );
    c.message(
        2,
        FromWorker::Heartbeat { seq: 1 },
        t0.after(Duration::from_secs(5)),
    );
    c.tick(t0.after(Duration::from_millis(5100)));
    let f = c.sync(id).unwrap().failure.clone().unwrap();
    assert_eq!(f.kind, FailureKind::Timeout);
    assert!(
        f.cause.contains("timed out") && f.cause.contains("trainer-0, rollout-0"),
        "{f}"
    );
}

/// Registers the world of `trainers` trainers (connections 1..) and one rollout (connection 100),
/// returning the coordinator and the effects of the last registration.
pub(super) fn registered(trainers: u32, t: Now) -> (Coordinator, Effects) {
    let mut c = Coordinator::new(config(trainers, 0));
    let mut fx = Effects::default();
    for r in 0..trainers {
        fx = c
            .register(u64::from(r) + 1, registration(WorkerId::trainer(r)), t)
            .unwrap();
    }
    fx.merge(
        c.register(100, registration(WorkerId::rollout(0)), t)
            .unwrap(),
    );
    (c, fx)
}

fn not_ready(c: &mut Coordinator, t: Now) -> String {
    match c.trigger(1, t) {
        Err(TriggerError::NotReady(why)) => why,
        other => panic!("expected NotReady, got {other:?}"),
    }
}

#[test]
fn a_plan_is_in_force_only_once_every_worker_is_ready_and_trainers_then_get_their_peers() {
    let t = Now::wall();
    let (mut c, fx) = registered(2, t);
    let req = fx.plan.expect("the complete world asks for a plan");
    assert_eq!(req.workers.len(), 3);
    assert!(not_ready(&mut c, t).contains("being computed"));
    assert_eq!(c.planning(), Some(req.plan_id));

    let out = NullPlanner.plan(req.plan_id, &req.world, &req.workers);
    let fx = c.planned(req.plan_id, out, t);
    let assigned: Vec<u64> = fx
        .send
        .iter()
        .filter(|(_, m)| matches!(m, ToWorker::Assign(_)))
        .map(|(conn, _)| *conn)
        .collect();
    assert_eq!(assigned, vec![1, 2, 100]);
    assert!(c.plan().is_none(), "not in force before every Ready");
    assert!(not_ready(&mut c, t).contains("waiting for trainer-0, trainer-1, rollout-0"));

    let gather = |r: u32| vec![Blob(format!("trainer-{r} gather").into_bytes())];
    assert!(
        c.message(1, ready(req.plan_id, gather(0)), t)
            .send
            .is_empty()
    );
    // A Ready for another plan, or a second one, counts for nothing.
    assert!(
        c.message(2, ready(req.plan_id + 1, gather(1)), t)
            .send
            .is_empty()
    );
    assert!(
        c.message(1, ready(req.plan_id, gather(0)), t)
            .send
            .is_empty()
    );
    assert!(
        c.message(2, ready(req.plan_id, gather(1)), t)
            .send
            .is_empty()
    );
    assert!(not_ready(&mut c, t).contains("waiting for rollout-0"));

    let fx = c.message(100, ready(req.plan_id, Vec::new()), t);
    assert!(c.plan().is_some_and(|p| p.id == req.plan_id));
    let mut peers_of = std::collections::BTreeMap::new();
    for (conn, m) in fx.send {
        let ToWorker::Peers { plan_id, peers } = m else {
            panic!("only Peers go out: {m:?}")
        };
        assert_eq!(plan_id, req.plan_id);
        peers_of.insert(conn, peers);
    }
    assert_eq!(peers_of.len(), 2, "every trainer, no rollout");
    let t0 = &peers_of[&1];
    assert_eq!(
        t0.iter().map(|p| p.id).collect::<Vec<_>>(),
        vec![WorkerId::trainer(1), WorkerId::rollout(0)],
        "everyone but itself"
    );
    assert_eq!(
        t0[0].regions,
        gather(1),
        "a trainer's regions come from its Ready"
    );
    assert_eq!(t0[1].regions, registration(WorkerId::rollout(0)).regions);
    assert_eq!(t0[1].fabric_endpoint, Blob(b"rollout-0".to_vec()));
    assert_eq!(peers_of[&2][0].regions, gather(0));
    let (Triggered::Created(_), fx) = c.trigger(1, t).unwrap() else {
        panic!("not created")
    };
    assert_eq!(prepares(&fx), 3);
}

#[test]
fn a_plan_superseded_by_a_membership_change_is_dropped_when_it_arrives() {
    let t = Now::wall();
    let (mut c, fx) = registered(1, t);
    let first = fx.plan.unwrap();
    // The rollout leaves and comes back while plan 1 is being computed.
    c.disconnect(100, "connection closed", t);
    assert_eq!(c.planning(), None);
    let fx = c
        .register(101, registration(WorkerId::rollout(0)), t)
        .unwrap();
    let second = fx.plan.expect("complete again: a new plan");
    assert!(second.plan_id > first.plan_id);

    let stale = NullPlanner.plan(first.plan_id, &first.world, &first.workers);
    let fx = c.planned(first.plan_id, stale, t);
    assert!(
        fx.send.is_empty(),
        "nothing goes out for a superseded plan: {fx:?}"
    );
    assert!(c.latest_plan().is_none());
    assert!(c.log().iter().any(|l| l.message.contains("dropped")));

    let fresh = NullPlanner.plan(second.plan_id, &second.world, &second.workers);
    let fx = c.planned(second.plan_id, fresh, t);
    let conns: Vec<u64> = fx.send.iter().map(|(conn, _)| *conn).collect();
    assert_eq!(
        conns,
        vec![1, 101],
        "the rollout's new connection gets the assignment"
    );
}

#[test]
fn a_worker_that_cannot_follow_its_plan_is_named_by_the_trigger() {
    let t = Now::wall();
    let (mut c, fx) = registered(1, t);
    let req = fx.plan.unwrap();
    let out = NullPlanner.plan(req.plan_id, &req.world, &req.workers);
    c.planned(req.plan_id, out, t);
    c.message(
        1,
        FromWorker::Failed {
            sync_id: 0,
            version: 0,
            failure: Fault {
                kind: FailureKind::Source,
                tensor: None,
                cause: "assignment: source memory of 8 bytes is shorter than the plan needs".into(),
            },
        },
        t,
    );
    let why = not_ready(&mut c, t);
    assert!(
        why.contains("trainer-0 could not follow plan 1: assignment: source memory"),
        "{why}"
    );
}

#[test]
fn a_re_plan_asks_every_worker_for_ready_again() {
    let mut c = coordinator(0);
    let t = Now::wall();
    c.disconnect(2, "connection closed", t);
    assert!(not_ready(&mut c, t).contains("missing rollout-0"));
    let fx = c
        .register(3, registration(WorkerId::rollout(0)), t)
        .unwrap();
    assert!(
        c.log()
            .iter()
            .any(|l| l.message.contains("re-plan: membership changed (rollout-0"))
    );
    let req = fx.plan.unwrap();
    let out = NullPlanner.plan(req.plan_id, &req.world, &req.workers);
    c.planned(req.plan_id, out, t);
    assert!(not_ready(&mut c, t).contains("waiting for trainer-0, rollout-0"));
    c.message(1, ready(req.plan_id, Vec::new()), t);
    let fx = c.message(3, ready(req.plan_id, Vec::new()), t);
    assert_eq!(fx.send.len(), 1, "Peers to the trainer");
    assert!(c.trigger(1, t).is_ok());
}

#[test]
fn a_pushed_version_starts_once_every_trainer_pushed_it_and_the_plan_is_in_force() {
    let mut c = Coordinator::new(config(2, 0));
    let t = Now::wall();
    let push = |version| FromWorker::Push { version, run: 0 };
    let mut fx = Effects::default();
    for (conn, id) in [
        (1, WorkerId::trainer(0)),
        (3, WorkerId::trainer(1)),
        (2, WorkerId::rollout(0)),
    ] {
        fx.merge(c.register(conn, registration(id), t).unwrap());
    }
    // Pushed before the plan is in force: it waits.
    assert_eq!(prepares(&c.message(1, push(1), t)), 0);
    assert_eq!(prepares(&c.message(3, push(1), t)), 0);
    let fx = plan_round(&mut c, fx, t);
    assert_eq!(prepares(&fx), 3, "the plan's last Ready starts it: {fx:?}");
    let id = c.active().unwrap();
    assert_eq!(c.sync(id).unwrap().version, 1);
    // Idempotent while it runs; a next version waits for it to end, and for every trainer.
    assert!(c.message(1, push(1), t).send.is_empty());
    assert_eq!(prepares(&c.message(1, push(2), t)), 0);
    assert_eq!(prepares(&c.message(3, push(2), t)), 0);
    // A rollout's push is ignored.
    assert!(c.message(2, push(3), t).send.is_empty());
    let fx = c.message(
        1,
        FromWorker::Failed {
            sync_id: id,
            version: 1,
            failure: Fault {
                kind: FailureKind::Other,
                tensor: None,
                cause: "boom".into(),
            },
        },
        t,
    );
    let aborts: Vec<_> = fx
        .send
        .iter()
        .filter_map(|(_, m)| match m {
            ToWorker::Abort { failure, .. } => failure.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(aborts.len(), 3, "{fx:?}");
    assert!(aborts.iter().all(|f| f.worker == WorkerId::trainer(0)));
    assert_eq!(prepares(&fx), 3, "version 2 starts once 1 ended: {fx:?}");
    assert_eq!(c.sync(c.active().unwrap()).unwrap().version, 2);
}

#[test]
fn a_job_spelled_differently_is_the_same_job_and_another_job_is_refused() {
    let mut cfg = config(1, 0);
    cfg.world.train = "fsdp=2".into();
    cfg.world.infer = "tp=2,format=hf,embed=vocab".into();
    cfg.rollouts = 2;
    let mut c = Coordinator::new(cfg.clone());
    let now = Now::wall();
    // The same layouts, keys in another order and the format by its other name.
    let same = WorldSpec {
        train: "fsdp=2,pp=1".into(),
        infer: "embed=vocab,format=transformers,tp=2".into(),
        ..cfg.world.clone()
    };
    let reg = Registration {
        world: same,
        ..registration(WorkerId::rollout(0))
    };
    c.register(1, reg, now)
        .expect("the same job, spelled differently");
    // The whole embedding is another layout: refused, both statements named.
    let other = WorldSpec {
        infer: "tp=2,format=hf".into(),
        ..cfg.world.clone()
    };
    let reg = Registration {
        world: other,
        ..registration(WorkerId::rollout(1))
    };
    let e = c.register(2, reg, now).unwrap_err();
    assert!(e.0.contains("states a different job"), "{e}");
    assert!(
        e.0.contains("infer=tp=2,format=hf ") && e.0.contains("embed=vocab"),
        "{e}"
    );
}
