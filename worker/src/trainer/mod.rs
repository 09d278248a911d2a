//! The trainer worker: pushes one version of its weights per sync, every stage busy at once.
//!
//! A trainer worker is a sidecar of one training rank. It is built once with its slice of the
//! routing table ([`TrainerPlan`]) and its source memory, registers its staging arena (exactly
//! `watermark` bytes) and, when fp8 blocks straddle shards, its gather arena, and checks the
//! whole plan against the source (lengths, dtypes, the watermark) so that bad input is refused
//! before any byte is written. Then, per sync ([`TrainerWorker::run_sync`]), it runs its tasks'
//! pieces through four overlapping stages (see [`pipeline`]): H2D, prepare, WRITE and the
//! per-worker half of the barrier (every write acknowledged by its destination).
//!
//! # Layout
//! - [`piece`]: cutting tasks into watermark-sized pieces, mapping writes onto them.
//! - [`direct`]: which tasks are written straight from registered source memory (zero copy).
//! - [`stages`]: the H2D ("source to staging") and prepare work of one piece, described as data
//!   for a source in device memory to run ([`DeviceStages`], beside the sources).
//! - [`staging`]: the registered staging arena and its leases.
//! - [`pipeline`]: the scheduler that overlaps the stages, immediates, the barrier.
//! - [`delta`]: the bases kept for delta syncs, and the encoding of a piece's runs.
//! - [`split_meter`]: where the sync's wall went (wire, idle, overhead: [`SyncReport::split`]).

mod delta;
#[cfg(test)]
mod delta_tests;
#[cfg(test)]
mod device_stages_tests;
mod direct;
#[cfg(test)]
mod early_check_tests;
mod piece;
mod piece_source;
mod pipeline;
mod run_checksums;
mod split_meter;
mod stages;
mod staging;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use weightsync_common::fabric::{
    Access, Endpoint, FabricBackend, Region, RegionDescriptor, TransferPaths,
};
use weightsync_common::protocol::{DeltaFigures, DeltaRecord, TimeSplit};
use weightsync_schedules::table::{TrainerPlan, WriteTarget};

use crate::checksum::RunChecksum;
use crate::error::{Result, WorkerError};
use crate::imm_tag::MAX_UNITS;
use crate::placement::Placement;
use crate::prepare::Threads;
use crate::source::device_stages::DeviceStages;
use crate::source::view::{SourceView, param_name};
use crate::sync::SyncId;
use crate::timeline::Timeline;

use delta::{Bases, Inbox};
pub use delta::{DeltaConfig, DeltaSync};
use piece::{TaskPiece, TaskShape, plan_pieces};
use staging::StagingArena;

/// Whether the stages overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum PipelineMode {
    /// H2D, prepare and WRITE of different pieces run at the same time (the normal mode).
    #[default]
    Pipelined,
    /// One piece at a time through every stage (the baseline the bench compares against).
    Serialised,
}

/// How a trainer worker runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerConfig {
    /// Name used in timelines and errors, e.g. `trainer-3`.
    pub name: String,
    /// Bytes of staging in flight at most (the size of the registered staging arena).
    pub watermark_bytes: u64,
    /// Target staging bytes per piece; tasks larger than this are split. Defaults to a quarter
    /// of the watermark, so that several pieces are in different stages at once.
    pub piece_bytes: Option<u64>,
    /// Compute xxh3 checksums of every run written to a rollout.
    pub verify: bool,
    /// Overlap the stages or not.
    pub mode: PipelineMode,
    /// Use every rayon thread in the prepare stage (`false`: the calling thread only).
    pub prepare_all_threads: bool,
    /// How long to wait for straddling fp8 rows from other trainers.
    pub gather_timeout: Duration,
    /// Delta syncs (bases kept, thresholds).
    #[serde(default)]
    pub delta: DeltaConfig,
}

impl TrainerConfig {
    /// Defaults for a worker called `name` with `watermark_bytes` of staging.
    pub fn new(name: impl Into<String>, watermark_bytes: u64) -> TrainerConfig {
        TrainerConfig {
            name: name.into(),
            watermark_bytes,
            piece_bytes: None,
            verify: true,
            mode: PipelineMode::Pipelined,
            prepare_all_threads: true,
            gather_timeout: Duration::from_secs(60),
            delta: DeltaConfig::default(),
        }
    }

    fn piece_budget(&self) -> u64 {
        self.piece_bytes
            .unwrap_or(self.watermark_bytes / 4)
            .clamp(1, self.watermark_bytes.max(1))
    }

    fn threads(&self) -> Threads {
        if self.prepare_all_threads {
            Threads::All
        } else {
            Threads::One
        }
    }
}

/// Registered memory of every destination this trainer writes to.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Destinations {
    /// Per rollout rank, its MRs' descriptors indexed by MR id.
    pub rollouts: BTreeMap<u32, Vec<RegionDescriptor>>,
    /// Per training rank, its gather arena's descriptor.
    pub trainers: BTreeMap<u32, RegionDescriptor>,
    /// Per rollout rank whose regions are an engine's own tensors, where each planned tensor
    /// lies in them (a rollout without one holds its tensors as planned).
    pub placements: BTreeMap<u32, Placement>,
    /// Per rollout rank that takes deltas, its delta inbox (see `crate::delta`).
    #[serde(default)]
    pub inboxes: BTreeMap<u32, RegionDescriptor>,
}

/// Where one write of the plan goes: the destination region and the actual offset of the
/// write's first byte there (the planned one, or relocated by the rollout's placement).
#[derive(Debug, Clone)]
pub(crate) struct WriteDst {
    pub desc: RegionDescriptor,
    /// The region's index on its worker (for checksums).
    pub mr: u16,
    pub offset: u64,
}

/// What one trainer did in one sync.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncReport {
    /// The sync.
    pub sync: SyncId,
    /// Every stage of every piece.
    pub timeline: Timeline,
    /// Bytes written to destinations (rollouts and gather arenas).
    pub bytes_written: u64,
    /// Write operations posted (before the fabric merged contiguous runs).
    pub writes_posted: u64,
    /// Pieces executed.
    pub pieces: u64,
    /// The most staging bytes in flight at once during the sync.
    pub peak_staging_bytes: u64,
    /// The watermark.
    pub watermark_bytes: u64,
    /// Checksums of the runs written to rollouts (empty unless `verify`).
    pub checksums: Vec<RunChecksum>,
    /// Source bytes that went through staging: copied into it (H2D) and prepared there, or
    /// prepared into it reading the source in place (casts and fp8 of contiguous boxes).
    pub staged_bytes: u64,
    /// Bytes written straight from registered source memory, copied by nobody but the fabric.
    pub direct_bytes: u64,
    /// Where the sync's wall went: wire, idle, overhead (they add up to `split.wall_ns`; see
    /// [`TimeSplit`] for exactly what each covers).
    pub split: TimeSplit,
    /// Writes in flight on average while any was: how many writes kept the wire busy during
    /// `split.wire_ns` (a wire busy with one write at a time is under-used).
    pub mean_writes_in_flight: f64,
    /// The runs written as deltas: what each receiver applies (empty in a full sync).
    pub deltas: Vec<DeltaRecord>,
    /// What the deltas came to (dense and delta bytes, changes, encode time).
    pub delta: DeltaFigures,
    /// How the written bytes reached their receivers: the transport's payloads, or a same-host
    /// copy (`process_vm_readv`, or memory shared by descriptor where ptrace access is
    /// refused); [`TransferPaths::name`] names the path. `None` where the fabric does not
    /// count them (one path).
    #[serde(default)]
    pub paths: Option<TransferPaths>,
}

/// Everything fixed at build time, shared by every sync.
#[derive(Debug)]
pub(crate) struct TrainerState {
    pub config: TrainerConfig,
    pub plan: TrainerPlan,
    pub shapes: Vec<TaskShape>,
    pub pieces: Vec<Vec<TaskPiece>>,
    /// The source's own fill and prepare steps (a source in device memory), bound to
    /// `staging`; `None` for host sources.
    pub device: Option<Box<dyn DeviceStages>>,
    pub staging: StagingArena,
    pub gather: Option<Region>,
    pub source: Arc<dyn SourceView>,
    /// Per write of the plan, where it goes (set by `set_destinations`).
    pub write_dst: Vec<WriteDst>,
    /// Per task, when it can be written straight from registered source memory (see
    /// [`direct::direct_source`]): that registration and where the task's box lies in it. A
    /// task that keeps a base is written from there only in syncs it goes dense
    /// ([`delta::Route::Dense`]).
    pub direct: Vec<Option<direct::DirectSource>>,
    /// Per task, when it is prepared reading its shard in place (no H2D copy, see
    /// [`TrainerPlan::in_place_input`], [`TrainerPlan::in_place_runs`]): where its box lies in
    /// its shard.
    pub in_place: Vec<Option<stages::InPlace>>,
    /// The prepared bytes last written, per task that keeps them (see [`delta`]).
    pub bases: Bases,
    /// Per task and piece, the staging its encodings need in a delta sync.
    pub enc_need: Vec<Vec<u64>>,
    /// Per rollout rank that takes deltas, its inbox (set by `set_destinations`).
    pub inboxes: BTreeMap<u32, Inbox>,
}

/// A trainer worker (see the module docs).
#[derive(Debug)]
pub struct TrainerWorker<F: FabricBackend> {
    fabric: F,
    state: Arc<TrainerState>,
    running: tokio::sync::Mutex<()>,
}

impl<F: FabricBackend> TrainerWorker<F> {
    /// Checks `plan` against `source` and `config`, and registers the staging arena (and the
    /// gather arena if the plan has one). Nothing is written to anyone.
    pub fn new(
        fabric: F,
        source: Arc<dyn SourceView>,
        plan: TrainerPlan,
        config: TrainerConfig,
    ) -> Result<TrainerWorker<F>> {
        // A plan straight from a compact table names repeated writes as copies; the pipeline
        // executes explicit writes (what `RoutingTable::slice` hands out).
        let plan = if plan.copies.is_empty() {
            plan
        } else {
            plan.expanded()
                .map_err(|e| WorkerError::InvalidPlan(e.to_string()))?
        };
        source.check_plan(&plan)?;
        check_units(&plan)?;
        let shapes = plan
            .tasks
            .iter()
            .enumerate()
            .map(|(i, t)| TaskShape::of(t, i as u32, &plan))
            .collect::<Result<Vec<_>>>()?;
        check_gather_reads(&plan)?;
        let pieces = plan_pieces(
            &plan,
            &shapes,
            config.piece_budget(),
            config.watermark_bytes,
        )?;
        let staging = StagingArena::new(&fabric, config.watermark_bytes)?;
        let device = source.device_stages(&plan, staging.region())?;
        let gather = if plan.gather_arena_bytes > 0 {
            Some(
                fabric
                    .alloc(plan.gather_arena_bytes as usize, Access::RECEIVE)
                    .map_err(|e| WorkerError::fabric("registering the gather arena", e))?,
            )
        } else {
            None
        };
        let min_run = fabric.min_strided_run();
        let direct: Vec<Option<direct::DirectSource>> = plan
            .tasks
            .iter()
            .map(|t| direct::direct_source(&plan, t, source.as_ref(), gather.as_ref(), min_run))
            .collect();
        // A task written straight from the source keeps a base only if told to (it is then
        // staged while its bytes are compared and kept: see `delta::Route`).
        let bases = Bases::new(&plan, &config.delta, |t| {
            config.delta.keep_direct || direct[t as usize].is_none()
        });
        let enc_need = pieces
            .iter()
            .map(|task_pieces: &Vec<TaskPiece>| {
                task_pieces
                    .iter()
                    .map(|p| {
                        let need = delta::enc_need(&plan, p, &bases, &config.delta);
                        // A piece whose encodings would not fit beside it goes dense.
                        if p.layout.total + need > config.watermark_bytes {
                            0
                        } else {
                            need
                        }
                    })
                    .collect()
            })
            .collect();
        let in_place = plan
            .tasks
            .iter()
            .map(|t| stages::InPlace::of(&plan, t, device.is_some()))
            .collect();
        Ok(TrainerWorker {
            fabric,
            state: Arc::new(TrainerState {
                config,
                plan,
                shapes,
                pieces,
                device,
                staging,
                gather,
                source,
                write_dst: Vec::new(),
                direct,
                in_place,
                bases,
                enc_need,
                inboxes: BTreeMap::new(),
            }),
            running: tokio::sync::Mutex::new(()),
        })
    }

    /// The descriptor of this trainer's gather arena, which other trainers write straddling fp8
    /// rows into (`None` when the plan has no gathers landing here).
    pub fn gather_descriptor(&self) -> Option<RegionDescriptor> {
        self.state.gather.as_ref().map(|r| r.descriptor().clone())
    }

    /// The plan this worker executes.
    pub fn plan(&self) -> &TrainerPlan {
        &self.state.plan
    }

    /// Number of pieces one sync runs (after watermark splitting).
    pub fn pieces(&self) -> usize {
        self.state.pieces.iter().map(Vec::len).sum()
    }

    /// Sets where the writes go, checking that every destination is described and every write
    /// lies inside its region. Must be called before the first sync (and again if peers change).
    pub fn set_destinations(&mut self, dsts: &Destinations) -> Result<()> {
        let plan = &self.state.plan;
        let mut write_dst = Vec::with_capacity(plan.writes.len());
        for (i, w) in plan.writes.iter().enumerate() {
            let (mr, offset) = match w.dst {
                WriteTarget::Rollout(r) => match dsts.placements.get(&r) {
                    Some(p) => p
                        .relocate(w.mr, w.dst_offset, w.len as u64)
                        .ok_or_else(|| unplaced_write(plan, i, r))?,
                    None => (w.mr, w.dst_offset),
                },
                WriteTarget::Trainer(_) => (w.mr, w.dst_offset),
            };
            let desc = match w.dst {
                WriteTarget::Rollout(r) => dsts
                    .rollouts
                    .get(&r)
                    .and_then(|mrs| mrs.get(mr as usize))
                    .ok_or_else(|| {
                        WorkerError::MissingDestination(format!("rollout rank {r} MR {mr}"))
                    })?,
                WriteTarget::Trainer(t) => dsts.trainers.get(&t).ok_or_else(|| {
                    WorkerError::MissingDestination(format!(
                        "the gather arena of training rank {t}"
                    ))
                })?,
            };
            if !desc.contains(offset, w.len as u64) {
                return Err(WorkerError::InvalidPlan(format!(
                    "write {i} to {:?} MR {} bytes {}..{} lies outside the registered {} bytes",
                    w.dst,
                    w.mr,
                    w.dst_offset,
                    w.dst_offset + w.len as u64,
                    desc.len
                )));
            }
            write_dst.push(WriteDst {
                desc: desc.clone(),
                mr,
                offset,
            });
        }
        let state = Arc::get_mut(&mut self.state).ok_or_else(|| {
            WorkerError::Protocol("destinations cannot change while a sync runs".into())
        })?;
        // The peers this trainer writes to, so that the fabric shares its lanes out over them.
        let peers: std::collections::BTreeSet<&Endpoint> =
            write_dst.iter().map(|d| &d.desc.endpoint).collect();
        self.fabric.expect_peers(peers.len());
        state.write_dst = write_dst;
        state.inboxes = dsts
            .inboxes
            .iter()
            .filter_map(|(r, desc)| {
                let regions = dsts.rollouts.get(r)?;
                Some((*r, Inbox::new(desc.clone(), regions)))
            })
            .collect();
        Ok(())
    }

    /// Runs one sync: every piece through H2D, prepare and WRITE, then waits until every write
    /// was acknowledged. On failure, every write already posted is drained before returning,
    /// and this trainer's gather immediates of the epoch are retired.
    pub async fn run_sync(&self, sync: SyncId) -> Result<SyncReport> {
        self.run_sync_until(sync, std::future::pending()).await
    }

    /// [`run_sync`](Self::run_sync), stopped early when `cancel` resolves: then it returns
    /// [`WorkerError::Cancelled`] once no piece job is left (nothing more will be posted for
    /// this sync). Writes already posted are abandoned, not awaited; reset the fabric's lanes
    /// ([`FabricBackend::reset_connections`]) before the next sync so none of them lands later.
    /// (Dropping a `run_sync` future instead leaves its piece jobs to wind down on their own.)
    pub async fn run_sync_until(
        &self,
        sync: SyncId,
        cancel: impl std::future::Future<Output = ()>,
    ) -> Result<SyncReport> {
        let _one_at_a_time = self.running.lock().await;
        if self.state.write_dst.len() != self.state.plan.writes.len() {
            return Err(WorkerError::Protocol(
                "run_sync before set_destinations".into(),
            ));
        }
        self.read_source_and_run(sync, None, cancel).await
    }

    /// [`run_sync_until`](Self::run_sync_until) as a delta sync: the engines in `delta` get
    /// deltas against `delta.base_version` where it pays, if this trainer's bases hold that
    /// version (else every engine gets dense writes, and the bases are refreshed for the next).
    pub async fn run_delta_sync_until(
        &self,
        sync: SyncId,
        delta: &DeltaSync,
        cancel: impl std::future::Future<Output = ()>,
    ) -> Result<SyncReport> {
        let _one_at_a_time = self.running.lock().await;
        if self.state.write_dst.len() != self.state.plan.writes.len() {
            return Err(WorkerError::Protocol(
                "run_sync before set_destinations".into(),
            ));
        }
        self.read_source_and_run(sync, Some(delta.clone()), cancel)
            .await
    }

    /// The version this trainer's bases hold (`None`: no delta can be encoded until a sync
    /// succeeds), and the bytes they take.
    pub fn delta_base(&self) -> (Option<u64>, u64) {
        (self.state.bases.version(), self.state.bases.bytes())
    }

    /// Runs the pipeline inside the source's read bracket: a source written while the sync read
    /// it fails the sync (what was sent would mix versions).
    async fn read_source_and_run(
        &self,
        sync: SyncId,
        delta: Option<DeltaSync>,
        cancel: impl std::future::Future<Output = ()>,
    ) -> Result<SyncReport> {
        let stamp = self.state.source.begin_read()?;
        let report =
            pipeline::run(self.fabric.clone(), self.state.clone(), sync, delta, cancel).await?;
        self.state.source.end_read(stamp)?;
        Ok(report)
    }

    /// The staging budget.
    pub fn watermark_bytes(&self) -> u64 {
        self.state.config.watermark_bytes
    }
}

/// A write to rollout `r` that its placement puts in no single tensor: names the parameter.
fn unplaced_write(plan: &TrainerPlan, i: usize, r: u32) -> WorkerError {
    let w = &plan.writes[i];
    let param = plan
        .tasks
        .iter()
        .find(|t| (t.first_write as usize..(t.first_write + t.num_writes) as usize).contains(&i))
        .map_or_else(|| "?".to_string(), |t| param_name(plan, t.param));
    WorkerError::InvalidPlan(format!(
        "write {i} (of {param}) to rollout rank {r} MR {} bytes {}..{} lies in no single tensor \
         of that rollout's placement",
        w.mr,
        w.dst_offset,
        w.dst_offset + w.len as u64
    ))
}

/// Whether every write's immediate unit fits the tag layout.
fn check_units(plan: &TrainerPlan) -> Result<()> {
    match plan.writes.iter().find(|w| w.unit as u32 >= MAX_UNITS) {
        Some(w) => Err(crate::imm_tag::UnitOutOfRange {
            unit: w.unit as u32,
        }
        .into()),
        None => Ok(()),
    }
}

/// Whether every gather-sourced task reads inside the gather arena. (Each region's size was
/// checked by `TaskShape::of`; the offset is as decoded.)
fn check_gather_reads(plan: &TrainerPlan) -> Result<()> {
    for (i, t) in plan.tasks.iter().enumerate() {
        if let weightsync_schedules::table::Source::Gather { offset } = t.source {
            let end = offset.saturating_add(t.source_bytes());
            if end > plan.gather_arena_bytes {
                return Err(WorkerError::InvalidPlan(format!(
                    "task {i} reads gather bytes up to {end}, the gather arena has {}",
                    plan.gather_arena_bytes
                )));
            }
        }
    }
    Ok(())
}
