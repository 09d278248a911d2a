//! The controller service: the shared state behind the HTTP API and the control channel, the
//! I/O that carries out the coordinator's [`Effects`]; [`crate::server::run`] serves it.
//!
//! Every input (a frame from a worker, a closed connection, an HTTP trigger, a clock tick) takes
//! the coordinator's lock for the duration of one pure step, then the effects are delivered by
//! `try_send` into each connection's bounded outbox, so no lock is held across I/O. A worker whose
//! outbox is full is too slow to be part of the world and is disconnected.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Semaphore};
use weightsync_common::protocol::{
    auth, read_frame, write_frame, FromWorker, ToWorker, WorldSpec, DEFAULT_MAX_FRAME,
};

use crate::coordinator::{ConnId, Coordinator, CoordinatorConfig, Effects};
use crate::metrics::Metrics;
use crate::planning::Planner;

/// Controller settings beyond the coordinator's.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Membership, timeouts, history.
    pub coordinator: CoordinatorConfig,
    /// Job token workers must prove they know (never sent, never shown).
    pub job_token: String,
    /// Bearer token for mutating HTTP endpoints.
    pub api_token: String,
    /// Largest control frame accepted.
    pub max_frame: u32,
    /// How often timeouts are checked.
    pub tick: Duration,
    /// How long a new connection may take to authenticate and register.
    pub handshake_timeout: Duration,
    /// Whether workers are told to exit when the controller shuts down (the demo does this).
    pub shutdown_workers: bool,
}

impl ControllerConfig {
    /// The configuration of a controller for `world`: it expects the workers the job's layouts
    /// imply (built here, so a bad statement is refused at start), asks them for a heartbeat a
    /// fifth of `heartbeat_timeout`, and waits 300 ms for a peer's disconnect before a failure
    /// report fails a sync.
    pub fn for_job(
        world: WorldSpec,
        job_token: String,
        api_token: String,
        heartbeat_timeout: Duration,
        sync_timeout: Duration,
        history: usize,
    ) -> Result<ControllerConfig, JobConfigError> {
        let text = world.read_model_config()?;
        let layouts = weightsync_schedules::job::layouts(&world, text.as_deref())?;
        Ok(ControllerConfig::new(
            CoordinatorConfig {
                world,
                trainers: layouts.train.ranks,
                rollouts: layouts.infer.ranks.len() as u32,
                heartbeat_interval: (heartbeat_timeout / 5).max(Duration::from_millis(50)),
                heartbeat_timeout,
                sync_timeout,
                failure_grace: Duration::from_millis(300),
                history,
            },
            job_token,
            api_token,
        ))
    }

    /// Defaults for everything but the job.
    pub fn new(coordinator: CoordinatorConfig, job_token: String, api_token: String) -> Self {
        ControllerConfig {
            coordinator,
            job_token,
            api_token,
            max_frame: DEFAULT_MAX_FRAME,
            tick: Duration::from_millis(100),
            handshake_timeout: Duration::from_secs(10),
            shutdown_workers: false,
        }
    }
}

/// Why a job's controller configuration could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobConfigError {
    /// The model's config.json could not be read.
    #[error(transparent)]
    ModelConfig(#[from] std::io::Error),
    /// The job's statement does not make a job.
    #[error(transparent)]
    Job(#[from] weightsync_schedules::job::JobError),
}

enum Outgoing {
    Msg(ToWorker),
    Close,
}

struct Shared {
    cfg: ControllerConfig,
    coord: Mutex<Coordinator>,
    conns: Mutex<HashMap<ConnId, mpsc::Sender<Outgoing>>>,
    changed: watch::Sender<u64>,
    metrics: Metrics,
    next_conn: AtomicU64,
    started: Instant,
}

/// Shared controller state (cheap to clone).
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").finish_non_exhaustive()
    }
}

impl AppState {
    /// A controller with no workers yet.
    pub fn new(cfg: ControllerConfig, planner: Box<dyn Planner>) -> Self {
        let coord = Coordinator::new(cfg.coordinator.clone(), planner);
        let (changed, _) = watch::channel(0);
        AppState(Arc::new(Shared {
            cfg,
            coord: Mutex::new(coord),
            conns: Mutex::new(HashMap::new()),
            changed,
            metrics: Metrics::new(),
            next_conn: AtomicU64::new(1),
            started: Instant::now(),
        }))
    }

    /// Settings.
    pub fn config(&self) -> &ControllerConfig {
        &self.0.cfg
    }

    /// Runs `f` on the coordinator under its lock, then carries out the effects it returns.
    pub fn step<R>(&self, f: impl FnOnce(&mut Coordinator) -> (R, Effects)) -> R {
        let (r, fx) = {
            let mut c = self.0.coord.lock();
            f(&mut c)
        };
        self.apply(fx);
        r
    }

    /// Reads the coordinator.
    pub fn read<R>(&self, f: impl FnOnce(&Coordinator) -> R) -> R {
        f(&self.0.coord.lock())
    }

    /// Metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.0.metrics
    }

    /// Seconds since the controller started.
    pub fn uptime(&self) -> Duration {
        self.0.started.elapsed()
    }

    /// A receiver that changes whenever any sync or membership changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.0.changed.subscribe()
    }

    fn apply(&self, fx: Effects) {
        if fx.send.is_empty() && fx.close.is_empty() && fx.finished.is_empty() {
            return;
        }
        let mut overflow = Vec::new();
        {
            let conns = self.0.conns.lock();
            for (conn, msg) in fx.send {
                if let Some(tx) = conns.get(&conn) {
                    if tx.try_send(Outgoing::Msg(msg)).is_err() {
                        overflow.push(conn);
                    }
                }
            }
            for conn in fx.close {
                if let Some(tx) = conns.get(&conn) {
                    let _ = tx.try_send(Outgoing::Close);
                }
            }
        }
        if !fx.finished.is_empty() {
            let c = self.0.coord.lock();
            for id in &fx.finished {
                if let Some(s) = c.sync(*id) {
                    self.0.metrics.record(s);
                }
            }
        }
        self.0.changed.send_modify(|v| *v = v.wrapping_add(1));
        for conn in overflow {
            tracing::warn!(conn, "worker outbox full; disconnecting it");
            self.step(|c| {
                (
                    (),
                    c.disconnect(conn, "outbox full (worker not reading)", Instant::now()),
                )
            });
            if let Some(tx) = self.0.conns.lock().remove(&conn) {
                let _ = tx.try_send(Outgoing::Close);
            }
        }
    }

    /// Sends `Shutdown` to every connected worker.
    pub fn shutdown_workers(&self) {
        for tx in self.0.conns.lock().values() {
            let _ = tx.try_send(Outgoing::Msg(ToWorker::Shutdown));
        }
    }
}

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

async fn handle_connection(stream: TcpStream, state: AppState) -> anyhow::Result<()> {
    let _ = stream.set_nodelay(true);
    let cfg = state.config().clone();
    let max = cfg.max_frame.min(DEFAULT_MAX_FRAME);
    let (mut rd, mut wr) = stream.into_split();
    let nonce = auth::nonce();
    write_frame(&mut wr, &ToWorker::Challenge { nonce }, max).await?;
    let handshake = async {
        let hello: Option<FromWorker> = read_frame(&mut rd, max).await?;
        match hello {
            Some(FromWorker::Hello { proof }) if auth::verify(&cfg.job_token, &nonce, &proof) => {}
            Some(FromWorker::Hello { .. }) => {
                anyhow::bail!("authentication failed (wrong job token)")
            }
            _ => anyhow::bail!("expected Hello as the first message"),
        }
        match read_frame::<_, FromWorker>(&mut rd, max).await? {
            Some(FromWorker::Register(reg)) => Ok(*reg),
            _ => anyhow::bail!("expected Register after Hello"),
        }
    };
    let reg = match tokio::time::timeout(cfg.handshake_timeout, handshake).await {
        Ok(Ok(reg)) => reg,
        Ok(Err(e)) => {
            let _ = write_frame(
                &mut wr,
                &ToWorker::Rejected {
                    reason: e.to_string(),
                },
                max,
            )
            .await;
            return Err(e);
        }
        Err(_) => {
            let reason = "handshake timed out".to_string();
            let _ = write_frame(
                &mut wr,
                &ToWorker::Rejected {
                    reason: reason.clone(),
                },
                max,
            )
            .await;
            anyhow::bail!(reason);
        }
    };
    let conn = state.0.next_conn.fetch_add(1, Ordering::Relaxed);
    let (tx, mut outbox) = mpsc::channel::<Outgoing>(1024);
    state.0.conns.lock().insert(conn, tx);
    let id = reg.id;
    let registered = {
        let mut c = state.0.coord.lock();
        c.register(conn, reg, Instant::now())
    };
    match registered {
        Ok(fx) => state.apply(fx),
        Err(refused) => {
            state.0.conns.lock().remove(&conn);
            tracing::warn!("refused registration: {refused}");
            let _ = write_frame(
                &mut wr,
                &ToWorker::Rejected {
                    reason: refused.0.clone(),
                },
                max,
            )
            .await;
            anyhow::bail!(refused.0);
        }
    }
    let writer = tokio::spawn(async move {
        while let Some(out) = outbox.recv().await {
            match out {
                Outgoing::Msg(m) => {
                    let shutdown = matches!(m, ToWorker::Shutdown);
                    if write_frame(&mut wr, &m, max).await.is_err() || shutdown {
                        break;
                    }
                }
                Outgoing::Close => break,
            }
        }
    });
    let reason = loop {
        tokio::select! {
            frame = read_frame::<_, FromWorker>(&mut rd, max) => match frame {
                Ok(Some(msg)) => {
                    state.step(|c| ((), c.message(conn, msg, Instant::now())));
                }
                Ok(None) => break "connection closed".to_string(),
                Err(e) => break format!("control channel error ({e})"),
            },
            _ = closed(&writer) => break "connection closed by the controller".to_string(),
        }
    };
    writer.abort();
    state.0.conns.lock().remove(&conn);
    state.step(|c| ((), c.disconnect(conn, &reason, Instant::now())));
    tracing::info!("{id}: {reason}");
    Ok(())
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
            _ = every.tick() => state.step(|c| ((), c.tick(Instant::now()))),
        }
    }
}
