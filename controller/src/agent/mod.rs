//! Worker agents: the process side of `weightsync worker trainer|rollout`.
//!
//! An agent runs beside one training rank or one inference rank. It connects to the controller,
//! proves it knows the job token, registers what its [`SyncDriver`] holds, and then follows the
//! version protocol: `Assign` → driver.assign; `Prepare N` → driver.prepare, answer `Prepared`
//! (rollouts then wait for N to land and answer `Landed`); `Start N` → driver.run, answer
//! `Written`; `Verify` → driver.verify, answer `Verified`; `Commit` → driver.finish; `Abort` →
//! driver.finish and driver.drain, answer `Drained` (nothing of the aborted sync can land later).
//!
//! Three tasks keep it responsive while a long step runs: a reader (frames → inbox), a writer
//! (outbox → frames) and the driver task, which runs one step at a time and drops a step the
//! moment the controller aborts its sync. Heartbeats go out on their own clock, so a busy worker
//! never looks dead, and a dead one is noticed within the controller's timeout.
//!
//! If the controller goes away, the agent reconnects and registers again (up to
//! `reconnect_for`), keeping its registered memory: a restarted controller re-plans and carries on.
//!
//! # Layout
//! - [`driver`]: the [`SyncDriver`] trait.
//! - [`trainer`], [`rollout`]: drivers over the worker library.
//! - [`demo_weights`]: the deterministic weights the demo trains with, and their recomputation.
//! - [`config`]: flags, env vars (torchrun, Slurm) and TOML.

pub mod config;
pub mod demo_weights;
pub mod driver;
pub mod rollout;
pub mod trainer;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use weightsync_common::protocol::{
    auth, read_frame, write_frame, Failure, FromWorker, Registration, Role, ToWorker, WorkerId,
    WorldSpec, DEFAULT_MAX_FRAME,
};

pub use driver::{DriverError, DriverInfo, Outcome, SyncDriver, SyncRef};

/// How an agent reaches its controller and who it is.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Control-channel address of the controller, `host:port`.
    pub controller: String,
    /// Job token.
    pub job_token: String,
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
}

/// How a session with the controller ended.
enum SessionEnd {
    Shutdown,
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
    let (cmd_tx, cmd_rx) = mpsc::channel::<DriverCmd>(64);
    let (abort_tx, abort_rx) = watch::channel::<u64>(0);
    let (out_tx, mut out_rx) = mpsc::channel::<FromWorker>(256);
    let info = driver.info();
    let driver_task = tokio::spawn(drive(driver, cfg.id.role, cmd_rx, abort_rx, out_tx));
    let mut first = true;
    let result = loop {
        let stream = match connect(&cfg, first).await {
            Ok(s) => s,
            Err(e) => break Err(e),
        };
        first = false;
        match session(&cfg, &info, stream, &cmd_tx, &abort_tx, &mut out_rx).await {
            Ok(SessionEnd::Shutdown) => break Ok(()),
            Ok(SessionEnd::Lost(why)) => {
                tracing::warn!("{}: lost the controller ({why}); reconnecting", cfg.id);
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

async fn connect(cfg: &AgentConfig, first: bool) -> Result<TcpStream, AgentError> {
    let deadline = Instant::now() + cfg.reconnect_for;
    let mut delay = Duration::from_millis(50);
    loop {
        match TcpStream::connect(&cfg.controller).await {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
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

async fn session(
    cfg: &AgentConfig,
    info: &DriverInfo,
    stream: TcpStream,
    cmd_tx: &mpsc::Sender<DriverCmd>,
    abort_tx: &watch::Sender<u64>,
    out_rx: &mut mpsc::Receiver<FromWorker>,
) -> Result<SessionEnd, AgentError> {
    let max = cfg.max_frame;
    let (mut rd, mut wr) = stream.into_split();
    let lost = |e: weightsync_common::protocol::FrameError| Ok(SessionEnd::Lost(e.to_string()));
    let nonce = match read_frame::<_, ToWorker>(&mut rd, max).await {
        Ok(Some(ToWorker::Challenge { nonce })) => nonce,
        Ok(Some(other)) => {
            return Err(AgentError::Protocol(format!(
                "expected a challenge, got {other:?}"
            )))
        }
        Ok(None) => return Ok(SessionEnd::Lost("closed before the challenge".into())),
        Err(e) => return lost(e),
    };
    let proof = auth::prove(&cfg.job_token, &nonce);
    let reg = Registration {
        id: cfg.id,
        host: cfg.host.clone(),
        pid: std::process::id(),
        world: cfg.world.clone(),
        fabric_endpoint: info.fabric_endpoint.clone(),
        regions: info.regions.clone(),
        tensors: info.tensors.clone(),
    };
    for msg in [
        FromWorker::Hello { proof },
        FromWorker::Register(Box::new(reg)),
    ] {
        if let Err(e) = write_frame(&mut wr, &msg, max).await {
            return lost(e);
        }
    }
    let heartbeat_ms = match read_frame::<_, ToWorker>(&mut rd, max).await {
        Ok(Some(ToWorker::Welcome { heartbeat_ms })) => heartbeat_ms.max(10),
        Ok(Some(ToWorker::Rejected { reason })) => {
            return Err(AgentError::Rejected { id: cfg.id, reason })
        }
        Ok(Some(other)) => {
            return Err(AgentError::Protocol(format!(
                "expected Welcome, got {other:?}"
            )))
        }
        Ok(None) => {
            return Err(AgentError::Rejected {
                id: cfg.id,
                reason: "connection closed during registration (wrong job token?)".into(),
            })
        }
        Err(e) => return lost(e),
    };
    tracing::info!(
        "{} registered with the controller at {}",
        cfg.id,
        cfg.controller
    );
    let (in_tx, mut in_rx) = mpsc::channel::<Result<ToWorker, String>>(256);
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
    let mut beat = tokio::time::interval(Duration::from_millis(heartbeat_ms));
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut current: Option<SyncRef> = None;
    let end = loop {
        tokio::select! {
            _ = beat.tick() => {
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
            msg = in_rx.recv() => {
                let msg = match msg {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => break SessionEnd::Lost(e),
                    None => break SessionEnd::Lost("reader stopped".into()),
                };
                let cmd = match msg {
                    ToWorker::Assign(a) => Some(DriverCmd::Assign(Box::new(a))),
                    ToWorker::Prepare { sync_id, version } => {
                        let s = SyncRef { sync_id, version, reference: Instant::now(), reference_unix_ns: unix_ns() };
                        current = Some(s);
                        // A new sync: earlier aborts (and ids of a restarted controller) no
                        // longer apply.
                        abort_tx.send_replace(0);
                        Some(DriverCmd::Prepare(s))
                    }
                    ToWorker::Start { sync_id, .. } => current.filter(|s| s.sync_id == sync_id).map(DriverCmd::Run),
                    ToWorker::Verify { sync_id, checksums, .. } => current
                        .filter(|s| s.sync_id == sync_id)
                        .map(|s| DriverCmd::Verify(s, checksums)),
                    ToWorker::Commit { sync_id, .. } => current
                        .filter(|s| s.sync_id == sync_id)
                        .map(|s| DriverCmd::Finish(s, Outcome::Committed)),
                    ToWorker::Abort { sync_id, version, reason } => {
                        tracing::warn!("{}: sync {sync_id} (version {version}) aborted: {reason}", cfg.id);
                        let _ = abort_tx.send(sync_id);
                        // Always answered (with Drained), also for a sync this worker never saw.
                        Some(DriverCmd::Abort {
                            sync: current.filter(|s| s.sync_id == sync_id),
                            sync_id,
                            version,
                        })
                    }
                    ToWorker::Shutdown => break SessionEnd::Shutdown,
                    ToWorker::Heartbeat { .. } | ToWorker::Welcome { .. } | ToWorker::Challenge { .. } => None,
                    ToWorker::Rejected { reason } => break SessionEnd::Lost(format!("rejected: {reason}")),
                };
                if let Some(cmd) = cmd {
                    if cmd_tx.send(cmd).await.is_err() {
                        break SessionEnd::Lost("driver stopped".into());
                    }
                }
            }
        }
    };
    reader.abort();
    Ok(end)
}

enum DriverCmd {
    Assign(Box<weightsync_common::protocol::Assignment>),
    Prepare(SyncRef),
    Run(SyncRef),
    Verify(SyncRef, Vec<weightsync_common::protocol::UnitChecksum>),
    Finish(SyncRef, Outcome),
    /// `Abort N`: finish the sync (when it is the current one), drain, answer `Drained`.
    Abort {
        sync: Option<SyncRef>,
        sync_id: u64,
        version: u64,
    },
    AbortAll,
}

/// Runs `fut` unless sync `id` is aborted first (then `None`).
async fn unless_aborted<T>(
    abort: &mut watch::Receiver<u64>,
    id: u64,
    fut: impl std::future::Future<Output = T>,
) -> Option<T> {
    let aborted = |v: u64| v == id || v == u64::MAX;
    if aborted(*abort.borrow()) {
        return None;
    }
    tokio::select! {
        r = fut => Some(r),
        _ = async {
            loop {
                if abort.changed().await.is_err() { std::future::pending::<()>().await; }
                if aborted(*abort.borrow()) { break; }
            }
        } => None,
    }
}

async fn drive<D: SyncDriver>(
    mut driver: D,
    role: Role,
    mut cmds: mpsc::Receiver<DriverCmd>,
    mut abort: watch::Receiver<u64>,
    out: mpsc::Sender<FromWorker>,
) {
    let mut last: Option<SyncRef> = None;
    let me = |tensor: Option<String>, cause: String, worker| Failure {
        worker,
        tensor,
        cause,
    };
    // The worker id is only needed for failure reports; role + rank come from the messages'
    // receiver, so the controller fills in who sent it. We still name ourselves for logs.
    let _ = role;
    while let Some(cmd) = cmds.recv().await {
        match cmd {
            DriverCmd::Assign(a) => {
                if let Err(e) = driver.assign(*a).await {
                    tracing::error!("assignment refused: {e}");
                    // Reported on the next sync, when the controller is listening for it.
                    last = None;
                    let _ = out
                        .send(FromWorker::Failed {
                            sync_id: 0,
                            version: 0,
                            failure: me(
                                e.tensor,
                                format!("assignment: {}", e.cause),
                                placeholder(),
                            ),
                        })
                        .await;
                }
            }
            DriverCmd::Prepare(s) => {
                if last.is_some_and(|l| l.sync_id != s.sync_id) {
                    // A sync we never saw end (e.g. reconnect); make sure the driver dropped it
                    // and that nothing of it can land during this one.
                    if let Some(l) = last {
                        driver.finish(l, Outcome::Aborted).await;
                        driver.drain().await;
                    }
                }
                last = Some(s);
                let Some(r) = unless_aborted(&mut abort, s.sync_id, driver.prepare(s)).await else {
                    continue;
                };
                let msg = match r {
                    Ok(report) => FromWorker::Prepared {
                        sync_id: s.sync_id,
                        version: s.version,
                        report,
                    },
                    Err(e) => failed(s, e),
                };
                let ok = matches!(msg, FromWorker::Prepared { .. });
                let _ = out.send(msg).await;
                if ok && role == Role::Rollout {
                    let Some(r) = unless_aborted(&mut abort, s.sync_id, driver.run(s)).await else {
                        continue;
                    };
                    let _ = out
                        .send(match r {
                            Ok((verified, report)) => FromWorker::Landed {
                                sync_id: s.sync_id,
                                version: s.version,
                                verified,
                                report,
                            },
                            Err(e) => failed(s, e),
                        })
                        .await;
                }
            }
            DriverCmd::Run(s) => {
                let Some(r) = unless_aborted(&mut abort, s.sync_id, driver.run(s)).await else {
                    continue;
                };
                let _ = out
                    .send(match r {
                        Ok((_, report)) => FromWorker::Written {
                            sync_id: s.sync_id,
                            version: s.version,
                            report,
                        },
                        Err(e) => failed(s, e),
                    })
                    .await;
            }
            DriverCmd::Verify(s, sums) => {
                let Some(r) = unless_aborted(&mut abort, s.sync_id, driver.verify(s, sums)).await
                else {
                    continue;
                };
                let _ = out
                    .send(match r {
                        Ok(report) => FromWorker::Verified {
                            sync_id: s.sync_id,
                            version: s.version,
                            report,
                        },
                        Err(e) => failed(s, e),
                    })
                    .await;
            }
            DriverCmd::Finish(s, outcome) => {
                driver.finish(s, outcome).await;
                if last.is_some_and(|l| l.sync_id == s.sync_id) {
                    last = None;
                }
            }
            DriverCmd::Abort {
                sync,
                sync_id,
                version,
            } => {
                if let Some(s) = sync {
                    driver.finish(s, Outcome::Aborted).await;
                }
                if last.is_some_and(|l| l.sync_id == sync_id) {
                    last = None;
                }
                driver.drain().await;
                let _ = out.send(FromWorker::Drained { sync_id, version }).await;
            }
            DriverCmd::AbortAll => {
                if let Some(l) = last.take() {
                    driver.finish(l, Outcome::Aborted).await;
                }
                // No controller to tell; a reconnecting worker registers anew.
                driver.drain().await;
            }
        }
    }
}

/// The controller attributes a failure to the connection it came on; the id inside is
/// overwritten there. This placeholder only fills the field.
fn placeholder() -> WorkerId {
    WorkerId::trainer(u32::MAX)
}

fn failed(s: SyncRef, e: DriverError) -> FromWorker {
    FromWorker::Failed {
        sync_id: s.sync_id,
        version: s.version,
        failure: Failure {
            worker: placeholder(),
            tensor: e.tensor,
            cause: e.cause,
        },
    }
}

/// A default control frame limit for agents.
pub const AGENT_MAX_FRAME: u32 = DEFAULT_MAX_FRAME;
