//! The driver loop: runs the [`SyncDriver`]'s steps one at a time, in protocol order, and turns
//! each step's result into the message the controller waits for. A step of a sync the
//! controller aborted is dropped at once (the future is cancelled), then the driver finishes
//! and drains it and the loop answers `Drained`.

use tokio::sync::{mpsc, watch};
use weightsync_common::protocol::{
    Assignment, DeltaBase, DeltaRecord, Failure, FromWorker, PeerInfo, RunChecksum, WorkerRole,
};

use crate::driver::{DriverError, Outcome, SyncDriver, SyncRef};

/// What the session asks the driver loop to do.
pub(crate) enum DriverCmd {
    /// `Assign`: build for the plan, answer `Ready`.
    Assign(Box<Assignment>),
    /// `Peers` of a plan in force.
    Peers(u64, Vec<PeerInfo>),
    /// `Prepare N` (rollouts then wait for N to land).
    Prepare(SyncRef),
    /// `Start N` (trainers), with the engines that take deltas.
    Run(SyncRef, Option<DeltaBase>),
    /// `Verify N` with the trainers' checksums and this rollout's deltas.
    Verify(SyncRef, Vec<RunChecksum>, Vec<DeltaRecord>),
    /// `Commit N`.
    Finish(SyncRef, Outcome),
    /// `Abort N`: finish the sync (when it is the current one), drain, answer `Drained`.
    Abort {
        sync: Option<SyncRef>,
        sync_id: u64,
        version: u64,
        reason: String,
        /// The failure, naming the worker, when one failed.
        failure: Option<Failure>,
    },
    /// The controller was lost: drop whatever runs, drain.
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

/// `Failed` for sync `s` (sync 0: the plan round). It does not name this worker: the
/// controller knows the connection it came on.
fn failed(sync_id: u64, version: u64, e: DriverError) -> FromWorker {
    FromWorker::Failed {
        sync_id,
        version,
        failure: e.fault(),
    }
}

/// The driver and what the loop remembers between commands.
struct DriverLoop<D> {
    driver: D,
    role: WorkerRole,
    abort: watch::Receiver<u64>,
    out: mpsc::Sender<FromWorker>,
    /// The sync last prepared and not yet finished.
    last: Option<SyncRef>,
}

pub(crate) async fn drive<D: SyncDriver>(
    driver: D,
    role: WorkerRole,
    mut cmds: mpsc::Receiver<DriverCmd>,
    abort: watch::Receiver<u64>,
    out: mpsc::Sender<FromWorker>,
) {
    let mut l = DriverLoop {
        driver,
        role,
        abort,
        out,
        last: None,
    };
    while let Some(cmd) = cmds.recv().await {
        match cmd {
            DriverCmd::Assign(a) => l.assign(*a).await,
            DriverCmd::Peers(plan_id, peers) => l.peers(plan_id, peers).await,
            DriverCmd::Prepare(s) => l.prepare(s).await,
            DriverCmd::Run(s, delta) => {
                l.driver.delta_start(delta);
                l.run(s).await
            }
            DriverCmd::Verify(s, sums, deltas) => l.verify(s, sums, deltas).await,
            DriverCmd::Finish(s, outcome) => l.finish(s, outcome).await,
            DriverCmd::Abort {
                sync,
                sync_id,
                version,
                reason,
                failure,
            } => {
                l.abort(sync, sync_id, version, &reason, failure.as_ref())
                    .await
            }
            DriverCmd::AbortAll => l.abort_all().await,
        }
    }
}

/// Sends to the session (which is gone only when the agent stops).
async fn send(out: &mpsc::Sender<FromWorker>, msg: FromWorker) {
    let _ = out.send(msg).await;
}

impl<D: SyncDriver> DriverLoop<D> {
    /// `Assign`: answered by `Ready`, or by `Failed` for sync 0 (the controller names the plan
    /// refused when a trigger asks).
    async fn assign(&mut self, a: Assignment) {
        let plan_id = a.plan_id();
        let started = std::time::Instant::now();
        match self.driver.assign(a).await {
            Ok(accepted) => {
                tracing::info!(
                    "assignment of plan {plan_id} accepted in {:.3} s",
                    started.elapsed().as_secs_f64()
                );
                send(
                    &self.out,
                    FromWorker::Ready {
                        plan_id,
                        regions: accepted.regions,
                        tensors: accepted.tensors,
                    },
                )
                .await
            }
            Err(e) => {
                tracing::error!("assignment of plan {plan_id} refused: {e}");
                self.last = None;
                send(&self.out, failed(0, 0, e.context("assignment"))).await;
            }
        }
    }

    /// `Peers`: a refusal is reported like a refused assignment.
    async fn peers(&mut self, plan_id: u64, peers: Vec<PeerInfo>) {
        if let Err(e) = self.driver.peers(plan_id, peers).await {
            tracing::error!("peers of plan {plan_id} refused: {e}");
            send(&self.out, failed(0, 0, e.context("peers"))).await;
        }
    }

    /// `Prepare N`: answered by `Prepared`; a rollout then waits for N to land and answers
    /// `Landed`.
    async fn prepare(&mut self, s: SyncRef) {
        if let Some(l) = self.last.filter(|l| l.sync_id != s.sync_id) {
            // A sync we never saw end (e.g. reconnect); make sure the driver dropped it and
            // that nothing of it can land during this one.
            self.driver.finish(l, Outcome::Aborted).await;
            self.driver.drain().await;
        }
        self.last = Some(s);
        let Some(r) = unless_aborted(&mut self.abort, s.sync_id, self.driver.prepare(s)).await
        else {
            return;
        };
        let prepared = r.is_ok();
        send(
            &self.out,
            match r {
                Ok(report) => FromWorker::Prepared {
                    sync_id: s.sync_id,
                    version: s.version,
                    report,
                },
                Err(e) => failed(s.sync_id, s.version, e),
            },
        )
        .await;
        if !(prepared && self.role == WorkerRole::Rollout) {
            return;
        }
        let Some(r) = unless_aborted(&mut self.abort, s.sync_id, self.driver.run(s)).await else {
            return;
        };
        send(
            &self.out,
            match r {
                Ok((verified, report)) => FromWorker::Landed {
                    sync_id: s.sync_id,
                    version: s.version,
                    verified,
                    report,
                },
                Err(e) => failed(s.sync_id, s.version, e),
            },
        )
        .await;
    }

    /// `Start N` (trainers): answered by `Written`.
    async fn run(&mut self, s: SyncRef) {
        let Some(r) = unless_aborted(&mut self.abort, s.sync_id, self.driver.run(s)).await else {
            return;
        };
        send(
            &self.out,
            match r {
                Ok((_, report)) => FromWorker::Written {
                    sync_id: s.sync_id,
                    version: s.version,
                    report,
                },
                Err(e) => failed(s.sync_id, s.version, e),
            },
        )
        .await;
    }

    /// `Verify N` (rollouts): applies the deltas, then verifies; answered by `Verified`.
    async fn verify(&mut self, s: SyncRef, sums: Vec<RunChecksum>, deltas: Vec<DeltaRecord>) {
        let driver = &mut self.driver;
        let verified = async move {
            let applied = driver.apply_deltas(s, deltas).await?;
            let mut report = driver.verify(s, sums).await?;
            report.delta = applied;
            Ok::<_, DriverError>(report)
        };
        let Some(r) = unless_aborted(&mut self.abort, s.sync_id, verified).await else {
            return;
        };
        send(
            &self.out,
            match r {
                Ok(report) => FromWorker::Verified {
                    sync_id: s.sync_id,
                    version: s.version,
                    report,
                },
                Err(e) => failed(s.sync_id, s.version, e),
            },
        )
        .await;
    }

    /// `Commit N`.
    async fn finish(&mut self, s: SyncRef, outcome: Outcome) {
        self.driver.finish(s, outcome).await;
        if self.last.is_some_and(|l| l.sync_id == s.sync_id) {
            self.last = None;
        }
    }

    /// `Abort N`: answered by `Drained`, also for a sync this worker never saw.
    async fn abort(
        &mut self,
        sync: Option<SyncRef>,
        sync_id: u64,
        version: u64,
        reason: &str,
        failure: Option<&Failure>,
    ) {
        if let Some(s) = sync {
            self.driver.aborted_because(s, reason, failure);
            self.driver.finish(s, Outcome::Aborted).await;
        }
        if self.last.is_some_and(|l| l.sync_id == sync_id) {
            self.last = None;
        }
        self.driver.drain().await;
        send(&self.out, FromWorker::Drained { sync_id, version }).await;
    }

    /// The controller was lost: nobody to tell; a reconnecting worker registers anew.
    async fn abort_all(&mut self) {
        if let Some(l) = self.last.take() {
            self.driver.finish(l, Outcome::Aborted).await;
        }
        self.driver.drain().await;
    }
}
