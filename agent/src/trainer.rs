//! The trainer driver: a `weightsync_worker::TrainerWorker` behind the agent.
//!
//! It plans nothing: the controller's assignment carries this rank's compact slice of the routing
//! table ([`TrainerSlice`]), which it expands into the explicit plan it executes (checked and
//! bounded: a slice is not trusted). Until then it holds only its fabric endpoint, which it
//! registers with. On `Assign` it attaches its source (the slice says the arena's size),
//! builds the worker (registering the staging arena and, when fp8 blocks straddle shards, the
//! gather arena whose size only the slice knows) and answers `Ready` with the gather arena's
//! descriptor; a re-plan with the same slice keeps what it built. On `Peers` it learns where
//! every write of the expanded plan goes (relocated into the engine's own regions for a rollout
//! that registered a placement).
//!
//! Deltas: when its assignment says the job sends them ([`Assignment::delta`], off by default)
//! and verification is on, the worker keeps its bases (the prepared bytes it last wrote) unless
//! [`TrainerDriver::full_syncs_only`] said not to, and a `Start` naming engines that take deltas
//! runs a delta sync for them (see `weightsync_worker::delta`).
//! Versions are bound to bytes for an embedded trainer: the embedding records in a
//! [`HoldingSlot`] which `(run, version)` its tensors hold (what it pushed), and `Prepare N` fails
//! when they hold a newer pushed version, naming both (a newer N than pushed is an outside
//! driver's `POST /v1/syncs`, which moves whatever the tensors hold); after the last byte of the
//! pushed version was read, the embedding's check says whether any registered tensor was written
//! meanwhile (an optimizer step during the sync), and a sync that saw a write fails naming the
//! tensor (`FailureKind::Modified`).
//!
//! Each sync runs in its own task, so that an abort can cancel it and wait until it has stopped
//! posting; draining then resets the fabric's lanes, discarding whatever of the aborted sync is
//! still queued (after a partition heals, TCP would otherwise deliver it during the next sync).

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;
use weightsync_common::fabric::{Fabric, FabricBackend, FabricConfig, RegionDescriptor};
use weightsync_common::protocol::{
    Assignment, Blob, DeltaBase, FailureKind, PeerInfo, RunChecksum, TensorMeta, WorkerId,
    WorkerReport, WorkerRole, WorldSpec,
};
use weightsync_schedules::TrainerSlice;
use weightsync_schedules::table::TrainerPlan;
use weightsync_worker::{
    DeltaSync, Destinations, SyncId, SyncReport, TrainerConfig, TrainerWorker, WorkerError,
};

use crate::driver::{Accepted, DriverError, DriverInfo, Outcome, SyncDriver, SyncRef};
pub use crate::source::{ProvideSource, SourceSpec};

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
    /// What the last assignment built (`None` before the first).
    built: Option<Built>,
    /// The sync whose task is running (kept when the agent drops `run` on an abort).
    in_flight: Option<InFlight>,
    /// Where the last sync's report is kept for an embedding (see [`TrainerDriver::keep_reports`]).
    reports: Option<ReportSlot>,
    /// The shards it registers with (a declared model's declarations; see
    /// [`TrainerDriver::declare`]); empty otherwise.
    declared: Vec<TensorMeta>,
    /// Never keep bases: every sync is full (see [`TrainerDriver::full_syncs_only`]).
    full_only: bool,
    /// The engines taking deltas in the sync about to run (from its `Start`).
    delta: Option<DeltaBase>,
    /// What an embedding's tensors hold (see [`TrainerDriver::hold`]); `None`: a sidecar, whose
    /// source is made to hold the version by other means.
    holding: Option<HoldingSlot>,
}

/// The last sync's version and report, for an embedding that reports it when the sync commits.
pub type ReportSlot = Arc<parking_lot::Mutex<Option<(u64, SyncReport)>>>;

/// Names a registered tensor written since the version was pushed, if one was (the embedding
/// knows how: torch's `tensor._version`, a generation counter).
pub type WriteCheck = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// What an embedding's tensors hold, shared between it and the driver.
#[derive(Default)]
pub struct Holding {
    /// The `(run, version)` the tensors hold: the last one pushed.
    pub held: Option<(u64, u64)>,
    /// The `(run, version)` whose sync this trainer is preparing or running.
    pub syncing: Option<(u64, u64)>,
    /// The check of the last push, run once the sync read every byte.
    pub unchanged: Option<WriteCheck>,
}

impl std::fmt::Debug for Holding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holding")
            .field("held", &self.held)
            .field("syncing", &self.syncing)
            .finish_non_exhaustive()
    }
}

/// A [`Holding`] shared between an embedding and its driver.
pub type HoldingSlot = Arc<parking_lot::Mutex<Holding>>;

/// The worker built for one slice.
#[derive(Debug)]
struct Built {
    /// The slice it was built from (a re-plan sending the same one keeps what was built).
    slice: TrainerSlice,
    /// Whether the job sends deltas ([`Assignment::delta`]): the worker keeps bases.
    delta: bool,
    worker: Arc<TrainerWorker<Fabric>>,
}

/// A sync running in its own task.
#[derive(Debug)]
struct InFlight {
    /// Dropping it cancels the sync.
    cancel: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<SyncReport, WorkerError>>,
}

/// Encodes a fabric value for the control channel.
pub fn blob<T: serde::Serialize>(v: &T) -> Blob {
    Blob(bincode::serialize(v).unwrap_or_default())
}

/// The shards a plan says this rank holds, for the dashboard, each as the box it is of its
/// parameter (so that they are also this rank's declarations of a declared model, which a
/// re-plan reads from the registration they replace).
fn shard_tensors(plan: &TrainerPlan) -> Vec<TensorMeta> {
    let dims = |d: &[u32]| d.iter().map(|&d| u64::from(d)).collect::<Vec<u64>>();
    plan.shards
        .iter()
        .map(|s| {
            let n = s.global.ndim as usize;
            let param = plan.params.get(s.param as usize);
            TensorMeta {
                name: param.map_or_else(String::new, |p| p.name.to_string()),
                shape: dims(&s.global.len[..n]),
                dtype: s.dtype,
                bytes: s.bytes(),
                global_shape: param.map_or_else(Vec::new, |p| dims(p.shape.dims())),
                offset: dims(&s.global.start[..n]),
                source: None,
            }
        })
        .collect()
}

fn report(r: &SyncReport, sync: &SyncRef) -> WorkerReport {
    WorkerReport {
        bytes: r.bytes_written,
        writes: r.writes_posted,
        peak_staging_bytes: r.peak_staging_bytes,
        staged_bytes: r.staged_bytes,
        direct_bytes: r.direct_bytes,
        events: r.timeline.relative_to(sync.reference_unix_ns),
        checksums: r.checksums.clone(),
        split: r.split,
        deltas: r.deltas.clone(),
        delta: r.delta,
    }
}

/// Where every write of the plan goes: this trainer's own gather arena and the peers'.
fn destinations(
    me: u32,
    own_gather: Option<RegionDescriptor>,
    peers: Vec<PeerInfo>,
) -> Result<Destinations, DriverError> {
    let mut dsts = Destinations::default();
    if let Some(g) = own_gather {
        dsts.trainers.insert(me, g);
    }
    for p in peers {
        let regions = p
            .regions
            .iter()
            .map(|b| bincode::deserialize::<RegionDescriptor>(&b.0))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| DriverError::other(format!("{}: undecodable region: {e}", p.id)))?;
        match p.id.role {
            WorkerRole::Rollout => {
                if let Some(b) = &p.placement {
                    let placement = bincode::deserialize(&b.0).map_err(|e| {
                        DriverError::other(format!("{}: undecodable placement: {e}", p.id))
                    })?;
                    dsts.placements.insert(p.id.rank, placement);
                }
                if let Some(b) = &p.inbox {
                    let inbox = bincode::deserialize(&b.0).map_err(|e| {
                        DriverError::other(format!("{}: undecodable delta inbox: {e}", p.id))
                    })?;
                    dsts.inboxes.insert(p.id.rank, inbox);
                }
                dsts.rollouts.insert(p.id.rank, regions);
            }
            WorkerRole::Trainer => {
                if let Some(g) = regions.into_iter().next() {
                    dsts.trainers.insert(p.id.rank, g);
                }
            }
        }
    }
    Ok(dsts)
}

impl TrainerDriver {
    /// Starts the fabric. Nothing else is known before the assignment.
    pub async fn new(cfg: TrainerDriverConfig) -> Result<TrainerDriver, DriverError> {
        let fabric = Fabric::start(&cfg.fabric).await?;
        Ok(TrainerDriver::with_fabric(cfg, fabric))
    }

    /// A driver over a fabric already started (the one its source tensors are registered with).
    pub fn with_fabric(cfg: TrainerDriverConfig, fabric: Fabric) -> TrainerDriver {
        TrainerDriver {
            cfg,
            fabric,
            built: None,
            in_flight: None,
            reports: None,
            declared: Vec::new(),
            full_only: false,
            delta: None,
            holding: None,
        }
    }

    /// Binds syncs to what the embedding pushed: `Prepare N` fails when `slot` says the tensors
    /// hold a newer version, and a sync whose check finds a tensor written fails naming it.
    pub fn hold(&mut self) -> HoldingSlot {
        self.holding.get_or_insert_with(Default::default).clone()
    }

    /// Whether the tensors hold `sync`'s version (always, without an embedding); marks it
    /// syncing.
    fn check_held(&self, sync: &SyncRef) -> Result<(), DriverError> {
        let Some(slot) = &self.holding else {
            return Ok(());
        };
        let mut h = slot.lock();
        let want = (sync.run, sync.version);
        // A newer version than it pushed is an outside driver's trigger (`POST /v1/syncs`
        // moves whatever the tensors hold); an older one would label newer bytes (a trainer
        // that ran ahead): refused.
        if let Some((r, v)) = h.held
            && want < (r, v)
        {
            return Err(DriverError::new(
                FailureKind::Source,
                format!(
                    "{} was asked for version {} of run {} but its tensors hold version {v} of \
                     run {r}, pushed since (a version is synced only while its trainers hold it)",
                    WorkerId::trainer(self.cfg.rank),
                    sync.version,
                    sync.run
                ),
            ));
        }
        h.syncing = Some(want);
        Ok(())
    }

    /// After the sync read every byte: a tensor written since the push fails it.
    fn check_unchanged(&self, sync: &SyncRef) -> Result<(), DriverError> {
        let Some(slot) = &self.holding else {
            return Ok(());
        };
        // The check compares with the pushed version's bytes: only that version's sync uses it.
        let check = {
            let h = slot.lock();
            h.unchanged
                .clone()
                .filter(|_| h.held == Some((sync.run, sync.version)))
        };
        if let Some(tensor) = check.and_then(|c| c()) {
            return Err(DriverError {
                kind: FailureKind::Modified,
                cause: format!(
                    "tensor {tensor} was written while version {} was being sent (an optimizer \
                     step during the sync?): what was sent mixes two versions",
                    sync.version
                ),
                tensor: Some(tensor),
            });
        }
        Ok(())
    }

    /// The sync ended here: the tensors may change again.
    fn release(&self) {
        if let Some(slot) = &self.holding {
            slot.lock().syncing = None;
        }
    }

    /// Keeps no bases, so every sync writes every byte (and copies of registered sources go
    /// straight from them): the switch that forces full syncs on this trainer.
    pub fn full_syncs_only(&mut self) {
        self.full_only = true;
    }

    /// Registers with `tensors` as this rank's declarations: the shards it holds of a declared
    /// model (each a box of its parameter, see `weightsync_schedules::declared`), which the
    /// controller plans from.
    pub fn declare(&mut self, tensors: Vec<TensorMeta>) {
        self.declared = tensors;
    }

    /// Keeps each successful sync's report in the returned slot (before `Written` is sent).
    pub fn keep_reports(&mut self) -> ReportSlot {
        self.reports.get_or_insert_with(Default::default).clone()
    }

    /// The plan this trainer executes, its slice expanded (`None` before its first assignment).
    pub fn plan(&self) -> Option<&TrainerPlan> {
        self.built.as_ref().map(|b| b.worker.plan())
    }

    fn built(&self) -> Result<&Built, DriverError> {
        self.built
            .as_ref()
            .ok_or_else(|| DriverError::other("no assignment yet: the controller sent none"))
    }

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

    /// Expands `slice`, attaches the source for its plan and builds the worker (registering its
    /// arenas).
    fn build(&self, slice: TrainerSlice, delta: bool) -> Result<Built, DriverError> {
        let started = Instant::now();
        let plan = slice
            .expand()
            .map_err(|e| DriverError::layout(format!("the plan slice does not expand: {e}")))?;
        tracing::info!(
            "trainer {}: slice expanded to {} tasks, {} writes in {:.3} s",
            self.cfg.rank,
            plan.tasks.len(),
            plan.writes.len(),
            started.elapsed().as_secs_f64()
        );
        let started = Instant::now();
        let source = self.cfg.source.attach(&plan)?;
        let attached = started.elapsed();
        let name = WorkerId::trainer(self.cfg.rank).to_string();
        let mut tc = TrainerConfig::new(name.clone(), self.cfg.watermark_bytes);
        tc.verify = self.cfg.world.verify;
        // Deltas only where the job sends them, and they are checked like full writes: only
        // with verification on.
        tc.delta.keep_bases = delta && tc.verify && !self.full_only;
        let (tasks, gather) = (plan.tasks.len(), plan.gather_arena_bytes);
        let worker = TrainerWorker::new(self.fabric.clone(), source, plan, tc)?;
        tracing::info!(
            "{name}: source attached in {:.3} s; worker built for {tasks} tasks in {} pieces \
             (staging {} B, gather arena {gather} B) in {:.3} s",
            attached.as_secs_f64(),
            worker.pieces(),
            self.cfg.watermark_bytes,
            (started.elapsed() - attached).as_secs_f64()
        );
        Ok(Built {
            slice,
            delta,
            worker: Arc::new(worker),
        })
    }
}

impl SyncDriver for TrainerDriver {
    fn info(&self) -> DriverInfo {
        DriverInfo {
            fabric_endpoint: blob(self.fabric.endpoint()),
            regions: Vec::new(),
            tensors: self.declared.clone(),
            placement: None,
            skip: Vec::new(),
        }
    }

    async fn assign(&mut self, a: Assignment) -> Result<Accepted, DriverError> {
        let Assignment::Trainer { slice, delta, .. } = a else {
            return Err(DriverError::other("a trainer got a rollout's assignment"));
        };
        let slice = TrainerSlice::from_bincode(&slice.0)
            .map_err(|e| DriverError::other(format!("undecodable plan slice: {e}")))?;
        if slice.rank != self.cfg.rank {
            return Err(DriverError::layout(format!(
                "the slice is training rank {}'s, this is rank {}",
                slice.rank, self.cfg.rank
            )));
        }
        self.stop_in_flight().await;
        if self.built.as_ref().map(|b| (&b.slice, b.delta)) != Some((&slice, delta)) {
            // Release the old arenas before registering new ones.
            self.built = None;
            self.built = Some(self.build(slice, delta)?);
        }
        let worker = &self.built()?.worker;
        Ok(Accepted {
            regions: worker.gather_descriptor().iter().map(blob).collect(),
            tensors: shard_tensors(worker.plan()),
        })
    }

    async fn peers(&mut self, _plan_id: u64, peers: Vec<PeerInfo>) -> Result<(), DriverError> {
        self.stop_in_flight().await;
        let me = self.cfg.rank;
        let built = self
            .built
            .as_mut()
            .ok_or_else(|| DriverError::other("peers before any assignment"))?;
        let dsts = destinations(me, built.worker.gather_descriptor(), peers)?;
        Arc::get_mut(&mut built.worker)
            .ok_or_else(|| DriverError::other("destinations cannot change while a sync runs"))?
            .set_destinations(&dsts)
            .map_err(DriverError::from)
    }

    async fn prepare(&mut self, sync: SyncRef) -> Result<WorkerReport, DriverError> {
        // The source holds the version already: the training step wrote it before the push.
        self.built()?;
        self.check_held(&sync)?;
        Ok(WorkerReport::default())
    }

    async fn run(&mut self, sync: SyncRef) -> Result<(Option<bool>, WorkerReport), DriverError> {
        self.stop_in_flight().await;
        let worker = self.built()?.worker.clone();
        // Every frame of this sync names it: a guarded receiver lands it only while this very
        // sync is armed there (never a late frame of an earlier one).
        self.fabric.set_send_epoch(sync.sync_id);
        let (cancel, cancelled) = oneshot::channel::<()>();
        let id = SyncId {
            version: sync.version,
            epoch: sync.sync_id,
        };
        let delta = self.delta.take().map(|d| DeltaSync {
            base_version: d.base_version,
            rollouts: d.rollouts,
        });
        let task = tokio::spawn(async move {
            let cancelled = async move {
                // Resolves when the sender is dropped: `stop_in_flight`, or the driver going away.
                let _ = cancelled.await;
            };
            match delta {
                Some(d) => worker.run_delta_sync_until(id, &d, cancelled).await,
                None => worker.run_sync_until(id, cancelled).await,
            }
        });
        // If this future is dropped here (an abort), the task keeps running until `drain`
        // cancels it and waits for it.
        let flight = self.in_flight.insert(InFlight { cancel, task });
        let joined = (&mut flight.task).await;
        self.in_flight = None;
        let r = joined
            .map_err(|e| DriverError::other(format!("the sync task ended abnormally: {e}")))??;
        self.check_unchanged(&sync)?;
        let rep = report(&r, &sync);
        if let Some(slot) = &self.reports {
            *slot.lock() = Some((sync.version, r));
        }
        Ok((None, rep))
    }

    fn delta_start(&mut self, delta: Option<DeltaBase>) {
        self.delta = delta;
    }

    async fn verify(
        &mut self,
        _sync: SyncRef,
        _checksums: Vec<RunChecksum>,
    ) -> Result<WorkerReport, DriverError> {
        Err(DriverError::other("trainers do not verify"))
    }

    async fn finish(&mut self, _sync: SyncRef, _outcome: Outcome) {
        self.release();
    }

    async fn drain(&mut self) {
        self.stop_in_flight().await;
        self.release();
        // Whatever the stopped sync posted and was not acknowledged is discarded here.
        self.fabric.reset_connections().await;
        tracing::info!(
            "{}: drained (sync stopped, fabric lanes reset)",
            WorkerId::trainer(self.cfg.rank)
        );
    }
}
