//! What committing costs once every byte landed, split into its parts: waiting for the last
//! trainer's "written" before `Verify` goes out, the rollouts' check, and the control messages.

use std::time::Duration;

use weightsync_common::protocol::{FromWorker, Stage, TimelineEvent, WHOLE_SYNC, WorkerReport};

use super::tests::{running, verifying_coordinator};
use super::*;
use crate::sync_record::SyncState;

const TRAINER_CONN: ConnId = 1;
const ROLLOUT_CONN: ConnId = 2;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn report(stage: Stage, start_ms: u64, end_ms: u64) -> WorkerReport {
    WorkerReport {
        bytes: 4096,
        events: vec![TimelineEvent {
            task: WHOLE_SYNC,
            piece: 0,
            stage,
            start_ns: start_ms * 1_000_000,
            end_ns: end_ms * 1_000_000,
            bytes: 4096,
        }],
        ..WorkerReport::default()
    }
}

/// Runs a verified sync: the rollout lands at `landed_ms`, the trainer reports written at
/// `written_ms`, the rollout checks from `check_ms.0` to `check_ms.1` and its `Verified`
/// arrives at `verified_ms` (all from the trigger). Returns the sync's durations.
fn verified_sync(
    landed_ms: u64,
    written_ms: u64,
    check_ms: (u64, u64),
    verified_ms: u64,
) -> crate::sync_record::StageDurations {
    let mut c = verifying_coordinator();
    let t = Now::wall();
    let id = running(&mut c, 1, t);
    let written = FromWorker::Written {
        sync_id: id,
        version: 1,
        report: WorkerReport::default(),
    };
    let landed = FromWorker::Landed {
        sync_id: id,
        version: 1,
        verified: None,
        report: report(Stage::Land, 0, landed_ms),
    };
    let mut arrivals = [
        (written_ms, TRAINER_CONN, written),
        (landed_ms, ROLLOUT_CONN, landed),
    ];
    arrivals.sort_by_key(|a| a.0);
    let mut verify_sent = false;
    for (at, conn, msg) in arrivals {
        let fx = c.message(conn, msg, t.after(ms(at)));
        verify_sent |= fx
            .send
            .iter()
            .any(|(_, m)| matches!(m, ToWorker::Verify { .. }));
    }
    assert!(verify_sent, "Verify went out once both reports were in");
    let fx = c.message(
        ROLLOUT_CONN,
        FromWorker::Verified {
            sync_id: id,
            version: 1,
            report: report(Stage::Verify, check_ms.0, check_ms.1),
        },
        t.after(ms(verified_ms)),
    );
    assert!(fx.finished.contains(&id));
    let s = c.sync(id).unwrap();
    assert_eq!(s.state, SyncState::Committed);
    assert_eq!(s.verified, Some(true));
    s.durations()
}

fn close(got: Option<f64>, want_ms: f64) -> bool {
    got.is_some_and(|g| (g - want_ms).abs() < 1e-6)
}

#[test]
fn after_landing_splits_into_the_check_and_the_control_messages() {
    let d = verified_sync(12, 10, (13, 19), 20);
    assert!(close(d.after_landing_ms, 8.0), "{d:?}");
    assert!(close(d.after_landing_wait_ms, 0.0), "{d:?}");
    assert!(close(d.after_landing_check_ms, 6.0), "{d:?}");
    assert!(close(d.after_landing_control_ms, 2.0), "{d:?}");
    assert!(close(d.verify_ms, 8.0), "{d:?}");
}

#[test]
fn a_trainer_written_after_the_last_landing_is_the_wait() {
    let d = verified_sync(10, 15, (16, 17), 18);
    assert!(close(d.after_landing_ms, 8.0), "{d:?}");
    assert!(close(d.after_landing_wait_ms, 5.0), "{d:?}");
    assert!(close(d.after_landing_check_ms, 1.0), "{d:?}");
    assert!(close(d.after_landing_control_ms, 2.0), "{d:?}");
}
