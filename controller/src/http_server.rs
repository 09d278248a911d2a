//! Serving the router over HTTP/1 with bounds a slow or hostile client cannot outlast.
//!
//! `axum::serve` sets no timer, so hyper's header-read timeout never fires and a client that
//! sends half a request line holds its connection (and file descriptor) forever; it has no cap on
//! connections either. Here every connection must send its request head within
//! [`HttpLimits::header_timeout`] (also the idle time allowed between keep-alive requests), and
//! at most [`HttpLimits::max_connections`] are open at once, [`HttpLimits::max_per_ip`] from
//! one address; a connection over a cap is closed at accept.
//!
//! With TLS ([`weightsync_common::tls::TlsServer`]) each connection first completes a TLS
//! handshake (within the header timeout; no client certificate is asked for: the API's bearer
//! tokens authenticate its callers); a client speaking plain HTTP to that port gets no answer.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tower::ServiceExt;
use weightsync_common::tls::{ByteStream, TlsServer};

/// The bounds of the HTTP server.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Of those, from one IP address.
    pub max_per_ip: usize,
    /// Time allowed for a request head (and between keep-alive requests).
    pub header_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 1024,
            max_per_ip: 256,
            header_timeout: Duration::from_secs(10),
        }
    }
}

/// Serves `app` on `listener` until `stop` changes; connections in flight then finish their
/// current request.
pub async fn serve_http(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    tls: Option<TlsServer>,
    mut stop: watch::Receiver<bool>,
) {
    let all = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let per_ip: Arc<parking_lot::Mutex<HashMap<IpAddr, usize>>> = Arc::default();
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("HTTP accept: {e} (raise the open-file limit?)");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = all.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "too many HTTP connections; closing");
            continue;
        };
        let ip = peer.ip();
        {
            let mut m = per_ip.lock();
            let n = m.entry(ip).or_insert(0);
            if *n >= limits.max_per_ip.max(1) {
                tracing::debug!(%peer, "too many HTTP connections from this address; closing");
                continue;
            }
            *n += 1;
        }
        let (app, per_ip, mut stop) = (app.clone(), per_ip.clone(), stop.clone());
        let tls = tls.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let _slot = IpSlot { per_ip, ip };
            let stream: ByteStream = match tls {
                None => Box::new(stream),
                Some(tls) => {
                    let accepted =
                        tokio::time::timeout(limits.header_timeout, tls.accept_http(stream));
                    match accepted.await {
                        Ok(Ok(s)) => Box::new(s),
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, "HTTP TLS handshake failed: {e}");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "HTTP TLS handshake timed out");
                            return;
                        }
                    }
                }
            };
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                app.clone().oneshot(req.map(axum::body::Body::new))
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .keep_alive(true);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(%peer, "HTTP connection ended: {e}");
            }
        });
    }
}

/// One connection's place in the per-address count, given back on drop (also when its TLS
/// handshake fails).
struct IpSlot {
    per_ip: Arc<parking_lot::Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut m = self.per_ip.lock();
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}
