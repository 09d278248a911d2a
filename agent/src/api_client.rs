//! A minimal client of the controller's HTTP API (HTTP/1.1, one request per connection), for
//! the demo's training loop and for tests that talk to a served controller. The API is a few
//! small JSON calls on a trusted network; a general HTTP client would add a dependency tree for
//! nothing.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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
    /// No answer in time.
    #[error("HTTP request to {0} timed out")]
    Timeout(String),
    /// The answer is not HTTP.
    #[error("malformed HTTP response from {0}")]
    Malformed(String),
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

/// Sends one request to `addr` (host:port).
pub async fn request(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
    timeout: Duration,
) -> Result<Response, ClientError> {
    tokio::time::timeout(timeout, request_inner(addr, method, path, token, body))
        .await
        .map_err(|_| ClientError::Timeout(addr.to_string()))?
}

async fn request_inner(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> Result<Response, ClientError> {
    let io = |source| ClientError::Io {
        addr: addr.to_string(),
        source,
    };
    let mut s = TcpStream::connect(addr).await.map_err(io)?;
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
