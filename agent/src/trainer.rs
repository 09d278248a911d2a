//! The trainer driver: `weightsync_worker::TrainerWorker` behind the agent.
//!
//! Built before registration: it plans its own side of the job (pure, deterministic), attaches
//! its source, and registers its staging and gather arenas, so the registration carries the
//! gather descriptor peers need. The controller's assignment must carry the same slice; a
//! difference (e.g. mismatched builds) is refused rather than half-followed.
//!
//! Each sync runs in its own task, so that an abort can cancel it and wait until it has stopped
//! posting; draining then resets the fabric's lanes, discarding whatever of the aborted sync is
//! still queued (after a partition heals, TCP would otherwise deliver it during the next sync).

use std::sync::Arc;
use std::time::Instant;

use weightsync_common::fabric::{Fabric, FabricBackend, FabricConfig, RegionDescriptor};
use weightsync_common::protocol::{
    Assignment, Blob, RunChecksum, Stage, TensorMeta, TimelineEvent, WorkerId, WorkerReport,
    WorkerRole, WorldSpec, WHOLE_SYNC,
};
use weightsync_schedules::table::TrainerPlan;
use weightsync_worker::{
    Destinations, SourceView, SyncId, SyncReport, TrainerConfig, TrainerWorker,
};

use tokio::sync::oneshot;
use weightsync_worker::WorkerError;

use crate::demo_weights::fill_trainer_arena;
use crate::driver::{DriverError, DriverInfo, Outcome, SyncDriver, SyncRef};
use weightsync_schedules::job;

/// Where a trainer's source weights come from.
#[derive(Debug, Clone)]
pub enum SourceSpec {
    /// Demo: regenerated from `(seed, version)` before every sync.
    Demo {
        /// Seed.
        seed: u64,
    },
    /// A shared-memory file the training process exports (read-only), laid out as the plan's
    /// source arena.
    Shm(std::path::PathBuf),
    /// A safetensors file holding this rank's shards.
    Safetensors(std::path::PathBuf),
}

/// Settings of a trainer driver.
#[derive(Debug, Clone)]
pub struct TrainerDriverConfig {
    /// The job.
    pub world: WorldSpec,
    /// Training rank.
    pub rank: u32,
    /// Fabric settings.
    pub fabric: FabricConfig,
    /// Staging watermark, bytes.
    pub watermark_bytes: u64,
    /// Source.
    pub source: SourceSpec,
}

/// Drives a [`TrainerWorker`].
#[derive(Debug)]
pub struct TrainerDriver {
    cfg: TrainerDriverConfig,
    fabric: Fabric,
    worker: Arc<TrainerWorker<Fabric>>,
    arena: Option<Arc<parking_lot::RwLock<Vec<u8>>>>,
    /// The sync whose task is running (kept when the agent drops `run` on an abort).
    in_flight: Option<InFlight>,
}

/// A sync running in its own task.
#[derive(Debug)]
struct InFlight {
    /// Dropping it cancels the sync.
    cancel: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<SyncReport, WorkerError>>,
}

impl TrainerDriver {
    /// Cancels the running sync, if any, and waits until it posts nothing more.
    async fn stop_in_flight(&mut self) {
        if let Some(InFlight { cancel, task }) = self.in_flight.take() {
            drop(cancel);
            match task.await {
                Ok(Err(WorkerError::Cancelled)) | Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::debug!("the stopped sync had failed: {e}"),
                Err(e) => tracing::warn!("the stopped sync's task ended abnormally: {e}"),
            }
        }
    }
}

fn err(e: impl std::fmt::Display) -> DriverError {
    DriverError::new(e.to_string())
}

/// Encodes a fabric value for the control channel.
pub fn blob<T: serde::Serialize>(v: &T) -> Blob {
    Blob(bincode::serialize(v).unwrap_or_default())
}

impl TrainerDriver {
    /// Plans, attaches the source and registers memory.
    pub async fn new(cfg: TrainerDriverConfig) -> Result<TrainerDriver, DriverError> {
        let fabric = Fabric::start(&cfg.fabric).await.map_err(err)?;
        let config_text = cfg.world.read_model_config().map_err(err)?;
        let job = job::plan_job(&cfg.world, config_text.as_deref()).map_err(err)?;
        let plan = job.table.slice(cfg.rank).map_err(err)?;
        let name = WorkerId::trainer(cfg.rank).to_string();
        let (source, arena): (Arc<dyn SourceView>, _) = match &cfg.source {
            SourceSpec::Demo { seed } => {
                let mut bytes = vec![0u8; plan.source_arena_bytes as usize];
                fill_trainer_arena(&plan, *seed, 0, &mut bytes);
                let a = Arc::new(parking_lot::RwLock::new(bytes));
                (a.clone(), Some(a))
            }
            SourceSpec::Shm(path) => {
                let s = weightsync_worker::ShmSource::open(path, Some(plan.source_arena_bytes))
                    .map_err(err)?;
                (Arc::new(weightsync_worker::SourceMemory::Shm(s)), None)
            }
            SourceSpec::Safetensors(path) => {
                let tensors = weightsync_worker::arena_tensors(&plan);
                let s = weightsync_worker::SafetensorsSource::load(
                    path,
                    &tensors,
                    plan.source_arena_bytes,
                )
                .map_err(err)?;
                (
                    Arc::new(weightsync_worker::SourceMemory::Safetensors(s)),
                    None,
                )
            }
        };
        let mut tc = TrainerConfig::new(name, cfg.watermark_bytes);
        tc.verify = cfg.world.verify;
        let worker = TrainerWorker::new(fabric.clone(), source, plan, tc).map_err(err)?;
        Ok(TrainerDriver {
            cfg,
            fabric,
            worker: Arc::new(worker),
            arena,
            in_flight: None,
        })
    }
}

fn report(r: &SyncReport, sync: &SyncRef) -> WorkerReport {
    WorkerReport {
        bytes: r.bytes_written,
        writes: r.writes_posted,
        peak_staging_bytes: r.peak_staging_bytes,
        events: r.timeline.relative_to(sync.reference_unix_ns),
        checksums: r.checksums.clone(),
    }
}

fn ns_since(t: Instant, since: Instant) -> u64 {
    t.saturating_duration_since(since).as_nanos() as u64
}

impl SyncDriver for TrainerDriver {
    fn info(&self) -> DriverInfo {
        let plan = self.worker.plan();
        DriverInfo {
            fabric_endpoint: blob(self.fabric.endpoint()),
            regions: self.worker.gather_descriptor().iter().map(blob).collect(),
            tensors: plan
                .shards
                .iter()
                .map(|s| TensorMeta {
                    name: plan
                        .params
                        .get(s.param as usize)
                        .map_or_else(String::new, |p| p.name.to_string()),
                    shape: s.global.len[..s.global.ndim as usize]
                        .iter()
                        .map(|&d| u64::from(d))
                        .collect(),
                    dtype: s.dtype,
                    bytes: s.bytes(),
                })
                .collect(),
        }
    }

    async fn assign(&mut self, a: Assignment) -> Result<(), DriverError> {
        let Assignment::Trainer { slice, peers, .. } = a else {
            return Err(DriverError::new("a trainer got a rollout's assignment"));
        };
        let plan: TrainerPlan = bincode::deserialize(&slice.0)
            .map_err(|e| DriverError::new(format!("undecodable plan slice: {e}")))?;
        self.stop_in_flight().await;
        if &plan != self.worker.plan() {
            return Err(DriverError::new(
                "the controller's plan slice differs from the one this worker computed \
                 (different weightsync builds or job settings?)",
            ));
        }
        let mut dsts = Destinations::default();
        if let Some(g) = self.worker.gather_descriptor() {
            dsts.trainers.insert(self.cfg.rank, g);
        }
        for p in peers {
            let regions = p
                .regions
                .iter()
                .map(|b| bincode::deserialize::<RegionDescriptor>(&b.0))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| DriverError::new(format!("{}: undecodable region: {e}", p.id)))?;
            match p.id.role {
                WorkerRole::Rollout => {
                    dsts.rollouts.insert(p.id.rank, regions);
                }
                WorkerRole::Trainer => {
                    if let Some(g) = regions.into_iter().next() {
                        dsts.trainers.insert(p.id.rank, g);
                    }
                }
            }
        }
        Arc::get_mut(&mut self.worker)
            .ok_or_else(|| DriverError::new("destinations cannot change while a sync runs"))?
            .set_destinations(&dsts)
            .map_err(err)?;
        Ok(())
    }

    async fn prepare(&mut self, sync: SyncRef) -> Result<WorkerReport, DriverError> {
        let mut rep = WorkerReport::default();
        if let (SourceSpec::Demo { seed }, Some(arena)) = (&self.cfg.source, &self.arena) {
            // A training step changed the weights: regenerate this rank's shards for N.
            let start = Instant::now();
            let (arena, plan, seed, version) = (
                arena.clone(),
                self.worker.plan().clone(),
                *seed,
                sync.version,
            );
            let bytes = tokio::task::spawn_blocking(move || {
                let mut a = arena.write();
                fill_trainer_arena(&plan, seed, version, &mut a);
                a.len() as u64
            })
            .await
            .map_err(err)?;
            rep.events.push(TimelineEvent {
                task: WHOLE_SYNC,
                piece: 0,
                stage: Stage::Source,
                start_ns: ns_since(start, sync.reference),
                end_ns: ns_since(Instant::now(), sync.reference),
                bytes,
            });
        }
        Ok(rep)
    }

    async fn run(&mut self, sync: SyncRef) -> Result<(Option<bool>, WorkerReport), DriverError> {
        self.stop_in_flight().await;
        let (cancel, cancelled) = oneshot::channel::<()>();
        let worker = self.worker.clone();
        let id = SyncId {
            version: sync.version,
            epoch: sync.sync_id,
        };
        let task = tokio::spawn(async move {
            let cancelled = async move {
                // Resolves when the sender is dropped: `stop_in_flight`, or the driver going away.
                let _ = cancelled.await;
            };
            worker.run_sync_until(id, cancelled).await
        });
        // If this future is dropped here (an abort), the task keeps running until `drain`
        // cancels it and waits for it.
        let flight = self.in_flight.insert(InFlight { cancel, task });
        let joined = (&mut flight.task).await;
        self.in_flight = None;
        let r = joined
            .map_err(|e| DriverError::new(format!("the sync task ended abnormally: {e}")))?
            .map_err(err)?;
        Ok((None, report(&r, &sync)))
    }

    async fn verify(
        &mut self,
        _sync: SyncRef,
        _checksums: Vec<RunChecksum>,
    ) -> Result<WorkerReport, DriverError> {
        Err(DriverError::new("trainers do not verify"))
    }

    async fn finish(&mut self, _sync: SyncRef, _outcome: Outcome) {}

    async fn drain(&mut self) {
        self.stop_in_flight().await;
        // Whatever the stopped sync posted and was not acknowledged is discarded here.
        self.fabric.reset_connections().await;
        tracing::info!(
            "{}: drained (sync stopped, fabric lanes reset)",
            WorkerId::trainer(self.cfg.rank)
        );
    }
}
