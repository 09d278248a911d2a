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
//!
//! This file holds the figures and their definitions; `counting` counts them from the table's
//! compact form (runs of tasks at once, write copies as progressions of ranks).

mod counting;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::cost::CostModel;
use crate::table::RoutingTable;
use counting::{CountTrainer, Counts, trainer_terms, trainer_terms_each_task};

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

impl Summary {
    /// Computes the summary of a table under a cost model, from its compact form: a run of
    /// tasks of the same patterns whose base records progress in step at once, in closed form
    /// (see `counting::trainer_terms`), other tasks one by one, each write copy as a progression of
    /// ranks (never write by write). Exactly [`Summary::of_each_task`]'s figures.
    ///
    /// Trainers are counted in parallel (rayon), each into the counts of the thread that takes
    /// it; the counts are integer sums, so adding them up in any order gives the same figures,
    /// and the slowest trainer is picked afterwards in rank order, as one thread would.
    pub fn of(table: &RoutingTable, cost: &CostModel) -> Summary {
        Summary::of_with(table, cost, trainer_terms)
    }

    /// [`Summary::of`] counted task by task (each task's base records decoded and walked): the
    /// reference the run-by-run count is tested against.
    pub fn of_each_task(table: &RoutingTable, cost: &CostModel) -> Summary {
        Summary::of_with(table, cost, trainer_terms_each_task)
    }

    fn of_with(table: &RoutingTable, cost: &CostModel, count: CountTrainer) -> Summary {
        let nt = table.trainers.len();
        let nr = table.rollouts.len();
        let (c, mut trainer_terms) = table
            .trainers
            .par_iter()
            .enumerate()
            .fold(
                || (Counts::new(nt, nr), Vec::new()),
                |(mut c, mut terms), (me, t)| {
                    terms.push((me, count(&mut c, me, &t.routes, cost)));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compact::{
        BASE_FIELDS, PatternCopy, PatternWrite, TASK_FIELDS, TaskPattern, TrainerRoutes,
    };
    use crate::packed::Packed;
    use crate::table::{CompactTrainer, RolloutEntry, TensorBox, Transform};
    use weightsync_common::DType;

    use super::counting::CHUNKS;

    /// A tiny xorshift generator (tests only).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Records of `w` fields: pieces of progressions of random periods and steps (some
    /// negative, some huge), some records literal.
    fn progressions<const W: usize>(
        rng: &mut Rng,
        n: usize,
        field: impl Fn(&mut Rng, usize) -> u64,
    ) -> Vec<[u64; W]> {
        let mut out = Vec::new();
        while out.len() < n {
            let p = rng.below(6) as usize + 1;
            let reps = rng.below(12);
            let first: Vec<[u64; W]> = (0..p)
                .map(|_| std::array::from_fn(|f| field(rng, f)))
                .collect();
            let step: Vec<[u64; W]> = (0..p)
                .map(|_| {
                    std::array::from_fn(|_| match rng.below(8) {
                        0..=3 => 0,
                        4 => 1,
                        5 => 1u64.wrapping_neg(),
                        6 => rng.below(5),
                        _ => 1 << (32 + rng.below(32)),
                    })
                })
                .collect();
            for r in 0..reps {
                for j in 0..p {
                    out.push(std::array::from_fn(|f| {
                        first[j][f].wrapping_add(step[j][f].wrapping_mul(r))
                    }));
                }
            }
            if rng.below(3) == 0 {
                out.push(std::array::from_fn(|f| field(rng, f)));
            }
        }
        out.truncate(n);
        out
    }

    /// A trainer's routes with random patterns, tasks and bases (the bases not necessarily as
    /// many as the tasks need, the pattern fields not always a pattern).
    fn random_routes(rng: &mut Rng, nt: u64, nr: u64) -> TrainerRoutes {
        let mut r = TrainerRoutes::default();
        let npat = rng.below(5) + 1;
        for _ in 0..npat {
            let nw = rng.below(5) as u32;
            let first_write = r.writes.len() as u32;
            for _ in 0..nw {
                r.writes.push(PatternWrite {
                    to_trainer: rng.below(4) == 0,
                    mr: 0,
                    len: rng.below(1000) as u32 + 1,
                    src_offset: 0,
                });
            }
            let first_copy = r.copies.len() as u32;
            for _ in 0..rng.below(3) {
                r.copies.push(PatternCopy {
                    from: rng.below(nw as u64 + 1) as u32,
                    num: rng.below(3) as u32,
                    rank_offset: (rng.below(2 * nr) as u32).wrapping_sub(nr as u32),
                    stride: rng.below(4) as u32,
                    count: rng.below(4) as u32,
                });
            }
            r.patterns.push(TaskPattern {
                region: TensorBox::new(&[0, 0], &[rng.below(64) as u32 + 1, 128]),
                transform: Transform::Fp8Block {
                    from: DType::BF16,
                    recipe: weightsync_common::Fp8Recipe::Vllm,
                },
                gather: rng.below(3) == 0,
                first_write,
                num_writes: nw,
                first_copy,
                num_copies: r.copies.len() as u32 - first_copy,
            });
        }
        let ntasks = rng.below(200) as usize;
        let mut tasks: Vec<[u64; TASK_FIELDS]> = Vec::new();
        let mut bases: Vec<[u64; BASE_FIELDS]> = Vec::new();
        let rank = |rng: &mut Rng| match rng.below(10) {
            0 => rng.next(),
            _ => rng.below(nt.max(nr) + 2),
        };
        let step = |rng: &mut Rng| match rng.below(8) {
            0..=3 => 0,
            4 => 1,
            5 => 1u64.wrapping_neg(),
            6 => rng.below(5),
            _ => 1 << (32 + rng.below(32)),
        };
        while tasks.len() < ntasks {
            if rng.below(2) == 0 {
                // Tasks of fixed patterns repeated, their bases moving with the repetitions.
                let p = rng.below(4) as usize + 1;
                let pats: Vec<u64> = (0..p).map(|_| rng.below(npat)).collect();
                let per_rep: u64 = pats
                    .iter()
                    .map(|&i| r.patterns[i as usize].num_writes as u64)
                    .sum();
                let first: Vec<u64> = (0..per_rep).map(|_| rank(rng)).collect();
                let steps: Vec<u64> = (0..per_rep).map(|_| step(rng)).collect();
                for rep in 0..rng.below(12) {
                    tasks.extend(pats.iter().map(|&i| [i, rep, rep]));
                    for (a, s) in first.iter().zip(&steps) {
                        bases.push([a.wrapping_add(s.wrapping_mul(rep)), rep]);
                    }
                }
            } else {
                let more = progressions::<TASK_FIELDS>(rng, 20, |rng, f| match f {
                    0 => {
                        let extra = (rng.below(10) == 0) as u64;
                        rng.below(npat + extra)
                    }
                    _ => rng.below(1000),
                });
                let need: u64 = more
                    .iter()
                    .map(|t| {
                        r.patterns
                            .get(t[0] as usize)
                            .map_or(0, |p| p.num_writes as u64)
                    })
                    .sum();
                bases.extend(progressions::<BASE_FIELDS>(
                    rng,
                    need as usize,
                    |rng, f| match f {
                        0 => rank(rng),
                        _ => rng.below(1 << 20),
                    },
                ));
                tasks.extend(more);
            }
        }
        if rng.below(8) == 0 {
            // Fewer bases than the tasks need.
            let keep = rng.below(bases.len() as u64 + 1) as usize;
            bases.truncate(keep);
        }
        r.tasks = Packed::of(&tasks);
        r.bases = Packed::of(&bases);
        if rng.below(10) == 0 {
            // Lists whose last stored fields are missing.
            r.bases
                .fields
                .truncate(r.bases.fields.len().saturating_sub(3));
        }
        r
    }

    #[test]
    fn counted_by_runs_the_figures_are_those_counted_task_by_task() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let cost = CostModel::default();
        for case in 0..300 {
            let (nt, nr) = (rng.below(6) + 1, rng.below(40) + 1);
            let table = RoutingTable {
                model: "random".into(),
                num_params: 0,
                num_elements: 0,
                params: Vec::new(),
                group_names: Vec::new(),
                trainers: (0..nt)
                    .map(|rank| CompactTrainer {
                        rank: rank as u32,
                        source_arena_bytes: 0,
                        gather_arena_bytes: 0,
                        params: Packed::default(),
                        groups: Packed::default(),
                        routes: random_routes(&mut rng, nt, nr),
                    })
                    .collect(),
                rollout_layouts: Vec::new(),
                rollouts: (0..nr)
                    .map(|rank| RolloutEntry {
                        rank: rank as u32,
                        engine: 0,
                        local_rank: rank as u32,
                        layout: 0,
                        expect: Vec::new(),
                    })
                    .collect(),
            };
            assert_eq!(
                Summary::of(&table, &cost),
                Summary::of_each_task(&table, &cost),
                "case {case}"
            );
        }
        // Most cases have runs counted at once (the rest of the tasks one by one).
        let chunks = CHUNKS.load(std::sync::atomic::Ordering::Relaxed);
        assert!(chunks > 1000, "only {chunks} runs counted at once");
    }
}
