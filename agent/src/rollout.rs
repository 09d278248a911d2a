//! The rollout driver: `weightsync_worker::RolloutWorker` behind the agent.
//!
//! It computes its own inference layout from the job at start-up, allocates and registers its
//! tensors once, and registers with their descriptors. Per sync: `Prepare N` arms the immediate
//! counters (before any trainer writes), then it waits until every expected write landed, then
//! `Verify` checks the trainers' checksums against what landed. In the demo it also recomputes
//! every tensor independently from the seed and compares every byte
//! ([`super::demo_weights`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use weightsync_common::fabric::{Fabric, FabricBackend, FabricConfig};
use weightsync_common::protocol::{
    Assignment, RunChecksum, Stage, TensorMeta, TimelineEvent, WorkerId, WorkerReport, WorldSpec,
    WHOLE_SYNC,
};
use weightsync_schedules::table::RolloutPlan;
use weightsync_worker::RolloutWorker;
use weightsync_worker::SyncId;

use crate::demo_weights::expected_rollout;
use crate::driver::{Accepted, DriverError, DriverInfo, Outcome, SyncDriver, SyncRef};
use crate::trainer::blob;
use weightsync_schedules::job::{self, rollout_layout};
use weightsync_schedules::{InferenceLayout, Model};

/// Settings of a rollout driver.
#[derive(Debug, Clone)]
pub struct RolloutDriverConfig {
    /// The job.
    pub world: WorldSpec,
    /// Global inference rank.
    pub rank: u32,
    /// Fabric settings.
    pub fabric: FabricConfig,
    /// How long to wait for a version to land once armed.
    pub land_timeout: Duration,
    /// Demo: recompute every tensor from this seed after verifying, and compare every byte.
    pub demo_check_seed: Option<u64>,
}

/// Drives a [`RolloutWorker`].
#[derive(Debug)]
pub struct RolloutDriver {
    cfg: RolloutDriverConfig,
    fabric: Fabric,
    worker: Arc<RolloutWorker<Fabric>>,
    /// The demo's independent recomputation needs the model and the layout's placements.
    demo: Option<Arc<(Model, InferenceLayout)>>,
    bytes: u64,
}

fn err(e: impl std::fmt::Display) -> DriverError {
    DriverError::new(e.to_string())
}

fn ns_since(t: Instant, since: Instant) -> u64 {
    t.saturating_duration_since(since).as_nanos() as u64
}

impl RolloutDriver {
    /// A driver over a receiver already built (an engine's own tensors, see
    /// `RolloutWorker::with_regions`) on `fabric`. No demo check.
    pub fn over(
        cfg: RolloutDriverConfig,
        fabric: Fabric,
        worker: RolloutWorker<Fabric>,
    ) -> RolloutDriver {
        let bytes = worker.layout().iter().map(|t| t.len).sum();
        RolloutDriver {
            cfg,
            fabric,
            worker: Arc::new(worker),
            demo: None,
            bytes,
        }
    }

    /// Lays out its tensors from the inference layout, allocates and registers them.
    pub async fn new(cfg: RolloutDriverConfig) -> Result<RolloutDriver, DriverError> {
        let fabric = Fabric::start(&cfg.fabric).await.map_err(err)?;
        let config_text = cfg.world.read_model_config().map_err(err)?;
        let (model, infer) =
            job::inference_layout(&cfg.world, config_text.as_deref()).map_err(err)?;
        let layout = rollout_layout(&infer, cfg.rank).map_err(err)?;
        let bytes = layout.tensors.iter().map(|t| t.len).sum();
        let worker = RolloutWorker::new(
            fabric.clone(),
            WorkerId::rollout(cfg.rank).to_string(),
            layout,
        )
        .map_err(err)?;
        let demo = cfg.demo_check_seed.map(|_| Arc::new((model, infer)));
        Ok(RolloutDriver {
            cfg,
            fabric,
            worker: Arc::new(worker),
            demo,
            bytes,
        })
    }

    /// The rollout's tensors as they are now (for checks).
    pub fn worker(&self) -> &RolloutWorker<Fabric> {
        &self.worker
    }
}

impl SyncDriver for RolloutDriver {
    fn info(&self) -> DriverInfo {
        DriverInfo {
            fabric_endpoint: blob(self.fabric.endpoint()),
            regions: self.worker.descriptors().iter().map(blob).collect(),
            tensors: self
                .worker
                .layout()
                .iter()
                .map(|t| TensorMeta {
                    name: t.name.clone(),
                    shape: t.shape.dims().iter().map(|&d| u64::from(d)).collect(),
                    dtype: t.dtype,
                    bytes: t.len,
                    global_shape: Vec::new(),
                    offset: Vec::new(),
                })
                .collect(),
            placement: self.worker.placement().map(blob),
            skip: Vec::new(),
        }
    }

    async fn assign(&mut self, a: Assignment) -> Result<Accepted, DriverError> {
        let Assignment::Rollout { expected, .. } = a else {
            return Err(DriverError::new("a rollout got a trainer's assignment"));
        };
        let plan: RolloutPlan = bincode::deserialize(&expected.0)
            .map_err(|e| DriverError::new(format!("undecodable expectations: {e}")))?;
        Arc::get_mut(&mut self.worker)
            .ok_or_else(|| DriverError::new("expectations cannot change while a check runs"))?
            .set_expectations(plan)
            .map_err(err)?;
        // Its regions and tensors went with the registration.
        Ok(Accepted::default())
    }

    async fn prepare(&mut self, sync: SyncRef) -> Result<WorkerReport, DriverError> {
        let start = Instant::now();
        // A previous sync that was never finished (controller lost) must not stay armed.
        let _ = self.worker.abort();
        self.worker
            .arm(SyncId {
                version: sync.version,
                epoch: sync.sync_id,
            })
            .map_err(err)?;
        Ok(WorkerReport {
            events: vec![TimelineEvent {
                task: WHOLE_SYNC,
                piece: 0,
                stage: Stage::Arm,
                start_ns: ns_since(start, sync.reference),
                end_ns: ns_since(Instant::now(), sync.reference),
                bytes: 0,
            }],
            ..Default::default()
        })
    }

    async fn run(&mut self, sync: SyncRef) -> Result<(Option<bool>, WorkerReport), DriverError> {
        let landed = self
            .worker
            .await_landed(self.cfg.land_timeout)
            .await
            .map_err(err)?;
        let mut evs = landed.timeline.relative_to(sync.reference_unix_ns);
        for e in &mut evs {
            if e.stage == Stage::Barrier {
                e.stage = Stage::Land;
                e.bytes = self.bytes;
            }
        }
        Ok((
            None,
            WorkerReport {
                bytes: self.bytes,
                writes: landed.writes,
                peak_staging_bytes: 0,
                staged_bytes: 0,
                direct_bytes: 0,
                split: Default::default(),
                events: evs,
                checksums: Vec::new(),
            },
        ))
    }

    async fn verify(
        &mut self,
        sync: SyncRef,
        checksums: Vec<RunChecksum>,
    ) -> Result<WorkerReport, DriverError> {
        let start = Instant::now();
        let worker = self.worker.clone();
        let demo = self.demo.clone();
        let (rank, seed) = (self.cfg.rank, self.cfg.demo_check_seed);
        let version = sync.version;
        let checked = tokio::task::spawn_blocking(move || -> Result<u64, DriverError> {
            let v = worker.verify(&checksums).map_err(|e| {
                let tensor = match &e {
                    weightsync_worker::WorkerError::ChecksumMismatch { tensors, .. } => {
                        Some(tensors.clone())
                    }
                    _ => None,
                };
                DriverError {
                    tensor,
                    cause: e.to_string(),
                }
            })?;
            tracing::debug!(
                "version {version}: {} bytes verified, {} of them hashed while they landed",
                v.bytes,
                v.early_bytes
            );
            if let (Some(seed), Some(demo)) = (seed, demo) {
                let (model, infer) = &*demo;
                independent_check(&worker, model, infer, rank, seed, version)?;
            }
            Ok(v.bytes)
        })
        .await
        .map_err(err)??;
        Ok(WorkerReport {
            events: vec![TimelineEvent {
                task: WHOLE_SYNC,
                piece: 0,
                stage: Stage::Verify,
                start_ns: ns_since(start, sync.reference),
                end_ns: ns_since(Instant::now(), sync.reference),
                bytes: checked,
            }],
            ..Default::default()
        })
    }

    async fn finish(&mut self, _sync: SyncRef, outcome: Outcome) {
        if outcome == Outcome::Aborted {
            let _ = self.worker.abort();
        }
    }
}

/// Compares every tensor with an independent recomputation from the demo seed.
fn independent_check(
    worker: &RolloutWorker<Fabric>,
    model: &Model,
    infer: &InferenceLayout,
    rank: u32,
    seed: u64,
    version: u64,
) -> Result<(), DriverError> {
    let expected = expected_rollout(model, infer, rank, seed, version);
    for t in worker.layout() {
        let got = worker.read_tensor(&t.name).map_err(err)?;
        let want = expected
            .get(t.mr as usize)
            .and_then(|m| m.get(t.offset as usize..(t.offset + t.len) as usize))
            .ok_or_else(|| DriverError::new(format!("no expected bytes for {}", t.name)))?;
        if got != want {
            let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            return Err(DriverError {
                tensor: Some(t.name.clone()),
                cause: format!(
                    "independent recomputation differs at byte {at} of {} (landed {:#04x}, expected {:#04x})",
                    t.name,
                    got.get(at).copied().unwrap_or(0),
                    want.get(at).copied().unwrap_or(0)
                ),
            });
        }
    }
    Ok(())
}
