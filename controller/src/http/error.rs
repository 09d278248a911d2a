//! Every refusal the HTTP API can give, as one enum that renders a JSON body
//! `{"error": {"code": "...", "message": "..."}}` with the right status. Internals (tokens,
//! rkeys, Rust error chains) never reach a client.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// An API error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// The request body is not valid JSON, or has the wrong fields or types.
    #[error("{0}")]
    BadRequest(String),
    /// The body is valid JSON but a value is not acceptable.
    #[error("{0}")]
    Unprocessable(String),
    /// The bearer token is missing or wrong.
    #[error("{0}")]
    Unauthorized(String),
    /// No such resource.
    #[error("{0}")]
    NotFound(String),
    /// Another sync is running.
    #[error("sync {running} (version {version}) is still running; retry when it ends")]
    SyncRunning {
        /// Its id.
        running: u64,
        /// Its version.
        version: u64,
    },
    /// The version is older than the last committed one.
    #[error("{0}")]
    Conflict(String),
    /// The world is not complete yet (or planning failed).
    #[error("{0}")]
    NotReady(String),
    /// Waiting for the sync took longer than the request allows.
    #[error("{0}")]
    Timeout(String),
    /// The request announces a body larger than the API accepts.
    #[error("{0}")]
    PayloadTooLarge(String),
}

impl ApiError {
    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            ApiError::Unprocessable(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_value"),
            ApiError::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::SyncRunning { .. } => (StatusCode::CONFLICT, "sync_running"),
            ApiError::Conflict(_) => (StatusCode::CONFLICT, "stale_version"),
            ApiError::NotReady(_) => (StatusCode::SERVICE_UNAVAILABLE, "not_ready"),
            ApiError::Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
            ApiError::PayloadTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        let mut body = serde_json::json!({
            "error": { "code": code, "message": self.to_string() }
        });
        if let ApiError::SyncRunning { running, version } = &self {
            body["error"]["running_sync_id"] = (*running).into();
            body["error"]["running_version"] = (*version).into();
        }
        let mut resp = (status, Json(body)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
