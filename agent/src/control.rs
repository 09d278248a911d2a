//! The control-channel client: connect, authenticate, register, heartbeat, and forward the
//! version protocol to the driver loop (`driver_loop`).
//!
//! Three tasks keep an agent responsive while a long step runs: a reader (frames → inbox), this
//! session loop (heartbeats, outbox → frames, inbox → driver commands) and the driver task, which
//! runs one step at a time and drops a step the moment the controller aborts its sync.
//! Heartbeats go out on their own clock, so a busy worker never looks dead, and a dead one is
//! noticed within the controller's timeout.
//!
//! If the controller goes away, the agent reconnects and registers again (up to
//! `reconnect_for`), keeping its registered memory: a restarted controller re-plans and carries on.
//!
//! After the job-token proof the controller says the job (`Job`); an agent launched with a job
//! of its own stops with [`AgentError::OtherJob`] naming what differs, before it registers. An
//! in-process worker learns the job first ([`fetch_job`]) and runs its agent with an
//! [`AgentLink`]: messages of its own (a trainer's `Push`) and the ends of syncs
//! ([`AgentEvent`]), which its handles wait on.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use weightsync_common::protocol::{
    ControlFrameError, DEFAULT_MAX_FRAME, FabricKey, Failure, FailureKind, FromWorker,
    PREAUTH_MAX_FRAME, Registration, ToWorker, WorkerId, WorkerRole, WorldSpec, auth, read_frame,
    write_frame,
};
use weightsync_common::secret::Secret;
use weightsync_common::tls::{ByteStream, TlsClient, tls_failure};

use crate::driver::{DriverInfo, Outcome, SyncDriver, SyncRef};
use crate::driver_loop::{DriverCmd, drive};

/// How an agent reaches its controller and who it is.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Control-channel address of the controller, `host:port`.
    pub controller: String,
    /// The secret of this worker's role (the trainer or engine credential, or the job token
    /// when one serves both roles).
    pub job_token: Secret,
    /// Role and rank.
    pub id: WorkerId,
    /// Host name to report.
    pub host: String,
    /// The job, as this worker was launched with it.
    pub world: WorldSpec,
    /// Keep trying to reach the controller (at start, and after losing it) for this long.
    pub reconnect_for: Duration,
    /// Largest control frame accepted.
    pub max_frame: u32,
    /// TLS to the controller (its certificate checked against the CA, this worker's client
    /// certificate shown); `None`: plain TCP, for loopback and tests.
    pub tls: Option<TlsClient>,
}

/// What an embedding (an in-process trainer or engine) exchanges with a running agent besides
/// the driver: messages of its own to send (a trainer's `Push`), and the ends of syncs as the
/// controller announced them.
#[derive(Debug, Default)]
pub struct AgentLink {
    /// Extra messages to send to the controller (after registration). When every sender is
    /// dropped the embedding is leaving: what it queued is written out first, then the agent
    /// closes its connection and stops (a report sent just before leaving is not lost).
    pub outbox: Option<mpsc::Receiver<FromWorker>>,
    /// Where the ends of syncs are announced.
    pub events: Option<mpsc::UnboundedSender<AgentEvent>>,
}

/// The end of a sync as the controller announced it to this worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentEvent {
    /// Registered with the controller (again, after a reconnect).
    Registered,
    /// `Commit N`.
    Committed {
        /// Sync id.
        sync_id: u64,
        /// Version.
        version: u64,
        /// The run it belongs to.
        run: u64,
    },
    /// `Abort N` (sync id 0: a pushed version that cannot be synced), or the controller lost
    /// while sync N was in flight here (it can never commit: a restarted controller never
    /// reuses the id).
    Aborted {
        /// Sync id.
        sync_id: u64,
        /// Version.
        version: u64,
        /// Why.
        reason: String,
        /// The failure, naming the worker that failed, when one did.
        failure: Option<Failure>,
    },
    /// The controller sent this worker its part of plan `plan_id`.
    Assigned {
        /// The plan.
        plan_id: u64,
    },
    /// The world is complete but could not be planned (`PlanFailed`): the reason names what
    /// was wrong (a declared model's tensor and both sides).
    PlanFailed {
        /// The plan.
        plan_id: u64,
        /// Why.
        reason: String,
    },
    /// The agent stopped (shutdown, refused, or the controller could not be reached).
    Stopped {
        /// Why.
        reason: String,
    },
}

/// Why an agent stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The controller could not be reached for `reconnect_for`.
    #[error("cannot reach the controller at {addr}: {last}")]
    Unreachable {
        /// Address tried.
        addr: String,
        /// Last error.
        last: String,
    },
    /// The controller refused this worker.
    #[error("the controller refused {id}: {reason}")]
    Rejected {
        /// This worker.
        id: WorkerId,
        /// Its reason.
        reason: String,
    },
    /// The control protocol was violated.
    #[error("control protocol: {0}")]
    Protocol(String),
    /// TLS with the controller failed: its certificate did not check against this worker's CA,
    /// or it refused this worker's certificate. Retrying does not help.
    #[error("{id}: TLS with the controller at {addr} failed: {reason}")]
    Tls {
        /// This worker.
        id: WorkerId,
        /// The controller's address.
        addr: String,
        /// What failed, as rustls says it (an unknown issuer, an alert from the controller...).
        reason: String,
    },
    /// The controller runs another job than the one this worker was launched with.
    #[error("{id} states a different job than the controller's: {detail}")]
    OtherJob {
        /// This worker.
        id: WorkerId,
        /// What differs.
        detail: String,
    },
}

/// How a session with the controller ended.
enum SessionEnd {
    Shutdown,
    /// The embedding left (its outbox closed) and everything queued was written.
    Left,
    Lost(String),
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Runs an agent until the controller says `Shutdown` (Ok) or cannot be reached (Err).
pub async fn run_agent<D: SyncDriver>(cfg: AgentConfig, driver: D) -> Result<(), AgentError> {
    run_agent_with(cfg, driver, AgentLink::default()).await
}

/// [`run_agent`] with an embedding's [`AgentLink`].
pub async fn run_agent_with<D: SyncDriver>(
    cfg: AgentConfig,
    driver: D,
    link: AgentLink,
) -> Result<(), AgentError> {
    let events = link.events.clone();
    let result = run_linked(cfg, driver, link).await;
    if let Some(ev) = events {
        let reason = match &result {
            Ok(why) => why.to_string(),
            Err(e) => e.to_string(),
        };
        let _ = ev.send(AgentEvent::Stopped { reason });
    }
    result.map(|_| ())
}

const SAID_SHUTDOWN: &str = "the controller said shutdown";
const LEFT: &str = "this worker left the job";

async fn run_linked<D: SyncDriver>(
    cfg: AgentConfig,
    driver: D,
    link: AgentLink,
) -> Result<&'static str, AgentError> {
    let (cmd_tx, cmd_rx) = mpsc::channel::<DriverCmd>(64);
    let (abort_tx, abort_rx) = watch::channel::<u64>(0);
    let (out_tx, mut out_rx) = mpsc::channel::<FromWorker>(256);
    // Turns true once the embedding's outbox closed and all it sent is queued in `out_rx`.
    let (leaving_tx, mut leaving) = watch::channel(false);
    if let Some(mut extra) = link.outbox {
        // The embedding's messages join the driver's on the way out.
        let out = out_tx.clone();
        tokio::spawn(async move {
            while let Some(m) = extra.recv().await {
                if out.send(m).await.is_err() {
                    return;
                }
            }
            let _ = leaving_tx.send(true);
        });
    }
    let events = link.events;
    let info = driver.info();
    let driver_task = tokio::spawn(drive(driver, cfg.id.role, cmd_rx, abort_rx, out_tx));
    let mut first = true;
    let result = loop {
        if *leaving.borrow() {
            // Left while the controller was out of reach: nothing to reconnect for.
            break Ok(LEFT);
        }
        let stream = match connect(&cfg, first).await {
            Ok(s) => s,
            Err(e) => break Err(e),
        };
        first = false;
        let ends = Ends {
            cmd_tx: &cmd_tx,
            abort_tx: &abort_tx,
            events: events.as_ref(),
        };
        let mut current = None;
        let ended = session(
            &cfg,
            &info,
            stream,
            &ends,
            &mut out_rx,
            &mut leaving,
            &mut current,
        )
        .await;
        match ended {
            Ok(SessionEnd::Shutdown) => break Ok(SAID_SHUTDOWN),
            Ok(SessionEnd::Left) => break Ok(LEFT),
            Ok(SessionEnd::Lost(why)) => {
                tracing::warn!("{}: lost the controller ({why}); reconnecting", cfg.id);
                if let Some(s) = current {
                    // The sync in flight here can never commit: say so to whoever waits on it
                    // (an embedding's `wait()` raises instead of hanging).
                    let cause = format!(
                        "lost the controller while sync {} (version {}) was in flight: {why}",
                        s.sync_id, s.version
                    );
                    ends.event(AgentEvent::Aborted {
                        sync_id: s.sync_id,
                        version: s.version,
                        reason: cause.clone(),
                        failure: Some(Failure {
                            worker: cfg.id,
                            kind: FailureKind::PeerLost,
                            tensor: None,
                            cause,
                        }),
                    });
                }
                // Whatever sync was running is void: the controller will not commit it.
                let _ = abort_tx.send(u64::MAX);
                let _ = cmd_tx.send(DriverCmd::AbortAll).await;
            }
            Err(e) => break Err(e),
        }
    };
    drop(cmd_tx);
    let _ = driver_task.await;
    result
}

/// Opens the control stream to `addr`: TCP, then TLS when `tls` is set. A TLS failure (a
/// certificate refused either way) is [`AgentError::Tls`]; other failures are I/O errors, worth
/// retrying.
async fn open(
    addr: &str,
    tls: Option<&TlsClient>,
    id: WorkerId,
) -> Result<std::io::Result<ByteStream>, AgentError> {
    let tcp = match TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) => return Ok(Err(e)),
    };
    let _ = tcp.set_nodelay(true);
    let Some(tls) = tls else {
        return Ok(Ok(Box::new(tcp)));
    };
    match tls.connect(tcp, addr).await {
        Ok(s) => Ok(Ok(s)),
        Err(e) => match tls_failure(&e) {
            Some(reason) => Err(AgentError::Tls {
                id,
                addr: addr.to_string(),
                reason,
            }),
            None => Ok(Err(e)),
        },
    }
}

/// [`AgentError::Tls`] when a control-channel error is a TLS failure (with TLS 1.3 the
/// controller's refusal of this worker's certificate arrives as an alert on the first read).
fn tls_refusal(cfg: &AgentConfig, e: &ControlFrameError) -> Option<AgentError> {
    let ControlFrameError::Io(io) = e else {
        return None;
    };
    tls_failure(io).map(|reason| AgentError::Tls {
        id: cfg.id,
        addr: cfg.controller.clone(),
        reason,
    })
}

async fn connect(cfg: &AgentConfig, first: bool) -> Result<ByteStream, AgentError> {
    let deadline = Instant::now() + cfg.reconnect_for;
    let mut delay = Duration::from_millis(50);
    loop {
        match open(&cfg.controller, cfg.tls.as_ref(), cfg.id).await? {
            Ok(s) => return Ok(s),
            Err(e) => {
                if Instant::now() >= deadline {
                    return Err(AgentError::Unreachable {
                        addr: cfg.controller.clone(),
                        last: e.to_string(),
                    });
                }
                if first {
                    tracing::debug!("{}: controller not up yet ({e})", cfg.id);
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// What a session answers a controller message with.
enum Next {
    /// Hand this to the driver loop.
    Cmd(DriverCmd),
    /// Nothing to do.
    Nothing,
    /// The session is over.
    End(SessionEnd),
}

/// The registration handshake: challenge, proof and registration, welcome. Returns the
/// heartbeat interval the controller asked for.
async fn register(
    cfg: &AgentConfig,
    info: &DriverInfo,
    rd: &mut ReadHalf<ByteStream>,
    wr: &mut WriteHalf<ByteStream>,
) -> Result<Result<u64, SessionEnd>, AgentError> {
    let max = cfg.max_frame;
    let lost = |e: ControlFrameError| match tls_refusal(cfg, &e) {
        Some(refused) => Err(refused),
        None => Ok(Err(SessionEnd::Lost(e.to_string()))),
    };
    let nonce = match read_frame::<_, ToWorker>(rd, PREAUTH_MAX_FRAME).await {
        Ok(Some(ToWorker::Challenge { nonce })) => nonce,
        Ok(Some(other)) => {
            return Err(AgentError::Protocol(format!(
                "expected a challenge, got {other:?}"
            )));
        }
        Ok(None) => return Ok(Err(SessionEnd::Lost("closed before the challenge".into()))),
        Err(e) => return lost(e),
    };
    let role = cfg.id.role;
    let mine = auth::nonce();
    let hello = FromWorker::Hello {
        role,
        nonce: mine,
        proof: auth::prove(cfg.job_token.expose(), role, &nonce),
    };
    if let Err(e) = write_frame(wr, &hello, PREAUTH_MAX_FRAME).await {
        return lost(e);
    }
    match read_frame::<_, ToWorker>(rd, max).await {
        Ok(Some(ToWorker::Job { proof, .. }))
            if !auth::check_answer(cfg.job_token.expose(), role, &mine, &nonce, &proof) =>
        {
            return Err(AgentError::Rejected {
                id: cfg.id,
                reason: format!(
                    "the controller at {} did not prove it holds the {role} secret \
                     (an impostor, or another job's controller)",
                    cfg.controller
                ),
            });
        }
        Ok(Some(ToWorker::Job { world, .. }))
            if weightsync_schedules::job::same_job(&world, &cfg.world) => {}
        Ok(Some(ToWorker::Job { world, .. })) => {
            return Err(AgentError::OtherJob {
                id: cfg.id,
                detail: job_difference(&cfg.world, &world),
            });
        }
        Ok(Some(ToWorker::Rejected { reason })) => {
            return Err(AgentError::Rejected { id: cfg.id, reason });
        }
        Ok(Some(other)) => {
            return Err(AgentError::Protocol(format!(
                "expected the job, got {other:?}"
            )));
        }
        Ok(None) => {
            return Err(AgentError::Rejected {
                id: cfg.id,
                reason: "connection closed after the proof (wrong job token?)".into(),
            });
        }
        Err(e) => return lost(e),
    }
    let reg = Registration {
        id: cfg.id,
        host: cfg.host.clone(),
        pid: std::process::id(),
        world: cfg.world.clone(),
        fabric_endpoint: info.fabric_endpoint.clone(),
        regions: info.regions.clone(),
        tensors: info.tensors.clone(),
        placement: info.placement.clone(),
        skip: info.skip.clone(),
    };
    if let Err(e) = write_frame(wr, &FromWorker::Register(Box::new(reg)), max).await {
        return lost(e);
    }
    match read_frame::<_, ToWorker>(rd, max).await {
        Ok(Some(ToWorker::Welcome { heartbeat_ms })) => Ok(Ok(heartbeat_ms.max(10))),
        Ok(Some(ToWorker::Rejected { reason })) => Err(AgentError::Rejected { id: cfg.id, reason }),
        Ok(Some(other)) => Err(AgentError::Protocol(format!(
            "expected Welcome, got {other:?}"
        ))),
        Ok(None) => Err(AgentError::Rejected {
            id: cfg.id,
            reason: "connection closed during registration (wrong job token?)".into(),
        }),
        Err(e) => lost(e),
    }
}

/// What differs between the job a worker was launched with and the controller's.
fn job_difference(mine: &WorldSpec, theirs: &WorldSpec) -> String {
    weightsync_schedules::job::job_differences(mine, theirs)
        .iter()
        .map(|(k, a, b)| format!("{k}: this worker {a:?}, the controller {b:?}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Learns the job from the controller at `controller` without registering: challenge, proof,
/// the `Job` message, then the connection closes. What an in-process worker does first, to lay
/// out its own side before it registers its memory. Returns the job and the text of the
/// model's `config.json` when the controller read one.
pub async fn fetch_job(
    controller: &str,
    job_token: &Secret,
    role: WorkerRole,
    max_frame: u32,
) -> Result<(WorldSpec, Option<String>), AgentError> {
    // Rank 0 of the role names the worker in an error: the job is not known yet.
    let id = WorkerId { role, rank: 0 };
    let job = fetch_job_over(controller, None, job_token, id, max_frame).await?;
    Ok((job.world, job.model_config))
}

/// [`fetch_job`] over TLS when `tls` is set, with the fabric key a controller with TLS hands
/// out.
pub async fn fetch_job_over(
    controller: &str,
    tls: Option<&TlsClient>,
    job_token: &Secret,
    id: WorkerId,
    max_frame: u32,
) -> Result<LearnedJob, AgentError> {
    let stream = open(controller, tls, id)
        .await?
        .map_err(|e| AgentError::Unreachable {
            addr: controller.to_string(),
            last: e.to_string(),
        })?;
    learn(controller, stream, job_token, id, max_frame).await
}

/// [`fetch_job_over`] for an agent about to run: it waits for the controller as the agent
/// would (up to [`AgentConfig::reconnect_for`]). What a sidecar with TLS does first, to learn
/// the fabric key before it starts its fabric.
pub async fn learn_job(cfg: &AgentConfig) -> Result<LearnedJob, AgentError> {
    let stream = connect(cfg, true).await?;
    learn(
        &cfg.controller,
        stream,
        &cfg.job_token,
        cfg.id,
        cfg.max_frame,
    )
    .await
}

/// The job as the controller says it before a worker registers.
#[derive(Debug, Clone)]
pub struct LearnedJob {
    /// The job.
    pub world: WorldSpec,
    /// The model's `config.json` text, when the controller read one.
    pub model_config: Option<String>,
    /// The fabric key, from a controller with TLS (see [`FabricKey`]).
    pub fabric_key: Option<FabricKey>,
}

/// Challenge, proof, the job (checking the controller's answer), then the connection closes.
async fn learn(
    controller: &str,
    stream: ByteStream,
    job_token: &Secret,
    id: WorkerId,
    max_frame: u32,
) -> Result<LearnedJob, AgentError> {
    let role = id.role;
    let unreachable = |e: &dyn std::fmt::Display| AgentError::Unreachable {
        addr: controller.to_string(),
        last: e.to_string(),
    };
    let (mut rd, mut wr) = tokio::io::split(stream);
    let tls_or = |e: ControlFrameError| match &e {
        ControlFrameError::Io(io) => match tls_failure(io) {
            Some(reason) => AgentError::Tls {
                id,
                addr: controller.to_string(),
                reason,
            },
            None => unreachable(&e),
        },
        _ => unreachable(&e),
    };
    let nonce = match read_frame::<_, ToWorker>(&mut rd, PREAUTH_MAX_FRAME).await {
        Ok(Some(ToWorker::Challenge { nonce })) => nonce,
        Ok(other) => {
            return Err(AgentError::Protocol(format!(
                "expected a challenge, got {other:?}"
            )));
        }
        Err(e) => return Err(tls_or(e)),
    };
    let mine = auth::nonce();
    let hello = FromWorker::Hello {
        role,
        nonce: mine,
        proof: auth::prove(job_token.expose(), role, &nonce),
    };
    write_frame(&mut wr, &hello, PREAUTH_MAX_FRAME)
        .await
        .map_err(|e| unreachable(&e))?;
    match read_frame::<_, ToWorker>(&mut rd, max_frame).await {
        Ok(Some(ToWorker::Job {
            world,
            model_config,
            proof,
            fabric_key,
        })) => {
            if auth::check_answer(job_token.expose(), role, &mine, &nonce, &proof) {
                Ok(LearnedJob {
                    world,
                    model_config,
                    fabric_key,
                })
            } else {
                Err(AgentError::Protocol(format!(
                    "the controller at {controller} did not prove it holds the {role} secret \
                     (an impostor, or another job's controller)"
                )))
            }
        }
        Ok(Some(ToWorker::Rejected { reason })) => Err(AgentError::Protocol(format!(
            "the controller refused the proof: {reason}"
        ))),
        Ok(None) => Err(AgentError::Protocol(
            "the controller closed the connection after the proof (wrong job token?)".into(),
        )),
        Ok(Some(other)) => Err(AgentError::Protocol(format!(
            "expected the job, got {other:?}"
        ))),
        Err(e) => Err(tls_or(e)),
    }
}

/// Reads frames into a channel until the stream ends or fails (the last item says why).
fn spawn_reader(
    mut rd: ReadHalf<ByteStream>,
    max: u32,
) -> (ReaderTask, mpsc::Receiver<Result<ToWorker, String>>) {
    let (in_tx, in_rx) = mpsc::channel::<Result<ToWorker, String>>(256);
    let reader = tokio::spawn(async move {
        loop {
            let msg = match read_frame::<_, ToWorker>(&mut rd, max).await {
                Ok(Some(m)) => Ok(m),
                Ok(None) => Err("controller closed the connection".to_string()),
                Err(e) => Err(e.to_string()),
            };
            let end = msg.is_err();
            if in_tx.send(msg).await.is_err() || end {
                break;
            }
        }
    });
    (ReaderTask(reader), in_rx)
}

/// The reader task, aborted when its session ends or is dropped (an aborted agent): it holds
/// the stream's read half, and the connection closes only once both halves are gone, so a
/// reader left running would keep a dead agent's connection open.
struct ReaderTask(tokio::task::JoinHandle<()>);

impl Drop for ReaderTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Where a session hands what it reads: the driver loop's commands, the abort signal that
/// cancels a step of an aborted sync at once (before its `Abort` command is read), and the
/// embedding's events.
struct Ends<'a> {
    cmd_tx: &'a mpsc::Sender<DriverCmd>,
    abort_tx: &'a watch::Sender<u64>,
    events: Option<&'a mpsc::UnboundedSender<AgentEvent>>,
}

impl Ends<'_> {
    fn event(&self, ev: AgentEvent) {
        if let Some(tx) = self.events {
            let _ = tx.send(ev);
        }
    }
}

/// What a controller message means for the driver loop. `current` is the sync last prepared.
fn next_for(cfg: &AgentConfig, msg: ToWorker, current: &mut Option<SyncRef>, ends: &Ends) -> Next {
    let abort_tx = ends.abort_tx;
    let of_current = |sync_id: u64| current.filter(|s| s.sync_id == sync_id);
    let cmd = match msg {
        ToWorker::Assign(a) => {
            ends.event(AgentEvent::Assigned {
                plan_id: a.plan_id(),
            });
            Some(DriverCmd::Assign(Box::new(a)))
        }
        ToWorker::PlanFailed { plan_id, reason } => {
            tracing::warn!("{}: plan {plan_id} failed: {reason}", cfg.id);
            ends.event(AgentEvent::PlanFailed { plan_id, reason });
            None
        }
        ToWorker::Peers { plan_id, peers } => Some(DriverCmd::Peers(plan_id, peers)),
        ToWorker::Prepare {
            sync_id,
            version,
            run,
        } => {
            let s = SyncRef {
                sync_id,
                version,
                run,
                reference: Instant::now(),
                reference_unix_ns: unix_ns(),
            };
            *current = Some(s);
            // A new sync: earlier aborts (and ids of a restarted controller) no longer apply.
            abort_tx.send_replace(0);
            Some(DriverCmd::Prepare(s))
        }
        ToWorker::Start { sync_id, delta, .. } => {
            of_current(sync_id).map(|s| DriverCmd::Run(s, delta))
        }
        ToWorker::Verify {
            sync_id,
            checksums,
            deltas,
            ..
        } => of_current(sync_id).map(|s| DriverCmd::Verify(s, checksums, deltas)),
        ToWorker::Commit {
            sync_id,
            version,
            run,
        } => {
            let cmd = of_current(sync_id).map(|s| DriverCmd::Finish(s, Outcome::Committed));
            if cmd.is_some() {
                *current = None;
            }
            ends.event(AgentEvent::Committed {
                sync_id,
                version,
                run,
            });
            cmd
        }
        ToWorker::Abort {
            sync_id,
            version,
            reason,
            failure,
        } => {
            tracing::warn!(
                "{}: sync {sync_id} (version {version}) aborted: {reason}",
                cfg.id
            );
            ends.event(AgentEvent::Aborted {
                sync_id,
                version,
                reason: reason.clone(),
                failure: failure.clone(),
            });
            if sync_id == 0 {
                // A pushed version refused before any sync started: nothing to drain.
                return Next::Nothing;
            }
            let _ = abort_tx.send(sync_id);
            let sync = of_current(sync_id);
            if sync.is_some() {
                *current = None;
            }
            // Always answered (with Drained), also for a sync this worker never saw.
            Some(DriverCmd::Abort {
                sync,
                sync_id,
                version,
                reason,
                failure,
            })
        }
        ToWorker::Shutdown => return Next::End(SessionEnd::Shutdown),
        ToWorker::Rejected { reason } => {
            return Next::End(SessionEnd::Lost(format!("rejected: {reason}")));
        }
        ToWorker::Heartbeat { .. }
        | ToWorker::Welcome { .. }
        | ToWorker::Challenge { .. }
        | ToWorker::Job { .. } => None,
    };
    cmd.map_or(Next::Nothing, Next::Cmd)
}

/// One connection to the controller: register, then heartbeats, the driver's answers out and
/// the controller's messages in, until one side ends it.
async fn session(
    cfg: &AgentConfig,
    info: &DriverInfo,
    stream: ByteStream,
    ends: &Ends<'_>,
    out_rx: &mut mpsc::Receiver<FromWorker>,
    leaving: &mut watch::Receiver<bool>,
    current: &mut Option<SyncRef>,
) -> Result<SessionEnd, AgentError> {
    let max = cfg.max_frame;
    let (mut rd, mut wr) = tokio::io::split(stream);
    let heartbeat_ms = match register(cfg, info, &mut rd, &mut wr).await? {
        Ok(ms) => ms,
        Err(end) => return Ok(end),
    };
    tracing::info!(
        "{} registered with the controller at {}",
        cfg.id,
        cfg.controller
    );
    ends.event(AgentEvent::Registered);
    let (reader, mut in_rx) = spawn_reader(rd, max);
    let mut beat = tokio::time::interval(Duration::from_millis(heartbeat_ms));
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    *current = None;
    // The controller echoes every heartbeat: silence for this long is a dead controller or a
    // one-way partition, noticed in seconds rather than at the TCP retransmission timeout.
    let silent_after = Duration::from_millis(heartbeat_ms.saturating_mul(5)).max(SILENT_AT_LEAST);
    let mut heard = Instant::now();
    let end = loop {
        tokio::select! {
            _ = beat.tick() => {
                if heard.elapsed() > silent_after {
                    break SessionEnd::Lost(format!(
                        "the controller said nothing for {:.1} s",
                        heard.elapsed().as_secs_f64()
                    ));
                }
                seq += 1;
                if let Err(e) = write_frame(&mut wr, &FromWorker::Heartbeat { seq }, max).await {
                    break SessionEnd::Lost(e.to_string());
                }
            }
            out = out_rx.recv() => {
                let Some(out) = out else { break SessionEnd::Lost("driver stopped".into()) };
                if let Err(e) = write_frame(&mut wr, &out, max).await {
                    break SessionEnd::Lost(e.to_string());
                }
            }
            () = left(leaving) => break leave(&mut wr, out_rx, max).await,
            msg = in_rx.recv() => {
                heard = Instant::now();
                let msg = match msg {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => break SessionEnd::Lost(e),
                    None => break SessionEnd::Lost("reader stopped".into()),
                };
                match next_for(cfg, msg, current, ends) {
                    Next::Cmd(cmd) => {
                        if ends.cmd_tx.send(cmd).await.is_err() {
                            break SessionEnd::Lost("driver stopped".into());
                        }
                    }
                    Next::Nothing => {}
                    Next::End(end) => break end,
                }
            }
        }
    };
    drop(reader);
    Ok(end)
}

/// The shortest controller silence that ends a session (heartbeats may be very frequent).
const SILENT_AT_LEAST: Duration = Duration::from_secs(3);

/// Resolves once the embedding left. (An error means the forwarder is gone, which leaves
/// nothing more to forward either.)
async fn left(leaving: &mut watch::Receiver<bool>) {
    let _ = leaving.wait_for(|left| *left).await;
}

/// The embedding left: writes what is already queued (its last reports, the driver's last
/// messages), then closes the write half so the controller reads every frame before the end.
async fn leave(
    wr: &mut WriteHalf<ByteStream>,
    out_rx: &mut mpsc::Receiver<FromWorker>,
    max: u32,
) -> SessionEnd {
    while let Ok(out) = out_rx.try_recv() {
        if let Err(e) = write_frame(wr, &out, max).await {
            return SessionEnd::Lost(e.to_string());
        }
    }
    let _ = wr.shutdown().await;
    SessionEnd::Left
}

/// A default control frame limit for agents.
pub const AGENT_MAX_FRAME: u32 = DEFAULT_MAX_FRAME;
