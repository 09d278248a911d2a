//! The receiving side of the bootstrap: accept a writer, authenticate it, give it a queue pair.
//!
//! For each accepted bootstrap connection we create a queue pair, move it to INIT, post its
//! receives, then to RTR/RTS towards the writer's endpoint, and only then answer with our
//! endpoint: by the time the writer can send, receives are waiting (the RNR hang of posting them
//! "later" cannot happen). The queue pair lives exactly as long as the bootstrap connection, which
//! then carries credit reports and the teardown (`verbs_lane_session`).
//!
//! Hardening: the handshake must complete within the connect timeout (a client that connects and
//! says nothing holds no task for long), the connection has TCP keepalive (a writer host that
//! vanishes without a FIN does not leave a queue pair with its receives and CQ behind for good),
//! and the blocking verbs calls that create a queue pair run on the blocking pool, not on a tokio
//! worker.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use parking_lot::Mutex;

use super::verbs_bootstrap::{HandshakeKey, Reply, Request, receiver_exchange};
use super::verbs_credits::ReceiveCredits;
use super::verbs_device::{PortInfo, VerbsPd};
use super::verbs_endpoint::QpEndpoint;
use super::verbs_lane::{Polled, PolledSet, Role};
use super::verbs_lane_session::serve_receiver_lane;
use super::verbs_qp::VerbsQp;
use super::verbs_qp_attr::{to_error, to_init, to_rtr, to_rts};
use super::verbs_registry::Registry;
use super::verbs_settings::VerbsSettings;
use super::verbs_window::InboundWindow;

/// Keepalive: first probe after this much silence.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
/// Keepalive: between probes.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// Keepalive: unanswered probes before the connection is dropped.
const KEEPALIVE_PROBES: u32 = 5;

/// Turns on TCP keepalive with short intervals (a dead peer is noticed within ~10 s).
pub fn set_keepalive(stream: &TcpStream) -> std::io::Result<()> {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive)
}

/// What the accept loop needs.
#[derive(Debug, Clone)]
pub struct Listener {
    /// Protection domain for the new queue pairs.
    pub pd: Arc<VerbsPd>,
    /// The port in use.
    pub port: PortInfo,
    /// Settings (depths, timers).
    pub settings: VerbsSettings,
    /// Handshake key from the job token.
    pub key: HandshakeKey,
    /// Where new queue pairs are registered for polling.
    pub polled: Arc<PolledSet>,
    /// Registrations (to diagnose refusals).
    pub registry: Arc<Mutex<Registry>>,
    /// Changes (errors) when the fabric is dropped.
    pub closed: tokio::sync::watch::Receiver<()>,
    /// Longest a writer may take to authenticate and ask.
    pub handshake_timeout: Duration,
    /// The write window: new queue pairs come up with its access and are listed in it.
    pub window: Arc<InboundWindow>,
}

/// A receiving queue pair, polled while this lives.
struct ReceiverGuard {
    qp: Arc<VerbsQp>,
    credits: Arc<ReceiveCredits>,
    polled: Arc<PolledSet>,
    window: Arc<InboundWindow>,
}

impl ReceiverGuard {
    /// Moves the queue pair to the error state: nothing lands through it any more.
    fn fence(&self) {
        if let Err(e) = self.qp.modify(&to_error(), "->ERR (lane ended)") {
            tracing::warn!(qp = self.qp.qp_num(), error = %e, "fencing a receiving queue pair");
        }
    }
}

impl Drop for ReceiverGuard {
    fn drop(&mut self) {
        self.polled.remove(self.qp.qp_num());
        self.window.remove(self.qp.qp_num());
    }
}

impl Listener {
    /// Accepts bootstrap connections until the task is aborted.
    pub async fn run(self, listener: TcpListener) {
        loop {
            let (mut stream, addr) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a bootstrap connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            if let Err(e) = set_keepalive(&stream) {
                tracing::debug!(%addr, error = %e, "enabling TCP keepalive failed");
            }
            let this = self.clone();
            tokio::spawn(async move {
                let exchange = receiver_exchange(&mut stream, &this.key.0, |request| {
                    let this = this.clone();
                    async move { this.answer(request).await }
                });
                let guard = match tokio::time::timeout(this.handshake_timeout, exchange).await {
                    Ok(Ok(Some(g))) => g,
                    Ok(Ok(None)) => return,
                    Ok(Err(e)) => {
                        tracing::warn!(%addr, error = %e, "bootstrap from a writer failed");
                        return;
                    }
                    Err(_) => {
                        tracing::warn!(%addr, after = ?this.handshake_timeout,
                            "bootstrap from a writer timed out");
                        return;
                    }
                };
                // Serve the lane until the writer tears it down or goes away, or this fabric is
                // dropped; the queue pair is fenced first in every case.
                let end = serve_receiver_lane(stream, &guard.credits, this.closed.clone(), || {
                    guard.fence()
                })
                .await;
                tracing::debug!(%addr, ?end, qp = guard.qp.qp_num(), "receiving lane ended");
                drop(guard);
            });
        }
    }

    async fn answer(&self, request: Request) -> Result<(Reply, Option<ReceiverGuard>), String> {
        match request {
            Request::Lane { lane, endpoint } => {
                let this = self.clone();
                let (ours, guard) =
                    tokio::task::spawn_blocking(move || this.accept_qp(lane, endpoint))
                        .await
                        .map_err(|e| format!("creating the queue pair: {e}"))??;
                Ok((Reply::Lane { endpoint: ours }, Some(guard)))
            }
            Request::Diagnose { rkey, addr, len } => {
                let kind = self.registry.lock().diagnose(rkey, addr, len);
                Ok((Reply::Diagnosis { kind }, None))
            }
        }
    }

    /// Brings up a receiving queue pair towards `writer`, granting remote write only if the
    /// write window is open (the window cannot change until it is in RTS and listed).
    fn accept_qp(
        &self,
        lane: u32,
        writer: QpEndpoint,
    ) -> Result<(QpEndpoint, ReceiverGuard), String> {
        let s = &self.settings;
        let (qp, (ours, credits)) = self.window.admit(|remote_write| {
            let qp = VerbsQp::new(&self.pd, 1, s.recv_depth, 1).map_err(|e| e.to_string())?;
            qp.modify(&to_init(self.port.port, remote_write), "RESET->INIT")
                .map_err(|e| e.to_string())?;
            qp.post_recvs(s.recv_depth as usize)
                .map_err(|e| e.to_string())?;
            let ours = self.port.endpoint(qp.qp_num(), s.recv_depth);
            let rtr = to_rtr(&ours, &writer, self.port.addressing, self.port.port, s)?;
            qp.modify(&rtr, "INIT->RTR").map_err(|e| e.to_string())?;
            qp.modify(&to_rts(ours.psn, s), "RTR->RTS")
                .map_err(|e| e.to_string())?;
            tracing::debug!(
                lane,
                writer_qp = writer.qp_num,
                qp = ours.qp_num,
                ?remote_write,
                "accepted a lane"
            );
            let credits = Arc::new(ReceiveCredits::default());
            self.polled.add(Polled {
                qp: qp.clone(),
                role: Role::Receiver(credits.clone()),
            });
            Ok::<_, String>((qp, (ours, credits)))
        })?;
        Ok((
            ours,
            ReceiverGuard {
                qp,
                credits,
                polled: self.polled.clone(),
                window: self.window.clone(),
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// V16: bootstrap connections (which hold a queue pair each) get keepalive with short
    /// intervals, so a writer host that vanishes without a FIN frees the receiver's queue pair.
    #[tokio::test]
    async fn bootstrap_connections_have_short_keepalive() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = TcpStream::connect(addr).await.unwrap();
        let sock = socket2::SockRef::from(&client);
        assert!(!sock.keepalive().unwrap(), "keepalive is off by default");
        set_keepalive(&client).unwrap();
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(sock.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(sock.tcp_keepalive_retries().unwrap(), KEEPALIVE_PROBES);
    }
}
