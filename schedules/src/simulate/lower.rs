//! Lowering a [`RoutingTable`] into engine operations: what each trainer's pipeline does, piece
//! by piece, on the cluster model.
//!
//! Per trainer, tasks are cut and grouped into *pieces* the way the worker does (a task larger
//! than the piece budget is split; see `worker::trainer::piece`), except that consecutive small
//! tasks of the same kind are merged up to the budget: their bytes and work requests add up, and
//! what they cost beyond their bytes is kept as `task_overhead_s` per task, so the timeline has a
//! few dozen pieces per trainer instead of a hundred thousand tasks. Each piece is three ops:
//!
//! 1. **H2D**: takes the piece's staging from the trainer's watermark pool (FIFO, as the worker's
//!    watermark), then copies the source bytes at the PCIe rate; one piece at a time.
//! 2. **prepare**: casts / quantises at the transform's rate, plus the per-task overhead; one
//!    piece at a time.
//! 3. **WRITE** (or **gather send**): one flow over the trainer's NIC and every receiving NIC
//!    (max-min shared with every other transfer in flight); gives the staging back when done.
//!
//! Mesh groups keep their order; before a group's first piece that reads the gather arena, a
//! **gather wait** op waits for every gather send into this trainer's group. The sync ends with
//! one **barrier** after the last write anywhere, whose latency is `cost.barrier_s` plus the
//! cluster's `fixed.after_landing_s`. With `fixed.start_s` above zero, a **sync start** op of
//! that latency on the controller's lane comes before every trainer's first op (the stage drawn
//! is `Arm`: the controller starting the sync), so both fixed costs add to the predicted time
//! exactly when nothing else changes.
//!
//! A **delta sync** ([`DeltaModel`]) lowers the same pieces with three changes: each write to a
//! rollout from a task that keeps a base carries its run's expected encoding (or the run, where
//! it goes dense) instead of the run; the trainer's prepare op also scans what it compares and
//! its piece takes the encodings' capacity from staging beside its bytes; and each rollout that
//! takes deltas applies them in an op of its own (drawn as its `Verify` stage, where the worker
//! applies them; on a resource of its own) once every write anywhere landed (the controller's
//! `Verify` comes after the barrier's landing notices), before the sync ends. Everything else (gathers, work
//! requests, fixed costs) is as in a full sync.

use std::collections::{BTreeMap, VecDeque};

use weightsync_common::protocol::Stage;

use crate::error::PlanError;
use crate::simulate::cluster::ClusterModel;
use crate::simulate::delta::{DeltaModel, element_size, keeps_base};
use crate::simulate::engine::{Hop, NONE, OpId, ResId, ResKind, SimPlan};
use crate::table::{RoutingTable, Task, TrainerPlan, Transform, WriteTarget};

/// At most this many pieces per trainer in a simulation: the piece budget grows for very large
/// tables (the pipeline's fill and drain, a piece each, stay small next to the sync).
const MAX_PIECES_PER_TRAINER: u64 = 48;

/// Alignment of staging sub-buffers (as the worker).
const STAGING_ALIGN: u64 = 64;

fn aligned(x: u64) -> u64 {
    x.div_ceil(STAGING_ALIGN) * STAGING_ALIGN
}

/// Which phase of a mesh group a task belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    GatherSend,
    Local,
    Gathered,
}

/// One simulated piece (a merge of small tasks or a part of a large one).
#[derive(Debug, Default)]
struct SimPiece {
    first_task: u32,
    tasks: f64,
    src_bytes: f64,
    /// Of `src_bytes`, what is copied into staging first: a task prepared reading its shard in
    /// place ([`TrainerPlan::in_place_input`], [`TrainerPlan::in_place_runs`]) has no H2D copy.
    h2d_bytes: f64,
    staging: f64,
    /// Staging for the encodings beside the piece's bytes (delta syncs).
    enc_staging: f64,
    prep_s: f64,
    host_prep_s: f64,
    /// Per receiving GPU: (gpu, bytes, writes), in first-write order.
    dsts: Vec<(u32, f64, f64)>,
    /// (trainer, unit) gather arenas this piece writes into.
    gathers: Vec<(u32, u16)>,
}

impl SimPiece {
    fn is_empty(&self) -> bool {
        self.tasks == 0.0
    }
}

/// What the lowering made, beside the plan.
#[derive(Debug, Clone, Default)]
pub(crate) struct Lowered {
    /// The engine plan.
    pub plan: SimPlan,
    /// The final barrier op.
    pub barrier: OpId,
    /// Trainer lanes (index = training rank) and rollout lanes (index = inference rank).
    pub trainer_lanes: Vec<u32>,
    /// Rollout lanes.
    pub rollout_lanes: Vec<u32>,
    /// Pieces simulated.
    pub pieces: u64,
    /// Bytes written to rollouts.
    pub rollout_bytes: u64,
    /// Bytes written into gather arenas.
    pub gather_bytes: u64,
    /// Writes (work requests) in the table.
    pub writes: u64,
    /// What a delta sync came to (all zero for a full sync).
    pub delta: DeltaTotals,
}

/// A delta sync's totals over the lowering (expected bytes: fractions of tasks add up).
#[derive(Debug, Clone, Default)]
pub(crate) struct DeltaTotals {
    /// Bytes written to rollouts: encodings, and the runs that go dense.
    pub wire_bytes: f64,
    /// Of the writes to rollouts, those sent as deltas and those sent dense.
    pub delta_writes: f64,
    /// Writes to rollouts sent dense.
    pub dense_writes: f64,
    /// Per trainer, the memory traffic of its encodes, bytes.
    pub encode_bytes: Vec<f64>,
    /// Per rollout, the memory traffic of its applies, bytes.
    pub apply_bytes: Vec<f64>,
}

/// GPU index of an endpoint (trainers first, then rollouts).
fn gpu_of(dst: WriteTarget, trainers: u32) -> u32 {
    match dst {
        WriteTarget::Trainer(t) => t,
        WriteTarget::Rollout(r) => trainers + r,
    }
}

/// Lowers `table` on `cluster` into engine operations: a full sync, or with `delta` a delta
/// sync (see the module docs).
/// Trainers' parts are expanded one at a time (only one explicit plan is held at once).
pub(crate) fn lower(
    table: &RoutingTable,
    cluster: &ClusterModel,
    delta: Option<&DeltaModel>,
) -> Result<Lowered, PlanError> {
    let mut l = Lowering::new(table, cluster, delta.copied());
    for t in 0..table.trainers.len() as u32 {
        l.trainer(t, &table.trainer_plan(t)?);
    }
    Ok(l.finish())
}

/// One lowering in progress: the plan being built, and what links ops across trainers.
struct Lowering<'c> {
    cluster: &'c ClusterModel,
    /// A delta sync's model (`None`: a full sync).
    delta: Option<DeltaModel>,
    /// Training ranks (GPU indices of rollouts start here).
    nt: u32,
    out: Lowered,
    /// The controller's lane (the barrier).
    ctl: u32,
    /// Every gather send into (trainer, unit), for the gather waits.
    gather_ops: BTreeMap<(u32, u16), Vec<OpId>>,
    /// Per trainer: (unit, op that must wait for gathers) to wire after all sends exist.
    waits: Vec<(u32, u16, OpId)>,
    all_writes: Vec<OpId>,
    /// Per GPU, its index in the current piece's destinations (u32::MAX: none yet).
    slots: Vec<u32>,
    /// The sync start op every trainer's first op waits for (`NONE`: no start cost).
    start: OpId,
}

/// A trainer's lane, pool and resources, and the last op of each of its stages.
struct TrainerLane {
    t: u32,
    lane: u32,
    gpu_node: u32,
    my_nics: std::ops::Range<u32>,
    /// Staging bytes per piece.
    budget: u64,
    pool: u32,
    h2d_res: Option<ResId>,
    prep_res: Option<ResId>,
    host_res: Option<ResId>,
    prev_h2d: OpId,
    prev_prep: OpId,
    /// The last `writes_in_flight` write ops of this trainer (a new one waits for the oldest).
    in_flight: VecDeque<OpId>,
}

impl<'c> Lowering<'c> {
    /// Lanes for every trainer, every rollout and the controller, in that order.
    fn new(
        table: &RoutingTable,
        cluster: &'c ClusterModel,
        delta: Option<DeltaModel>,
    ) -> Lowering<'c> {
        let nt = table.trainers.len() as u32;
        let nr = table.rollouts.len() as u32;
        let mut out = Lowered::default();
        out.delta.encode_bytes = vec![0.0; nt as usize];
        out.delta.apply_bytes = vec![0.0; nr as usize];
        let p = &mut out.plan;
        out.trainer_lanes = (0..nt).map(|t| p.lane(format!("trainer-{t}"))).collect();
        out.rollout_lanes = (0..nr).map(|r| p.lane(format!("rollout-{r}"))).collect();
        let ctl = p.lane("controller".into());
        let start = if cluster.fixed.start_s > 0.0 {
            p.op(ctl, Stage::Arm, 0, 0, cluster.fixed.start_s, 0.0, &[])
        } else {
            NONE
        };
        Lowering {
            cluster,
            delta,
            nt,
            out,
            ctl,
            gather_ops: BTreeMap::new(),
            waits: Vec::new(),
            all_writes: Vec::new(),
            slots: vec![u32::MAX; (nt + nr) as usize],
            start,
        }
    }

    /// Lowers trainer `t`'s plan: per mesh group and phase, its tasks cut and merged into
    /// pieces, each piece's ops; then counts its writes.
    fn trainer(&mut self, t: u32, plan: &TrainerPlan) {
        let mut tr = self.trainer_lane(t, plan);
        for g in &plan.groups {
            let a = g.first_task;
            let phases = [
                (Phase::GatherSend, a, a + g.gather_sends),
                (
                    Phase::Local,
                    a + g.gather_sends,
                    a + g.gather_sends + g.local_tasks,
                ),
                (
                    Phase::Gathered,
                    a + g.gather_sends + g.local_tasks,
                    a + g.num_tasks,
                ),
            ];
            for (phase, lo, hi) in phases {
                if lo >= hi {
                    continue;
                }
                let mut waited = phase != Phase::Gathered || g.gather_expect == 0;
                for pc in self.pieces(plan, lo, hi, tr.budget) {
                    self.out.pieces += 1;
                    // Gather wait before the first gathered piece of the group.
                    if !waited {
                        waited = true;
                        self.gather_wait(&mut tr, g.id, pc.first_task);
                    }
                    self.piece_ops(&mut tr, phase, &pc);
                }
            }
        }
        for w in plan.all_writes() {
            self.out.writes += 1;
            match w.dst {
                WriteTarget::Rollout(_) => self.out.rollout_bytes += w.len as u64,
                WriteTarget::Trainer(_) => self.out.gather_bytes += w.len as u64,
            }
        }
    }

    /// Trainer `t`'s lane, its staging pool and (with a shared host) its resources; its piece
    /// budget grows for very large plans (at most [`MAX_PIECES_PER_TRAINER`] pieces).
    fn trainer_lane(&mut self, t: u32, plan: &TrainerPlan) -> TrainerLane {
        let cluster = self.cluster;
        let (nt, host) = (self.nt, cluster.host);
        let p = &mut self.out.plan;
        let gpu_node = cluster.node_of(t, nt);
        let total_staging: u64 = plan.tasks.iter().map(task_staging).sum::<u64>();
        let budget = cluster
            .piece_budget()
            .max(total_staging.div_ceil(MAX_PIECES_PER_TRAINER))
            .min(cluster.watermark_bytes);
        let pool = p.pool(cluster.watermark_bytes);
        let h2d_res = host.map(|_| p.resource(ResKind::H2d(t)));
        let prep_res = host.map(|_| p.resource(ResKind::Prep(t)));
        let host_res = host.map(|_| p.resource(ResKind::Host(gpu_node)));
        TrainerLane {
            t,
            lane: self.out.trainer_lanes[t as usize],
            gpu_node,
            my_nics: cluster.nics_of(t, nt),
            budget,
            pool,
            h2d_res,
            prep_res,
            host_res,
            // The first H2D (or gather wait) waits for the sync start.
            prev_h2d: self.start,
            prev_prep: NONE,
            in_flight: VecDeque::new(),
        }
    }

    /// Tasks `lo..hi` of `plan` as pieces of at most `budget` staging bytes: a larger task is
    /// split into equal parts, consecutive smaller ones are merged.
    fn pieces(&mut self, plan: &TrainerPlan, lo: u32, hi: u32, budget: u64) -> Vec<SimPiece> {
        let (slots, nt, cluster) = (&mut self.slots, self.nt, self.cluster);
        let mut on = AddCtx {
            plan,
            trainers: nt,
            cluster,
            delta: self.delta.as_ref(),
            totals: &mut self.out.delta,
        };
        let mut pieces: Vec<SimPiece> = Vec::new();
        let mut cur = SimPiece::default();
        for k in lo..hi {
            let task = &plan.tasks[k as usize];
            let staging = task_staging(task);
            let parts = staging.div_ceil(budget).max(1);
            if (parts > 1 || cur.staging + staging as f64 > budget as f64) && !cur.is_empty() {
                finish(slots, &mut pieces, &mut cur);
            }
            let frac = 1.0 / parts as f64;
            for _ in 0..parts {
                add_task(slots, &mut cur, &mut on, k, task, frac);
                if parts > 1 {
                    finish(slots, &mut pieces, &mut cur);
                }
            }
        }
        if !cur.is_empty() {
            finish(slots, &mut pieces, &mut cur);
        }
        pieces
    }

    /// The op that holds the trainer's next H2D until every gather send into its unit is done.
    fn gather_wait(&mut self, tr: &mut TrainerLane, unit: u16, task: u32) {
        let p = &mut self.out.plan;
        let w = p.op(tr.lane, Stage::GatherWait, task, 0, 0.0, 0.0, &[]);
        p.after(tr.prev_h2d, w);
        self.waits.push((tr.t, unit, w));
        tr.prev_h2d = w;
    }

    /// A piece's three ops: H2D (taking its staging), prepare, and the WRITE or gather send
    /// (giving the staging back).
    fn piece_ops(&mut self, tr: &mut TrainerLane, phase: Phase, pc: &SimPiece) {
        let staging = ((pc.staging + pc.enc_staging) as u64).clamp(1, self.cluster.watermark_bytes);
        let h2d = self.h2d_op(tr, pc);
        let p = &mut self.out.plan;
        p.ops[h2d as usize].acquire = Some((tr.pool, staging));
        p.after(tr.prev_h2d, h2d);
        tr.prev_h2d = h2d;
        let prep = self.prepare_op(tr, pc);
        let p = &mut self.out.plan;
        p.after(h2d, prep);
        p.after(tr.prev_prep, prep);
        tr.prev_prep = prep;
        let w = self.write_op(tr, phase, pc);
        let p = &mut self.out.plan;
        p.ops[w as usize].release = Some((tr.pool, staging));
        p.after(prep, w);
        let writes_in_flight = self.cluster.writes_in_flight;
        if writes_in_flight > 0 {
            if tr.in_flight.len() >= writes_in_flight as usize
                && let Some(old) = tr.in_flight.pop_front()
            {
                p.after(old, w);
            }
            tr.in_flight.push_back(w);
        }
        for &(gpu, _, _) in &pc.dsts {
            if gpu >= self.nt {
                p.lands
                    .push((w, self.out.rollout_lanes[(gpu - self.nt) as usize]));
            }
        }
        for &key in &pc.gathers {
            self.gather_ops.entry(key).or_default().push(w);
        }
        self.all_writes.push(w);
    }

    /// The piece's copy into staging at the PCIe rate (and the shared host's, if any): of its
    /// tasks' inputs, those not prepared in place. (The op stays when that is nothing: it is
    /// where the piece takes its staging.)
    fn h2d_op(&mut self, tr: &TrainerLane, pc: &SimPiece) -> OpId {
        let cost = &self.cluster.cost;
        let p = &mut self.out.plan;
        let bytes = pc.h2d_bytes;
        match (tr.h2d_res, tr.host_res, self.cluster.host) {
            (Some(hr), Some(hh), Some(h)) => p.op(
                tr.lane,
                Stage::H2d,
                pc.first_task,
                bytes as u64,
                0.0,
                bytes,
                &[(hr, 1.0 / cost.h2d_bytes_per_s), (hh, h.h2d_s_per_byte)],
            ),
            _ => p.op(
                tr.lane,
                Stage::H2d,
                pc.first_task,
                bytes as u64,
                bytes / cost.h2d_bytes_per_s,
                0.0,
                &[],
            ),
        }
    }

    /// The piece's cast or quantisation at its transforms' rates, plus the per-task overhead.
    fn prepare_op(&mut self, tr: &TrainerLane, pc: &SimPiece) -> OpId {
        let p = &mut self.out.plan;
        match (tr.prep_res, tr.host_res) {
            (Some(pr), Some(hh)) if pc.src_bytes > 0.0 => p.op(
                tr.lane,
                Stage::Prepare,
                pc.first_task,
                pc.src_bytes as u64,
                0.0,
                pc.src_bytes,
                &[
                    (pr, pc.prep_s / pc.src_bytes),
                    (hh, pc.host_prep_s / pc.src_bytes),
                ],
            ),
            _ => p.op(
                tr.lane,
                Stage::Prepare,
                pc.first_task,
                pc.src_bytes as u64,
                pc.prep_s,
                0.0,
                &[],
            ),
        }
    }

    /// The piece's writes as one flow over the trainer's NIC and every receiving NIC.
    fn write_op(&mut self, tr: &TrainerLane, phase: Phase, pc: &SimPiece) -> OpId {
        let (cluster, nt, t) = (self.cluster, self.nt, tr.t);
        let hops: Vec<Hop> = pc
            .dsts
            .iter()
            .map(|&(gpu, bytes, wrs)| Hop {
                local: gpu == t,
                from: if gpu == t { 0..0 } else { tr.my_nics.clone() },
                to: if gpu == t {
                    0..0
                } else {
                    cluster.nics_of(gpu, nt)
                },
                to_node: cluster.node_of(gpu, nt),
                bytes,
                wrs,
            })
            .collect();
        let stage = if phase == Phase::GatherSend {
            Stage::GatherSend
        } else {
            Stage::Write
        };
        self.out.plan.transfer(
            tr.lane,
            stage,
            pc.first_task,
            &hops,
            tr.gpu_node,
            cluster.cost.nic_bytes_per_s,
            cluster.cost.per_wr_s,
            cluster
                .host
                .map(|h| (tr.gpu_node, h.net_s_per_byte, h.net_s_per_write)),
        )
    }

    /// Wires every gather wait after the sends into its unit, and the barrier after every write.
    fn finish(mut self) -> Lowered {
        let p = &mut self.out.plan;
        for (t, unit, wait) in self.waits {
            if let Some(sends) = self.gather_ops.get(&(t, unit)) {
                for &s in sends {
                    p.after(s, wait);
                }
            }
        }
        let barrier = p.op(
            self.ctl,
            Stage::Barrier,
            0,
            0,
            self.cluster.cost.barrier_s + self.cluster.fixed.after_landing_s,
            0.0,
            &[],
        );
        // A table with no writes still pays the start.
        p.after(self.start, barrier);
        for &w in &self.all_writes {
            p.after(w, barrier);
        }
        if let Some(d) = self.delta {
            // Each rollout applies its deltas when the controller tells it to verify: once every
            // write anywhere landed (a join on the controller's lane), before the sync ends.
            let written = p.op(self.ctl, Stage::Barrier, 0, 0, 0.0, 0.0, &[]);
            p.after(self.start, written);
            for &w in &self.all_writes {
                p.after(w, written);
            }
            for (r, &bytes) in self.out.delta.apply_bytes.iter().enumerate() {
                if bytes <= 0.0 {
                    continue;
                }
                let res = p.resource(ResKind::Apply(self.nt + r as u32));
                let apply = p.op(
                    self.out.rollout_lanes[r],
                    Stage::Verify,
                    0,
                    bytes as u64,
                    0.0,
                    bytes,
                    &[(res, 1.0 / d.scan_bytes_per_s)],
                );
                p.after(written, apply);
                p.after(apply, barrier);
            }
        }
        self.out.barrier = barrier;
        self.out
    }
}

/// Moves the current piece to `pieces`, clearing its destination slots.
fn finish(slots: &mut [u32], pieces: &mut Vec<SimPiece>, cur: &mut SimPiece) {
    for &(gpu, _, _) in &cur.dsts {
        slots[gpu as usize] = u32::MAX;
    }
    pieces.push(std::mem::take(cur));
}

/// Staging of a whole task: its source copy plus its prepared output (a plain copy is written
/// straight from the source copy).
fn task_staging(t: &Task) -> u64 {
    let input = aligned(t.source_bytes());
    match t.transform {
        Transform::Copy { .. } => input,
        _ => input + aligned(t.prepared_bytes()),
    }
}

/// What [`add_task`] reads, and the delta totals it adds to.
struct AddCtx<'a> {
    plan: &'a TrainerPlan,
    trainers: u32,
    cluster: &'a ClusterModel,
    delta: Option<&'a DeltaModel>,
    totals: &'a mut DeltaTotals,
}

/// Adds `frac` of task `k` to the piece.
fn add_task(
    slots: &mut [u32],
    pc: &mut SimPiece,
    on: &mut AddCtx<'_>,
    k: u32,
    task: &Task,
    frac: f64,
) {
    let (plan, cluster) = (on.plan, on.cluster);
    if pc.is_empty() {
        pc.first_task = k;
    }
    let src = task.source_bytes() as f64 * frac;
    pc.tasks += frac;
    pc.src_bytes += src;
    if plan.in_place_input(task).is_none() && plan.in_place_runs(task).is_none() {
        pc.h2d_bytes += src;
    }
    pc.staging += task_staging(task) as f64 * frac;
    let (rate, host_cost) = match task.transform {
        Transform::Copy { .. } => (
            cluster.prep.copy,
            cluster.host.map_or(0.0, |h| h.prep_s_per_byte.copy),
        ),
        Transform::Cast { .. } => (
            cluster.prep.cast,
            cluster.host.map_or(0.0, |h| h.prep_s_per_byte.cast),
        ),
        Transform::Fp8Block { .. } => (
            cluster.prep.fp8,
            cluster.host.map_or(0.0, |h| h.prep_s_per_byte.fp8),
        ),
    };
    pc.prep_s += src / rate + cluster.task_overhead_s * frac;
    pc.host_prep_s += src * host_cost;
    if cluster.host.is_some() {
        // The overhead is host work too (scheduling, a thread hop).
        pc.host_prep_s += cluster.task_overhead_s * frac;
    }
    let delta = on.delta.filter(|_| keeps_base(&task.transform));
    let elem = element_size(&task.transform);
    // Replicas of one run (the same prepared bytes to several rollouts) share one encoding.
    let mut encoded: std::collections::BTreeSet<(u64, u32)> = Default::default();
    let mut encode_bytes = 0.0;
    for w in plan.task_writes(task) {
        let gpu = gpu_of(w.dst, on.trainers);
        let mut bytes = w.len as f64;
        match (delta, w.dst) {
            (Some(d), WriteTarget::Rollout(r)) => {
                let run = d.run(w.len as u64, elem);
                bytes = run.wire_bytes;
                on.totals.wire_bytes += bytes * frac;
                if run.kind.is_some() {
                    on.totals.delta_writes += frac;
                } else {
                    on.totals.dense_writes += frac;
                }
                on.totals.apply_bytes[r as usize] += run.apply_bytes * frac;
                if encoded.insert((w.src_offset, w.len)) {
                    encode_bytes += run.encode_bytes * frac;
                    pc.enc_staging += d.capacity(w.len as u64) * frac;
                }
            }
            (None, WriteTarget::Rollout(_)) if on.delta.is_some() => {
                // A copy keeps no base: dense.
                on.totals.wire_bytes += bytes * frac;
                on.totals.dense_writes += frac;
            }
            _ => {}
        }
        let slot = &mut slots[gpu as usize];
        if *slot == u32::MAX {
            *slot = pc.dsts.len() as u32;
            pc.dsts.push((gpu, 0.0, 0.0));
        }
        let e = &mut pc.dsts[*slot as usize];
        e.1 += bytes * frac;
        e.2 += frac;
        if let WriteTarget::Trainer(to) = w.dst {
            let key = (to, w.unit);
            if !pc.gathers.contains(&key) {
                pc.gathers.push(key);
            }
        }
    }
    if let Some(d) = delta {
        // The compare runs in the prepare stage, after the piece's bytes are prepared.
        pc.prep_s += encode_bytes / d.scan_bytes_per_s;
        on.totals.encode_bytes[plan.rank as usize] += encode_bytes;
    }
}
