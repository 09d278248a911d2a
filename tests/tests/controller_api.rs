//! Router tests: every endpoint through `app(state)` with tower's `oneshot`, no socket; the
//! version protocol driven by feeding worker messages straight into the state.

use serde_json::Value;
use weightsync_common::protocol::{FailureKind, Fault, FromWorker, WorkerId, WorkerReport};
use weightsync_controller::app;
use weightsync_tests::controller_harness::*;

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

fn error_message(body: &str) -> String {
    json(body)["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error.message in {body}"))
        .to_string()
}

#[tokio::test]
async fn healthz_reports_readiness() {
    let st = state(2, 2, false);
    let (code, body) = call(app(st.clone()), "GET", "/healthz", None, None).await;
    assert_eq!(code, 200);
    assert_eq!(json(&body)["world_complete"], false);
    register_all(&st, 2, 2);
    let (_, body) = call(app(st), "GET", "/healthz", None, None).await;
    assert_eq!(json(&body)["world_complete"], true);
    assert_eq!(json(&body)["ready"], true);
}

#[tokio::test]
async fn trigger_refused_before_the_world_is_complete_names_who_is_missing() {
    let st = state(2, 2, false);
    let (code, body) = call(
        app(st),
        "POST",
        "/v1/syncs",
        Some(r#"{"version": 1}"#),
        Some(API_TOKEN),
    )
    .await;
    assert_eq!(code, 503, "{body}");
    let msg = error_message(&body);
    assert!(
        msg.contains("trainer-0") && msg.contains("rollout-1"),
        "{msg}"
    );
}

#[tokio::test]
async fn trigger_commit_and_read_back() {
    let st = state(2, 2, false);
    register_all(&st, 2, 2);
    let (code, body) = call(
        app(st.clone()),
        "POST",
        "/v1/syncs",
        Some(r#"{"version": 7}"#),
        Some(API_TOKEN),
    )
    .await;
    assert_eq!(code, 202, "{body}");
    let v = json(&body);
    let id = v["sync_id"].as_u64().unwrap();
    assert_eq!(v["state"], "pending");
    assert_eq!(v["version"], 7);

    // Idempotent per version: same id, 200.
    let (code, body) = call(
        app(st.clone()),
        "POST",
        "/v1/syncs",
        Some(r#"{"version": 7}"#),
        Some(API_TOKEN),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(json(&body)["sync_id"].as_u64(), Some(id));
    assert_eq!(json(&body)["created"], false);

    // Another version while this one runs: 409 with the running id.
    let (code, body) = call(
        app(st.clone()),
        "POST",
        "/v1/syncs",
        Some(r#"{"version": 8}"#),
        Some(API_TOKEN),
    )
    .await;
    assert_eq!(code, 409, "{body}");
    assert_eq!(json(&body)["error"]["running_sync_id"].as_u64(), Some(id));
    assert!(error_message(&body).contains("still running"));

    complete_sync(&st, id, 7, 2, 2);
    let (code, body) = call(
        app(st.clone()),
        "GET",
        &format!("/v1/syncs/{id}"),
        None,
        None,
    )
    .await;
    assert_eq!(code, 200);
    let v = json(&body);
    assert_eq!(v["state"], "committed", "{body}");
    assert_eq!(v["bytes"].as_u64(), Some(2 << 20));
    assert!(v["gbps"].as_f64().unwrap() > 0.0);
    assert!(v["stages"]["total_ms"].as_f64().is_some());
    let lanes = v["lanes"].as_array().unwrap();
    assert_eq!(lanes.len(), 4, "one lane per worker: {body}");
    assert_eq!(
        lanes.iter().filter(|l| l["critical"] == true).count(),
        2,
        "one critical lane per role"
    );

    // History, newest first.
    let (code, body) = call(app(st.clone()), "GET", "/v1/syncs", None, None).await;
    assert_eq!(code, 200);
    let v = json(&body);
    assert_eq!(v["syncs"][0]["id"].as_u64(), Some(id));
    assert!(v["running"].is_null());

    // A stale version is refused.
    let (code, body) = call(
        app(st.clone()),
        "POST",
        "/v1/syncs",
        Some(r#"{"version": 3}"#),
        Some(API_TOKEN),
    )
    .await;
    assert_eq!(code, 409, "{body}");
    assert!(error_message(&body).contains("not newer"), "{body}");

    // Trace: Chrome trace JSON with one thread per worker.
    let (code, body) = call(
        app(st.clone()),
        "GET",
        &format!("/v1/syncs/{id}/trace"),
        None,
        None,
    )
    .await;
    assert_eq!(code, 200);
    let t = json(&body);
    let events = t["traceEvents"].as_array().unwrap();
    let threads = events.iter().filter(|e| e["name"] == "thread_name").count();
    assert_eq!(threads, 4);
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "X" && e["name"] == "write" && e["dur"].as_f64().unwrap() > 0.0)
    );

    // Metrics record the committed sync.
    let (code, body) = call(app(st), "GET", "/metrics", None, None).await;
    assert_eq!(code, 200);
    assert!(
        body.contains("weightsync_sync_duration_seconds_count{outcome=\"committed\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("weightsync_sync_bytes_total 2097152"),
        "{body}"
    );
    assert!(
        body.contains("weightsync_worker_throughput_gbps{worker=\"trainer-0\"}"),
        "{body}"
    );
}

#[tokio::test]
async fn wait_true_returns_when_the_sync_ends() {
    let st = state(1, 1, true);
    register_all(&st, 1, 1);
    let waiter = tokio::spawn(call(
        app(st.clone()),
        "POST",
        "/v1/syncs?wait=true",
        Some(r#"{"version": 1}"#),
        Some(API_TOKEN),
    ));
    // Wait until the sync exists, then answer as the workers would.
    assert!(
        eventually(std::time::Duration::from_secs(5), || st
            .read(|c| c.active().is_some()))
        .await
    );
    let id = st.read(|c| c.active()).unwrap();
    complete_sync(&st, id, 1, 1, 1);
    let (code, body) = waiter.await.unwrap();
    assert_eq!(code, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["state"], "committed");
    assert_eq!(v["verified"], true);
}

#[tokio::test]
async fn failure_names_worker_and_tensor_and_next_sync_proceeds() {
    let st = state(2, 1, false);
    register_all(&st, 2, 1);
    let (_, body) = call(
        app(st.clone()),
        "POST",
        "/v1/syncs",
        Some(r#"{"version": 1}"#),
        Some(API_TOKEN),
    )
    .await;
    let id = json(&body)["sync_id"].as_u64().unwrap();
    feed(
        &st,
        WorkerId::rollout(0),
        FromWorker::Failed {
            sync_id: id,
            version: 1,
            failure: Fault {
                kind: FailureKind::Checksum,
                tensor: Some("model.layers.0.mlp.gate_up_proj.weight".into()),
                cause: "checksum mismatch".into(),
            },
        },
    );
    let (_, body) = call(
        app(st.clone()),
        "GET",
        &format!("/v1/syncs/{id}"),
        None,
        None,
    )
    .await;
    let v = json(&body);
    assert_eq!(v["state"], "failed");
    assert_eq!(v["failure"]["worker"], "rollout-0");
    assert_eq!(
        v["failure"]["tensor"],
        "model.layers.0.mlp.gate_up_proj.weight"
    );
    // The kind the worker reported, beside the text.
    assert_eq!(v["failure"]["kind"], "checksum");
    assert_eq!(v["failure"]["cause"], "checksum mismatch");
    // A late report for the failed sync changes nothing.
    feed(
        &st,
        WorkerId::trainer(0),
        FromWorker::Written {
            sync_id: id,
            version: 1,
            report: WorkerReport::default(),
        },
    );
    let (code, body) = call(
        app(st.clone()),
        "POST",
        "/v1/syncs",
        Some(r#"{"version": 2}"#),
        Some(API_TOKEN),
    )
    .await;
    assert_eq!(code, 202, "{body}");
    let id2 = json(&body)["sync_id"].as_u64().unwrap();
    complete_sync(&st, id2, 2, 2, 1);
    let (_, body) = call(
        app(st.clone()),
        "GET",
        &format!("/v1/syncs/{id2}"),
        None,
        None,
    )
    .await;
    assert_eq!(json(&body)["state"], "committed");
    let (_, body) = call(app(st), "GET", "/metrics", None, None).await;
    assert!(
        body.contains("weightsync_syncs_total{outcome=\"failed\"} 1"),
        "{body}"
    );
}

#[tokio::test]
async fn a_trigger_while_trainers_drain_a_failed_sync_is_accepted_queued_and_started_after() {
    let st = state(2, 1, false);
    register_all(&st, 2, 1);
    let trigger = |version: u64| {
        let st = st.clone();
        async move {
            call(
                app(st),
                "POST",
                "/v1/syncs",
                Some(&format!(r#"{{"version": {version}}}"#)),
                Some(API_TOKEN),
            )
            .await
        }
    };
    let (_, body) = trigger(1).await;
    let id = json(&body)["sync_id"].as_u64().unwrap();
    for w in ids(2, 1) {
        feed(
            &st,
            w,
            FromWorker::Prepared {
                sync_id: id,
                version: 1,
                report: WorkerReport::default(),
            },
        );
    }
    // Trainers were told to write; then the rollout fails the sync.
    feed(
        &st,
        WorkerId::rollout(0),
        FromWorker::Failed {
            sync_id: id,
            version: 1,
            failure: Fault {
                kind: FailureKind::Timeout,
                tensor: None,
                cause: "landing timed out".into(),
            },
        },
    );
    // Accepted (no retry loop needed), queued behind the drain, naming who it waits for.
    let (code, body) = trigger(2).await;
    assert_eq!(code, 202, "{body}");
    let v = json(&body);
    let id2 = v["sync_id"].as_u64().unwrap();
    assert_eq!(v["state"], "pending");
    assert_eq!(v["waiting_for_drain_of"], id);
    assert_eq!(
        v["waiting_on"],
        serde_json::json!(["trainer-0", "trainer-1"])
    );
    let drained = || FromWorker::Drained {
        sync_id: id,
        version: 1,
    };
    feed(&st, WorkerId::trainer(0), drained());
    let (_, body) = call(
        app(st.clone()),
        "GET",
        &format!("/v1/syncs/{id2}"),
        None,
        None,
    )
    .await;
    assert_eq!(json(&body)["waiting_on"], serde_json::json!(["trainer-1"]));
    feed(&st, WorkerId::trainer(1), drained());
    let (_, body) = call(
        app(st.clone()),
        "GET",
        &format!("/v1/syncs/{id2}"),
        None,
        None,
    )
    .await;
    let v = json(&body);
    assert!(v["waiting_for_drain_of"].is_null(), "{v}");
    assert!(v["drain_wait_ms"].is_number(), "{v}");
    complete_sync(&st, id2, 2, 2, 1);
    let (_, body) = call(app(st), "GET", &format!("/v1/syncs/{id2}"), None, None).await;
    assert_eq!(json(&body)["state"], "committed");
}

/// method, uri, body, bearer token, expected status, text the message must contain.
type Case<'a> = (
    &'a str,
    &'a str,
    Option<&'a str>,
    Option<&'a str>,
    u16,
    &'a str,
);

#[tokio::test]
async fn refused_and_malformed_requests_get_clear_4xx() {
    let st = state(1, 1, false);
    register_all(&st, 1, 1);
    let cases: &[Case] = &[
        (
            "POST",
            "/v1/syncs",
            Some(r#"{"version": 1}"#),
            None,
            401,
            "missing Authorization",
        ),
        (
            "POST",
            "/v1/syncs",
            Some(r#"{"version": 1}"#),
            Some("nope"),
            401,
            "wrong bearer token",
        ),
        (
            "POST",
            "/v1/syncs",
            Some(r#"{"version": "one"}"#),
            Some(API_TOKEN),
            422,
            "version",
        ),
        (
            "POST",
            "/v1/syncs",
            Some(r#"{"version": -3}"#),
            Some(API_TOKEN),
            422,
            "version",
        ),
        (
            "POST",
            "/v1/syncs",
            Some(r#"{"version": 1.5}"#),
            Some(API_TOKEN),
            422,
            "version",
        ),
        (
            "POST",
            "/v1/syncs",
            Some(r#"{"versoin": 1}"#),
            Some(API_TOKEN),
            422,
            "versoin",
        ),
        (
            "POST",
            "/v1/syncs",
            Some(r#"{"version": 1"#),
            Some(API_TOKEN),
            400,
            "expected a body",
        ),
        (
            "POST",
            "/v1/syncs",
            Some("not json"),
            Some(API_TOKEN),
            400,
            "expected a body",
        ),
        (
            "POST",
            "/v1/syncs?wait=perhaps",
            Some(r#"{"version": 1}"#),
            Some(API_TOKEN),
            400,
            "wait",
        ),
        (
            "GET",
            "/v1/syncs/999",
            None,
            None,
            404,
            "no sync with id 999",
        ),
        (
            "GET",
            "/v1/syncs/abc",
            None,
            None,
            400,
            "non-negative integer",
        ),
        (
            "GET",
            "/v1/syncs/999/trace",
            None,
            None,
            404,
            "no sync with id 999",
        ),
        ("GET", "/v1/nothing", None, None, 404, "no such endpoint"),
        ("DELETE", "/v1/syncs", None, None, 405, "method not allowed"),
        ("GET", "/assets/evil.js", None, None, 404, "no asset"),
    ];
    for (method, uri, body, token, want, needle) in cases {
        let (code, text) = call(app(st.clone()), method, uri, *body, *token).await;
        assert_eq!(code, *want, "{method} {uri} {body:?}: {text}");
        let msg = error_message(&text);
        assert!(
            msg.contains(needle),
            "{method} {uri}: {msg:?} should mention {needle:?}"
        );
    }
    // Missing content type.
    {
        use http_body_util::BodyExt;
        use tower::ServiceExt;
        let req = axum::http::Request::builder()
            .method("POST")
            .uri("/v1/syncs")
            .header("authorization", format!("Bearer {API_TOKEN}"))
            .body(axum::body::Body::from(r#"{"version": 1}"#))
            .unwrap();
        let resp = app(st.clone()).oneshot(req).await.unwrap();
        assert_eq!(resp.status(), 400);
        let b = resp.into_body().collect().await.unwrap().to_bytes();
        assert!(String::from_utf8_lossy(&b).contains("Content-Type"));
    }
    // Oversized body.
    let big = format!(r#"{{"version": 1, "pad": "{}"}}"#, "x".repeat(64 * 1024));
    let (code, text) = call(
        app(st.clone()),
        "POST",
        "/v1/syncs",
        Some(&big),
        Some(API_TOKEN),
    )
    .await;
    assert!(code == 400 || code == 413, "{code} {text}");
    assert!(error_message(&text).contains("too large"), "{text}");
    // Nothing was triggered by any of that.
    assert!(st.read(|c| c.history().is_empty()));
}

#[tokio::test]
async fn plan_and_workers_never_reveal_rkeys_or_tokens() {
    let st = state(2, 2, false);
    let (code, body) = call(app(st.clone()), "GET", "/v1/plan", None, None).await;
    assert_eq!(code, 404);
    assert!(error_message(&body).contains("waiting for"), "{body}");
    register_all(&st, 2, 2);
    let marker = String::from_utf8_lossy(SECRET_RKEY_MARKER).into_owned();
    let marker_bytes: Vec<String> = SECRET_RKEY_MARKER.iter().map(|b| b.to_string()).collect();
    let marker_array = marker_bytes.join(",");
    for uri in [
        "/v1/plan",
        "/v1/workers",
        "/healthz",
        "/v1/syncs",
        "/metrics",
        "/",
    ] {
        let (code, body) = call(app(st.clone()), "GET", uri, None, None).await;
        assert_eq!(code, 200, "{uri}: {body}");
        for secret in [marker.as_str(), marker_array.as_str(), API_TOKEN, JOB_TOKEN] {
            assert!(!body.contains(secret), "{uri} reveals {secret:?}");
        }
    }
    let (_, body) = call(app(st.clone()), "GET", "/v1/workers", None, None).await;
    let v = json(&body);
    assert_eq!(v["workers"].as_array().unwrap().len(), 4);
    assert_eq!(v["workers"][0]["id"], "trainer-0");
    let (_, body) = call(app(st), "GET", "/v1/plan", None, None).await;
    let v = json(&body);
    assert_eq!(v["plan"]["id"], 1);
    assert!(v["plan"]["reason"].as_str().unwrap().contains("first plan"));
}

#[tokio::test]
async fn dashboard_assets_are_served() {
    let st = state(1, 1, false);
    let (code, body) = call(app(st.clone()), "GET", "/", None, None).await;
    assert_eq!(code, 200);
    assert!(body.contains("/assets/app.js"));
    let (code, body) = call(app(st.clone()), "GET", "/assets/app.js", None, None).await;
    assert_eq!(code, 200);
    assert!(body.contains("/v1/syncs"), "the script polls the API");
    let (code, _) = call(app(st), "GET", "/assets/app.css", None, None).await;
    assert_eq!(code, 200);
}
