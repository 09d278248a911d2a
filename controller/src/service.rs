//! The controller service: the shared state behind the HTTP API and the control channel, and
//! the I/O that carries out the coordinator's [`Effects`]; [`crate::server::run`] serves it.
//!
//! Every input (a frame from a worker, a closed connection, an HTTP trigger, a clock tick, a
//! plan result) takes the coordinator's lock for the duration of one pure step, then the effects
//! are delivered by `try_send` into each connection's bounded outbox, so no lock is held across
//! I/O. A worker whose outbox is full is too slow to be part of the world and is disconnected.
//!
//! Planning is the one slow step (seconds and gigabytes for a 1T-parameter job), so it never runs
//! under the lock: a [`PlanRequest`] effect starts the planner on a thread of its own, and its
//! result comes back as one more input ([`Coordinator::planned`]), which drops it if membership
//! changed meanwhile. The API and heartbeats are served throughout.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use weightsync_common::protocol::{DEFAULT_MAX_FRAME, ToWorker, WorldSpec};

use crate::coordinator::{
    ConnId, Coordinator, CoordinatorConfig, DeltaMode, Effects, Now, PlanRequest,
};
use crate::metrics::Metrics;
use crate::planning::{AssignmentError, Planner};
use crate::secrets::ControllerSecrets;
use crate::state_file::{StateFile, StateFileError};
use weightsync_common::secret::Secret;

/// Controller settings beyond the coordinator's.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Membership, timeouts, history.
    pub coordinator: CoordinatorConfig,
    /// The credentials of each role (never sent, never shown).
    pub secrets: ControllerSecrets,
    /// Largest control frame accepted.
    pub max_frame: u32,
    /// How often timeouts are checked.
    pub tick: Duration,
    /// How long a new connection may take to authenticate and register.
    pub handshake_timeout: Duration,
    /// Control connections that have not yet proved a secret, at most, in all.
    pub max_unauthenticated: usize,
    /// Of those, from one IP address.
    pub max_unauthenticated_per_ip: usize,
    /// Bounds of the HTTP server (connections, header timeout).
    pub http_limits: crate::http_server::HttpLimits,
    /// Whether workers are told to exit when the controller shuts down (the demo does this).
    pub shutdown_workers: bool,
    /// Send engines deltas (only what changed since the version they hold) where they hold a
    /// base: `auto` (the default: where measurements say they pay), `on`, or `off` (every sync
    /// writes every byte). See `coordinator`'s `delta` and `delta_policy`.
    pub delta: DeltaMode,
    /// The text of the model's `config.json` when the job's model names a file (read once at
    /// start): sent to every worker with the job, so an in-process worker need not read it.
    pub model_config: Option<String>,
    /// Where the controller keeps what must survive its own crash (run, last committed
    /// version, next sync id, incarnation); `None`: nothing survives a restart.
    pub state_file: Option<std::path::PathBuf>,
    /// TLS on the control channel (client certificates required) and the HTTP API; `None`:
    /// plain TCP, for loopback and tests (the controller says so at start).
    pub tls: Option<weightsync_common::tls::TlsServer>,
}

impl ControllerConfig {
    /// The configuration of a controller for `world`: it expects the workers the job's layouts
    /// imply (built here, so a bad statement is refused at start), asks them for a heartbeat a
    /// fifth of `heartbeat_timeout`, and waits 300 ms for a peer's disconnect before a failure
    /// report fails a sync.
    pub fn for_job(
        world: WorldSpec,
        job_token: Secret,
        api_token: Secret,
        heartbeat_timeout: Duration,
        sync_timeout: Duration,
        history: usize,
    ) -> Result<ControllerConfig, JobConfigError> {
        let text = world.read_model_config()?;
        // A declared model has no layouts before its workers register: the layout strings
        // give the numbers of ranks (and must suit a declared model).
        let (trainers, rollouts) =
            if weightsync_schedules::job::is_declared(&world, text.as_deref()) {
                weightsync_schedules::job::declared_world(&world)?
            } else {
                let layouts = weightsync_schedules::job::layouts(&world, text.as_deref())?;
                (layouts.train.ranks, layouts.infer.ranks.len() as u32)
            };
        let mut cfg = ControllerConfig::new(
            CoordinatorConfig {
                world,
                trainers,
                rollouts,
                heartbeat_interval: (heartbeat_timeout / 5).max(Duration::from_millis(50)),
                heartbeat_timeout,
                sync_timeout,
                failure_grace: Duration::from_millis(300),
                history,
            },
            job_token,
            api_token,
        );
        cfg.model_config = text;
        Ok(cfg)
    }

    /// Defaults for everything but the job, with one secret for every worker role
    /// ([`ControllerSecrets::shared`]); set [`ControllerConfig::secrets`] for one per role.
    pub fn new(coordinator: CoordinatorConfig, job_token: Secret, api_token: Secret) -> Self {
        ControllerConfig {
            coordinator,
            secrets: ControllerSecrets::shared(job_token, api_token),
            max_unauthenticated: 512,
            max_unauthenticated_per_ip: 64,
            http_limits: Default::default(),
            max_frame: DEFAULT_MAX_FRAME,
            tick: Duration::from_millis(100),
            handshake_timeout: Duration::from_secs(10),
            shutdown_workers: false,
            delta: DeltaMode::Auto,
            model_config: None,
            state_file: None,
            tls: None,
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

/// What a connection's writer task is told to do.
pub(crate) enum Outgoing {
    /// Send this message.
    Msg(ToWorker),
    /// Close the connection.
    Close,
}

struct Shared {
    cfg: ControllerConfig,
    state_file: Option<StateFile>,
    coord: Mutex<Coordinator>,
    planner: Arc<dyn Planner>,
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
    /// A controller with no workers yet, starting afresh. A configured state file is not read
    /// here (use [`AppState::open`]): this panics if one is set.
    pub fn new(cfg: ControllerConfig, planner: Box<dyn Planner>) -> Self {
        assert!(
            cfg.state_file.is_none(),
            "a controller with a state file starts with AppState::open"
        );
        Self::with(cfg, planner, Coordinator::new, None)
    }

    /// A controller with no workers yet that carries on from its state file, if one is
    /// configured and exists (the run, the last committed version and sync ids go on), as a
    /// new incarnation, which it saves at once.
    pub fn open(cfg: ControllerConfig, planner: Box<dyn Planner>) -> Result<Self, StateFileError> {
        let Some(path) = cfg.state_file.clone() else {
            return Ok(Self::with(cfg, planner, Coordinator::new, None));
        };
        let file = StateFile::new(path);
        let saved = file.load()?;
        let mut incarnation: u64 = rand::random();
        if saved.is_some_and(|s| s.incarnation == incarnation) {
            incarnation = incarnation.wrapping_add(1);
        }
        let state = saved.unwrap_or_default();
        match saved {
            Some(s) => tracing::info!(
                "carrying on from {}: run {}, last committed {:?}, next sync id {} (incarnation \
                 {:#x} follows {:#x})",
                file.path().display(),
                s.run,
                s.committed,
                s.next_sync_id,
                incarnation,
                s.incarnation
            ),
            None => tracing::info!(
                "no state file at {} yet: a first start (incarnation {incarnation:#x})",
                file.path().display()
            ),
        }
        let me = Self::with(
            cfg,
            planner,
            |c| Coordinator::restore(c, &state, incarnation),
            Some(file.clone()),
        );
        file.save(&me.read(Coordinator::durable))?;
        Ok(me)
    }

    fn with(
        cfg: ControllerConfig,
        planner: Box<dyn Planner>,
        coordinator: impl FnOnce(CoordinatorConfig) -> Coordinator,
        state_file: Option<StateFile>,
    ) -> Self {
        let mut coord = coordinator(cfg.coordinator.clone());
        coord.set_delta_mode(cfg.delta);
        let (changed, _) = watch::channel(0);
        AppState(Arc::new(Shared {
            cfg,
            state_file,
            coord: Mutex::new(coord),
            planner: Arc::from(planner),
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
    /// Its messages reach the outboxes before the lock is released (a non-blocking hand-off),
    /// so every connection gets them in the order the coordinator produced them: a `Welcome`
    /// can never be overtaken by the assignment of a plan that a concurrent registration asked
    /// for.
    pub fn step<R>(&self, f: impl FnOnce(&mut Coordinator) -> (R, Effects)) -> R {
        let (r, fx, overflow, wake) = {
            let mut c = self.0.coord.lock();
            let (r, mut fx) = f(&mut c);
            if fx.is_empty() {
                return r;
            }
            if fx.persist
                && let Some(file) = &self.0.state_file
                && let Err(e) = file.save(&c.durable())
            {
                // Nothing can be undone here; a restart would reuse ids or forget the version.
                tracing::error!("cannot save the controller's state: {e}");
            }
            // A heartbeat's echo changes nothing a waiter reads: only syncs, membership, plans
            // and the durable state wake them (F4: heartbeats woke every HTTP long poll).
            let wake = !(fx.finished.is_empty()
                && !fx.persist
                && fx.plan.is_none()
                && fx.close.is_empty()
                && fx
                    .send
                    .iter()
                    .all(|(_, m)| matches!(m, ToWorker::Heartbeat { .. })));
            let overflow = self.deliver(&mut fx);
            (r, fx, overflow, wake)
        };
        self.apply(fx, overflow, wake);
        r
    }

    /// Hands the effects' messages and closes to the connections' outboxes; returns the
    /// connections whose outbox is full.
    fn deliver(&self, fx: &mut Effects) -> Vec<ConnId> {
        let mut overflow = Vec::new();
        let conns = self.0.conns.lock();
        for (conn, msg) in fx.send.drain(..) {
            if let Some(tx) = conns.get(&conn)
                && tx.try_send(Outgoing::Msg(msg)).is_err()
            {
                overflow.push(conn);
            }
        }
        for conn in fx.close.drain(..) {
            if let Some(tx) = conns.get(&conn) {
                let _ = tx.try_send(Outgoing::Close);
            }
        }
        overflow
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

    /// The rest of the effects (of a step that had any), after their messages were delivered.
    fn apply(&self, fx: Effects, overflow: Vec<ConnId>, wake: bool) {
        if !fx.finished.is_empty() {
            let c = self.0.coord.lock();
            for id in &fx.finished {
                if let Some(s) = c.sync(*id) {
                    self.0.metrics.record(s);
                }
            }
        }
        // After the sends: a registration's `Welcome` must reach its outbox before the
        // assignment of the plan it asked for.
        if let Some(req) = fx.plan {
            self.start_planning(req);
        }
        if wake {
            self.0.changed.send_modify(|v| *v = v.wrapping_add(1));
        }
        for conn in overflow {
            tracing::warn!(conn, "worker outbox full; disconnecting it");
            self.step(|c| {
                (
                    (),
                    c.disconnect(conn, "outbox full (worker not reading)", Now::wall()),
                )
            });
            if let Some(tx) = self.0.conns.lock().remove(&conn) {
                let _ = tx.try_send(Outgoing::Close);
            }
        }
    }

    /// Runs the planner for `req` on a thread of its own and feeds the result back.
    fn start_planning(&self, req: PlanRequest) {
        let state = self.clone();
        let plan_id = req.plan_id;
        let spawned = std::thread::Builder::new()
            .name(format!("plan-{plan_id}"))
            .spawn(move || {
                let started = Instant::now();
                let out = state.0.planner.plan(req.plan_id, &req.world, &req.workers);
                tracing::info!(
                    plan_id,
                    seconds = started.elapsed().as_secs_f64(),
                    "planner finished"
                );
                drop(req);
                state.step(|c| ((), c.planned(plan_id, out, Now::wall())));
            });
        if let Err(e) = spawned {
            let out = Err(AssignmentError(format!(
                "cannot start the planner thread: {e}"
            )));
            self.step(|c| ((), c.planned(plan_id, out, Now::wall())));
        }
    }

    /// A new connection's id and the receiving end of its outbox.
    pub(crate) fn open_connection(&self) -> (ConnId, mpsc::Receiver<Outgoing>) {
        let conn = self.0.next_conn.fetch_add(1, Ordering::Relaxed);
        let (tx, outbox) = mpsc::channel::<Outgoing>(1024);
        self.0.conns.lock().insert(conn, tx);
        (conn, outbox)
    }

    /// Forgets a connection's outbox.
    pub(crate) fn close_connection(&self, conn: ConnId) {
        self.0.conns.lock().remove(&conn);
    }

    /// A clean stop (SIGTERM, Ctrl-C): saves the state file one last time and lets go of every
    /// worker's connection, so each sees it close and reconnects by itself to the controller
    /// that follows (an embedding's in-flight `wait()` raises `peer_lost` instead of hanging).
    pub fn stop(&self) -> Result<(), StateFileError> {
        self.0.conns.lock().clear();
        match &self.0.state_file {
            Some(file) => file.save(&self.read(Coordinator::durable)),
            None => Ok(()),
        }
    }

    /// Sends `Shutdown` to every connected worker.
    pub fn shutdown_workers(&self) {
        for tx in self.0.conns.lock().values() {
            let _ = tx.try_send(Outgoing::Msg(ToWorker::Shutdown));
        }
    }
}
