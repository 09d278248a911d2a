//! The dashboard: one HTML page, a script and a stylesheet, embedded in the binary with
//! `include_str!` so users need no build step and no network (no CDN). The script polls the JSON
//! API and draws with SVG.

use axum::extract::Path;
use axum::http::header;
use axum::response::{Html, IntoResponse, Response};

use super::ApiError;

const INDEX: &str = include_str!("../../assets/index.html");
const APP_JS: &str = include_str!("../../assets/app.js");
const APP_CSS: &str = include_str!("../../assets/app.css");

/// `GET /`.
pub async fn index() -> Html<&'static str> {
    Html(INDEX)
}

/// `GET /assets/{file}`.
pub async fn asset(Path(file): Path<String>) -> Result<Response, ApiError> {
    let (body, ty) = match file.as_str() {
        "app.js" => (APP_JS, "text/javascript; charset=utf-8"),
        "app.css" => (APP_CSS, "text/css; charset=utf-8"),
        _ => return Err(ApiError::NotFound(format!("no asset named {file:?}"))),
    };
    Ok((
        [
            (header::CONTENT_TYPE, ty),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response())
}
