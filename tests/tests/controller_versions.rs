//! `GET /v1/versions/{v}`, the long poll an inference engine's driver waits on instead of its
//! engine's workers: through `app(state)` with tower's `oneshot`, no socket; the version
//! protocol driven by feeding worker messages straight into the state.

use std::time::{Duration, Instant};

use serde_json::Value;
use weightsync_common::protocol::{FailureKind, Fault, FromWorker, WorkerId};
use weightsync_controller::app;
use weightsync_tests::controller_harness::*;

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

async fn get(st: &weightsync_controller::AppState, uri: &str) -> (u16, Value) {
    let (code, body) = call(app(st.clone()), "GET", uri, None, None).await;
    (code, json(&body))
}

async fn trigger(st: &weightsync_controller::AppState, version: u64) -> u64 {
    let (code, body) = call(
        app(st.clone()),
        "POST",
        "/v1/syncs",
        Some(&format!(r#"{{"version": {version}}}"#)),
        Some(API_TOKEN),
    )
    .await;
    assert_eq!(code, 202, "{body}");
    json(&body)["sync_id"].as_u64().unwrap()
}

#[tokio::test]
async fn waiters_return_when_the_version_starts_and_when_it_ends() {
    let st = state(1, 1, false);
    register_all(&st, 1, 1);
    let (code, v) = get(&st, "/v1/versions/1").await;
    assert_eq!(code, 200);
    assert_eq!(
        (&v["started"], &v["ended"], &v["reached"]),
        (&false.into(), &false.into(), &false.into()),
        "{v}"
    );
    assert!(
        v["sync"].is_null() && v["latest_committed"].is_null(),
        "{v}"
    );

    let started = tokio::spawn(get_owned(
        st.clone(),
        "/v1/versions/1?until=started&wait_s=20",
    ));
    let ended = tokio::spawn(get_owned(st.clone(), "/v1/versions/1?wait_s=20"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!started.is_finished() && !ended.is_finished());

    let id = trigger(&st, 1).await;
    let (code, v) = tokio::time::timeout(Duration::from_secs(5), started)
        .await
        .expect("the `started` waiter returned when the sync was created")
        .unwrap();
    assert_eq!(code, 200);
    assert_eq!(v["reached"], true, "{v}");
    assert_eq!(v["started"], true);
    assert_eq!(v["ended"], false);
    assert_eq!(v["sync"]["id"].as_u64(), Some(id));
    assert_eq!(v["sync"]["state"], "pending");
    assert!(
        !ended.is_finished(),
        "`ended` still waits while the sync runs"
    );

    complete_sync(&st, id, 1, 1, 1);
    let (_, v) = tokio::time::timeout(Duration::from_secs(5), ended)
        .await
        .expect("the `ended` waiter returned when the sync committed")
        .unwrap();
    assert_eq!(v["reached"], true, "{v}");
    assert_eq!(v["sync"]["state"], "committed");
    assert_eq!(v["latest_committed"].as_u64(), Some(1));

    // An older version is answered by the newer commit, at once.
    let (_, v) = get(&st, "/v1/versions/0?wait_s=30").await;
    assert_eq!(
        (v["ended"].as_bool(), v["reached"].as_bool()),
        (Some(true), Some(true))
    );
}

async fn get_owned(st: weightsync_controller::AppState, uri: &'static str) -> (u16, Value) {
    get(&st, uri).await
}

#[tokio::test]
async fn a_wait_that_runs_out_answers_what_is_known() {
    let st = state(1, 1, false);
    register_all(&st, 1, 1);
    let t0 = Instant::now();
    let (code, v) = get(&st, "/v1/versions/5?until=ended&wait_s=0.3").await;
    assert_eq!(code, 200);
    assert!(t0.elapsed() >= Duration::from_millis(300), "it waited");
    assert_eq!(
        (v["reached"].as_bool(), v["started"].as_bool()),
        (Some(false), Some(false))
    );
    assert_eq!(v["version"].as_u64(), Some(5));
}

#[tokio::test]
async fn a_failed_newer_version_ends_the_wait() {
    let st = state(1, 1, false);
    register_all(&st, 1, 1);
    let id = trigger(&st, 4).await;
    feed(
        &st,
        WorkerId::rollout(0),
        FromWorker::Failed {
            sync_id: id,
            version: 4,
            failure: Fault {
                kind: FailureKind::Timeout,
                tensor: None,
                cause: "landing timed out".into(),
            },
        },
    );
    // Asked for 3, the engine would load 4 or fail with it: 4 failed, so the wait is over.
    let (_, v) = get(&st, "/v1/versions/3").await;
    assert_eq!(
        (v["ended"].as_bool(), v["reached"].as_bool()),
        (Some(true), Some(true))
    );
    assert_eq!(v["sync"]["state"], "failed");
    assert_eq!(v["sync"]["version"].as_u64(), Some(4));
    assert!(v["latest_committed"].is_null());
    // Not for a version after it.
    let (_, v) = get(&st, "/v1/versions/5").await;
    assert_eq!(v["started"], false);
}

#[tokio::test]
async fn bad_queries_are_named() {
    let st = state(1, 1, false);
    for (uri, names) in [
        ("/v1/versions/1?wait_s=-1", "wait_s=-1"),
        ("/v1/versions/1?until=soon", "until=started|ended"),
        ("/v1/versions/1?wait=3", "until=started|ended, wait_s"),
        ("/v1/versions/x", "version must be a non-negative integer"),
    ] {
        let (code, body) = call(app(st.clone()), "GET", uri, None, None).await;
        assert_eq!(code, 400, "{uri}: {body}");
        let msg = json(&body)["error"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(msg.contains(names), "{uri}: {msg}");
    }
}
