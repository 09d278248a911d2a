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
//! one **barrier** after the last write anywhere.

use std::collections::BTreeMap;

use weightsync_common::protocol::Stage;

use crate::simulate::cluster::ClusterModel;
use crate::simulate::engine::{Hop, OpId, ResKind, SimPlan, NONE};
use crate::table::{Endpoint, Task, TrainerPlan, Transform};

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
struct Piece {
    first_task: u32,
    tasks: f64,
    src_bytes: f64,
    staging: f64,
    prep_s: f64,
    host_prep_s: f64,
    /// Per receiving GPU: (gpu, bytes, writes), in first-write order.
    dsts: Vec<(u32, f64, f64)>,
    /// (trainer, unit) gather arenas this piece writes into.
    gathers: Vec<(u32, u16)>,
}

impl Piece {
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
}

/// GPU index of an endpoint (trainers first, then rollouts).
fn gpu_of(dst: Endpoint, trainers: u32) -> u32 {
    match dst {
        Endpoint::Trainer(t) => t,
        Endpoint::Rollout(r) => trainers + r,
    }
}

/// Lowers `table` on `cluster` into engine operations.
pub(crate) fn lower(table: &crate::table::RoutingTable, cluster: &ClusterModel) -> Lowered {
    let nt = table.trainers.len() as u32;
    let nr = table.rollouts.len() as u32;
    let mut out = Lowered::default();
    let p = &mut out.plan;
    out.trainer_lanes = (0..nt).map(|t| p.lane(format!("trainer-{t}"))).collect();
    out.rollout_lanes = (0..nr).map(|r| p.lane(format!("rollout-{r}"))).collect();
    let ctl = p.lane("controller".into());
    let cost = &cluster.cost;
    let host = cluster.host;

    // Every gather send into (trainer, unit), for the gather waits.
    let mut gather_ops: BTreeMap<(u32, u16), Vec<OpId>> = BTreeMap::new();
    // Per trainer: (unit, op that must wait for gathers) to wire after all sends exist.
    let mut waits: Vec<(u32, u16, OpId)> = Vec::new();
    let mut all_writes: Vec<OpId> = Vec::new();
    // Per GPU, its index in the current piece's destinations (u32::MAX: none yet).
    let mut slots = vec![u32::MAX; (nt + nr) as usize];

    for (ti, plan) in table.trainers.iter().enumerate() {
        let t = ti as u32;
        let lane = out.trainer_lanes[ti];
        let gpu_node = cluster.node_of(t, nt);
        let my_nic = cluster.nic_of(t, nt);
        let total_staging: u64 = plan.tasks.iter().map(task_staging).sum::<u64>();
        let budget = cluster
            .piece_budget()
            .max(total_staging.div_ceil(MAX_PIECES_PER_TRAINER))
            .min(cluster.watermark_bytes);
        let pool = p.pool(cluster.watermark_bytes);
        let h2d_res = host.map(|_| p.resource(ResKind::H2d(t)));
        let prep_res = host.map(|_| p.resource(ResKind::Prep(t)));
        let host_res = host.map(|_| p.resource(ResKind::Host(gpu_node)));
        let mut prev_h2d = NONE;
        let mut prev_prep = NONE;
        // The last `writes_in_flight` write ops of this trainer (a new one waits for the oldest).
        let mut in_flight: std::collections::VecDeque<OpId> = Default::default();

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
                let mut pieces: Vec<Piece> = Vec::new();
                let mut cur = Piece::default();
                for k in lo..hi {
                    let task = &plan.tasks[k as usize];
                    let staging = task_staging(task);
                    let parts = staging.div_ceil(budget).max(1);
                    if (parts > 1 || cur.staging + staging as f64 > budget as f64)
                        && !cur.is_empty()
                    {
                        finish(&mut slots, &mut pieces, &mut cur);
                    }
                    let frac = 1.0 / parts as f64;
                    for _ in 0..parts {
                        add_task(&mut slots, &mut cur, plan, k, task, frac, nt, cluster);
                        if parts > 1 {
                            finish(&mut slots, &mut pieces, &mut cur);
                        }
                    }
                }
                if !cur.is_empty() {
                    finish(&mut slots, &mut pieces, &mut cur);
                }
                for pc in pieces {
                    out.pieces += 1;
                    let staging = (pc.staging as u64).clamp(1, cluster.watermark_bytes);
                    // Gather wait before the first gathered piece of the group.
                    if !waited {
                        waited = true;
                        let w = p.op(lane, Stage::GatherWait, pc.first_task, 0, 0.0, 0.0, &[]);
                        p.after(prev_h2d, w);
                        waits.push((t, g.id, w));
                        prev_h2d = w;
                    }
                    // H2D.
                    let h2d_s = pc.src_bytes / cost.h2d_bytes_per_s;
                    let h2d = match (h2d_res, host_res, host) {
                        (Some(hr), Some(hh), Some(h)) => p.op(
                            lane,
                            Stage::H2d,
                            pc.first_task,
                            pc.src_bytes as u64,
                            0.0,
                            pc.src_bytes,
                            &[(hr, 1.0 / cost.h2d_bytes_per_s), (hh, h.h2d_s_per_byte)],
                        ),
                        _ => p.op(
                            lane,
                            Stage::H2d,
                            pc.first_task,
                            pc.src_bytes as u64,
                            h2d_s,
                            0.0,
                            &[],
                        ),
                    };
                    p.ops[h2d as usize].acquire = Some((pool, staging));
                    p.after(prev_h2d, h2d);
                    prev_h2d = h2d;
                    // Prepare.
                    let prep = match (prep_res, host_res) {
                        (Some(pr), Some(hh)) if pc.src_bytes > 0.0 => p.op(
                            lane,
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
                            lane,
                            Stage::Prepare,
                            pc.first_task,
                            pc.src_bytes as u64,
                            pc.prep_s,
                            0.0,
                            &[],
                        ),
                    };
                    p.after(h2d, prep);
                    p.after(prev_prep, prep);
                    prev_prep = prep;
                    // WRITE.
                    let hops: Vec<Hop> = pc
                        .dsts
                        .iter()
                        .map(|&(gpu, bytes, wrs)| Hop {
                            local: gpu == t,
                            from: if gpu == t { u32::MAX } else { my_nic },
                            to: if gpu == t {
                                u32::MAX
                            } else {
                                cluster.nic_of(gpu, nt)
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
                    let w = p.transfer(
                        lane,
                        stage,
                        pc.first_task,
                        &hops,
                        gpu_node,
                        cost.nic_bytes_per_s,
                        cost.per_wr_s,
                        host.map(|h| (gpu_node, h.net_s_per_byte)),
                    );
                    p.ops[w as usize].release = Some((pool, staging));
                    p.after(prep, w);
                    if cluster.writes_in_flight > 0 {
                        if in_flight.len() >= cluster.writes_in_flight as usize {
                            if let Some(old) = in_flight.pop_front() {
                                p.after(old, w);
                            }
                        }
                        in_flight.push_back(w);
                    }
                    for &(gpu, _, _) in &pc.dsts {
                        if gpu >= nt {
                            p.lands.push((w, out.rollout_lanes[(gpu - nt) as usize]));
                        }
                    }
                    for &key in &pc.gathers {
                        gather_ops.entry(key).or_default().push(w);
                    }
                    all_writes.push(w);
                }
            }
        }
        for w in plan.all_writes() {
            out.writes += 1;
            match w.dst {
                Endpoint::Rollout(_) => out.rollout_bytes += w.len as u64,
                Endpoint::Trainer(_) => out.gather_bytes += w.len as u64,
            }
        }
    }
    for (t, unit, wait) in waits {
        if let Some(sends) = gather_ops.get(&(t, unit)) {
            for &s in sends {
                p.after(s, wait);
            }
        }
    }
    let barrier = p.op(ctl, Stage::Barrier, 0, 0, cost.barrier_s, 0.0, &[]);
    for w in all_writes {
        p.after(w, barrier);
    }
    out.barrier = barrier;
    out
}

/// Moves the current piece to `pieces`, clearing its destination slots.
fn finish(slots: &mut [u32], pieces: &mut Vec<Piece>, cur: &mut Piece) {
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

/// Adds `frac` of task `k` to the piece.
#[allow(clippy::too_many_arguments)]
fn add_task(
    slots: &mut [u32],
    pc: &mut Piece,
    plan: &TrainerPlan,
    k: u32,
    task: &Task,
    frac: f64,
    trainers: u32,
    cluster: &ClusterModel,
) {
    if pc.is_empty() {
        pc.first_task = k;
    }
    let src = task.source_bytes() as f64 * frac;
    pc.tasks += frac;
    pc.src_bytes += src;
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
    for w in plan.task_writes(task) {
        let gpu = gpu_of(w.dst, trainers);
        let slot = &mut slots[gpu as usize];
        if *slot == u32::MAX {
            *slot = pc.dsts.len() as u32;
            pc.dsts.push((gpu, 0.0, 0.0));
        }
        let e = &mut pc.dsts[*slot as usize];
        e.1 += w.len as f64 * frac;
        e.2 += frac;
        if let Endpoint::Trainer(to) = w.dst {
            let key = (to, w.unit);
            if !pc.gathers.contains(&key) {
                pc.gathers.push(key);
            }
        }
    }
}
