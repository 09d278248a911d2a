//! The HTTP API and the dashboard.
//!
//! [`app`] builds the whole router from the shared state, so tests drive it with tower's
//! `oneshot` and no socket. Mutating endpoints take `Authorization: Bearer <api token>`; reads are
//! open unless the controller has a read-only token (then they need it or the API token;
//! `/healthz` stays open), and no response carries an rkey, a fabric endpoint or a token.
//!
//! | method | path | what |
//! |---|---|---|
//! | POST | `/v1/syncs` `{"version": N}` (`?wait=true`) | trigger a sync (idempotent per version; 409 while another runs) |
//! | GET | `/v1/syncs` | history, newest first |
//! | GET | `/v1/syncs/{id}` | state, stage durations, bytes, GB/s, failure (worker, kind, tensor, cause), lanes |
//! | GET | `/v1/syncs/{id}/trace` | Chrome trace / Perfetto JSON |
//! | GET | `/v1/versions/{v}` (`?until=started\|ended&wait_s=S`) | whether a version >= v started / ended; waits up to S s (at most 60) for `until` |
//! | GET | `/v1/plan` | plan summary and membership log |
//! | GET | `/v1/workers` | registered workers |
//! | GET | `/healthz` | liveness and readiness |
//! | GET | `/metrics` | Prometheus / OpenMetrics |
//! | GET | `/` | the dashboard |

pub mod dashboard;
pub mod error;
pub mod trace;

use std::time::Duration;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use tower_http::timeout::TimeoutLayer;

use crate::coordinator::{Now, TriggerError, Triggered};
use crate::service::AppState;
use crate::sync_record::SyncState;
pub use error::ApiError;

/// Largest request body accepted (a trigger is a few bytes).
pub const MAX_BODY: usize = 16 * 1024;

/// Builds the router.
pub fn app(state: AppState) -> Router {
    let wait_budget = state.config().coordinator.sync_timeout + Duration::from_secs(30);
    Router::new()
        .route("/", get(dashboard::index))
        .route("/assets/{file}", get(dashboard::asset))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/syncs", post(trigger).get(list_syncs))
        .route("/v1/syncs/{id}", get(get_sync))
        .route("/v1/syncs/{id}/trace", get(get_trace))
        .route("/v1/versions/{version}", get(get_version))
        .route("/v1/runs", post(begin_run))
        .route("/v1/plan", get(get_plan))
        .route("/v1/workers", get(get_workers))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn(refuse_announced_oversize))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_read_token,
        ))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            wait_budget,
        ))
        .with_state(state)
}

/// Refuses a request whose `Content-Length` already says it is too large, before reading any of
/// the body: a client announcing a huge body must not hold a connection until the timeout.
/// (`DefaultBodyLimit` still bounds bodies without a length, e.g. chunked ones, as they are read.)
async fn refuse_announced_oversize(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match announced {
        Some(n) if n > MAX_BODY as u64 => ApiError::PayloadTooLarge(format!(
            "request body too large: Content-Length {n} bytes, the API accepts at most {MAX_BODY}"
        ))
        .into_response(),
        _ => next.run(req).await,
    }
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such endpoint; see GET / for the dashboard and /v1/syncs".into())
}

async fn method_not_allowed() -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        Json(serde_json::json!({
            "error": {"code": "method_not_allowed", "message": "method not allowed on this endpoint"}
        })),
    )
        .into_response()
}

fn require_token(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let presented = bearer(headers)?;
    if !same_secret(presented, &state.config().secrets.api) {
        return Err(ApiError::Unauthorized("wrong bearer token".into()));
    }
    Ok(())
}

/// Compares hashes: constant time, and lengths do not leak.
fn same_secret(presented: &str, secret: &weightsync_common::secret::Secret) -> bool {
    blake3::hash(presented.trim().as_bytes()) == blake3::hash(secret.expose().as_bytes())
}

/// When the controller has a read-only token, every route but `/healthz` needs it (or the API
/// token); without one the views are open, as before.
async fn require_read_token(
    State(state): State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(read) = &state.config().secrets.read
        && req.uri().path() != "/healthz"
    {
        let ok = bearer(req.headers()).is_ok_and(|presented| {
            same_secret(presented, read) || same_secret(presented, &state.config().secrets.api)
        });
        if !ok {
            return ApiError::Unauthorized(
                "this controller's views need `Authorization: Bearer <read-only or API token>`"
                    .into(),
            )
            .into_response();
        }
    }
    next.run(req).await
}

fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Err(ApiError::Unauthorized(
            "missing Authorization: Bearer <token> header".into(),
        ));
    };
    let presented = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| ApiError::Unauthorized("Authorization must be `Bearer <token>`".into()))?;
    Ok(presented)
}

/// Body of `POST /v1/syncs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggerBody {
    /// Weight version (the training step), a non-negative integer.
    pub version: u64,
}

/// Query of `POST /v1/syncs`.
#[derive(Debug, Deserialize)]
pub struct TriggerQuery {
    /// Return only when the sync has ended.
    #[serde(default)]
    pub wait: bool,
}

fn json_rejection(r: JsonRejection) -> ApiError {
    let msg = r.body_text();
    match r.status() {
        StatusCode::UNPROCESSABLE_ENTITY => {
            ApiError::Unprocessable(format!("{msg} (expected a body like {{\"version\": 42}})"))
        }
        StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::BadRequest(format!("request body too large (at most {MAX_BODY} bytes)"))
        }
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::BadRequest(
            "expected Content-Type: application/json with a body like {\"version\": 42}".into(),
        ),
        _ => ApiError::BadRequest(format!("{msg} (expected a body like {{\"version\": 42}})")),
    }
}

async fn trigger(
    State(state): State<AppState>,
    headers: HeaderMap,
    query: Result<Query<TriggerQuery>, QueryRejection>,
    body: Result<Json<TriggerBody>, JsonRejection>,
) -> Result<Response, ApiError> {
    require_token(&state, &headers)?;
    let Query(query) = query.map_err(|e| {
        ApiError::BadRequest(format!(
            "{} (the only query parameter is wait=true|false)",
            e.body_text()
        ))
    })?;
    let Json(body) = body.map_err(json_rejection)?;
    let triggered = state.step(|c| match c.trigger(body.version, Now::wall()) {
        Ok((t, fx)) => (Ok(t), fx),
        Err(e) => (Err(e), Default::default()),
    });
    let (id, created) = match triggered {
        Ok(Triggered::Created(id)) => (id, true),
        Ok(Triggered::Existing(id)) => (id, false),
        Err(TriggerError::Busy { running, version }) => {
            return Err(ApiError::SyncRunning { running, version });
        }
        Err(e @ TriggerError::Stale { .. }) => return Err(ApiError::Conflict(e.to_string())),
        Err(e @ TriggerError::NotReady(_)) => return Err(ApiError::NotReady(e.to_string())),
    };
    if query.wait {
        wait_for_end(&state, id).await?;
    }
    let view = state
        .read(|c| c.sync(id).map(|s| s.view(false)))
        .ok_or_else(|| ApiError::NotFound(format!("sync {id} left the history")))?;
    let status = if query.wait || !created {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    let mut body = serde_json::to_value(&view).unwrap_or_default();
    body["sync_id"] = id.into();
    body["created"] = created.into();
    Ok((status, Json(body)).into_response())
}

/// Body of `POST /v1/runs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunBody {
    /// The new run: larger than the job's current one.
    pub run: u64,
}

/// `POST /v1/runs {"run": R}`: a job restarted from a checkpoint declares a new run, after which
/// versions may restart below the last committed one (the committed `(run, version)` still only
/// grows). 409 when `R` is not newer than the current run.
async fn begin_run(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Json<RunBody>, JsonRejection>,
) -> Result<Response, ApiError> {
    require_token(&state, &headers)?;
    let Json(body) = body.map_err(|r| {
        ApiError::BadRequest(format!(
            "{} (expected a body like {{\"run\": 2}})",
            r.body_text()
        ))
    })?;
    let begun = state.step(|c| match c.begin_run(body.run, Now::wall()) {
        Ok(fx) => (Ok(()), fx),
        Err(e) => (Err(e), Default::default()),
    });
    begun.map_err(|e| ApiError::Conflict(e.to_string()))?;
    let (run, committed) = state.read(|c| (c.run(), c.latest_committed()));
    Ok(Json(serde_json::json!({
        "run": run,
        "latest_committed": committed.map(|(r, v)| serde_json::json!({"run": r, "version": v})),
    }))
    .into_response())
}

async fn wait_for_end(state: &AppState, id: u64) -> Result<(), ApiError> {
    let mut rx = state.subscribe();
    let budget = state.config().coordinator.sync_timeout + Duration::from_secs(10);
    let deadline = tokio::time::Instant::now() + budget;
    loop {
        let state_now = state.read(|c| c.sync(id).map(|s| s.state));
        match state_now {
            None => return Err(ApiError::NotFound(format!("sync {id} left the history"))),
            Some(s) if s.is_terminal() => return Ok(()),
            Some(_) => {}
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(ApiError::Timeout("controller shutting down".into())),
            Err(_) => {
                return Err(ApiError::Timeout(format!(
                    "sync {id} did not end within {} s",
                    budget.as_secs()
                )));
            }
        }
    }
}

fn parse_id(id: Result<Path<u64>, PathRejection>) -> Result<u64, ApiError> {
    id.map(|Path(id)| id).map_err(|_| {
        ApiError::BadRequest("sync id must be a non-negative integer, e.g. /v1/syncs/3".into())
    })
}

async fn get_sync(
    State(state): State<AppState>,
    id: Result<Path<u64>, PathRejection>,
) -> Result<Response, ApiError> {
    let id = parse_id(id)?;
    let view = state
        .read(|c| c.sync(id).map(|s| s.view(true)))
        .ok_or_else(|| ApiError::NotFound(format!("no sync with id {id}")))?;
    Ok(Json(view).into_response())
}

async fn get_trace(
    State(state): State<AppState>,
    id: Result<Path<u64>, PathRejection>,
) -> Result<Response, ApiError> {
    let id = parse_id(id)?;
    let trace = state
        .read(|c| c.sync(id).map(trace::chrome_trace))
        .ok_or_else(|| ApiError::NotFound(format!("no sync with id {id}")))?;
    Ok(Json(trace).into_response())
}

async fn list_syncs(State(state): State<AppState>) -> Response {
    let (syncs, running) = state.read(|c| (c.history(), c.active()));
    Json(serde_json::json!({ "running": running, "syncs": syncs })).into_response()
}

/// Longest wait of one `GET /v1/versions/{v}` (a client that needs longer asks again, so a
/// connection is never held past proxies' idle timeouts).
pub const MAX_VERSION_WAIT_S: f64 = 60.0;

/// What `GET /v1/versions/{v}` waits for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VersionUntil {
    /// A sync of a version >= v exists.
    Started,
    /// A sync of a version >= v committed or failed.
    #[default]
    Ended,
}

/// Query of `GET /v1/versions/{v}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VersionQuery {
    /// What to wait for (default `ended`).
    #[serde(default)]
    pub until: VersionUntil,
    /// Seconds to wait for it (default 0: answer at once; at most [`MAX_VERSION_WAIT_S`]).
    #[serde(default)]
    pub wait_s: f64,
}

/// `GET /v1/versions/{v}`: where version `v` stands ([`crate::coordinator::VersionView`]),
/// after waiting up to `wait_s` for `until`; `reached` says whether it came. An inference
/// engine's driver long-polls this instead of its engine's workers while the trainers write.
async fn get_version(
    State(state): State<AppState>,
    version: Result<Path<u64>, PathRejection>,
    query: Result<Query<VersionQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let version = version.map(|Path(v)| v).map_err(|_| {
        ApiError::BadRequest("version must be a non-negative integer, e.g. /v1/versions/3".into())
    })?;
    let Query(query) = query.map_err(|e| {
        ApiError::BadRequest(format!(
            "{} (query parameters: until=started|ended, wait_s=<seconds>)",
            e.body_text()
        ))
    })?;
    if !query.wait_s.is_finite() || query.wait_s < 0.0 {
        return Err(ApiError::BadRequest(format!(
            "wait_s={} must be a non-negative number of seconds",
            query.wait_s
        )));
    }
    let reached = |v: &crate::coordinator::VersionView| match query.until {
        VersionUntil::Started => v.started,
        VersionUntil::Ended => v.ended,
    };
    let mut rx = state.subscribe();
    let deadline =
        tokio::time::Instant::now() + Duration::from_secs_f64(query.wait_s.min(MAX_VERSION_WAIT_S));
    let view = loop {
        let view = state.read(|c| c.version_view(version));
        if reached(&view) {
            break view;
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            // Shutting down or the wait is over: answer with what is known.
            Ok(Err(_)) | Err(_) => break state.read(|c| c.version_view(version)),
        }
    };
    let mut body = serde_json::to_value(&view).unwrap_or_default();
    body["reached"] = reached(&view).into();
    Ok(Json(body).into_response())
}

async fn get_plan(State(state): State<AppState>) -> Result<Response, ApiError> {
    let (plan, error, log, missing) = state.read(|c| {
        (
            c.latest_plan().cloned(),
            c.plan_error().map(str::to_string),
            c.log(),
            c.missing_workers(),
        )
    });
    match plan {
        Some(p) => Ok(Json(serde_json::json!({
            "plan": p, "missing": missing, "log": log,
        }))
        .into_response()),
        None => Err(ApiError::NotFound(match error {
            Some(e) => format!("no plan: {e}"),
            None => format!(
                "no plan yet: waiting for {} to register",
                if missing.is_empty() {
                    "nobody".to_string()
                } else {
                    missing.join(", ")
                }
            ),
        })),
    }
}

async fn get_workers(State(state): State<AppState>) -> Response {
    let now = Now::wall();
    let (workers, trainers, rollouts, missing) = state.read(|c| {
        (
            c.workers(now),
            c.config().trainers,
            c.config().rollouts,
            c.missing_workers(),
        )
    });
    Json(serde_json::json!({
        "expected": {"trainers": trainers, "rollouts": rollouts},
        "missing": missing,
        "workers": workers,
    }))
    .into_response()
}

async fn healthz(State(state): State<AppState>) -> Response {
    let (complete, planned, planning, running, last) = state.read(|c| {
        (
            c.world_complete(),
            c.plan_ready(),
            c.planning(),
            c.active(),
            c.last_sync(),
        )
    });
    let (run, incarnation, committed) =
        state.read(|c| (c.run(), c.incarnation(), c.latest_committed()));
    Json(serde_json::json!({
        "status": "ok",
        "uptime_s": state.uptime().as_secs_f64(),
        "world_complete": complete,
        "planned": planned,
        "planning": planning,
        "running_sync": running,
        "run": run,
        "incarnation": format!("{incarnation:016x}"),
        "latest_committed": committed.map(|(r, v)| serde_json::json!({"run": r, "version": v})),
        "last_sync": last.map(|(id, st)| serde_json::json!({"id": id, "state": st})),
        "ready": complete && planned && !matches!(last, Some((_, SyncState::Running | SyncState::Pending))),
    }))
    .into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics().encode(),
    )
        .into_response()
}
