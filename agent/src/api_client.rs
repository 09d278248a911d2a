//! A minimal client of the controller's HTTP API (HTTP/1.1, one request per connection), for
//! the demo's training loop and for tests that talk to a served controller, plain or over TLS
//! (`https://`: the same [`TlsClient`] the workers' control channel uses, so the same CA, CRL and
//! client-certificate files). The API is a few small JSON calls; a general HTTP client would add
//! a dependency tree for nothing.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use weightsync_common::tls::{ByteStream, TlsClient, TlsError, tls_failure};

/// A failed request.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting, writing or reading failed.
    #[error("HTTP request to {addr} failed: {source}")]
    Io {
        /// Address.
        addr: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The TLS handshake failed: the controller's certificate was refused here (an unknown
    /// issuer, a revoked certificate, a name that does not match) or this client's by it.
    #[error("HTTPS to {addr} refused: TLS handshake failed: {reason}")]
    Tls {
        /// Address.
        addr: String,
        /// rustls's reason, e.g. `invalid peer certificate: UnknownIssuer`.
        reason: String,
    },
    /// The TLS files could not be used (unreadable, not PEM, a CA not named).
    #[error("HTTPS client setup: {0}")]
    TlsSetup(#[from] TlsError),
    /// No answer in time.
    #[error("HTTP request to {0} timed out")]
    Timeout(String),
    /// The answer is not HTTP.
    #[error("malformed HTTP response from {0}")]
    Malformed(String),
    /// The controller refused the request (the status and its message).
    #[error("the controller at {addr} answered {status}: {message}")]
    Refused {
        /// Address.
        addr: String,
        /// HTTP status.
        status: u16,
        /// The error message of its JSON body (or the body).
        message: String,
    },
}

/// Why a sync failed, as the controller reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncFailure {
    /// The worker to blame, e.g. `rollout-1`.
    pub worker: String,
    /// What kind of failure (`other` when the controller did not say one this build knows).
    pub kind: weightsync_common::protocol::FailureKind,
    /// The tensor, when known.
    pub tensor: Option<String>,
    /// Why.
    pub cause: String,
}

/// A sync as `POST /v1/syncs` reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncResult {
    /// The sync's id.
    pub sync_id: u64,
    /// Its version.
    pub version: u64,
    /// `pending`, `running`, `committed` or `failed`.
    pub state: String,
    /// Whether this call created it (false: it existed, the trigger is idempotent).
    pub created: bool,
    /// Bytes written by trainers.
    pub bytes: u64,
    /// Source bytes trainers copied into staging before writing.
    pub staged_bytes: u64,
    /// Bytes trainers wrote straight from their registered tensors.
    pub direct_bytes: u64,
    /// Creation to the end, seconds (when it ended).
    pub seconds: Option<f64>,
    /// Per stage as the controller saw it (`prepare`, `write`, `land`, `verify`, `total`),
    /// seconds.
    pub stages: Vec<(String, f64)>,
    /// Why it failed.
    pub failure: Option<SyncFailure>,
}

impl SyncResult {
    fn from_json(v: &serde_json::Value) -> Option<SyncResult> {
        let stages: Vec<(String, f64)> = v["stages"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, x)| {
                        Some((k.trim_end_matches("_ms").to_string(), x.as_f64()? / 1e3))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let failure = v["failure"].as_object().map(|f| SyncFailure {
            worker: f["worker"].as_str().unwrap_or_default().to_string(),
            kind: f["kind"]
                .as_str()
                .and_then(|k| k.parse().ok())
                .unwrap_or_default(),
            tensor: f["tensor"].as_str().map(str::to_string),
            cause: f["cause"].as_str().unwrap_or_default().to_string(),
        });
        Some(SyncResult {
            sync_id: v["sync_id"].as_u64()?,
            version: v["version"].as_u64()?,
            state: v["state"].as_str()?.to_string(),
            created: v["created"].as_bool().unwrap_or(false),
            bytes: v["bytes"].as_u64().unwrap_or(0),
            staged_bytes: v["staged_bytes"].as_u64().unwrap_or(0),
            direct_bytes: v["direct_bytes"].as_u64().unwrap_or(0),
            seconds: v["stages"]["total_ms"].as_f64().map(|ms| ms / 1e3),
            stages,
            failure,
        })
    }
}

/// `POST /v1/syncs` for `version` (`wait`: until it ends), typed. A sync that failed is an
/// `Ok` whose `state` is `failed` and whose `failure` names the worker; a refused trigger
/// (another sync running, a stale version, the world not ready, a wrong token) is
/// [`ClientError::Refused`] with the controller's message.
pub async fn sync(
    addr: &str,
    token: &str,
    version: u64,
    wait: bool,
    timeout: Duration,
) -> Result<SyncResult, ClientError> {
    sync_over(addr, None, token, version, wait, timeout).await
}

/// [`sync`] over `tls` (`None`: plain HTTP).
pub async fn sync_over(
    addr: &str,
    tls: Option<&TlsClient>,
    token: &str,
    version: u64,
    wait: bool,
    timeout: Duration,
) -> Result<SyncResult, ClientError> {
    let path = if wait {
        "/v1/syncs?wait=true"
    } else {
        "/v1/syncs"
    };
    let body = format!("{{\"version\": {version}}}");
    let r = request_over(addr, tls, "POST", path, Some(token), Some(&body), timeout).await?;
    let json = r.json();
    if !(200..300).contains(&r.status) {
        let message = json["error"]["message"]
            .as_str()
            .map_or_else(|| r.body.clone(), str::to_string);
        return Err(ClientError::Refused {
            addr: addr.to_string(),
            status: r.status,
            message,
        });
    }
    SyncResult::from_json(&json).ok_or_else(|| ClientError::Malformed(addr.to_string()))
}

/// A response: status and body text.
#[derive(Debug, Clone)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Body.
    pub body: String,
}

impl Response {
    /// The body as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// Sends one request to `addr` (host:port), plain HTTP.
pub async fn request(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
    timeout: Duration,
) -> Result<Response, ClientError> {
    request_over(addr, None, method, path, token, body, timeout).await
}

/// Sends one request to `addr` (host:port) over `tls` (`None`: plain HTTP). A refused TLS
/// handshake is [`ClientError::Tls`] with rustls's reason.
pub async fn request_over(
    addr: &str,
    tls: Option<&TlsClient>,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
    timeout: Duration,
) -> Result<Response, ClientError> {
    tokio::time::timeout(timeout, request_inner(addr, tls, method, path, token, body))
        .await
        .map_err(|_| ClientError::Timeout(addr.to_string()))?
}

async fn request_inner(
    addr: &str,
    tls: Option<&TlsClient>,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> Result<Response, ClientError> {
    let io = |source: std::io::Error| match tls_failure(&source) {
        Some(reason) => ClientError::Tls {
            addr: addr.to_string(),
            reason,
        },
        None => ClientError::Io {
            addr: addr.to_string(),
            source,
        },
    };
    let tcp = TcpStream::connect(addr).await.map_err(io)?;
    let mut s: ByteStream = match tls {
        Some(tls) => tls.connect(tcp, addr).await.map_err(io)?,
        None => Box::new(tcp),
    };
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    let body = body.unwrap_or("");
    if !body.is_empty() || method == "POST" {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await.map_err(io)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.map_err(io)?;
    parse(&raw).ok_or_else(|| ClientError::Malformed(addr.to_string()))
}

fn parse(raw: &[u8]) -> Option<Response> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let mut body = raw[split + 4..].to_vec();
    if chunked {
        let mut out = Vec::new();
        let mut rest = &body[..];
        loop {
            let eol = rest.windows(2).position(|w| w == b"\r\n")?;
            let size =
                usize::from_str_radix(std::str::from_utf8(&rest[..eol]).ok()?.trim(), 16).ok()?;
            rest = &rest[eol + 2..];
            if size == 0 {
                break;
            }
            out.extend_from_slice(rest.get(..size)?);
            rest = rest.get(size + 2..)?;
        }
        body = out;
    }
    Some(Response {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked() {
        let r = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "{}"));
        let r = parse(b"HTTP/1.1 409 Conflict\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            .unwrap();
        assert_eq!((r.status, r.body.as_str()), (409, "abcde"));
        assert!(parse(b"garbage").is_none());
    }
}
