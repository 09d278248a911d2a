//! The engine's driver: the rollout driver over the engine's own tensors, with the engine's
//! hooks and its visible state.
//!
//! `Prepare N` remembers the sync of N (its id and the instant `Prepare` arrived, the zero of
//! the engine's own stages of N), calls `before_landing(N)` (the engine stops reading its
//! weights) and only then arms the counters and answers `Prepared`, so no byte lands while the
//! engine still reads; state `landing`. `Commit N` calls `after_commit(N)`, then the state is
//! `committed` with version N. `Abort N` of a version that was landing leaves the state
//! `invalid` with the controller's reason, until a later version commits. A hook that fails fails the sync (at
//! `Prepare`) naming the engine, or (at `Commit`, too late to fail it) leaves it invalid.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use weightsync_common::protocol::{
    Assignment, DeltaFigures, DeltaRecord, Failure, FailureKind, RunChecksum, WorkerReport,
};

use super::{EngineState, EngineStatus};
use crate::driver::{Accepted, DriverError, DriverInfo, Outcome, SyncDriver, SyncRef};
use crate::rollout::RolloutDriver;

/// A hook called with the version: an error fails (or invalidates) it.
pub type Hook = Box<dyn Fn(u64) -> Result<(), String> + Send + Sync>;

/// Versions whose sync this engine remembers (for its own stages, reported later).
const REMEMBERED_SYNCS: usize = 64;

/// The engine's state and hooks, shared by its handle and its driver.
#[derive(Default)]
pub(crate) struct EngineShared {
    pub state: Mutex<Watched>,
    pub changed: Condvar,
    pub hooks: Mutex<Hooks>,
    /// The last sync of each recent version this engine was told to prepare (its id and the
    /// instant `Prepare` arrived, the zero of its spans), for the engine's own stages
    /// ([`super::EngineHandle::report_stages`]).
    pub syncs: Mutex<BTreeMap<u64, SyncRef>>,
}

/// Who failed the sync an engine is invalid for, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Blame {
    /// The worker that failed (this engine, when its hook raised).
    pub worker: String,
    pub kind: FailureKind,
    pub tensor: Option<String>,
}

/// The visible state, the version it is invalid for and who failed it.
#[derive(Debug, Clone)]
pub(crate) struct Watched {
    pub state: EngineState,
    pub landing: Option<u64>,
    pub failed: Option<(u64, Blame)>,
}

impl Default for Watched {
    fn default() -> Self {
        Watched {
            state: EngineState {
                version: None,
                run: 0,
                status: EngineStatus::Idle,
                cause: None,
            },
            landing: None,
            failed: None,
        }
    }
}

/// The engine's hooks.
#[derive(Default)]
pub(crate) struct Hooks {
    pub before_landing: Option<Arc<Hook>>,
    pub after_commit: Option<Arc<Hook>>,
}

impl EngineShared {
    fn update(&self, f: impl FnOnce(&mut Watched)) {
        f(&mut self.state.lock());
        self.changed.notify_all();
    }

    /// Remembers `sync` as the sync of its version (a retried version: the latest attempt).
    fn remember(&self, sync: SyncRef) {
        let mut syncs = self.syncs.lock();
        syncs.insert(sync.version, sync);
        while syncs.len() > REMEMBERED_SYNCS {
            syncs.pop_first();
        }
    }

    fn invalidate(&self, version: u64, cause: String, blame: Blame) {
        self.update(|w| {
            w.state.status = EngineStatus::Invalid;
            w.state.cause = Some(cause);
            w.landing = None;
            w.failed = Some((version, blame));
        });
    }
}

/// Runs `hook(version)` off the runtime's threads (it may take the GIL, or block).
async fn call(hook: Option<Arc<Hook>>, version: u64) -> Result<(), String> {
    let Some(hook) = hook else {
        return Ok(());
    };
    tokio::task::spawn_blocking(move || hook(version))
        .await
        .map_err(|e| format!("the hook panicked: {e}"))?
}

/// The rollout driver with the engine's hooks and state.
pub(crate) struct EngineDriver {
    pub inner: RolloutDriver,
    pub shared: Arc<EngineShared>,
    pub name: String,
    pub abort_cause: Option<(String, Option<Failure>)>,
    /// The version whose `before_landing` hook was called (set before the call: an abort that
    /// cancels `prepare` while the hook runs still leaves the engine told to stop reading).
    pub hooked: Option<u64>,
    /// A declared model's engine: the names it takes nothing of (sent with its registration).
    pub skip: Vec<String>,
    /// A declared model's engine: its declarations, in its order (sent with its registration
    /// instead of its tensors in address order); `None` otherwise.
    pub declared: Option<Vec<weightsync_common::protocol::TensorMeta>>,
}

impl EngineDriver {
    /// This engine to blame, for a failure of `kind`.
    fn blame_self(&self, kind: FailureKind) -> Blame {
        Blame {
            worker: self.name.clone(),
            kind,
            tensor: None,
        }
    }
}

impl SyncDriver for EngineDriver {
    fn info(&self) -> DriverInfo {
        let info = self.inner.info();
        DriverInfo {
            skip: self.skip.clone(),
            // A declared model's engine declares its tensors in its own order (the order its
            // layout and the controller's are built in), not its regions' address order.
            tensors: self.declared.clone().unwrap_or(info.tensors),
            ..info
        }
    }

    async fn assign(&mut self, a: Assignment) -> Result<Accepted, DriverError> {
        self.inner.assign(a).await
    }

    async fn prepare(&mut self, sync: SyncRef) -> Result<WorkerReport, DriverError> {
        let v = sync.version;
        let held = {
            let w = self.shared.state.lock();
            w.state.version.map(|hv| (w.state.run, hv))
        };
        if let Some((hr, hv)) = held
            && (sync.run, v) < (hr, hv)
        {
            // A controller that forgot what it committed (restarted without its state file):
            // never go back silently.
            return Err(DriverError::new(
                FailureKind::Stale,
                format!(
                    "engine {} holds version {hv} of run {hr}; version {v} of run {} would go \
                     back (a job restarted from an older checkpoint declares a new run)",
                    self.name, sync.run
                ),
            ));
        }
        // Before the hook: an engine may time its pause from inside it.
        self.shared.remember(sync);
        let hook = self.shared.hooks.lock().before_landing.clone();
        self.hooked = Some(v);
        if let Err(e) = call(hook, v).await {
            let cause = format!("engine {}: before_landing({v}) failed: {e}", self.name);
            self.shared
                .invalidate(v, cause.clone(), self.blame_self(FailureKind::Hook));
            return Err(DriverError::new(FailureKind::Hook, cause));
        }
        self.shared.update(|w| {
            w.state.status = EngineStatus::Landing;
            w.landing = Some(v);
        });
        self.inner.prepare(sync).await
    }

    async fn run(&mut self, sync: SyncRef) -> Result<(Option<bool>, WorkerReport), DriverError> {
        self.inner.run(sync).await
    }

    async fn apply_deltas(
        &mut self,
        sync: SyncRef,
        deltas: Vec<DeltaRecord>,
    ) -> Result<DeltaFigures, DriverError> {
        self.inner.apply_deltas(sync, deltas).await
    }

    async fn verify(
        &mut self,
        sync: SyncRef,
        checksums: Vec<RunChecksum>,
    ) -> Result<WorkerReport, DriverError> {
        self.inner.verify(sync, checksums).await
    }

    fn aborted_because(&mut self, _sync: SyncRef, reason: &str, failure: Option<&Failure>) {
        self.abort_cause = Some((reason.to_string(), failure.cloned()));
    }

    async fn finish(&mut self, sync: SyncRef, outcome: Outcome) {
        self.inner.finish(sync, outcome).await;
        let v = sync.version;
        let hooked = self.hooked.take();
        match outcome {
            Outcome::Committed => {
                let hook = self.shared.hooks.lock().after_commit.clone();
                match call(hook, v).await {
                    Ok(()) => self.shared.update(|w| {
                        w.state = EngineState {
                            version: Some(v),
                            run: sync.run,
                            status: EngineStatus::Committed,
                            cause: None,
                        };
                        w.landing = None;
                        w.failed = None;
                    }),
                    Err(e) => {
                        let cause = format!("engine {}: after_commit({v}) failed: {e}", self.name);
                        self.shared
                            .invalidate(v, cause, self.blame_self(FailureKind::Hook));
                    }
                }
            }
            Outcome::Aborted => {
                let (cause, failure) = self
                    .abort_cause
                    .take()
                    .unwrap_or_else(|| (format!("the sync of version {v} was aborted"), None));
                let blame = match failure {
                    Some(f) => Blame {
                        worker: f.worker.to_string(),
                        kind: f.kind,
                        tensor: f.tensor,
                    },
                    None => self.blame_self(FailureKind::Other),
                };
                // Landing, or told to stop reading for it (an abort that arrived while
                // before_landing ran): the version failed, and the engine must hear it.
                if self.shared.state.lock().landing == Some(v) || hooked == Some(v) {
                    self.shared.invalidate(v, cause, blame);
                }
            }
        }
    }

    async fn drain(&mut self) {
        self.inner.drain().await
    }
}
