//! The rollout driver: `weightsync_worker::RolloutWorker` behind the agent.
//!
//! It computes its own inference layout from the job at start-up, allocates and registers its
//! tensors once, and registers with their descriptors. Per sync: `Prepare N` arms the immediate
//! counters (before any trainer writes) and opens the fabric's write window (its answer goes out
//! only once the window is in force), then it waits until every expected write landed and closes
//! the window (a TCP receiver refuses and counts writes outside it, a verbs receiver's NIC
//! refuses them, so bytes sent while the engine serves never reach its tensors; with verbs the
//! close costs one firmware command per inbound queue pair, so it runs on the blocking pool while
//! the landing report travels, and `Verify`, `Commit` and the next `Prepare` wait for it), then
//! `Verify`
//! applies the trainers' deltas (into the tensors, from the delta inbox it registered on its first
//! assignment when the job sends deltas: see `weightsync_worker::delta`) and checks the trainers'
//! checksums against what the tensors then hold. A program that wants more (the
//! CLI's demo recomputes every byte from its seed) wraps this driver in its own
//! [`SyncDriver`] and reads the landed tensors through [`RolloutDriver::worker`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use weightsync_common::fabric::{Fabric, FabricBackend, FabricConfig, WriteWindow};
use weightsync_common::protocol::{
    Assignment, DeltaFigures, DeltaRecord, RunChecksum, Stage, TensorMeta, TimelineEvent,
    WHOLE_SYNC, WorkerId, WorkerReport, WorldSpec,
};
use weightsync_schedules::table::RolloutPlan;
use weightsync_worker::RolloutWorker;
use weightsync_worker::SyncId;

use crate::driver::{Accepted, DriverError, DriverInfo, Outcome, SyncDriver, SyncRef};
use crate::trainer::blob;
use weightsync_schedules::job::{self, rollout_layout};

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
}

/// Drives a [`RolloutWorker`].
#[derive(Debug)]
pub struct RolloutDriver {
    cfg: RolloutDriverConfig,
    fabric: Fabric,
    worker: Arc<RolloutWorker<Fabric>>,
    bytes: u64,
    /// The inbox's share of the tensors' bytes (0: no inbox, never deltas).
    inbox_fraction: f64,
    /// The write window's close after a landing, still running (see [`RolloutDriver::closed`]).
    closing: Option<tokio::task::JoinHandle<()>>,
}

/// The share of an engine's bytes its delta inbox takes by default: a run whose encoding is
/// larger than its share of the inbox goes dense, and the trainers send a run as a delta only
/// when its encoding is at most half its bytes anyway.
pub const DEFAULT_INBOX_FRACTION: f64 = 0.25;

fn ns_since(t: Instant, since: Instant) -> u64 {
    t.saturating_duration_since(since).as_nanos() as u64
}

impl RolloutDriver {
    /// A driver over a receiver already built (an engine's own tensors, see
    /// `RolloutWorker::with_regions`) on `fabric`.
    pub fn over(
        cfg: RolloutDriverConfig,
        fabric: Fabric,
        worker: RolloutWorker<Fabric>,
    ) -> RolloutDriver {
        let bytes = worker.layout().iter().map(|t| t.len).sum();
        fabric.set_write_window(WriteWindow::Closed);
        RolloutDriver {
            cfg,
            fabric,
            worker: Arc::new(worker),
            bytes,
            inbox_fraction: DEFAULT_INBOX_FRACTION,
            closing: None,
        }
    }

    /// Registers no delta inbox: every sync writes every byte to this engine (`0.0`), or an
    /// inbox of another share of its bytes.
    pub fn set_inbox_fraction(&mut self, fraction: f64) {
        self.inbox_fraction = fraction.clamp(0.0, 1.0);
    }

    /// Lays out its tensors from the inference layout, allocates and registers them.
    pub async fn new(cfg: RolloutDriverConfig) -> Result<RolloutDriver, DriverError> {
        let fabric = Fabric::start(&cfg.fabric).await?;
        let config_text = cfg
            .world
            .read_model_config()
            .map_err(|e| DriverError::layout(e.to_string()))?;
        let (_, infer) = job::inference_layout(&cfg.world, config_text.as_deref())?;
        let layout = rollout_layout(&infer, cfg.rank)?;
        let bytes = layout.tensors.iter().map(|t| t.len).sum();
        fabric.set_write_window(WriteWindow::Closed);
        let worker = RolloutWorker::new(
            fabric.clone(),
            WorkerId::rollout(cfg.rank).to_string(),
            layout,
        )?;
        Ok(RolloutDriver {
            cfg,
            fabric,
            worker: Arc::new(worker),
            bytes,
            inbox_fraction: DEFAULT_INBOX_FRACTION,
            closing: None,
        })
    }

    /// The rollout's tensors as they are now (for checks).
    pub fn worker(&self) -> &RolloutWorker<Fabric> {
        &self.worker
    }

    /// Waits until a close started after a landing is in force. Kept until it finished, so a
    /// caller cancelled while waiting leaves it for the next one: a close never runs after the
    /// next sync's arm.
    async fn closed(&mut self) {
        if let Some(closing) = self.closing.as_mut() {
            if let Err(e) = closing.await {
                tracing::warn!(error = %e, "closing the write window ended abnormally");
            }
            self.closing = None;
        }
    }
}

/// Sets `fabric`'s write window on the blocking pool (with verbs, one firmware command per
/// inbound queue pair) and returns once it is in force.
async fn set_window(fabric: &Fabric, window: WriteWindow) -> Result<(), DriverError> {
    let fabric = fabric.clone();
    tokio::task::spawn_blocking(move || fabric.set_write_window(window))
        .await
        .map_err(|e| DriverError::other(format!("setting the write window ended abnormally: {e}")))
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
                    source: None,
                })
                .collect(),
            placement: self.worker.placement().map(blob),
            skip: Vec::new(),
        }
    }

    async fn assign(&mut self, a: Assignment) -> Result<Accepted, DriverError> {
        let Assignment::Rollout {
            expected, delta, ..
        } = a
        else {
            return Err(DriverError::other("a rollout got a trainer's assignment"));
        };
        let plan: RolloutPlan = bincode::deserialize(&expected.0)
            .map_err(|e| DriverError::other(format!("undecodable expectations: {e}")))?;
        let worker = Arc::get_mut(&mut self.worker)
            .ok_or_else(|| DriverError::other("expectations cannot change while a check runs"))?;
        worker.set_expectations(plan)?;
        // An inbox only where the job sends deltas, and they are checked like full writes: only
        // with verification on. (Not into device memory: what landed was copied there already.)
        if delta
            && self.cfg.world.verify
            && self.inbox_fraction > 0.0
            && worker.can_apply_deltas()
            && worker.inbox_descriptor().is_none()
        {
            let bytes = weightsync_worker::delta::inbox_bytes(self.bytes, self.inbox_fraction);
            worker.enable_delta_inbox(bytes)?;
        }
        // Its regions and tensors went with the registration; its inbox goes with `Ready`.
        Ok(Accepted {
            regions: worker.inbox_descriptor().iter().map(blob).collect(),
            tensors: Vec::new(),
        })
    }

    async fn prepare(&mut self, sync: SyncRef) -> Result<WorkerReport, DriverError> {
        let start = Instant::now();
        self.closed().await;
        // A previous sync that was never finished (controller lost) must not stay armed.
        let _ = self.worker.abort();
        self.worker.arm(SyncId {
            version: sync.version,
            epoch: sync.sync_id,
        })?;
        // Only this sync's frames (stamped with its id by the trainers) land until it ends; in
        // force before `Prepared` goes out, so before any trainer is told to write.
        set_window(
            &self.fabric,
            WriteWindow::Armed {
                epoch: sync.sync_id,
            },
        )
        .await?;
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
        let landed = self.worker.await_landed(self.cfg.land_timeout).await;
        // Landed or not, nothing more may be written until the next sync arms. Every expected
        // immediate was counted, so every byte of this sync landed: the close refuses only
        // writes nobody waits for. It runs while the landing report travels; `verify` waits.
        self.closed().await;
        let fabric = self.fabric.clone();
        self.closing = Some(tokio::task::spawn_blocking(move || {
            fabric.set_write_window(WriteWindow::Closed)
        }));
        let landed = landed?;
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
                ..Default::default()
            },
        ))
    }

    async fn apply_deltas(
        &mut self,
        _sync: SyncRef,
        deltas: Vec<DeltaRecord>,
    ) -> Result<DeltaFigures, DriverError> {
        // The inbox is read once nothing more can be written into it.
        self.closed().await;
        let worker = self.worker.clone();
        tokio::task::spawn_blocking(move || worker.apply_deltas(&deltas))
            .await
            .map_err(|e| DriverError::other(format!("the delta apply ended abnormally: {e}")))?
            .map_err(DriverError::from)
    }

    async fn verify(
        &mut self,
        sync: SyncRef,
        checksums: Vec<RunChecksum>,
    ) -> Result<WorkerReport, DriverError> {
        // The bytes checked are the bytes served: nothing can be written once the close is in.
        self.closed().await;
        let start = Instant::now();
        let worker = self.worker.clone();
        let version = sync.version;
        let checked = tokio::task::spawn_blocking(move || -> Result<u64, DriverError> {
            let v = worker.verify(&checksums)?;
            tracing::debug!(
                "version {version}: {} bytes verified, {} of them hashed while they landed",
                v.bytes,
                v.early_bytes
            );
            Ok(v.bytes)
        })
        .await
        .map_err(|e| {
            DriverError::other(format!("the verification task ended abnormally: {e}"))
        })??;
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
        self.closed().await;
        if let Err(e) = set_window(&self.fabric, WriteWindow::Closed).await {
            tracing::warn!(error = %e, "closing the write window");
        }
        if outcome == Outcome::Aborted {
            let _ = self.worker.abort();
        }
    }
}
