//! The scheduler of one sync: pieces flow through H2D -> prepare -> WRITE, stages overlapping.
//!
//! One scheduler for every source: "H2D" is the source-to-staging stage, a host gather for host
//! memory and DMA into the pinned lease for device memory (the source's
//! [`DeviceStages`](crate::source::device_stages::DeviceStages), called by [`super::stages`]); nothing here depends on
//! where the source lives.
//!
//! Each piece is a small async job: it takes the H2D stage (one piece at a time: the copy
//! engine), then the prepare stage (one piece at a time, the kernel itself using every rayon
//! thread), then posts its writes, which run concurrently with everything else (the fabric's
//! lanes). The stages are FIFO locks, so pieces pass through them in plan order, and while piece
//! `k` is being written, `k+1` is prepared and `k+2` copied: the classic three-stage pipeline.
//! What bounds it is the [`Watermark`](crate::watermark::Watermark): the scheduler leases a
//! piece's staging *before* the piece starts and the lease is returned only when the piece's
//! writes were acknowledged, so the staging in flight never exceeds the watermark.
//!
//! Mesh groups run in order. Within a group, gather sends come first, then local tasks; before the
//! first task that reads the gather arena, the scheduler waits for this trainer's gather count of
//! the epoch (earlier pieces keep flowing meanwhile).
//!
//! Immediates: every write carries `imm_for(epoch, unit)` (see [`crate::imm_tag`]). A write the
//! watermark split into parts carries it on its last part only, and that part is posted only
//! after every earlier part was acknowledged, so the destination counts it once, after all its
//! bytes landed: the count per destination stays what the table says.
//!
//! The barrier: the sync's per-worker half ends when every posted write was acknowledged; the
//! controller's global barrier waits for every rollout's `await_landed`. On failure the scheduler
//! stops starting pieces, drains every write already posted (so nothing of this epoch is still in
//! flight when it returns) and retires its own gather immediates of the epoch.
//!
//! Cancellation: when the caller's `cancel` future resolves (the controller aborted the sync),
//! the scheduler stops, aborts every piece job and waits until each is gone, so that when it
//! returns nothing more can be posted for this epoch. Writes already posted are not awaited
//! (a partitioned peer may never answer): the caller resets the fabric's lanes next
//! ([`FabricBackend::reset_connections`]), which discards them.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use weightsync_common::fabric::{FabricBackend, TransferPaths, WriteOp};
use weightsync_schedules::table::{MeshGroup, Source, Transform, WriteTarget};

use super::delta::{DeltaSync, EncodeCtx, PartMode, Route, encode_piece};
use super::direct::DirectSource;
use super::piece_source::PieceSource;
use super::run_checksums::{part_checksums, run_checksums};
use super::split_meter::{Activity, SplitMeter};
use super::stages::{prepare_from_source, prepare_piece, stage_input};
use super::{PipelineMode, SyncReport, TrainerState};
use crate::checksum::{RunChecksum, xxh3};
use crate::error::{Result, WorkerError};
use crate::imm_tag::imm_for;
use crate::source::view::source_range;
use crate::sync::SyncId;
use crate::timeline::TimelineRecorder;
use crate::watermark::{Lease, Watermark};
use weightsync_common::protocol::{DeltaFigures, DeltaRecord, Stage, WHOLE_SYNC};

/// State of one sync shared by its piece jobs.
struct SyncRun<F: FabricBackend> {
    fabric: F,
    state: Arc<TrainerState>,
    sync: SyncId,
    rec: TimelineRecorder,
    failed: AtomicBool,
    first_error: Mutex<Option<WorkerError>>,
    /// Per write of the plan split into several parts: permits released by its earlier parts.
    gates: Vec<Option<Semaphore>>,
    h2d: tokio::sync::Mutex<()>,
    prepare: tokio::sync::Mutex<()>,
    checksums: Mutex<Vec<RunChecksum>>,
    bytes_written: AtomicU64,
    writes_posted: AtomicU64,
    staged_bytes: AtomicU64,
    direct_bytes: AtomicU64,
    /// Where the wall goes: wire, idle, overhead.
    meter: SplitMeter,
    /// This sync's deltas, when the bases hold the version they are encoded against.
    active: Option<DeltaSync>,
    /// Per task, how it goes this sync ([`super::delta::Bases::routes`]).
    routes: Vec<Route>,
    /// Per piece `(task, piece)` encoded, how each of its parts is written.
    modes: Mutex<HashMap<(u32, usize), Vec<PartMode>>>,
    /// The runs written as deltas.
    records: Mutex<Vec<DeltaRecord>>,
    figures: Mutex<DeltaFigures>,
    /// The fabric's bytes by path when the sync began (`SyncReport::paths` is the difference).
    paths_before: Option<TransferPaths>,
}

impl<F: FabricBackend> SyncRun<F> {
    fn new(
        fabric: F,
        state: Arc<TrainerState>,
        sync: SyncId,
        rec: TimelineRecorder,
        active: Option<DeltaSync>,
        routes: Vec<Route>,
    ) -> Self {
        let gates = split_write_gates(&state);
        let paths_before = fabric.transfer_paths();
        SyncRun {
            fabric,
            state,
            sync,
            rec,
            failed: AtomicBool::new(false),
            first_error: Mutex::new(None),
            gates,
            h2d: tokio::sync::Mutex::new(()),
            prepare: tokio::sync::Mutex::new(()),
            checksums: Mutex::new(Vec::new()),
            bytes_written: AtomicU64::new(0),
            writes_posted: AtomicU64::new(0),
            staged_bytes: AtomicU64::new(0),
            direct_bytes: AtomicU64::new(0),
            meter: SplitMeter::start(),
            active,
            routes,
            modes: Mutex::new(HashMap::new()),
            records: Mutex::new(Vec::new()),
            figures: Mutex::new(DeltaFigures::default()),
            paths_before,
        }
    }

    /// What the sync did, once it succeeded.
    fn report(&self, pieces: u64, watermark: &Watermark) -> SyncReport {
        let mut checksums = std::mem::take(&mut *self.checksums.lock());
        checksums.sort();
        let mut deltas = std::mem::take(&mut *self.records.lock());
        deltas.sort();
        let mut delta = *self.figures.lock();
        delta.dense_bytes = self
            .state
            .plan
            .writes
            .iter()
            .filter(|w| matches!(w.dst, WriteTarget::Rollout(_)))
            .map(|w| u64::from(w.len))
            .sum();
        SyncReport {
            sync: self.sync,
            timeline: self.rec.finish(),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            writes_posted: self.writes_posted.load(Ordering::Relaxed),
            pieces,
            peak_staging_bytes: watermark.peak(),
            watermark_bytes: watermark.capacity(),
            checksums,
            staged_bytes: self.staged_bytes.load(Ordering::Relaxed),
            direct_bytes: self.direct_bytes.load(Ordering::Relaxed),
            split: self.meter.finish(),
            mean_writes_in_flight: self.meter.mean_writes_in_flight(),
            deltas,
            delta,
            paths: self
                .fabric
                .transfer_paths()
                .zip(self.paths_before)
                .map(|(now, before)| now.since(&before)),
        }
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Records the first error and stops the run: no new piece starts, waiting parts give up.
    fn fail(&self, err: WorkerError) {
        let mut first = self.first_error.lock();
        if first.is_none() {
            tracing::warn!(worker = %self.state.config.name, error = %err, "sync failed");
            *first = Some(err);
        }
        self.failed.store(true, Ordering::Release);
        for gate in self.gates.iter().flatten() {
            gate.close();
        }
    }
}

/// Runs one sync (see the module docs) unless `cancel` resolves first.
pub(crate) async fn run<F: FabricBackend>(
    fabric: F,
    state: Arc<TrainerState>,
    sync: SyncId,
    delta: Option<DeltaSync>,
    cancel: impl std::future::Future<Output = ()>,
) -> Result<SyncReport> {
    let rec = TimelineRecorder::start(&state.config.name);
    let watermark = state.staging.watermark().clone();
    watermark.reset_peak();
    // Deltas only on top of the version the bases hold; while the sync runs they hold none.
    let active = delta.filter(|d| state.bases.version() == Some(d.base_version));
    state.bases.set_version(None);
    let routes = state.bases.routes(state.plan.tasks.len());
    let run = Arc::new(SyncRun::new(
        fabric,
        state.clone(),
        sync,
        rec.clone(),
        active,
        routes,
    ));
    let serial = state.config.mode == PipelineMode::Serialised;
    let mut jobs = JoinSet::new();
    let mut pieces = 0u64;

    let schedule = async {
        'groups: for group in &state.plan.groups {
            let gather_from = group.first_task + group.gather_sends + group.local_tasks;
            for t in group.first_task..group.first_task + group.num_tasks {
                if t == gather_from
                    && group.gather_expect > 0
                    && let Err(e) = wait_for_gathers(&run, group, t).await
                {
                    run.fail(e);
                    break 'groups;
                }
                for p in 0..state.pieces[t as usize].len() {
                    if run.failed() {
                        break 'groups;
                    }
                    let route = run.routes[t as usize];
                    // A piece compared where its source holds it stages only its encodings.
                    let mut need = match compared_in_place(&state, t) {
                        Some(c) if route != Route::Dense && c.direct.is_some() => 0,
                        _ => state.pieces[t as usize][p].layout.total,
                    };
                    if run.active.is_some() && route == Route::Compare {
                        need += state.enc_need[t as usize][p];
                    }
                    // A task keeping a base is staged unless it goes as a full sync would.
                    let lease = if state.direct[t as usize].is_some() && route == Route::Dense {
                        None // written from the source: no staging
                    } else {
                        let _idle = run.meter.begin(Activity::Wait, 1);
                        match watermark.acquire(need).await {
                            Ok(lease) => Some(lease),
                            Err(e) => {
                                run.fail(e.into());
                                break 'groups;
                            }
                        }
                    };
                    pieces += 1;
                    if serial {
                        if let Err(e) = run_piece(run.clone(), t, p, lease).await {
                            run.fail(e);
                        }
                    } else {
                        let job = run.clone();
                        jobs.spawn(async move {
                            if let Err(e) = run_piece(job.clone(), t, p, lease).await {
                                job.fail(e);
                            }
                        });
                        // Reap finished jobs so a panic surfaces early.
                        while let Some(done) = jobs.try_join_next() {
                            if let Err(e) = done {
                                run.fail(stage_panic("piece", e));
                            }
                        }
                    }
                }
            }
        }

        // Barrier (this worker's half): every posted write acknowledged.
        let barrier_start = rec.now_ns();
        while let Some(done) = jobs.join_next().await {
            if let Err(e) = done {
                run.fail(stage_panic("piece", e));
            }
        }
        rec.record(WHOLE_SYNC, 0, Stage::Barrier, barrier_start, 0);
    };
    let cancelled = tokio::select! {
        biased;
        () = cancel => true,
        () = schedule => false,
    };
    if cancelled {
        run.fail(WorkerError::Cancelled);
        // Every piece job is gone when this returns: none can post a write after it.
        jobs.shutdown().await;
    }

    if let Some(err) = run.first_error.lock().take() {
        retire_gathers(&run);
        return Err(err);
    }
    state.bases.set_version(Some(sync.version));
    Ok(run.report(pieces, &watermark))
}

/// One gate per write the watermark split over several pieces: its last part (the one with
/// the immediate) waits for a permit from every earlier part.
fn split_write_gates(state: &TrainerState) -> Vec<Option<Semaphore>> {
    let mut gates: Vec<Option<Semaphore>> = (0..state.plan.writes.len()).map(|_| None).collect();
    for part in state.pieces.iter().flatten().flat_map(|p| &p.parts) {
        if part.parts > 1 {
            gates[part.write as usize] = Some(Semaphore::new(0));
        }
    }
    gates
}

/// Before task `t`, the first of `group` that reads the gather arena: waits until every
/// straddling-row write of the group arrived.
async fn wait_for_gathers<F: FabricBackend>(
    run: &SyncRun<F>,
    group: &MeshGroup,
    t: u32,
) -> Result<()> {
    let start = run.rec.now_ns();
    let _idle = run.meter.begin(Activity::Wait, 1);
    let imm = imm_for(run.sync.epoch, group.id as u32)?;
    let wait = run.fabric.imm_counter().expect_within(
        imm,
        group.gather_expect as u64,
        run.state.config.gather_timeout,
    );
    wait.await.map_err(|e| {
        WorkerError::fabric(
            format!(
                "waiting for {} straddling-row writes of mesh group {} ({})",
                group.gather_expect, group.id, group.name
            ),
            e,
        )
    })?;
    run.rec.record(t, 0, Stage::GatherWait, start, 0);
    Ok(())
}

/// After a failure: retires this epoch's gather immediates, so late gather writes can never
/// count toward a later sync.
fn retire_gathers<F: FabricBackend>(run: &SyncRun<F>) {
    for group in &run.state.plan.groups {
        if group.gather_expect > 0
            && let Ok(imm) = imm_for(run.sync.epoch, group.id as u32)
        {
            run.fabric.imm_counter().cancel(imm);
        }
    }
}

fn stage_panic(stage: &'static str, e: tokio::task::JoinError) -> WorkerError {
    WorkerError::Stage {
        stage,
        detail: e.to_string(),
    }
}

/// One piece through every stage (`None` lease: a piece written straight from the source, see
/// [`super::direct`]). The lease is returned when this returns. A stage that finds the sync
/// failed elsewhere stops the piece quietly (the first error is already recorded).
async fn run_piece<F: FabricBackend>(
    run: Arc<SyncRun<F>>,
    t: u32,
    p: usize,
    lease: Option<Lease>,
) -> Result<()> {
    let Some(lease) = lease else {
        return piece_direct(&run, t, p).await;
    };
    if run.routes[t as usize] != Route::Dense
        && let Some(at) = compared_in_place(&run.state, t)
    {
        return piece_in_place(&run, t, p, lease, at).await;
    }
    // A piece prepared reading its source in place has nothing to copy first.
    let lease = if run.state.in_place[t as usize].is_some() {
        lease
    } else {
        let Some(lease) = piece_h2d(&run, t, p, lease).await? else {
            return Ok(());
        };
        lease
    };
    // A staged copy's input is its output: unless its checksums are wanted there is nothing to
    // prepare, and it goes to its writes without a hop through the prepare stage (whose queue
    // holds one piece at a time: a copy would wait there behind a quantisation).
    let nothing_to_prepare = matches!(
        run.state.plan.tasks[t as usize].transform,
        Transform::Copy { .. }
    ) && !run.state.config.verify
        && run.routes[t as usize] == Route::Dense;
    let lease = if nothing_to_prepare {
        lease
    } else {
        let Some(lease) = piece_prepare(&run, t, p, lease).await? else {
            return Ok(());
        };
        lease
    };
    if run.failed() {
        return Ok(());
    }
    let source = PieceSource::Staged {
        region: run.state.staging.region().clone(),
        at: lease.offset(),
    };
    piece_write(&run, t, p, &source).await
}

/// A piece of a task written straight from registered source memory: its checksums (from the
/// source bytes, when verifying), then its writes.
async fn piece_direct<F: FabricBackend>(run: &Arc<SyncRun<F>>, t: u32, p: usize) -> Result<()> {
    if run.failed() {
        return Ok(());
    }
    let st = &run.state;
    let Some(direct) = st.direct[t as usize].clone() else {
        return Err(WorkerError::InvalidPlan(format!(
            "task {t} has no registered source"
        )));
    };
    let piece = &st.pieces[t as usize][p];
    let shape = &st.shapes[t as usize];
    // A Copy's prepared bytes are its box's: the piece starts this far into the box.
    let from = shape.grain.elems_before(piece.u0) * shape.out_size;
    if st.config.verify {
        let job = run.clone();
        let at = direct.clone();
        let _work = run.meter.begin(Activity::Work, 1);
        let sums = tokio::task::spawn_blocking(move || direct_checksums(&job, t, p, &at, from))
            .await
            .map_err(|e| stage_panic("checksum", e))??;
        run.checksums.lock().extend(sums);
    }
    let source = PieceSource::Direct { direct, from };
    piece_write(run, t, p, &source).await?;
    run.direct_bytes
        .fetch_add(piece.layout.input, Ordering::Relaxed);
    Ok(())
}

/// The checksums of a direct piece's runs, read where the source holds them (gathered into a
/// buffer first when the box strides through its shard: checksums are a verification mode).
fn direct_checksums<F: FabricBackend>(
    run: &SyncRun<F>,
    t: u32,
    p: usize,
    direct: &DirectSource,
    from: u64,
) -> Result<Vec<RunChecksum>> {
    let st = &run.state;
    let piece = &st.pieces[t as usize][p];
    let len = piece.layout.input;
    let shard = match st.plan.tasks[t as usize].source {
        weightsync_schedules::table::Source::Shard { shard } => shard,
        weightsync_schedules::table::Source::Gather { .. } => {
            // Gathered rows are few; the checksum reads a copy of them.
            let (at, _) = direct.at(from);
            let bytes = direct.region.copy_to_vec(at, len as usize).map_err(|e| {
                WorkerError::fabric(format!("task {t}: reading the gather arena"), e)
            })?;
            return Ok(run_checksums(st, piece, &bytes));
        }
    };
    let Some((_, shard_at)) = st.source.registered_shard(shard) else {
        return Ok(Vec::new());
    };
    let mut sums = Vec::new();
    st.source.read_shard(&st.plan, shard, &mut |bytes: &[u8]| {
        let (at, stride) = direct.at(from);
        let start = (at - shard_at) as usize;
        match stride {
            Some(s) if s.head + len > s.run => {
                let mut gathered = Vec::with_capacity(len as usize);
                for (o, n) in s.segments(start as u64, len) {
                    let range = o as usize..(o + n) as usize;
                    gathered.extend_from_slice(bytes.get(range).unwrap_or(&[]));
                }
                sums = run_checksums(st, piece, &gathered);
            }
            _ => {
                let piece_bytes = &bytes[start.min(bytes.len())..];
                sums = run_checksums(st, piece, piece_bytes);
            }
        }
        Ok(())
    })?;
    Ok(sums)
}

/// Runs `work` on a piece's staging bytes off the runtime's threads, holding `stage` (one piece
/// per stage at a time). `None`: the sync failed meanwhile; else the lease and when work began.
async fn in_staging<F, W>(
    run: &Arc<SyncRun<F>>,
    stage: &tokio::sync::Mutex<()>,
    name: &'static str,
    lease: Lease,
    work: W,
) -> Result<Option<(Lease, u64)>>
where
    F: FabricBackend,
    W: FnOnce(&SyncRun<F>, u64, &mut [u8]) -> Result<()> + Send + 'static,
{
    let _stage = stage.lock().await;
    if run.failed() {
        return Ok(None);
    }
    let start = run.rec.now_ns();
    let job = run.clone();
    let _work = run.meter.begin(Activity::Work, 1);
    let (lease, res) = tokio::task::spawn_blocking(move || {
        let mut lease = lease;
        let offset = lease.offset();
        let res = job
            .state
            .staging
            .bytes_mut(&mut lease)
            .and_then(|buf| work(&job, offset, buf));
        (lease, res)
    })
    .await
    .map_err(|e| stage_panic(name, e))?;
    res?;
    Ok(Some((lease, start)))
}

/// H2D: the piece's source into its staging lease (`None`: the sync failed meanwhile).
async fn piece_h2d<F: FabricBackend>(
    run: &Arc<SyncRun<F>>,
    t: u32,
    p: usize,
    lease: Lease,
) -> Result<Option<Lease>> {
    let staged = in_staging(run, &run.h2d, "h2d", lease, move |job, _, buf| {
        let st = &job.state;
        let piece = &st.pieces[t as usize][p];
        stage_input(
            &st.plan,
            &st.shapes[t as usize],
            piece,
            st.source.as_ref(),
            st.device.as_deref(),
            st.gather.as_ref(),
            &mut buf[..piece.layout.input as usize],
        )
    })
    .await?;
    let Some((lease, start)) = staged else {
        return Ok(None);
    };
    let bytes = run.state.pieces[t as usize][p].layout.input;
    run.rec.record(t, p as u32, Stage::H2d, start, bytes);
    run.staged_bytes.fetch_add(bytes, Ordering::Relaxed);
    Ok(Some(lease))
}

/// Prepare: the destination's exact bytes, in place in the lease, and the checksums of the runs
/// they hold (`None`: the sync failed meanwhile).
async fn piece_prepare<F: FabricBackend>(
    run: &Arc<SyncRun<F>>,
    t: u32,
    p: usize,
    lease: Lease,
) -> Result<Option<Lease>> {
    let prepared = in_staging(
        run,
        &run.prepare,
        "prepare",
        lease,
        move |job, offset, buf| {
            let st = &job.state;
            let piece = &st.pieces[t as usize][p];
            let shape = &st.shapes[t as usize];
            match st.in_place[t as usize] {
                Some(at) => {
                    prepare_from_source(
                        &st.plan,
                        shape,
                        piece,
                        st.source.as_ref(),
                        st.device.as_deref(),
                        at,
                        offset,
                        buf,
                        st.config.threads(),
                    )?;
                    job.staged_bytes
                        .fetch_add(piece.layout.input, Ordering::Relaxed);
                }
                None => prepare_piece(&st.plan, shape, piece, buf, st.config.threads())?,
            }
            if job.routes[t as usize] == Route::Dense {
                if st.config.verify {
                    job.checksums.lock().extend(run_checksums(st, piece, buf));
                }
            } else {
                let total = piece.layout.total;
                let (prepared, enc_area) = buf.split_at_mut(total as usize);
                encode_and_record(job, t, p, prepared, enc_area, total);
            }
            Ok(())
        },
    )
    .await?;
    let Some((lease, start)) = prepared else {
        return Ok(None);
    };
    let lay = run.state.pieces[t as usize][p].layout;
    run.rec
        .record(t, p as u32, Stage::Prepare, start, lay.values + lay.scales);
    Ok(Some(lease))
}

/// Encodes piece `p` of task `t` (its prepared bytes `prepared`, encodings into `enc_area`
/// at `enc_at` of its lease; see [`encode_piece`]) and records what came of it: checksums
/// (taken in the pass that compared the runs with their bases), delta records and figures, and
/// how each part is written.
fn encode_and_record<F: FabricBackend>(
    job: &SyncRun<F>,
    t: u32,
    p: usize,
    prepared: &[u8],
    enc_area: &mut [u8],
    enc_at: u64,
) {
    let st = &job.state;
    let piece = &st.pieces[t as usize][p];
    let route = job.routes[t as usize];
    let ctx = EncodeCtx {
        plan: &st.plan,
        write_dst: &st.write_dst,
        inboxes: &st.inboxes,
        bases: &st.bases,
        config: &st.config.delta,
        // A refreshed base is stale until this sync's bytes are copied into it.
        active: job.active.as_ref().filter(|_| route == Route::Compare),
    };
    let done = encode_piece(&ctx, piece, prepared, enc_area, enc_at);
    if st.config.verify {
        let sums = part_checksums(st, piece, |i, part| {
            done.hashes[i].unwrap_or_else(|| {
                let a = part.staging_offset as usize;
                xxh3(&prepared[a..a + part.len as usize])
            })
        });
        job.checksums.lock().extend(sums);
    }
    job.figures.lock().add(&done.figures);
    job.records.lock().extend(done.records);
    job.modes.lock().insert((t, p), done.modes);
}

/// Where a task that keeps a base and does not go dense is compared where its source holds it
/// (see `super::delta`'s module docs): a same-dtype copy of a contiguous box of a shard the
/// host reads.
struct InPlaceCompare {
    /// The shard, and the byte offset of the task's box in it.
    shard: u32,
    box_at: u64,
    /// The box in registered memory: its dense runs are written from there, and only the
    /// encodings are staged (else the runs that go dense are copied into the lease).
    direct: Option<DirectSource>,
}

fn compared_in_place(st: &TrainerState, t: u32) -> Option<InPlaceCompare> {
    let task = &st.plan.tasks[t as usize];
    let (Transform::Copy { dtype }, Source::Shard { shard }) = (task.transform, task.source) else {
        return None;
    };
    let s = st.plan.shards.get(shard as usize)?;
    let sub = st.plan.source_box(task)?;
    let dims = s.global.shape();
    if st.device.is_some() || s.dtype != dtype || !sub.is_contiguous_in(dims.dims()) {
        return None;
    }
    let direct = st.direct[t as usize].clone().filter(|d| d.runs.is_none());
    Some(InPlaceCompare {
        shard,
        box_at: sub.first_element_in(dims.dims()) * dtype.size() as u64,
        direct,
    })
}

/// A piece compared where its source holds it ([`compared_in_place`]): its runs are compared
/// with the base (and hashed) in the source and its encodings go to its lease; its runs that go
/// dense are written straight from registered source memory, or copied into the lease (only
/// they) and written from there.
async fn piece_in_place<F: FabricBackend>(
    run: &Arc<SyncRun<F>>,
    t: u32,
    p: usize,
    lease: Lease,
    at: InPlaceCompare,
) -> Result<()> {
    let st = &run.state;
    let piece = &st.pieces[t as usize][p];
    let shape = &st.shapes[t as usize];
    let from = shape.grain.elems_before(piece.u0) * shape.out_size;
    let (shard, registered) = (at.shard, at.direct.is_some());
    let start = (at.box_at + from) as usize;
    let compared = in_staging(run, &run.prepare, "prepare", lease, move |job, _, buf| {
        let st = &job.state;
        let piece = &st.pieces[t as usize][p];
        let len = piece.layout.input as usize;
        st.source.read_shard(&st.plan, shard, &mut |bytes: &[u8]| {
            let mine = source_range(bytes, start, len, || format!("task {t}'s box in its shard"))?;
            if registered {
                encode_and_record(job, t, p, mine, buf, 0);
                return Ok(());
            }
            let total = piece.layout.total;
            let (staged, enc_area) = buf.split_at_mut(total as usize);
            encode_and_record(job, t, p, mine, enc_area, total);
            let modes = job.modes.lock();
            let modes = modes.get(&(t, p)).map_or(&[][..], Vec::as_slice);
            for (i, part) in piece.parts.iter().enumerate() {
                if modes.get(i).is_none_or(|m| *m == PartMode::Dense) {
                    let r = part.staging_offset as usize..(part.staging_offset + part.len) as usize;
                    staged[r.clone()].copy_from_slice(&mine[r]);
                    job.staged_bytes.fetch_add(part.len, Ordering::Relaxed);
                }
            }
            Ok(())
        })
    })
    .await?;
    let Some((lease, began)) = compared else {
        return Ok(());
    };
    run.rec
        .record(t, p as u32, Stage::Prepare, began, piece.layout.input);
    if run.failed() {
        return Ok(());
    }
    let staged = PieceSource::Staged {
        region: st.staging.region().clone(),
        at: lease.offset(),
    };
    let source = match at.direct {
        Some(direct) => PieceSource::Encodings {
            region: st.staging.region().clone(),
            at: lease.offset(),
            direct,
            from,
        },
        None => staged,
    };
    piece_write(run, t, p, &source).await?;
    if registered {
        run.direct_bytes
            .fetch_add(piece.layout.input, Ordering::Relaxed);
    }
    Ok(())
}

/// WRITE: every part of the piece, each until acknowledged. The last part of a write split over
/// several pieces carries the immediate and goes only after every earlier part landed.
async fn piece_write<F: FabricBackend>(
    run: &Arc<SyncRun<F>>,
    t: u32,
    p: usize,
    source: &PieceSource,
) -> Result<()> {
    let start = run.rec.now_ns();
    let st = &run.state;
    let piece = &st.pieces[t as usize][p];
    let modes = run.modes.lock().remove(&(t, p));
    let op_of = |i: usize, part: &super::piece::Part, with_imm: bool| -> Result<WriteOp> {
        let w = st.plan.writes[part.write as usize];
        let dst = &st.write_dst[part.write as usize];
        let mode = modes.as_ref().map_or(PartMode::Dense, |m| m[i]);
        let op = match (mode, source, w.dst) {
            (
                PartMode::Delta {
                    enc_at,
                    enc_len,
                    inbox_at,
                },
                PieceSource::Staged { region, at } | PieceSource::Encodings { region, at, .. },
                WriteTarget::Rollout(r),
            ) => {
                let inbox = st.inboxes.get(&r).ok_or_else(|| {
                    WorkerError::MissingDestination(format!("the delta inbox of rollout rank {r}"))
                })?;
                // An empty encoding travels as one byte: its write carries the immediate.
                WriteOp::new(region, at + enc_at, &inbox.desc, inbox_at, enc_len.max(1))
            }
            _ => source.op(
                part.staging_offset,
                &dst.desc,
                dst.offset + (part.dst_offset - w.dst_offset),
                part.len,
            ),
        };
        Ok(if with_imm {
            op.with_imm(imm_for(run.sync.epoch, w.unit as u32)?)
        } else {
            op
        })
    };
    let mut now = Vec::new();
    let mut later = Vec::new();
    for (i, part) in piece.parts.iter().enumerate() {
        if part.parts == 1 {
            now.push(op_of(i, part, true)?);
        } else if !part.last {
            now.push(op_of(i, part, false)?);
        } else {
            later.push((part, op_of(i, part, true)?));
        }
    }
    let mut bytes = 0;
    if !now.is_empty() {
        bytes += now.iter().map(|o| o.len).sum::<u64>();
        run.writes_posted
            .fetch_add(now.len() as u64, Ordering::Relaxed);
        let _wire = run.meter.begin(Activity::Write, now.len() as u64);
        run.fabric
            .write_batch(now)
            .await
            .map_err(|e| WorkerError::fabric(format!("task {t} piece {p}: writing"), e))?;
        for part in &piece.parts {
            if part.parts > 1
                && !part.last
                && let Some(gate) = &run.gates[part.write as usize]
            {
                gate.add_permits(1);
            }
        }
    }
    for (part, op) in later {
        // The last part of a split write: wait until every earlier part landed, then post it
        // with the immediate.
        if let Some(gate) = &run.gates[part.write as usize] {
            let _idle = run.meter.begin(Activity::Wait, 1);
            match gate.acquire_many(part.parts - 1).await {
                Ok(permits) => permits.forget(),
                Err(_) => return Ok(()), // the sync failed elsewhere
            }
        }
        bytes += op.len;
        run.writes_posted.fetch_add(1, Ordering::Relaxed);
        let _wire = run.meter.begin(Activity::Write, 1);
        run.fabric.write(op).await.map_err(|e| {
            WorkerError::fabric(format!("task {t} piece {p}: writing the last part"), e)
        })?;
    }
    run.bytes_written.fetch_add(bytes, Ordering::Relaxed);
    run.rec.record(t, p as u32, Stage::Write, start, bytes);
    Ok(())
}
