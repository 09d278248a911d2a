//! The control channel's server side: one task per worker connection (challenge, the proof of
//! its role's secret, the controller's own proof, registration, then frames in and the outbox
//! out), and the clock that drives the coordinator's timeouts.
//!
//! Work done for a peer that has proved nothing is bounded: caps on such connections in all
//! and per address, one deadline for the handshake, and kilobyte frames until the proof checks
//! (a peer that announces 4 GiB is refused at the header; one that announces 4 KiB and sends
//! nothing holds a task and a few kilobytes until the deadline).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use weightsync_common::protocol::{
    ControlFrameError, DEFAULT_MAX_FRAME, FabricKey, FromWorker, PREAUTH_MAX_FRAME, Registration,
    ToWorker, WorkerRole, auth, read_frame, write_frame,
};
use weightsync_common::tls::ByteStream;

use crate::coordinator::{Effects, Now, Refused};
use crate::service::{AppState, ControllerConfig, Outgoing};

/// Connections at most, authenticated or not.
const MAX_CONNECTIONS: usize = 16_384;

/// Serves the control channel on `listener` until `shutdown` fires.
///
/// Before a peer has proved a secret it is bounded: at most
/// [`ControllerConfig::max_unauthenticated`] such connections in all and
/// [`ControllerConfig::max_unauthenticated_per_ip`] from one address (others are closed at
/// once and counted), each must finish its handshake within `handshake_timeout`, and the
/// frames it may send are [`PREAUTH_MAX_FRAME`] bytes at most, read as they arrive.
pub async fn serve_control(
    listener: TcpListener,
    state: AppState,
    mut shutdown: watch::Receiver<bool>,
) {
    let cfg = state.config().clone();
    let all = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let unauthenticated = Arc::new(Semaphore::new(cfg.max_unauthenticated.max(1)));
    let per_ip = Arc::new(PerIp::default());
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!("control accept: {e} (raise the open-file limit?)");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = all.clone().try_acquire_owned() else {
                    state.metrics().refused("preauth_cap");
                    tracing::warn!(%peer, "too many control connections; refusing");
                    continue;
                };
                let Ok(preauth) = unauthenticated.clone().try_acquire_owned() else {
                    state.metrics().refused("preauth_cap");
                    tracing::debug!(%peer, "too many unauthenticated control connections; refusing");
                    continue;
                };
                let Some(ip_slot) = per_ip.admit(peer.ip(), cfg.max_unauthenticated_per_ip) else {
                    state.metrics().refused("preauth_cap");
                    tracing::debug!(%peer, "too many unauthenticated control connections from this address");
                    continue;
                };
                let state = state.clone();
                tokio::spawn(async move {
                    match handle_connection(stream, state, (preauth, ip_slot)).await {
                        Err(e @ ConnectionError::Tls(_)) => {
                            tracing::warn!(%peer, "refused a control connection: {e}");
                        }
                        Err(e) => tracing::info!(%peer, "control connection ended: {e}"),
                        Ok(()) => {}
                    }
                    drop(permit);
                });
            }
        }
    }
}

/// Unauthenticated connections by address.
#[derive(Debug, Default)]
struct PerIp(parking_lot::Mutex<HashMap<IpAddr, usize>>);

/// One unauthenticated connection's place in [`PerIp`], given back on drop.
struct IpSlot {
    table: Arc<PerIp>,
    ip: IpAddr,
}

impl PerIp {
    fn admit(self: &Arc<Self>, ip: IpAddr, cap: usize) -> Option<IpSlot> {
        let mut m = self.0.lock();
        let n = m.entry(ip).or_insert(0);
        if *n >= cap.max(1) {
            return None;
        }
        *n += 1;
        Some(IpSlot {
            table: self.clone(),
            ip,
        })
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut m = self.table.0.lock();
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

/// Why a control connection ended before or instead of joining the world.
#[derive(Debug, thiserror::Error)]
enum ConnectionError {
    /// The TLS handshake failed: no client certificate, or one the CA did not sign.
    #[error("TLS handshake refused: {0}")]
    Tls(String),
    /// The stream failed or carried garbage.
    #[error(transparent)]
    Frame(#[from] ControlFrameError),
    /// The peer did not follow the handshake (or did not know the role's secret).
    #[error("{0}")]
    Handshake(String),
    /// The peer registered as another role than the one whose secret it proved.
    #[error("{0}")]
    Role(String),
    /// The coordinator refused the registration.
    #[error(transparent)]
    Refused(#[from] Refused),
    /// The peer closed after learning the job (an in-process worker's first look).
    #[error("closed after learning the job")]
    JobOnly,
}

impl ConnectionError {
    /// The metric label of this refusal.
    fn reason(&self) -> &'static str {
        match self {
            ConnectionError::Tls(_) => "tls",
            ConnectionError::Frame(_) | ConnectionError::Handshake(_) => "auth",
            ConnectionError::Role(_) => "role",
            ConnectionError::Refused(_) => "registration",
            ConnectionError::JobOnly => "none",
        }
    }
}

/// One worker's connection: handshake, registration, then its frames in and its outbox out,
/// until either side ends it. `preauth` holds its unauthenticated slots until its handshake ends.
async fn handle_connection(
    stream: TcpStream,
    state: AppState,
    preauth: (OwnedSemaphorePermit, IpSlot),
) -> Result<(), ConnectionError> {
    let _ = stream.set_nodelay(true);
    let cfg = state.config().clone();
    let max = cfg.max_frame.min(DEFAULT_MAX_FRAME);
    let deadline = tokio::time::Instant::now() + cfg.handshake_timeout;
    // TLS first (under the same deadline): a peer without a certificate the CA signed never
    // reaches the role secrets' handshake.
    let stream: ByteStream = match &cfg.tls {
        None => Box::new(stream),
        Some(tls) => match tokio::time::timeout_at(deadline, tls.accept_control(stream)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                state.metrics().refused("tls");
                return Err(ConnectionError::Tls(e.to_string()));
            }
            Err(_) => {
                state.metrics().refused("timeout");
                return Err(ConnectionError::Tls("handshake timed out".into()));
            }
        },
    };
    let (mut rd, mut wr) = tokio::io::split(stream);
    let handshake = tokio::time::timeout_at(deadline, handshake(&mut rd, &mut wr, &cfg));
    let handshake = handshake.await;
    drop(preauth);
    let reg = match handshake {
        Ok(Ok(reg)) => reg,
        Ok(Err(ConnectionError::JobOnly)) => return Ok(()),
        Ok(Err(e)) => {
            state.metrics().refused(e.reason());
            return Err(reject(&mut wr, e).await);
        }
        Err(_) => {
            state.metrics().refused("timeout");
            let e = ConnectionError::Handshake("handshake timed out".into());
            return Err(reject(&mut wr, e).await);
        }
    };
    let (conn, outbox) = state.open_connection();
    let id = reg.id;
    let registered = state.step(|c| match c.register(conn, reg, Now::wall()) {
        Ok(fx) => (Ok(()), fx),
        Err(refused) => (Err(refused), Effects::default()),
    });
    if let Err(refused) = registered {
        state.close_connection(conn);
        state.metrics().refused("registration");
        tracing::warn!("refused registration: {refused}");
        return Err(reject(&mut wr, refused.into()).await);
    }
    let writer = tokio::spawn(write_outbox(wr, outbox, max));
    let reason = loop {
        tokio::select! {
            frame = read_frame::<_, FromWorker>(&mut rd, max) => match frame {
                Ok(Some(msg)) => {
                    // Stamped when read, not when the lock is won: a stall behind the lock must
                    // not make a live worker look silent.
                    let now = Now::wall();
                    state.step(|c| ((), c.message(conn, msg, now)));
                }
                Ok(None) => break "connection closed".to_string(),
                Err(e) => break format!("control channel error ({e})"),
            },
            _ = closed(&writer) => break "connection closed by the controller".to_string(),
        }
    };
    writer.abort();
    state.close_connection(conn);
    state.step(|c| ((), c.disconnect(conn, &reason, Now::wall())));
    tracing::info!("{id}: {reason}");
    Ok(())
}

/// Challenge, proof of the role's secret, the controller's answer with the job, registration
/// of that role.
async fn handshake<R, W>(
    rd: &mut R,
    wr: &mut W,
    cfg: &ControllerConfig,
) -> Result<Registration, ConnectionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let max = cfg.max_frame.min(DEFAULT_MAX_FRAME);
    let nonce = auth::nonce();
    write_frame(wr, &ToWorker::Challenge { nonce }, PREAUTH_MAX_FRAME).await?;
    let (role, worker_nonce) = match read_frame::<_, FromWorker>(rd, PREAUTH_MAX_FRAME).await? {
        Some(FromWorker::Hello {
            role,
            nonce: worker_nonce,
            proof,
        }) => {
            let secret = cfg.secrets.for_role(role);
            if !auth::verify(secret.expose(), role, &nonce, &proof) {
                let other = match role {
                    WorkerRole::Trainer => WorkerRole::Rollout,
                    WorkerRole::Rollout => WorkerRole::Trainer,
                };
                // Say so when a worker holds the other role's credential (a misconfigured
                // launch, or an engine host trying to pose as a trainer).
                let detail = if !cfg.secrets.roles_shared()
                    && auth::verify(cfg.secrets.for_role(other).expose(), role, &nonce, &proof)
                {
                    format!("authentication failed: a {other} credential cannot register a {role}")
                } else {
                    format!("authentication failed: wrong secret for the {role} role")
                };
                return Err(ConnectionError::Handshake(detail));
            }
            (role, worker_nonce)
        }
        _ => {
            return Err(ConnectionError::Handshake(
                "expected Hello as the first message".into(),
            ));
        }
    };
    let job = ToWorker::Job {
        world: cfg.coordinator.world.clone(),
        model_config: cfg.model_config.clone(),
        proof: auth::answer(
            cfg.secrets.for_role(role).expose(),
            role,
            &worker_nonce,
            &nonce,
        ),
        fabric_key: cfg.tls.as_ref().map(|tls| {
            FabricKey(tls.fabric_key(&[cfg.secrets.trainer.expose(), cfg.secrets.rollout.expose()]))
        }),
    };
    write_frame(wr, &job, max).await?;
    match read_frame::<_, FromWorker>(rd, max).await? {
        Some(FromWorker::Register(reg)) if reg.id.role == role => Ok(*reg),
        Some(FromWorker::Register(reg)) => Err(ConnectionError::Role(format!(
            "{} proved the {role} secret, not the {} one",
            reg.id, reg.id.role
        ))),
        // An in-process worker asking for the job before it registers its memory.
        None => Err(ConnectionError::JobOnly),
        _ => Err(ConnectionError::Handshake(
            "expected Register after Hello".into(),
        )),
    }
}

/// The controller's side of a worker's handshake over any byte stream: the registration of a
/// worker that proved its role's secret and registered as that role, or why not (the reason a
/// refused worker is sent). Connections run it under their deadline and caps; the
/// `control_handshake` fuzz target and its seed replay drive it with bytes in memory.
pub async fn worker_handshake<R, W>(
    rd: &mut R,
    wr: &mut W,
    cfg: &ControllerConfig,
) -> Result<Registration, String>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    match handshake(rd, wr, cfg).await {
        Ok(reg) => Ok(reg),
        Err(ConnectionError::JobOnly) => Err("the worker asked for the job only".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Tells the peer why it is refused (best effort) and hands the error back.
async fn reject(wr: &mut WriteHalf<ByteStream>, e: ConnectionError) -> ConnectionError {
    let reason = e.to_string();
    let _ = write_frame(wr, &ToWorker::Rejected { reason }, PREAUTH_MAX_FRAME).await;
    e
}

/// How long one frame may take to be written: a worker that reads nothing for this long (a
/// half-open connection, a one-way partition) is dropped instead of stalling its writer until
/// the kernel's retransmission timeout (about 15 minutes).
const WRITE_WITHIN: Duration = Duration::from_secs(15);

/// Writes the connection's outbox until it closes, `Shutdown` went out, or the stream fails or
/// stalls for [`WRITE_WITHIN`].
async fn write_outbox(
    mut wr: WriteHalf<ByteStream>,
    mut outbox: mpsc::Receiver<Outgoing>,
    max: u32,
) {
    while let Some(out) = outbox.recv().await {
        match out {
            Outgoing::Msg(m) => {
                let shutdown = matches!(m, ToWorker::Shutdown);
                let written = tokio::time::timeout(WRITE_WITHIN, write_frame(&mut wr, &m, max));
                if !matches!(written.await, Ok(Ok(()))) || shutdown {
                    break;
                }
            }
            Outgoing::Close => break,
        }
    }
}

async fn closed(task: &tokio::task::JoinHandle<()>) {
    while !task.is_finished() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Drives timeouts until `shutdown` fires.
pub async fn tick(state: AppState, mut shutdown: watch::Receiver<bool>) {
    let mut every = tokio::time::interval(state.config().tick);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            _ = every.tick() => {
                let now = Now::wall();
                state.step(|c| ((), c.tick(now)));
            }
        }
    }
}
