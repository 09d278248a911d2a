//! An engine's own stages: added to its lane of a committed sync (views and trace), or refused
//! whole, naming why, with nothing changed and the connection kept.

use std::time::Duration;

use weightsync_common::protocol::{
    FromWorker, MAX_ENGINE_STAGE_EVENTS, Stage, TimelineEvent, WHOLE_SYNC, WorkerId, WorkerReport,
};

use super::tests::{coordinator, created, failed_by_trainer, running};
use super::*;
use crate::sync_record::SyncState;

const ROLLOUT_CONN: ConnId = 2;
const TRAINER_CONN: ConnId = 1;

fn span(stage: Stage, start_ms: u64, end_ms: u64) -> TimelineEvent {
    TimelineEvent {
        task: WHOLE_SYNC,
        piece: 0,
        stage,
        start_ns: start_ms * 1_000_000,
        end_ns: end_ms * 1_000_000,
        bytes: 0,
    }
}

/// Runs `version` to its commit at `t`; the rollout's `Landed` carries a land span of 0..10 ms.
fn committed(c: &mut Coordinator, version: u64, t: Now) -> u64 {
    let id = running(c, version, t);
    c.message(
        TRAINER_CONN,
        FromWorker::Written {
            sync_id: id,
            version,
            report: WorkerReport::default(),
        },
        t,
    );
    let fx = c.message(
        ROLLOUT_CONN,
        FromWorker::Landed {
            sync_id: id,
            version,
            verified: None,
            report: WorkerReport {
                bytes: 4096,
                writes: 2,
                events: vec![span(Stage::Land, 0, 10)],
                ..WorkerReport::default()
            },
        },
        t,
    );
    assert!(fx.finished.contains(&id));
    assert_eq!(c.sync(id).unwrap().state, SyncState::Committed);
    id
}

fn stages(sync_id: u64, version: u64, events: Vec<TimelineEvent>) -> FromWorker {
    FromWorker::EngineStages {
        sync_id,
        version,
        events,
    }
}

/// What every view shows of a sync: its JSON with lanes, and its trace.
fn shown(c: &Coordinator, id: u64) -> String {
    let s = c.sync(id).unwrap();
    format!(
        "{}\n{}",
        serde_json::to_string(&s.view(true)).unwrap(),
        crate::http::trace::chrome_trace(s)
    )
}

#[test]
fn an_engines_stages_join_its_lane_of_a_committed_sync_in_start_order() {
    let mut c = coordinator(0);
    let t = Now::wall();
    let id = committed(&mut c, 1, t);
    let rollout = WorkerId::rollout(0);
    let lane_before = c.sync(id).unwrap().lanes[&rollout].clone();
    let gbps_before = crate::sync_record::lane_gbps(c.sync(id).unwrap(), &rollout);

    // Reported after the commit, out of order: resume, pause, load.
    let fx = c.message(
        ROLLOUT_CONN,
        stages(
            id,
            1,
            vec![
                span(Stage::Resume, 30, 34),
                span(Stage::Pause, 12, 34),
                span(Stage::Load, 13, 30),
            ],
        ),
        t.after(Duration::from_millis(50)),
    );
    assert!(fx.is_empty(), "not answered: {fx:?}");
    let s = c.sync(id).unwrap();
    let lane = &s.lanes[&rollout];
    let names: Vec<&str> = lane.spans.iter().map(|x| x.stage.name()).collect();
    assert_eq!(names, ["land", "pause", "load", "resume"]);
    let load = &lane.spans[2];
    assert_eq!((load.start_ns, load.end_ns), (13_000_000, 30_000_000));
    // The lane's counts, done marks and rate are the landing's.
    assert_eq!(
        (lane.bytes, lane.writes, lane.done_ns, lane.part_done_ns),
        (
            lane_before.bytes,
            lane_before.writes,
            lane_before.done_ns,
            lane_before.part_done_ns
        )
    );
    assert_eq!(crate::sync_record::lane_gbps(s, &rollout), gbps_before);
    assert_eq!(s.state, SyncState::Committed);

    // The JSON view and the trace show them on rollout-0's lane.
    let view = serde_json::to_value(s.view(true)).unwrap();
    let lanes = view["lanes"].as_array().unwrap();
    let rl = lanes.iter().find(|l| l["worker"] == "rollout-0").unwrap();
    let stages: Vec<&str> = rl["spans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["stage"].as_str().unwrap())
        .collect();
    assert_eq!(stages, ["land", "pause", "load", "resume"]);
    let trace = crate::http::trace::chrome_trace(s);
    let events = trace["traceEvents"].as_array().unwrap();
    let tid = events
        .iter()
        .find(|e| {
            e["name"] == "thread_name"
                && e["args"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("rollout-0"))
        })
        .map(|e| e["tid"].clone())
        .unwrap();
    let on_rollout: Vec<(&str, f64)> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["tid"] == tid)
        .map(|e| (e["name"].as_str().unwrap(), e["ts"].as_f64().unwrap()))
        .collect();
    assert_eq!(
        on_rollout,
        [
            ("land", 0.0),
            ("pause", 12_000.0),
            ("load", 13_000.0),
            ("resume", 30_000.0)
        ]
    );
}

#[test]
fn a_running_sync_takes_an_engines_stages_too() {
    let mut c = coordinator(0);
    let t = Now::wall();
    let id = running(&mut c, 1, t);
    c.message(
        ROLLOUT_CONN,
        stages(id, 1, vec![span(Stage::Pause, 0, 5)]),
        t.after(Duration::from_millis(5)),
    );
    let lane = &c.sync(id).unwrap().lanes[&WorkerId::rollout(0)];
    assert!(lane.spans.iter().any(|x| x.stage == Stage::Pause));
    assert_eq!(c.sync(id).unwrap().state, SyncState::Running);
}

/// Sends `msg` from `conn` and checks that it was refused saying `why` and changed nothing
/// that any view shows, and that the connection stays.
fn refused(c: &mut Coordinator, conn: ConnId, id: u64, msg: FromWorker, t: Now, why: &str) {
    let FromWorker::EngineStages {
        sync_id,
        version,
        events,
    } = msg.clone()
    else {
        unreachable!()
    };
    let sender = c.member_on(conn).unwrap();
    let before = shown(c, id);
    // The check itself, then the message as the connection delivers it.
    let err = c
        .add_engine_stages(sender, sync_id, version, &events, t)
        .unwrap_err()
        .to_string();
    assert!(err.contains(why), "refused saying {err:?}, not {why:?}");
    assert_eq!(
        shown(c, id),
        before,
        "a refused report changed the views ({err})"
    );
    let fx = c.message(conn, msg, t);
    assert!(fx.close.is_empty() && fx.send.is_empty(), "{fx:?}");
    assert_eq!(
        shown(c, id),
        before,
        "a refused report changed the views ({err})"
    );
    assert!(c.member_on(conn).is_some(), "{sender} is still registered");
}

#[test]
fn bad_reports_are_refused_whole_naming_why_and_change_nothing() {
    let mut c = coordinator(0);
    let t = Now::wall();
    let id = committed(&mut c, 1, t);
    let later = t.after(Duration::from_millis(100));
    let good = || vec![span(Stage::Pause, 10, 20), span(Stage::Load, 11, 19)];
    let pauses = |n: usize| vec![span(Stage::Pause, 1, 2); n];
    let too_many = format!("{} engine spans", MAX_ENGINE_STAGE_EVENTS + 1);
    let cases: Vec<(ConnId, FromWorker, &str)> = vec![
        (
            TRAINER_CONN,
            stages(id, 1, good()),
            "trainer-0 is not an engine",
        ),
        (ROLLOUT_CONN, stages(99, 1, good()), "sync 99 is unknown"),
        (
            ROLLOUT_CONN,
            stages(id, 7, good()),
            "is of version 1, not 7",
        ),
        (ROLLOUT_CONN, stages(id, 1, Vec::new()), "no spans"),
        (
            ROLLOUT_CONN,
            stages(id, 1, vec![good()[0].clone(), span(Stage::Load, 19, 11)]),
            "span 1 (load) ends at 11000000 ns, before it starts at 19000000 ns",
        ),
        (
            ROLLOUT_CONN,
            stages(id, 1, vec![span(Stage::Write, 10, 20)]),
            "span 0: stage write is not one an engine reports",
        ),
        // Ends 5 s after the report arrived (100 ms after the sync began).
        (
            ROLLOUT_CONN,
            stages(id, 1, vec![span(Stage::Resume, 10, 5_100)]),
            "span 0 (resume) ends 5000.0 ms after the report arrived",
        ),
        (
            ROLLOUT_CONN,
            stages(id, 1, pauses(MAX_ENGINE_STAGE_EVENTS + 1)),
            &too_many,
        ),
    ];
    for (conn, msg, why) in cases {
        refused(&mut c, conn, id, msg, later, why);
    }
    // The bound holds across reports: a lane of one sync never holds more.
    c.message(
        ROLLOUT_CONN,
        stages(id, 1, pauses(MAX_ENGINE_STAGE_EVENTS - 1)),
        later,
    );
    let lane = &c.sync(id).unwrap().lanes[&WorkerId::rollout(0)];
    assert_eq!(lane.spans.len(), 1 + MAX_ENGINE_STAGE_EVENTS - 1);
    refused(
        &mut c,
        ROLLOUT_CONN,
        id,
        stages(id, 1, pauses(2)),
        later,
        &too_many,
    );
    // A worker the sync did not include (it joined later).
    c.syncs
        .get_mut(&id)
        .unwrap()
        .members
        .remove(&WorkerId::rollout(0));
    let not_member = format!("rollout-0 is not one of sync {id}'s workers");
    refused(
        &mut c,
        ROLLOUT_CONN,
        id,
        stages(id, 1, pauses(1)),
        later,
        &not_member,
    );
}

#[test]
fn a_failed_or_queued_sync_takes_no_engine_stages() {
    let mut c = coordinator(0);
    let t = Now::wall();
    let id = running(&mut c, 1, t);
    failed_by_trainer(&mut c, id, t);
    assert_eq!(c.sync(id).unwrap().state, SyncState::Failed);
    let pause = || vec![span(Stage::Pause, 0, 1)];
    let later = t.after(Duration::from_millis(10));
    let failed = format!("sync {id} failed");
    refused(
        &mut c,
        ROLLOUT_CONN,
        id,
        stages(id, 1, pause()),
        later,
        &failed,
    );
    // Version 2 waits for trainer-0 to drain sync 1: nobody was told of it.
    let next = created(&mut c, 2, t);
    assert!(c.sync(next).unwrap().queued_behind.is_some());
    let queued = format!("sync {next} has not started");
    refused(
        &mut c,
        ROLLOUT_CONN,
        next,
        stages(next, 2, pause()),
        later,
        &queued,
    );
}
