//! A deliberately small HTTP/1.1 client over a raw TCP stream, for abuse tests.
//!
//! Abuse tests need what a well-behaved client library will not do: send a body larger than its
//! `Content-Length` promise, stop half-way through the headers, open hundreds of connections and
//! leave them idle. So requests are written as bytes, and responses are parsed just enough to get
//! the status, the headers and a `Content-Length` or chunked body (the controller uses both).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A parsed response.
#[derive(Debug, Clone)]
pub struct RawResponse {
    /// Status code.
    pub status: u16,
    /// Header lines as (lower-case name, value).
    pub headers: Vec<(String, String)>,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl RawResponse {
    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON, if it is.
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Builds the bytes of a request with a body and `Content-Length`.
pub fn request_bytes(
    method: &str,
    path: &str,
    extra_headers: &[(&str, &str)],
    body: &[u8],
) -> Vec<u8> {
    let mut out = format!("{method} {path} HTTP/1.1\r\nHost: weightsync\r\nConnection: close\r\n");
    for (k, v) in extra_headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// Connects with a timeout for every read and write.
pub fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    Ok(s)
}

/// Sends `bytes` and reads one response.
pub fn exchange(addr: SocketAddr, bytes: &[u8], timeout: Duration) -> io::Result<RawResponse> {
    let mut s = connect(addr, timeout)?;
    // The server may answer (413) and close before the whole body is written; what it answered
    // is what matters, so a failed write is not an error as long as a response can be read.
    let _ = s.write_all(bytes);
    read_response(&mut s)
}

/// A request with a JSON or text body; `token` adds a bearer token.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &[u8],
) -> io::Result<RawResponse> {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("Authorization", a.as_str()));
    }
    exchange(
        addr,
        &request_bytes(method, path, &headers, body),
        Duration::from_secs(30),
    )
}

/// Reads one response from `s`.
pub fn read_response(s: &mut TcpStream) -> io::Result<RawResponse> {
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad status line {line:?}"),
            )
        })?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    let mut resp = RawResponse {
        status,
        headers,
        body: Vec::new(),
    };
    if let Some(len) = resp
        .header("content-length")
        .and_then(|v| v.parse::<usize>().ok())
    {
        resp.body.resize(len, 0);
        r.read_exact(&mut resp.body)?;
    } else if resp
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let size = usize::from_str_radix(line.trim(), 16)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad chunk size"))?;
            if size == 0 {
                break;
            }
            let start = resp.body.len();
            resp.body.resize(start + size, 0);
            r.read_exact(&mut resp.body[start..])?;
            line.clear();
            r.read_line(&mut line)?;
        }
    } else {
        let _ = r.read_to_end(&mut resp.body);
    }
    Ok(resp)
}
