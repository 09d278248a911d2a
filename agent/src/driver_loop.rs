//! The driver loop: runs the [`SyncDriver`]'s steps one at a time, in protocol order, and turns
//! each step's result into the message the controller waits for. A step of a sync the
//! controller aborted is dropped at once (the future is cancelled), then the driver finishes
//! and drains it and the loop answers `Drained`.

use tokio::sync::{mpsc, watch};
use weightsync_common::protocol::{Failure, FromWorker, WorkerId, WorkerRole};

use crate::driver::{DriverError, Outcome, SyncDriver, SyncRef};

/// What the session asks the driver loop to do.
pub(crate) enum DriverCmd {
    Assign(Box<weightsync_common::protocol::Assignment>),
    Prepare(SyncRef),
    Run(SyncRef),
    Verify(SyncRef, Vec<weightsync_common::protocol::RunChecksum>),
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

pub(crate) async fn drive<D: SyncDriver>(
    mut driver: D,
    role: WorkerRole,
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
                if ok && role == WorkerRole::Rollout {
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
