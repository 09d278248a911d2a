//! The delta policy driven through the coordinator: real syncs (trigger, `Prepared`, `Start`,
//! `Written`, `Landed`, `Verify`, `Verified`) with chosen `Start`-to-commit times, checking
//! what each `Start` offered and the reason the sync records.

use std::time::Duration;

use weightsync_common::protocol::{Blob, FromWorker, ToWorker, WorkerId, WorkerReport};

use super::delta_policy::{DeltaMode, REPROBE_EVERY};
use super::tests::{config, created, failed_by_trainer, ready, registration, world};
use super::*;
use crate::planning::{NullPlanner, Planner};
use crate::sync_record::SyncState;

const TRAINER: ConnId = 1;
const ROLLOUT: ConnId = 2;

/// Trainer-0 and rollout-0 of a verifying job in `mode`, the rollout with a delta inbox, the
/// plan in force.
fn coordinator(mode: DeltaMode) -> Coordinator {
    let mut cfg = config(1, 0);
    cfg.world = world(true);
    let mut c = Coordinator::new(cfg.clone());
    c.set_delta_mode(mode);
    let now = Now::wall();
    let mut fx = Effects::default();
    for (conn, id) in [
        (TRAINER, WorkerId::trainer(0)),
        (ROLLOUT, WorkerId::rollout(0)),
    ] {
        let reg = Registration {
            world: cfg.world.clone(),
            ..registration(id)
        };
        fx.merge(c.register(conn, reg, now).unwrap());
    }
    let req = fx.plan.expect("a plan was asked for");
    let out = NullPlanner.plan(req.plan_id, &req.world, &req.workers);
    for (conn, msg) in c.planned(req.plan_id, out, now).send {
        let ToWorker::Assign(a) = msg else {
            panic!("expected an assignment, got {msg:?}")
        };
        assert_eq!(a.delta(), mode != DeltaMode::Off, "{mode}: {a:?}");
        let inbox = if conn == ROLLOUT && a.delta() {
            vec![Blob(b"rollout-0 inbox".to_vec())]
        } else {
            Vec::new()
        };
        c.message(conn, ready(a.plan_id(), inbox), now);
    }
    c
}

/// Runs `version` from `t`: `Start` to commit takes `ms` (or the trainer fails it at `Start`,
/// and drains). Returns whether `Start` offered deltas, and the reason the sync records.
fn sync(c: &mut Coordinator, version: u64, t: Now, ms: u64, fail: bool) -> (bool, String) {
    let id = created(c, version, t);
    let mut offered = None;
    for conn in [TRAINER, ROLLOUT] {
        let prepared = FromWorker::Prepared {
            sync_id: id,
            version,
            report: WorkerReport::default(),
        };
        for (_, m) in c.message(conn, prepared, t).send {
            if let ToWorker::Start { delta, .. } = m {
                offered = Some(delta.is_some());
            }
        }
    }
    let offered = offered.expect("Start went to the trainer");
    let why = c.sync(id).unwrap().delta_policy.clone().unwrap().1;
    if fail {
        failed_by_trainer(c, id, t);
        c.message(
            TRAINER,
            FromWorker::Drained {
                sync_id: id,
                version,
            },
            t,
        );
        assert_eq!(c.sync(id).unwrap().state, SyncState::Failed);
        return (offered, why);
    }
    let end = t.after(Duration::from_millis(ms));
    let written = FromWorker::Written {
        sync_id: id,
        version,
        report: WorkerReport::default(),
    };
    let landed = FromWorker::Landed {
        sync_id: id,
        version,
        verified: None,
        report: WorkerReport::default(),
    };
    c.message(TRAINER, written, end);
    c.message(ROLLOUT, landed, end);
    let verified = FromWorker::Verified {
        sync_id: id,
        version,
        report: WorkerReport::default(),
    };
    c.message(ROLLOUT, verified, end);
    assert_eq!(c.sync(id).unwrap().state, SyncState::Committed);
    (offered, why)
}

#[test]
fn auto_probes_after_the_first_full_sync_and_keeps_deltas_while_they_pay() {
    let mut c = coordinator(DeltaMode::Auto);
    let t = Now::wall();
    assert_eq!(
        sync(&mut c, 1, t, 100, false),
        (
            false,
            "auto: full (nothing committed in this run yet)".into()
        )
    );
    assert_eq!(
        sync(&mut c, 2, t, 30, false),
        (true, "auto: probe (full 100.0 ms)".into())
    );
    assert_eq!(
        sync(&mut c, 3, t, 40, false),
        (true, "auto: delta pays (30.0 ms vs full 100.0 ms)".into())
    );
    assert_eq!(
        sync(&mut c, 4, t, 150, false),
        (true, "auto: delta pays (40.0 ms vs full 100.0 ms)".into())
    );
    // The last delta sync took longer than the last full one: back to full.
    let (offered, why) = sync(&mut c, 5, t, 100, false);
    assert!(!offered, "{why}");
    assert_eq!(
        why,
        format!(
            "auto: full pays (delta 150.0 ms vs full 100.0 ms; probe again in {REPROBE_EVERY} syncs)"
        )
    );
}

#[test]
fn auto_probes_again_after_reprobe_every_full_syncs() {
    let mut c = coordinator(DeltaMode::Auto);
    let t = Now::wall();
    sync(&mut c, 1, t, 100, false);
    assert!(sync(&mut c, 2, t, 300, false).0, "the probe");
    let mut v = 3;
    for _ in 0..REPROBE_EVERY {
        let (offered, why) = sync(&mut c, v, t, 100, false);
        assert!(!offered && why.starts_with("auto: full pays"), "{v}: {why}");
        v += 1;
    }
    let (offered, why) = sync(&mut c, v, t, 20, false);
    assert!(offered, "{why}");
    assert!(
        why.starts_with(&format!(
            "auto: probe again after {REPROBE_EVERY} full syncs"
        )),
        "{why}"
    );
    // The probe paid this time (changes thinned out): deltas stay.
    assert_eq!(
        sync(&mut c, v + 1, t, 20, false),
        (true, "auto: delta pays (20.0 ms vs full 100.0 ms)".into())
    );
}

#[test]
fn a_failed_sync_makes_the_next_one_full_then_deltas_resume() {
    let mut c = coordinator(DeltaMode::Auto);
    let t = Now::wall();
    sync(&mut c, 1, t, 100, false);
    assert!(sync(&mut c, 2, t, 10, false).0);
    // Version 3 fails after `Start`: the engine may hold half of it.
    assert!(sync(&mut c, 3, t, 0, true).0);
    assert!(!c.engine_bases().contains_key(&WorkerId::rollout(0)));
    assert_eq!(
        sync(&mut c, 4, t, 90, false),
        (
            false,
            "auto: full (no engine holds the last committed version with a delta inbox)".into()
        )
    );
    assert_eq!(
        sync(&mut c, 5, t, 10, false),
        (true, "auto: delta pays (10.0 ms vs full 90.0 ms)".into())
    );
}

#[test]
fn on_offers_deltas_whatever_they_cost_and_off_never() {
    let mut on = coordinator(DeltaMode::On);
    let t = Now::wall();
    assert_eq!(
        sync(&mut on, 1, t, 10, false),
        (false, "on: full (nothing committed in this run yet)".into())
    );
    for v in 2..=3 {
        assert_eq!(sync(&mut on, v, t, 500, false), (true, "on".into()));
    }
    let mut off = coordinator(DeltaMode::Off);
    for v in 1..=3 {
        assert_eq!(sync(&mut off, v, t, 10, false), (false, "off".into()));
    }
}
