//! The control channel's server side: one task per worker connection (challenge, job-token
//! proof, registration, then frames in and the outbox out), and the clock that drives the
//! coordinator's timeouts.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, watch};
use weightsync_common::protocol::{
    ControlFrameError, DEFAULT_MAX_FRAME, FromWorker, Registration, ToWorker, auth, read_frame,
    write_frame,
};

use crate::coordinator::{Effects, Now, Refused};
use crate::service::{AppState, ControllerConfig, Outgoing};

/// Serves the control channel on `listener` until `shutdown` fires.
pub async fn serve_control(
    listener: TcpListener,
    state: AppState,
    mut shutdown: watch::Receiver<bool>,
) {
    let limit = Arc::new(Semaphore::new(4096));
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!("control accept: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = limit.clone().try_acquire_owned() else {
                    tracing::warn!(%peer, "too many control connections; refusing");
                    continue;
                };
                let state = state.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle_connection(stream, state).await {
                        tracing::info!(%peer, "control connection ended: {e}");
                    }
                    drop(permit);
                });
            }
        }
    }
}

/// Why a control connection ended before or instead of joining the world.
#[derive(Debug, thiserror::Error)]
enum ConnectionError {
    /// The stream failed or carried garbage.
    #[error(transparent)]
    Frame(#[from] ControlFrameError),
    /// The peer did not follow the handshake (or did not know the job token).
    #[error("{0}")]
    Handshake(String),
    /// The coordinator refused the registration.
    #[error(transparent)]
    Refused(#[from] Refused),
    /// The peer closed after learning the job (an in-process worker's first look).
    #[error("closed after learning the job")]
    JobOnly,
}

/// One worker's connection: handshake, registration, then its frames in and its outbox out,
/// until either side ends it.
async fn handle_connection(stream: TcpStream, state: AppState) -> Result<(), ConnectionError> {
    let _ = stream.set_nodelay(true);
    let cfg = state.config().clone();
    let max = cfg.max_frame.min(DEFAULT_MAX_FRAME);
    let (mut rd, mut wr) = stream.into_split();
    let handshake = tokio::time::timeout(cfg.handshake_timeout, handshake(&mut rd, &mut wr, &cfg));
    let reg = match handshake.await {
        Ok(Ok(reg)) => reg,
        Ok(Err(ConnectionError::JobOnly)) => return Ok(()),
        Ok(Err(e)) => return Err(reject(&mut wr, max, e).await),
        Err(_) => {
            let e = ConnectionError::Handshake("handshake timed out".into());
            return Err(reject(&mut wr, max, e).await);
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
        tracing::warn!("refused registration: {refused}");
        return Err(reject(&mut wr, max, refused.into()).await);
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

/// Challenge, proof of the job token, registration.
async fn handshake(
    rd: &mut OwnedReadHalf,
    wr: &mut OwnedWriteHalf,
    cfg: &ControllerConfig,
) -> Result<Registration, ConnectionError> {
    let max = cfg.max_frame.min(DEFAULT_MAX_FRAME);
    let nonce = auth::nonce();
    write_frame(wr, &ToWorker::Challenge { nonce }, max).await?;
    match read_frame::<_, FromWorker>(rd, max).await? {
        Some(FromWorker::Hello { proof }) if auth::verify(&cfg.job_token, &nonce, &proof) => {}
        Some(FromWorker::Hello { .. }) => {
            return Err(ConnectionError::Handshake(
                "authentication failed (wrong job token)".into(),
            ));
        }
        _ => {
            return Err(ConnectionError::Handshake(
                "expected Hello as the first message".into(),
            ));
        }
    }
    let job = ToWorker::Job {
        world: cfg.coordinator.world.clone(),
        model_config: cfg.model_config.clone(),
    };
    write_frame(wr, &job, max).await?;
    match read_frame::<_, FromWorker>(rd, max).await? {
        Some(FromWorker::Register(reg)) => Ok(*reg),
        // An in-process worker asking for the job before it registers its memory.
        None => Err(ConnectionError::JobOnly),
        _ => Err(ConnectionError::Handshake(
            "expected Register after Hello".into(),
        )),
    }
}

/// Tells the peer why it is refused (best effort) and hands the error back.
async fn reject(wr: &mut OwnedWriteHalf, max: u32, e: ConnectionError) -> ConnectionError {
    let reason = e.to_string();
    let _ = write_frame(wr, &ToWorker::Rejected { reason }, max).await;
    e
}

/// How long one frame may take to be written: a worker that reads nothing for this long (a
/// half-open connection, a one-way partition) is dropped instead of stalling its writer until
/// the kernel's retransmission timeout (about 15 minutes).
const WRITE_WITHIN: Duration = Duration::from_secs(15);

/// Writes the connection's outbox until it closes, `Shutdown` went out, or the stream fails or
/// stalls for [`WRITE_WITHIN`].
async fn write_outbox(mut wr: OwnedWriteHalf, mut outbox: mpsc::Receiver<Outgoing>, max: u32) {
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
