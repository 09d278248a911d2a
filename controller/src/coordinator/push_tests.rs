//! Pushed versions bound to the bytes of the process that pushed them, and runs: the cases of
//! the reliability review (a restarted rank completing a version with its predecessor's push, a
//! trainer that ran ahead, a job restarted from an older checkpoint, a controller restart).

use weightsync_common::protocol::{FailureKind, FromWorker, ToWorker, WorkerId, WorkerReport};

use super::tests::{coordinator, plan_round, prepares, registered, registration};
use super::*;

fn push(version: u64, run: u64) -> FromWorker {
    FromWorker::Push { version, run }
}

/// The (version, kind) of every `Abort` of sync 0 in `fx`.
fn ended_unsynced(fx: &Effects) -> Vec<(u64, FailureKind)> {
    fx.send
        .iter()
        .filter_map(|(_, m)| match m {
            ToWorker::Abort {
                sync_id: 0,
                version,
                failure,
                ..
            } => Some((
                *version,
                failure.as_ref().map_or(FailureKind::Other, |f| f.kind),
            )),
            _ => None,
        })
        .collect()
}

/// The (sync id, version, run) of the `Prepare`s in `fx`.
fn prepared(fx: &Effects) -> Vec<(u64, u64, u64)> {
    fx.send
        .iter()
        .filter_map(|(_, m)| match m {
            ToWorker::Prepare {
                sync_id,
                version,
                run,
            } => Some((*sync_id, *version, *run)),
            _ => None,
        })
        .collect()
}

/// Answers sync `id` of `version` in the one-trainer job (trainer on 1, rollout on 2) until it
/// commits; the commit's effects.
fn complete(c: &mut Coordinator, id: u64, version: u64, t: Now) -> Effects {
    let r = WorkerReport::default;
    for conn in [1, 2] {
        c.message(
            conn,
            FromWorker::Prepared {
                sync_id: id,
                version,
                report: r(),
            },
            t,
        );
    }
    c.message(
        1,
        FromWorker::Written {
            sync_id: id,
            version,
            report: r(),
        },
        t,
    );
    let fx = c.message(
        2,
        FromWorker::Landed {
            sync_id: id,
            version,
            verified: None,
            report: r(),
        },
        t,
    );
    assert!(
        fx.send
            .iter()
            .any(|(_, m)| matches!(m, ToWorker::Commit { sync_id, .. } if *sync_id == id)),
        "{fx:?}"
    );
    fx
}

#[test]
fn a_restarted_ranks_push_never_completes_a_version_with_its_predecessors() {
    let t = Now::wall();
    let (mut c, fx) = registered(2, t);
    plan_round(&mut c, fx, t);
    // trainer-0 pushes 1, then its process dies; the new one registers on another connection.
    assert_eq!(prepares(&c.message(1, push(1, 0), t)), 0);
    c.disconnect(1, "killed", t);
    let fx = c
        .register(7, registration(WorkerId::trainer(0)), t)
        .unwrap();
    plan_round(&mut c, fx, t);
    // trainer-1's push of 1 does not start it: the new trainer-0 has not pushed (it may be
    // inside its optimizer step).
    assert_eq!(prepares(&c.message(2, push(1, 0), t)), 0);
    assert_eq!(c.active(), None);
    // Once it pushes on its own connection, version 1 starts.
    let fx = c.message(7, push(1, 0), t);
    assert_eq!(prepares(&fx), 3, "{fx:?}");
}

#[test]
fn the_newest_fully_pushed_version_starts_and_older_ones_end_superseded() {
    let t = Now::wall();
    let (mut c, fx) = registered(2, t);
    // Both trainers push 1 and 2 before the plan is in force (a trainer that ran ahead).
    c.message(1, push(1, 0), t);
    c.message(2, push(1, 0), t);
    let fx1 = c.message(1, push(2, 0), t);
    // trainer-0's push of 2 replaces its push of 1: its tensors no longer hold 1.
    assert_eq!(ended_unsynced(&fx1), vec![(1, FailureKind::Superseded)]);
    c.message(2, push(2, 0), t);
    let started = plan_round(&mut c, fx, t);
    assert_eq!(prepared(&started).len(), 3, "{started:?}");
    assert!(prepared(&started).iter().all(|&(_, v, r)| (v, r) == (2, 0)));
    // A trainer pushing an older version again (its tensors went back) leaves no push of the
    // newer one behind.
    let (mut c, fx) = registered(2, t);
    c.message(1, push(2, 0), t);
    c.message(2, push(2, 0), t);
    let back = c.message(1, push(1, 0), t);
    assert_eq!(ended_unsynced(&back), vec![(2, FailureKind::Superseded)]);
    let started = plan_round(&mut c, fx, t);
    assert!(prepared(&started).is_empty(), "{started:?}");
}

#[test]
fn a_job_restarted_from_an_older_checkpoint_goes_on_under_a_new_run() {
    let mut c = coordinator(0);
    let t = Now::wall();
    let fx = c.message(1, push(5, 0), t);
    let (id, _, _) = prepared(&fx)[0];
    assert!(
        fx.persist,
        "a new sync id is saved before its Prepare goes out"
    );
    assert!(complete(&mut c, id, 5, t).persist);
    assert_eq!(c.latest_committed(), Some((0, 5)));
    // The newest committed version pushed again is answered with its commit (idempotent).
    let fx = c.message(1, push(5, 0), t);
    assert!(
        matches!(fx.send[..], [(1, ToWorker::Commit { sync_id, version: 5, run: 0 })] if sync_id == id),
        "{fx:?}"
    );
    // Restarted from the checkpoint of version 3: stale in run 0, and said so by kind.
    let fx = c.message(1, push(3, 0), t);
    assert_eq!(ended_unsynced(&fx), vec![(3, FailureKind::Stale)]);
    assert_eq!(c.active(), None);
    // Under a new run, version 3 syncs and the committed (run, version) still grows.
    let fx = c.message(1, push(3, 1), t);
    let p = prepared(&fx);
    assert_eq!(p.len(), 2, "{fx:?}");
    assert!(p.iter().all(|&(_, v, r)| (v, r) == (3, 1)));
    let fx = complete(&mut c, p[0].0, 3, t);
    assert!(fx.send.iter().all(|(_, m)| matches!(
        m,
        ToWorker::Commit {
            run: 1,
            version: 3,
            ..
        }
    )));
    assert_eq!(c.latest_committed(), Some((1, 3)));
    assert_eq!(c.run(), 1);
    // The old run's pushes are superseded now, and runs only grow.
    let fx = c.message(1, push(9, 0), t);
    assert_eq!(ended_unsynced(&fx), vec![(9, FailureKind::Superseded)]);
    assert!(c.begin_run(1, t).is_err());
}

#[test]
fn a_restored_coordinator_keeps_the_run_and_the_committed_version_and_never_reuses_an_id() {
    let mut c = coordinator(0);
    let t = Now::wall();
    let fx = c.message(1, push(4, 2), t);
    let (id, _, _) = prepared(&fx)[0];
    complete(&mut c, id, 4, t);
    // A second sync is in flight when the controller dies.
    let fx = c.message(1, push(6, 2), t);
    let (in_flight, _, _) = prepared(&fx)[0];
    let saved = c.durable();
    let mut again = Coordinator::restore(c.config().clone(), &saved, 99);
    assert_eq!(again.incarnation(), 99);
    assert_eq!(again.run(), 2);
    assert_eq!(again.latest_committed(), Some((2, 4)));
    // Workers reconnect (new connections) and the plan is redone.
    let mut fx = Effects::default();
    for (conn, id) in [(11, WorkerId::trainer(0)), (12, WorkerId::rollout(0))] {
        fx.merge(again.register(conn, registration(id), t).unwrap());
    }
    plan_round(&mut again, fx, t);
    // The pushes re-sent after the reconnect: the version syncs under an id never used.
    let fx = again.message(11, push(6, 2), t);
    let (next, v, r) = prepared(&fx)[0];
    assert!(next > in_flight, "{next} after {in_flight}");
    assert_eq!((v, r), (6, 2));
    // A stale push is still stale after the restart.
    let fx = again.message(11, push(4, 2), t);
    assert_eq!(ended_unsynced(&fx), vec![(4, FailureKind::Stale)]);
}
