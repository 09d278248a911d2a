//! The receiving side of the bootstrap: accept a writer, authenticate it, give it a queue pair.
//!
//! For each accepted bootstrap connection we create a queue pair, move it to INIT, post its
//! receives, then to RTR/RTS towards the writer's endpoint, and only then answer with our
//! endpoint: by the time the writer can send, receives are waiting (the RNR hang of posting them
//! "later" cannot happen). The queue pair lives exactly as long as the bootstrap connection.

use std::sync::Arc;

use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;

use parking_lot::Mutex;

use super::verbs_bootstrap::{receiver_exchange, HandshakeKey, Reply, Request};
use super::verbs_device::{PortInfo, VerbsPd};
use super::verbs_endpoint::{random_psn, QpEndpoint};
use super::verbs_lane::{Polled, PolledSet, Role};
use super::verbs_qp::VerbsQp;
use super::verbs_qp_attr::{to_init, to_rtr, to_rts};
use super::verbs_registry::Registry;
use super::verbs_settings::VerbsSettings;

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
}

/// Removes a receiving queue pair from polling when its bootstrap connection ends.
struct ReceiverGuard {
    qp: Arc<VerbsQp>,
    polled: Arc<PolledSet>,
}

impl Drop for ReceiverGuard {
    fn drop(&mut self) {
        self.polled.remove(self.qp.qp_num());
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
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let this = self.clone();
            tokio::spawn(async move {
                let accepted =
                    receiver_exchange(&mut stream, &this.key.0, |request| this.answer(request))
                        .await;
                let guard = match accepted {
                    Ok(Some(g)) => g,
                    Ok(None) => return,
                    Err(e) => {
                        tracing::warn!(%addr, error = %e, "bootstrap from a writer failed");
                        return;
                    }
                };
                // Hold the queue pair until the writer closes the connection or this fabric is
                // dropped.
                let mut closed = this.closed.clone();
                let mut buf = [0u8; 64];
                loop {
                    tokio::select! {
                        r = stream.read(&mut buf) => match r {
                            Ok(0) | Err(_) => break,
                            Ok(_) => continue,
                        },
                        _ = closed.changed() => break,
                    }
                }
                drop(guard);
            });
        }
    }

    fn answer(&self, request: Request) -> Result<(Reply, Option<ReceiverGuard>), String> {
        match request {
            Request::Lane { lane, endpoint } => {
                let (ours, guard) = self.accept_qp(lane, endpoint)?;
                Ok((Reply::Lane { endpoint: ours }, Some(guard)))
            }
            Request::Diagnose { rkey, addr, len } => {
                let kind = self.registry.lock().diagnose(rkey, addr, len);
                Ok((Reply::Diagnosis { kind }, None))
            }
        }
    }

    fn accept_qp(
        &self,
        lane: u32,
        writer: QpEndpoint,
    ) -> Result<(QpEndpoint, ReceiverGuard), String> {
        let s = &self.settings;
        let qp = VerbsQp::new(&self.pd, 1, s.recv_depth).map_err(|e| e.to_string())?;
        qp.modify(&to_init(self.port.port), "RESET->INIT")
            .map_err(|e| e.to_string())?;
        qp.post_recvs(s.recv_depth as usize)
            .map_err(|e| e.to_string())?;
        let psn = random_psn();
        let rtr = to_rtr(
            &writer,
            self.port.addressing,
            self.port.port,
            self.port.active_mtu,
            s,
        )?;
        qp.modify(&rtr, "INIT->RTR").map_err(|e| e.to_string())?;
        qp.modify(&to_rts(psn, s), "RTR->RTS")
            .map_err(|e| e.to_string())?;
        let ours = QpEndpoint {
            qp_num: qp.qp_num(),
            psn,
            lid: self.port.lid,
            gid: self.port.gid,
            mtu: self.port.active_mtu,
        };
        tracing::debug!(
            lane,
            writer_qp = writer.qp_num,
            qp = ours.qp_num,
            "accepted a lane"
        );
        self.polled.add(Polled {
            qp: qp.clone(),
            role: Role::Receiver,
        });
        Ok((
            ours,
            ReceiverGuard {
                qp,
                polled: self.polled.clone(),
            },
        ))
    }
}
