//! The seam between the agent's control loop and the worker library.
//!
//! The agent speaks the control protocol (connect, authenticate, register, heartbeat, forward
//! the version protocol); a [`SyncDriver`] does the work each step asks for. The production
//! drivers wrap `weightsync_worker`'s `TrainerWorker` and `RolloutWorker`
//! ([`super::trainer`], [`super::rollout`]); tests plug in scripted drivers to exercise the
//! protocol without moving bytes.

use std::future::Future;
use std::time::Instant;

use weightsync_common::protocol::{
    Assignment, Blob, DeltaBase, DeltaFigures, DeltaRecord, Failure, PeerInfo, RunChecksum,
    TensorMeta, WorkerReport,
};

pub use crate::driver_error::DriverError;

/// One sync as the driver sees it.
#[derive(Debug, Clone, Copy)]
pub struct SyncRef {
    /// Controller's sync id (also the epoch that tags immediates).
    pub sync_id: u64,
    /// Weight version.
    pub version: u64,
    /// The job's run the version belongs to.
    pub run: u64,
    /// When this worker received `Prepare`: every reported span is relative to it.
    pub reference: Instant,
    /// The same instant on the wall clock, ns since the Unix epoch.
    pub reference_unix_ns: u64,
}

/// What a worker tells the controller about itself when it registers.
#[derive(Debug, Clone, Default)]
pub struct DriverInfo {
    /// Fabric endpoint (backend-encoded).
    pub fabric_endpoint: Blob,
    /// Registered regions' descriptors (backend-encoded).
    pub regions: Vec<Blob>,
    /// Tensors held.
    pub tensors: Vec<TensorMeta>,
    /// Where the planned tensors lie in `regions` when they are not laid out as planned (a
    /// rollout over an engine's own tensors); `None`: as planned.
    pub placement: Option<Blob>,
    /// An engine of a declared model: the names it takes nothing of (see
    /// [`weightsync_common::protocol::Registration::skip`]).
    pub skip: Vec<String>,
}

/// What a worker built for its assignment, sent back in `Ready`.
#[derive(Debug, Clone, Default)]
pub struct Accepted {
    /// Regions registered for this plan that peers write into (a trainer's gather arena),
    /// backend-encoded.
    pub regions: Vec<Blob>,
    /// Tensors held under this plan, when the registration could not say them (a trainer's
    /// shards).
    pub tensors: Vec<TensorMeta>,
}

/// How a sync ended, as the controller announced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// `Commit N`: the version may be used.
    Committed,
    /// `Abort N`: the version is not valid.
    Aborted,
}

/// Does a worker's part of each step of the version protocol.
///
/// Calls come one at a time, in protocol order. A future may be dropped part-way when the
/// controller aborts the sync; [`SyncDriver::finish`] with [`Outcome::Aborted`] and then
/// [`SyncDriver::drain`] follow.
pub trait SyncDriver: Send + 'static {
    /// Endpoint, regions and tensors to register with.
    fn info(&self) -> DriverInfo;

    /// The worker's part of the (re-)planned world: build what it needs (a trainer attaches its
    /// source and registers its staging and gather arenas) and say what peers need to know.
    fn assign(
        &mut self,
        a: Assignment,
    ) -> impl Future<Output = Result<Accepted, DriverError>> + Send;

    /// Trainers, once the plan is in force: every other worker's endpoint and regions. The
    /// default ignores them (a worker that posts no writes).
    fn peers(
        &mut self,
        plan_id: u64,
        peers: Vec<PeerInfo>,
    ) -> impl Future<Output = Result<(), DriverError>> + Send {
        let _ = (plan_id, peers);
        std::future::ready(Ok(()))
    }

    /// `Prepare N`: rollouts arm, trainers make their source hold N.
    fn prepare(
        &mut self,
        sync: SyncRef,
    ) -> impl Future<Output = Result<WorkerReport, DriverError>> + Send;

    /// Trainers: write N (after `Start`). Rollouts: wait until N landed (right after
    /// preparing). Returns whether it verified locally (`None`: not done here) and the report.
    fn run(
        &mut self,
        sync: SyncRef,
    ) -> impl Future<Output = Result<(Option<bool>, WorkerReport), DriverError>> + Send;

    /// Trainers, just before [`SyncDriver::run`]: the engines that take deltas this sync and
    /// the version they hold (`None`: a full sync). The default ignores it (every write dense).
    fn delta_start(&mut self, delta: Option<DeltaBase>) {
        let _ = delta;
    }

    /// Rollouts, on `Verify` and before [`SyncDriver::verify`]: apply the trainers' deltas to
    /// what landed. The default takes none (it registered no inbox): any delta is refused.
    fn apply_deltas(
        &mut self,
        sync: SyncRef,
        deltas: Vec<DeltaRecord>,
    ) -> impl Future<Output = Result<DeltaFigures, DriverError>> + Send {
        let _ = sync;
        std::future::ready(if deltas.is_empty() {
            Ok(DeltaFigures::default())
        } else {
            Err(DriverError::other(
                "deltas sent to a worker that registered no delta inbox",
            ))
        })
    }

    /// Rollouts: check what landed against the trainers' checksums.
    fn verify(
        &mut self,
        sync: SyncRef,
        checksums: Vec<RunChecksum>,
    ) -> impl Future<Output = Result<WorkerReport, DriverError>> + Send;

    /// Why the controller aborted `sync` (and the failure, naming the worker, when one
    /// failed): called just before [`SyncDriver::finish`] with [`Outcome::Aborted`] (an engine
    /// keeps it as the cause of its invalid state). The default ignores it.
    fn aborted_because(&mut self, sync: SyncRef, reason: &str, failure: Option<&Failure>) {
        let _ = (sync, reason, failure);
    }

    /// The sync ended (commit or abort).
    fn finish(&mut self, sync: SyncRef, outcome: Outcome) -> impl Future<Output = ()> + Send;

    /// After an abort (or losing the controller): make sure nothing this worker posted for an
    /// abandoned sync can still land anywhere. A writer stops its work (and waits until it has
    /// stopped) and resets its fabric lanes; the agent then answers `Drained`, and the
    /// controller starts no new sync before every writer of the aborted one did. The default
    /// has nothing to drain (a worker that posts no writes).
    fn drain(&mut self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}
