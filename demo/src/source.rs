//! The demo's weights as a trainer's source, and the training step between two pushes.
//!
//! [`DemoSource`] is the agent's [`ProvideSource`]: when the slice arrives it allocates the
//! rank's source arena and writes the weights of the next version into it. [`DemoTrainer`]
//! wraps the production trainer driver: right after a version commits it writes the next one
//! (what an optimizer step does before the training loop pushes again) and says so in its
//! progress file, so the demo can wait for it before triggering the next sync and time it on a
//! line of its own. A sync asking for a version the arena does not hold (a first sync with
//! another number, a retry after an abort) gets it written in its `Prepare`, inside the sync.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use weightsync_agent::driver::{Accepted, DriverError, DriverInfo, Outcome, SyncDriver, SyncRef};
use weightsync_agent::trainer::{ProvideSource, TrainerDriver};
use weightsync_common::protocol::{Assignment, Failure, PeerInfo, RunChecksum, WorkerReport};
use weightsync_schedules::table::TrainerPlan;
use weightsync_worker::SourceView;

use crate::progress::{DemoEvent, ProgressFile};
use crate::weights::fill_trainer_arena;

/// The arena attached for the current slice and the version it holds.
#[derive(Debug)]
struct Attached {
    plan: TrainerPlan,
    arena: Arc<RwLock<Vec<u8>>>,
    version: u64,
}

/// The demo's weights for one trainer: a source arena regenerated from `(seed, version)`.
#[derive(Debug)]
pub struct DemoSource {
    seed: u64,
    /// The version the next attachment writes (1 at first: the demo's first push).
    next: Mutex<u64>,
    attached: Mutex<Option<Attached>>,
}

impl DemoSource {
    /// The weights of `seed`.
    pub fn new(seed: u64) -> Arc<DemoSource> {
        Arc::new(DemoSource {
            seed,
            next: Mutex::new(1),
            attached: Mutex::new(None),
        })
    }

    /// Makes the arena hold `version` (nothing to do when it does); the bytes written, `None`
    /// when nothing is attached yet.
    fn write(&self, version: u64) -> Option<u64> {
        let mut guard = self.attached.lock();
        let a = guard.as_mut()?;
        if a.version != version {
            fill_trainer_arena(&a.plan, self.seed, version, &mut a.arena.write());
            a.version = version;
        }
        Some(a.plan.source_arena_bytes)
    }

    /// The version the arena holds.
    fn holds(&self) -> Option<u64> {
        self.attached.lock().as_ref().map(|a| a.version)
    }
}

impl ProvideSource for DemoSource {
    fn attach(&self, plan: &TrainerPlan) -> Result<Arc<dyn SourceView>, DriverError> {
        let len = usize::try_from(plan.source_arena_bytes).map_err(|_| {
            DriverError::layout(format!(
                "a source arena of {} bytes does not fit this machine",
                plan.source_arena_bytes
            ))
        })?;
        let version = *self.next.lock();
        let mut bytes = vec![0u8; len];
        fill_trainer_arena(plan, self.seed, version, &mut bytes);
        let arena = Arc::new(RwLock::new(bytes));
        *self.attached.lock() = Some(Attached {
            plan: plan.clone(),
            arena: arena.clone(),
            version,
        });
        Ok(arena)
    }
}

/// The production trainer driver with the demo's training step around it.
#[derive(Debug)]
pub struct DemoTrainer {
    inner: TrainerDriver,
    source: Arc<DemoSource>,
    progress: Option<ProgressFile>,
    name: String,
}

impl DemoTrainer {
    /// Wraps `inner`, whose configured source must be `source` (as
    /// `SourceSpec::Provided(source.clone())`); events go to `progress` when given.
    pub fn new(
        inner: TrainerDriver,
        source: Arc<DemoSource>,
        rank: u32,
        progress: Option<ProgressFile>,
    ) -> DemoTrainer {
        DemoTrainer {
            inner,
            source,
            progress,
            name: format!("trainer-{rank}"),
        }
    }

    /// The training step: the arena holds `version` afterwards; reported when it wrote.
    fn step(&self, version: u64) {
        let start = Instant::now();
        let before = self.source.holds();
        let Some(bytes) = tokio::task::block_in_place(|| self.source.write(version)) else {
            return;
        };
        if let (Some(p), true) = (&self.progress, before != Some(version)) {
            p.append(&DemoEvent::Weights {
                worker: self.name.clone(),
                version,
                bytes,
                seconds: start.elapsed().as_secs_f64(),
            });
        }
    }
}

impl SyncDriver for DemoTrainer {
    fn info(&self) -> DriverInfo {
        self.inner.info()
    }

    async fn assign(&mut self, a: Assignment) -> Result<Accepted, DriverError> {
        let fresh = self.source.holds().is_none();
        let start = Instant::now();
        let accepted = self.inner.assign(a).await?;
        if let (Some(p), true, Some(version)) = (&self.progress, fresh, self.source.holds()) {
            // The attachment wrote the first version (its time includes building the worker).
            p.append(&DemoEvent::Weights {
                worker: self.name.clone(),
                version,
                bytes: self.inner.plan().map_or(0, |p| p.source_arena_bytes),
                seconds: start.elapsed().as_secs_f64(),
            });
        }
        Ok(accepted)
    }

    async fn peers(&mut self, plan_id: u64, peers: Vec<PeerInfo>) -> Result<(), DriverError> {
        self.inner.peers(plan_id, peers).await
    }

    async fn prepare(&mut self, sync: SyncRef) -> Result<WorkerReport, DriverError> {
        if self.source.holds() != Some(sync.version) {
            tracing::info!(
                "{}: writing the demo's weights for version {} inside its sync (not written ahead)",
                self.name,
                sync.version
            );
            self.step(sync.version);
        }
        self.inner.prepare(sync).await
    }

    async fn run(&mut self, sync: SyncRef) -> Result<(Option<bool>, WorkerReport), DriverError> {
        self.inner.run(sync).await
    }

    async fn verify(
        &mut self,
        sync: SyncRef,
        checksums: Vec<RunChecksum>,
    ) -> Result<WorkerReport, DriverError> {
        self.inner.verify(sync, checksums).await
    }

    fn aborted_because(&mut self, sync: SyncRef, reason: &str, failure: Option<&Failure>) {
        self.inner.aborted_because(sync, reason, failure);
    }

    async fn finish(&mut self, sync: SyncRef, outcome: Outcome) {
        self.inner.finish(sync, outcome).await;
        if outcome == Outcome::Committed {
            let next = sync.version + 1;
            *self.source.next.lock() = next;
            self.step(next);
        }
    }

    async fn drain(&mut self) {
        self.inner.drain().await;
    }
}
