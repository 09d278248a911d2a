//! Any HTTP request to the controller's router (`app(state)`, driven with `oneshot`, no socket).
//!
//! Input: one selector byte (endpoint, method, whether the bearer token and a JSON content type
//! are present), then the body; for the `{id}` endpoints the body is also used as the path
//! segment when it forms a valid URI, and as the query of `/v1/versions/1` unless it could
//! name a wait (a fuzz run must not sleep). No request may panic the controller, and none may
//! get a 500: bad input is the client's fault (4xx), and the only 5xx allowed is 503 (world not
//! complete yet) or 504 (a waited sync timed out).
#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request};
use axum::Router;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;
use weightsync_common::protocol::WorldSpec;
use weightsync_common::DType;
use weightsync_controller::coordinator::CoordinatorConfig;
use weightsync_controller::planning::NullPlanner;
use weightsync_controller::{app, AppState, ControllerConfig};

const API_TOKEN: &str = "fuzz-api-token";

fn router() -> &'static (tokio::runtime::Runtime, Router) {
    static R: OnceLock<(tokio::runtime::Runtime, Router)> = OnceLock::new();
    R.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let world = WorldSpec {
            model: "qwen3-0.6b".into(),
            train: "fsdp=2".into(),
            infer: "tp=1".into(),
            dtype: DType::BF16,
            verify: true,
        };
        let coordinator = CoordinatorConfig {
            world,
            trainers: 2,
            rollouts: 1,
            heartbeat_interval: Duration::from_millis(500),
            heartbeat_timeout: Duration::from_secs(5),
            sync_timeout: Duration::from_millis(50),
            failure_grace: Duration::ZERO,
            history: 16,
        };
        let cfg = ControllerConfig::new(coordinator, "fuzz-job-token".into(), API_TOKEN.into());
        let state = AppState::new(cfg, Box::new(NullPlanner));
        (rt, app(state))
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let segment = std::str::from_utf8(body).ok().filter(|s| {
        !s.is_empty()
            && s.len() < 256
            && s.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'?' && b != b'#')
    });
    let (method, uri) = match sel & 7 {
        // The long poll, its path and its query (without a wait: a fuzz run must not sleep).
        _ if sel & 0x80 != 0 => match segment {
            Some(q) if sel & 0x08 != 0 && !q.contains("wait") && !q.contains('%') => {
                (Method::GET, format!("/v1/versions/1?{q}"))
            }
            _ => (
                Method::GET,
                format!("/v1/versions/{}", segment.unwrap_or("1")),
            ),
        },
        0 => (Method::POST, "/v1/syncs".to_owned()),
        1 => (Method::POST, "/v1/syncs?wait=true".to_owned()),
        2 => (Method::GET, format!("/v1/syncs/{}", segment.unwrap_or("1"))),
        3 => (
            Method::GET,
            format!("/v1/syncs/{}/trace", segment.unwrap_or("1")),
        ),
        4 => (Method::GET, "/v1/syncs".to_owned()),
        5 => (
            Method::GET,
            format!("/v1/syncs?{}", segment.unwrap_or("limit=1")),
        ),
        6 => (Method::PUT, "/v1/syncs".to_owned()),
        _ => (
            Method::POST,
            format!("/v1/syncs?{}", segment.unwrap_or("wait=maybe")),
        ),
    };
    let mut req = Request::builder().method(method).uri(uri.as_str());
    if sel & 0x10 != 0 {
        req = req.header("authorization", format!("Bearer {API_TOKEN}"));
    } else if sel & 0x40 != 0 {
        req = req.header("authorization", "Bearer wrong");
    }
    if sel & 0x20 != 0 {
        req = req.header("content-type", "application/json");
    }
    let Ok(req) = req.body(Body::from(body.to_vec())) else {
        return;
    };
    let (rt, app) = router();
    let resp = rt
        .block_on(app.clone().oneshot(req))
        .expect("the router is infallible");
    let status = resp.status().as_u16();
    assert!(
        status < 500 || status == 503 || status == 504,
        "{uri}: status {status} for a client's request"
    );
});
