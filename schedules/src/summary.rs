//! The figures of a routing table: what it moves, how evenly, and how long the cost model says
//! it takes. This is what `weightsync plan` prints (a table, or JSON with `--json`).
//!
//! Definitions:
//! - `bytes_to_move`: bytes written into inference ranks per sync (weights and fp8 scales).
//! - `routes`: (task, inference rank) pairs: one prepared box delivered to one rank.
//! - `work_requests`: network writes (one WRITE each), gathers included, writes a trainer sends
//!   to itself (local gather copies) excluded.
//! - `gather_bytes`: bytes trainers send to *other* trainers so fp8 blocks straddling shards are
//!   quantised by one owner.
//! - per-NIC statistics: senders are training ranks' NICs (what they send), receivers are
//!   inference ranks' NICs (what lands).
//! - `bound_s`: the most loaded NIC's bytes (sent, received, or gathers received by a trainer)
//!   over the NIC bandwidth. `predicted_s`: see [`crate::cost`].

use serde::{Deserialize, Serialize};

use crate::cost::CostModel;
use std::collections::BTreeMap;

use rayon::prelude::*;

use crate::compact::{TaskPattern, TrainerRoutes};
use crate::table::RoutingTable;

/// Max and mean of one side's NICs.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct NicStats {
    /// Number of NICs (ranks) on this side.
    pub nics: u32,
    /// Bytes on the most loaded NIC.
    pub max_bytes: u64,
    /// Mean bytes per NIC.
    pub mean_bytes: f64,
    /// Work requests on the busiest NIC (by work requests).
    pub max_wrs: u64,
    /// Mean work requests per NIC.
    pub mean_wrs: f64,
    /// Slowest NIC time under the cost model, seconds.
    pub max_time_s: f64,
}

/// What a routing table does, in numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Model name.
    pub model: String,
    /// Training ranks.
    pub train_ranks: u32,
    /// Inference ranks.
    pub infer_ranks: u32,
    /// Logical parameter tensors.
    pub params: u64,
    /// Parameter elements.
    pub elements: u64,
    /// Bytes written into inference ranks per sync.
    pub bytes_to_move: u64,
    /// (task, inference rank) pairs.
    pub routes: u64,
    /// Tasks over all trainers.
    pub tasks: u64,
    /// Network writes (WRITEs) per sync.
    pub work_requests: u64,
    /// Bytes sent trainer-to-trainer for fp8 blocks straddling shards.
    pub gather_bytes: u64,
    /// Their writes.
    pub gather_work_requests: u64,
    /// Bytes of gather regions assembled locally (a trainer's own rows).
    pub gather_local_bytes: u64,
    /// Largest gather arena on one trainer.
    pub max_gather_arena_bytes: u64,
    /// Sending NICs (training ranks).
    pub sender: NicStats,
    /// Receiving NICs (inference ranks).
    pub receiver: NicStats,
    /// Most gather bytes received by one trainer.
    pub max_gather_rx_bytes: u64,
    /// Predicted sync time under the cost model, seconds.
    pub predicted_s: f64,
    /// Lower bound: most loaded NIC bytes / bandwidth, seconds.
    pub bound_s: f64,
    /// What dominates the prediction.
    pub bottleneck: String,
}

fn stats(bytes: &[u64], wrs: &[u64], cost: &CostModel) -> NicStats {
    let n = bytes.len().max(1) as f64;
    NicStats {
        nics: bytes.len() as u32,
        max_bytes: bytes.iter().copied().max().unwrap_or(0),
        mean_bytes: bytes.iter().sum::<u64>() as f64 / n,
        max_wrs: wrs.iter().copied().max().unwrap_or(0),
        mean_wrs: wrs.iter().sum::<u64>() as f64 / n,
        max_time_s: bytes
            .iter()
            .zip(wrs)
            .map(|(&b, &w)| cost.nic_time(b, w))
            .fold(0.0, f64::max),
    }
}

/// Per rollout rank, bytes and writes received, summed from arithmetic progressions of ranks
/// without visiting each rank: one difference array per stride.
#[derive(Default)]
struct Received {
    /// Per stride: added (bytes, writes) at the progression's first rank, taken away past its
    /// last; summed along the stride at the end.
    by_stride: BTreeMap<u32, (Vec<u64>, Vec<u64>)>,
}

impl Received {
    /// Adds `bytes` and `wrs` to ranks `first + i * stride`, `i < count`, that are below `nr`.
    fn add(&mut self, nr: usize, first: u32, stride: u32, count: u32, bytes: u64, wrs: u64) {
        let first = first as u64;
        if count == 0 || first >= nr as u64 {
            return;
        }
        // Stride 0: one rank, `count` times over.
        let (count, stride, bytes, wrs) = if stride == 0 {
            (1, 1, bytes * count as u64, wrs * count as u64)
        } else {
            let fit = (nr as u64 - 1 - first) / stride as u64 + 1;
            (
                count.min(fit.min(u32::MAX as u64) as u32),
                stride,
                bytes,
                wrs,
            )
        };
        let (b, w) = self
            .by_stride
            .entry(stride)
            .or_insert_with(|| (vec![0; nr], vec![0; nr]));
        b[first as usize] = b[first as usize].wrapping_add(bytes);
        w[first as usize] = w[first as usize].wrapping_add(wrs);
        let end = first + count as u64 * stride as u64;
        if end < nr as u64 {
            b[end as usize] = b[end as usize].wrapping_sub(bytes);
            w[end as usize] = w[end as usize].wrapping_sub(wrs);
        }
    }

    /// Adds what `other` holds (differences add up, in wrapping arithmetic, in any order).
    fn add_all(&mut self, other: Received) {
        for (stride, (ob, ow)) in other.by_stride {
            match self.by_stride.entry(stride) {
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert((ob, ow));
                }
                std::collections::btree_map::Entry::Occupied(mut o) => {
                    let (b, w) = o.get_mut();
                    for (x, y) in b.iter_mut().zip(&ob) {
                        *x = x.wrapping_add(*y);
                    }
                    for (x, y) in w.iter_mut().zip(&ow) {
                        *x = x.wrapping_add(*y);
                    }
                }
            }
        }
    }

    /// Adds everything received into `rx` and `rx_wrs`.
    fn sum_into(self, rx: &mut [u64], rx_wrs: &mut [u64]) {
        for (stride, (mut b, mut w)) in self.by_stride {
            let s = stride as usize;
            for r in s..b.len() {
                b[r] = b[r].wrapping_add(b[r - s]);
                w[r] = w[r].wrapping_add(w[r - s]);
            }
            for r in 0..b.len() {
                rx[r] += b[r];
                rx_wrs[r] += w[r];
            }
        }
    }
}

/// What [`Summary::of`] counts, task by task.
struct Counts {
    /// Per trainer: bytes and work requests sent, gather bytes received.
    tx: Vec<u64>,
    tx_wrs: Vec<u64>,
    grx: Vec<u64>,
    /// Per rollout: bytes and work requests of listed writes received.
    rx: Vec<u64>,
    rx_wrs: Vec<u64>,
    /// What write copies deliver, by progressions of ranks.
    copied: Received,
    routes: u64,
    tasks: u64,
    gather: u64,
    gather_wrs: u64,
    gather_local: u64,
}

impl Counts {
    fn new(nt: usize, nr: usize) -> Counts {
        Counts {
            tx: vec![0; nt],
            tx_wrs: vec![0; nt],
            grx: vec![0; nt],
            rx: vec![0; nr],
            rx_wrs: vec![0; nr],
            copied: Received::default(),
            routes: 0,
            tasks: 0,
            gather: 0,
            gather_wrs: 0,
            gather_local: 0,
        }
    }

    /// Adds what `other` counted.
    fn add(&mut self, other: Counts) {
        for (a, b) in [
            (&mut self.tx, &other.tx),
            (&mut self.tx_wrs, &other.tx_wrs),
            (&mut self.grx, &other.grx),
            (&mut self.rx, &other.rx),
            (&mut self.rx_wrs, &other.rx_wrs),
        ] {
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
        }
        self.copied.add_all(other.copied);
        self.routes += other.routes;
        self.tasks += other.tasks;
        self.gather += other.gather;
        self.gather_wrs += other.gather_wrs;
        self.gather_local += other.gather_local;
    }

    /// Counts one task of trainer `me`, of pattern `p`, whose writes land at `bases`.
    fn task(&mut self, me: usize, r: &TrainerRoutes, p: &TaskPattern, bases: &[[u64; 2]]) {
        let (nt, nr) = (self.tx.len(), self.rx.len());
        self.tasks += 1;
        let pw = r.pattern_writes(p);
        let mut last: Option<u32> = None;
        for (w, b) in pw.iter().zip(bases) {
            let (rank, len) = (b[0] as usize, w.len as u64);
            if !w.to_trainer {
                self.tx[me] += len;
                self.tx_wrs[me] += 1;
                if rank < nr {
                    self.rx[rank] += len;
                    self.rx_wrs[rank] += 1;
                }
                if last != Some(rank as u32) {
                    self.routes += 1;
                    last = Some(rank as u32);
                }
            } else if rank == me {
                self.gather_local += len;
            } else {
                self.tx[me] += len;
                self.tx_wrs[me] += 1;
                if rank < nt {
                    self.grx[rank] += len;
                }
                self.gather += len;
                self.gather_wrs += 1;
            }
        }
        for c in r.pattern_copies(p) {
            let (a, n) = (c.from as usize, c.num as usize);
            let (Some(part), Some(base)) = (pw.get(a..a + n), bases.get(a)) else {
                continue;
            };
            if n == 0 || c.count == 0 {
                continue;
            }
            let bytes: u64 = part.iter().map(|w| w.len as u64).sum();
            let first = (base[0] as u32).wrapping_add(c.rank_offset);
            self.tx[me] += bytes * c.count as u64;
            self.tx_wrs[me] += n as u64 * c.count as u64;
            self.copied
                .add(nr, first, c.stride, c.count, bytes, n as u64);
            // Ranks in a progression differ from one to the next (none when the stride is 0):
            // a route each, but for a first rank equal to the last one.
            let lastr = first.wrapping_add((c.count - 1).wrapping_mul(c.stride));
            if c.stride == 0 {
                self.routes += (last != Some(first)) as u64;
            } else {
                self.routes += c.count as u64 - (last == Some(first)) as u64;
            }
            last = Some(lastr);
        }
    }
}

impl Summary {
    /// Computes the summary of a table under a cost model, from its compact form: each task
    /// once, each write copy as a progression of ranks (never write by write).
    ///
    /// Trainers are counted in parallel (rayon), each into the counts of the thread that takes
    /// it; the counts are integer sums, so adding them up in any order gives the same figures,
    /// and the slowest trainer is picked afterwards in rank order, as one thread would.
    pub fn of(table: &RoutingTable, cost: &CostModel) -> Summary {
        let nt = table.trainers.len();
        let nr = table.rollouts.len();
        let (c, mut trainer_terms) = table
            .trainers
            .par_iter()
            .enumerate()
            .fold(
                || (Counts::new(nt, nr), Vec::new()),
                |(mut c, mut terms), (me, t)| {
                    terms.push((me, trainer_terms(&mut c, me, &t.routes, cost)));
                    (c, terms)
                },
            )
            .reduce(
                || (Counts::new(nt, nr), Vec::new()),
                |(mut a, mut at), (b, bt)| {
                    a.add(b);
                    at.extend(bt);
                    (a, at)
                },
            );
        trainer_terms.sort_unstable_by_key(|&(me, _)| me);
        let mut worst_trainer = (0.0f64, "");
        for (_, terms) in trainer_terms {
            for (s, what) in terms {
                if s > worst_trainer.0 {
                    worst_trainer = (s, what);
                }
            }
        }
        let Counts {
            tx,
            tx_wrs,
            grx,
            mut rx,
            mut rx_wrs,
            copied,
            routes,
            tasks,
            gather,
            gather_wrs,
            gather_local,
        } = c;
        copied.sum_into(&mut rx, &mut rx_wrs);
        let sender = stats(&tx, &tx_wrs, cost);
        let receiver = stats(&rx, &rx_wrs, cost);
        let (predicted, bottleneck) = if receiver.max_time_s > worst_trainer.0 {
            (receiver.max_time_s, "inference NIC")
        } else {
            worst_trainer
        };
        let max_gx = grx.iter().copied().max().unwrap_or(0);
        let most = sender.max_bytes.max(receiver.max_bytes).max(max_gx);
        Summary {
            model: table.model.clone(),
            train_ranks: nt as u32,
            infer_ranks: nr as u32,
            params: table.num_params,
            elements: table.num_elements,
            bytes_to_move: rx.iter().sum(),
            routes,
            tasks,
            work_requests: tx_wrs.iter().sum(),
            gather_bytes: gather,
            gather_work_requests: gather_wrs,
            gather_local_bytes: gather_local,
            max_gather_arena_bytes: table
                .trainers
                .iter()
                .map(|t| t.gather_arena_bytes)
                .max()
                .unwrap_or(0),
            sender,
            receiver,
            max_gather_rx_bytes: max_gx,
            predicted_s: predicted + cost.barrier_s,
            bound_s: most as f64 / cost.nic_bytes_per_s,
            bottleneck: bottleneck.to_string(),
        }
    }
}

/// Counts trainer `me`'s tasks into `c`; returns its time under the cost model by what limits
/// it (its NIC, its host-to-device copies, its preparation), each with the pipeline's fill.
fn trainer_terms(
    c: &mut Counts,
    me: usize,
    r: &TrainerRoutes,
    cost: &CostModel,
) -> [(f64, &'static str); 3] {
    let (mut h2d, mut prep, mut fill) = (0u64, 0u64, 0.0f64);
    let mut cursor = r.cursor();
    while let Some(task) = cursor.next() {
        let Some(p) = r.patterns.get(task.pattern as usize) else {
            continue;
        };
        let input = task_input_bytes(p);
        if !p.gather {
            h2d += input;
        }
        prep += input;
        fill = fill.max(input as f64 / cost.h2d_bytes_per_s + input as f64 / cost.prep_bytes_per_s);
        c.task(me, r, p, task.bases);
    }
    let (tx, tx_wrs) = (c.tx[me], c.tx_wrs[me]);
    [
        (cost.nic_time(tx, tx_wrs) + fill, "trainer NIC"),
        (
            h2d as f64 / cost.h2d_bytes_per_s + fill,
            "host-to-device copies",
        ),
        (prep as f64 / cost.prep_bytes_per_s + fill, "preparation"),
    ]
}

/// Bytes a task of pattern `p` reads (its region in the transform's input dtype).
fn task_input_bytes(p: &TaskPattern) -> u64 {
    p.region.numel() * p.transform.input_dtype().size() as u64
}
