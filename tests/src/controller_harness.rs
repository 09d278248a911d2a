//! Harness for the controller suites: a controller state with a small world, registrations and
//! protocol messages fed straight into it (router tests, no socket), a controller served on
//! loopback sockets, and agents with scripted drivers that follow the protocol without moving
//! bytes (control-channel tests).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use weightsync_agent::{
    Accepted, AgentConfig, DriverError, DriverInfo, Outcome, SyncDriver, SyncRef,
};
use weightsync_common::DType;
use weightsync_common::protocol::{
    Assignment, Blob, FromWorker, Registration, RunChecksum, Stage, TensorMeta, TimelineEvent,
    WorkerId, WorkerReport, WorldSpec,
};
use weightsync_controller::coordinator::{ConnId, CoordinatorConfig, Now};
use weightsync_controller::planning::NullPlanner;
use weightsync_controller::{AppState, ControllerConfig};

/// Bearer token of test controllers.
pub const API_TOKEN: &str = "test-api-token-0123456789";
/// Job token of test controllers.
pub const JOB_TOKEN: &str = "test-job-token-0123456789";
/// Bytes placed in every test registration's region blob: must never appear in an HTTP response.
pub const SECRET_RKEY_MARKER: &[u8] = b"RKEY-7f3a9c";

/// The job every test worker states.
pub fn world(verify: bool) -> WorldSpec {
    WorldSpec {
        model: "tiny".into(),
        train: "fsdp=2".into(),
        infer: "tp=2".into(),
        dtype: DType::BF16,
        verify,
    }
}

/// Coordinator settings for tests: short heartbeats, no failure grace.
pub fn coordinator_config(trainers: u32, rollouts: u32, verify: bool) -> CoordinatorConfig {
    CoordinatorConfig {
        world: world(verify),
        trainers,
        rollouts,
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(3),
        sync_timeout: Duration::from_secs(15),
        failure_grace: Duration::ZERO,
        history: 64,
    }
}

/// A controller state with the null planner.
pub fn state(trainers: u32, rollouts: u32, verify: bool) -> AppState {
    let cfg = ControllerConfig::new(
        coordinator_config(trainers, rollouts, verify),
        JOB_TOKEN.into(),
        API_TOKEN.into(),
    );
    AppState::new(cfg, Box::new(NullPlanner))
}

/// The connection id the router tests use for a worker.
pub fn conn_of(id: WorkerId) -> ConnId {
    match id.role {
        weightsync_common::protocol::WorkerRole::Trainer => 100 + u64::from(id.rank),
        weightsync_common::protocol::WorkerRole::Rollout => 200 + u64::from(id.rank),
    }
}

/// A registration for `id`.
pub fn registration(id: WorkerId, verify: bool) -> Registration {
    Registration {
        id,
        host: "localhost".into(),
        pid: 1000 + id.rank,
        world: world(verify),
        fabric_endpoint: Blob(b"127.0.0.1:1".to_vec()),
        regions: vec![Blob(SECRET_RKEY_MARKER.to_vec())],
        tensors: vec![TensorMeta {
            name: "w".into(),
            shape: vec![8, 8],
            dtype: DType::BF16,
            bytes: 128,
            global_shape: Vec::new(),
            offset: Vec::new(),
            source: None,
        }],
        placement: None,
        skip: Vec::new(),
    }
}

/// Every worker of the world.
pub fn ids(trainers: u32, rollouts: u32) -> Vec<WorkerId> {
    (0..trainers)
        .map(WorkerId::trainer)
        .chain((0..rollouts).map(WorkerId::rollout))
        .collect()
}

/// Registers every worker directly (no socket).
pub fn register_all(state: &AppState, trainers: u32, rollouts: u32) {
    let verify = state.config().coordinator.world.verify;
    for id in ids(trainers, rollouts) {
        state.step(|c| {
            let fx = c
                .register(conn_of(id), registration(id, verify), Now::wall())
                .expect("registration accepted");
            ((), fx)
        });
    }
    accept_plan(state, trainers, rollouts);
}

/// Waits for the plan the complete world asked for (the service plans on a thread of its own)
/// and answers its assignments with `Ready` from every worker, as agents do: the plan is then
/// in force.
pub fn accept_plan(state: &AppState, trainers: u32, rollouts: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let plan_id = loop {
        let made = state.read(|c| {
            c.latest_plan()
                .filter(|_| c.planning().is_none())
                .map(|p| p.id)
        });
        if let Some(id) = made {
            break id;
        }
        assert!(
            Instant::now() < deadline,
            "no plan within 10 s: {:?}",
            state.read(|c| c.plan_error().map(str::to_string))
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    for id in ids(trainers, rollouts) {
        feed(
            state,
            id,
            FromWorker::Ready {
                plan_id,
                regions: Vec::new(),
                tensors: Vec::new(),
            },
        );
    }
}

/// Feeds one message from `id`.
pub fn feed(state: &AppState, id: WorkerId, msg: FromWorker) {
    state.step(|c| ((), c.message(conn_of(id), msg, Now::wall())));
}

/// A report with one span per stage given.
pub fn report(bytes: u64, stages: &[Stage]) -> WorkerReport {
    WorkerReport {
        bytes,
        writes: 4,
        peak_staging_bytes: 0,
        staged_bytes: 0,
        direct_bytes: 0,
        split: Default::default(),
        deltas: Vec::new(),
        delta: Default::default(),
        events: stages
            .iter()
            .enumerate()
            .map(|(i, &stage)| TimelineEvent {
                task: 0,
                piece: 0,
                stage,
                start_ns: i as u64 * 1_000_000,
                end_ns: (i as u64 + 1) * 1_000_000,
                bytes,
            })
            .collect(),
        checksums: Vec::new(),
    }
}

/// Answers every step of sync `sync_id` as healthy workers would, up to commit.
pub fn complete_sync(state: &AppState, sync_id: u64, version: u64, trainers: u32, rollouts: u32) {
    let verify = state.config().coordinator.world.verify;
    for id in ids(trainers, rollouts) {
        feed(
            state,
            id,
            FromWorker::Prepared {
                sync_id,
                version,
                report: WorkerReport::default(),
            },
        );
    }
    for r in 0..trainers {
        let mut rep = report(
            1 << 20,
            &[Stage::H2d, Stage::Prepare, Stage::Write, Stage::Barrier],
        );
        rep.checksums = (0..rollouts)
            .map(|o| RunChecksum {
                rollout: o,
                mr: 0,
                offset: u64::from(r) * 64,
                len: 64,
                xxh3: 7,
            })
            .collect();
        feed(
            state,
            WorkerId::trainer(r),
            FromWorker::Written {
                sync_id,
                version,
                report: rep,
            },
        );
    }
    for r in 0..rollouts {
        feed(
            state,
            WorkerId::rollout(r),
            FromWorker::Landed {
                sync_id,
                version,
                verified: None,
                report: report(1 << 20, &[Stage::Arm, Stage::Land]),
            },
        );
    }
    if verify {
        for r in 0..rollouts {
            feed(
                state,
                WorkerId::rollout(r),
                FromWorker::Verified {
                    sync_id,
                    version,
                    report: report(1 << 20, &[Stage::Verify]),
                },
            );
        }
    }
}

/// A controller served on loopback.
#[derive(Debug)]
pub struct ServedController {
    /// HTTP address.
    pub http: SocketAddr,
    /// Control-channel address.
    pub control: SocketAddr,
    /// Its state.
    pub state: AppState,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl ServedController {
    /// Serves `state` on two ephemeral loopback ports.
    pub async fn start(state: AppState) -> ServedController {
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let control = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (http_addr, control_addr) = (http.local_addr().unwrap(), control.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(weightsync_controller::run(
            http,
            control,
            state.clone(),
            async move {
                let _ = stopped.await;
            },
        ));
        ServedController {
            http: http_addr,
            control: control_addr,
            state,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Stops it and waits.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

/// Agent settings for a worker of the test world.
pub fn agent_config(control: SocketAddr, id: WorkerId, verify: bool) -> AgentConfig {
    AgentConfig {
        controller: control.to_string(),
        job_token: JOB_TOKEN.into(),
        id,
        host: "localhost".into(),
        world: world(verify),
        reconnect_for: Duration::from_secs(5),
        max_frame: weightsync_agent::AGENT_MAX_FRAME,
        tls: None,
    }
}

/// A driver that moves no bytes: it answers each step after `step_delay`, reports `bytes`, and
/// while `hang` is set, never finishes `run` (a worker stuck mid-write).
#[derive(Debug, Clone)]
pub struct ScriptedDriver {
    /// Delay of each step.
    pub step_delay: Duration,
    /// Bytes to report per sync.
    pub bytes: u64,
    /// When set, `run` never returns.
    pub hang: Arc<AtomicBool>,
    /// Set once `run` has started (the worker is mid-sync).
    pub running: Arc<AtomicBool>,
    /// Outcomes seen, in order: (version, committed).
    pub outcomes: Arc<std::sync::Mutex<Vec<(u64, bool)>>>,
}

impl ScriptedDriver {
    /// A driver with short steps.
    pub fn new() -> ScriptedDriver {
        ScriptedDriver {
            step_delay: Duration::from_millis(5),
            bytes: 1 << 20,
            hang: Arc::default(),
            running: Arc::default(),
            outcomes: Arc::default(),
        }
    }
}

impl Default for ScriptedDriver {
    fn default() -> Self {
        Self::new()
    }
}

impl SyncDriver for ScriptedDriver {
    fn info(&self) -> DriverInfo {
        DriverInfo {
            fabric_endpoint: Blob(b"scripted".to_vec()),
            regions: vec![Blob(SECRET_RKEY_MARKER.to_vec())],
            tensors: Vec::new(),
            placement: None,
            skip: Vec::new(),
        }
    }

    async fn assign(&mut self, _a: Assignment) -> Result<Accepted, DriverError> {
        Ok(Accepted::default())
    }

    async fn prepare(&mut self, _sync: SyncRef) -> Result<WorkerReport, DriverError> {
        tokio::time::sleep(self.step_delay).await;
        Ok(WorkerReport::default())
    }

    async fn run(&mut self, sync: SyncRef) -> Result<(Option<bool>, WorkerReport), DriverError> {
        self.running.store(true, Ordering::SeqCst);
        let start = sync.reference.elapsed().as_nanos() as u64;
        while self.hang.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(self.step_delay).await;
        let end = sync.reference.elapsed().as_nanos() as u64;
        Ok((
            None,
            WorkerReport {
                bytes: self.bytes,
                writes: 1,
                peak_staging_bytes: 0,
                staged_bytes: 0,
                direct_bytes: 0,
                split: Default::default(),
                deltas: Vec::new(),
                delta: Default::default(),
                events: vec![TimelineEvent {
                    task: 0,
                    piece: 0,
                    stage: Stage::Write,
                    start_ns: start,
                    end_ns: end,
                    bytes: self.bytes,
                }],
                checksums: Vec::new(),
            },
        ))
    }

    async fn verify(
        &mut self,
        _sync: SyncRef,
        _checksums: Vec<RunChecksum>,
    ) -> Result<WorkerReport, DriverError> {
        Ok(WorkerReport::default())
    }

    async fn finish(&mut self, sync: SyncRef, outcome: Outcome) {
        self.running.store(false, Ordering::SeqCst);
        if let Ok(mut log) = self.outcomes.lock() {
            log.push((sync.version, outcome == Outcome::Committed));
        }
    }
}

/// Sends an HTTP request through the router without a socket; returns status and body text.
pub async fn call(
    app: axum::Router,
    method: &str,
    uri: &str,
    body: Option<&str>,
    token: Option<&str>,
) -> (u16, String) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let mut req = axum::http::Request::builder().method(method).uri(uri);
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let req = req
        .body(axum::body::Body::from(body.unwrap_or("").to_string()))
        .unwrap();
    let resp = app.oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// Polls `GET`-like state until `cond` holds or `within` passes.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}
