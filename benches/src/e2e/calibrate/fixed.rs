//! The per-sync fixed costs, measured into the simulator's model from near-empty syncs.
//!
//! Why: a sync pays, whatever its bytes, for starting (spawning the trainers' runs, each run's
//! setup), for every task it executes (a piece's spawn, its staging lease, the thread hops of its
//! stages, posting and acknowledging its write) and for finishing (the landing notices). On a
//! 1.5 GB sync these are a few percent, more than the 10% check can leave to an assumption.
//!
//! How, without fitting the runs being checked: the same loopback cluster shape (as many
//! trainers and rollouts as the configuration, the same worker options) runs a synthetic table
//! of tiny tasks ([`TASK_BYTES`] each, every trainer's task `k` written whole to rollout
//! `(t + k) % R`: bytes cost nothing here) at two task counts: the configuration's most tasks
//! on one trainer (`n_large`) and an eighth of it (`n_small`). Each is the median of
//! [`SYNCS`] syncs after a warm-up. The two sizes of the same configuration are a regression:
//! - the per-task cost is the one that makes the simulator, given this machine's measured
//!   rates, reproduce the measured difference `m(n_large) - m(n_small)`: the simulator is
//!   linear in it on such tables, so two simulations per size (with the cost at 0 and at a
//!   probe) solve for it exactly;
//! - the per-sync cost is what is left of `m(n_small)` beyond the simulation of that table with
//!   the per-task cost found: the sync start, the landing notices and the driver's joins. The
//!   loopback driver has no controller, so there is no commit round trip or verification pass
//!   to tell apart from the start: all of it goes into `FixedCosts::start_s`, and
//!   `after_landing_s` stays 0 (on a deployment, the controller's `after_landing_ms` is that
//!   figure).

use serde::Serialize;
use weightsync_common::DType;
use weightsync_schedules::simulate::{simulate, ClusterModel, FixedCosts};
use weightsync_schedules::table::{
    LocalShard, MeshGroup, ParamRef, RolloutPlan, Shape, Source, Task, TensorBox, TrainerPlan,
    Transform, UnitExpect, Write, WriteTarget,
};
use weightsync_schedules::RoutingTable;

use super::super::loopback::{LoopbackCluster, WorkerOptions};
use super::super::E2eError;

/// Bytes of one synthetic task (bf16): small enough that its copy and write cost nothing next
/// to what is being measured.
pub const TASK_BYTES: u64 = 4096;

/// Timed syncs per size (median), after one warm-up.
pub const SYNCS: usize = 5;

/// Per-task cost the search for it starts from (beside 0), seconds.
const PROBE_S: f64 = 100e-6;

/// What the near-empty syncs measured and the fixed costs derived from them.
#[derive(Debug, Clone, Serialize)]
pub struct Fixed {
    /// Tasks per trainer of the small and large near-empty syncs.
    pub tasks: [u32; 2],
    /// Their measured seconds (medians).
    pub measured_s: [f64; 2],
    /// Every timed sync of each.
    pub all_measured_s: [Vec<f64>; 2],
    /// Per-task cost found (the model's `task_overhead_s`), seconds.
    pub task_overhead_s: f64,
    /// Per-sync costs found.
    pub costs: FixedCosts,
}

/// A table where each of `trainers` trainers copies `tasks` tiny bf16 tasks, task `k` of
/// trainer `t` written whole to rollout `(t + k) % rollouts`.
pub fn near_empty_table(
    trainers: u32,
    rollouts: u32,
    tasks: u32,
) -> Result<RoutingTable, E2eError> {
    let elems = (TASK_BYTES / 2) as u32;
    let mut rolls: Vec<RolloutPlan> = (0..rollouts)
        .map(|r| RolloutPlan {
            rank: r,
            engine: 0,
            local_rank: r,
            mr_bytes: vec![0],
            tensors: vec![],
            expect: vec![UnitExpect { unit: 0, writes: 0 }],
        })
        .collect();
    let mut plans = Vec::with_capacity(trainers as usize);
    for t in 0..trainers {
        let mut p = TrainerPlan {
            rank: t,
            params: vec![],
            shards: vec![],
            source_arena_bytes: tasks as u64 * TASK_BYTES,
            gather_arena_bytes: 0,
            groups: vec![MeshGroup {
                id: 0,
                name: "near-empty".into(),
                first_task: 0,
                num_tasks: tasks,
                gather_sends: 0,
                local_tasks: tasks,
                gather_expect: 0,
            }],
            tasks: vec![],
            copies: Vec::new(),
            writes: vec![],
        };
        for k in 0..tasks {
            p.params.push(ParamRef {
                id: k,
                name: format!("p{k}").into(),
                shape: Shape::new(&[elems]),
            });
            p.shards.push(LocalShard {
                param: k,
                global: TensorBox::new(&[0], &[elems]),
                dtype: DType::BF16,
                offset: k as u64 * TASK_BYTES,
            });
            let r = (t + k) % rollouts;
            let roll = &mut rolls[r as usize];
            p.writes.push(Write {
                dst: WriteTarget::Rollout(r),
                mr: 0,
                unit: 0,
                len: TASK_BYTES as u32,
                src_offset: 0,
                dst_offset: roll.mr_bytes[0],
            });
            roll.mr_bytes[0] += TASK_BYTES;
            roll.expect[0].writes += 1;
            p.tasks.push(Task {
                param: k,
                region: TensorBox::new(&[0], &[elems]),
                source: Source::Shard { shard: k },
                transform: Transform::Copy { dtype: DType::BF16 },
                first_write: k,
                num_writes: 1,
                first_copy: 0,
                num_copies: 0,
            });
        }
        plans.push(p);
    }
    RoutingTable::from_plans("near-empty", tasks as u64, 0, &plans, &rolls)
        .map_err(|e| E2eError::Setup(format!("the near-empty table: {e}")))
}

/// Median seconds of [`SYNCS`] syncs of `table` after a warm-up, and every one.
async fn time_syncs(
    table: &RoutingTable,
    workers: &WorkerOptions,
) -> Result<(f64, Vec<f64>), E2eError> {
    let mut c = LoopbackCluster::start(table, workers).await?;
    c.sync().await?;
    let mut v = Vec::with_capacity(SYNCS);
    for _ in 0..SYNCS {
        v.push(c.sync().await?.seconds);
    }
    let mut s = v.clone();
    s.sort_by(f64::total_cmp);
    Ok((s[s.len() / 2], v))
}

/// Runs the two near-empty syncs for `trainers` x `rollouts` with `max_tasks` tasks on the
/// busiest trainer (at least 8 per rollout, and an eighth of it).
pub async fn measure_syncs(
    trainers: u32,
    rollouts: u32,
    max_tasks: u32,
    workers: &WorkerOptions,
) -> Result<Measured, E2eError> {
    // Every rollout gets writes at both sizes.
    let large = max_tasks.max(8 * rollouts);
    let small = (large / 8).max(rollouts);
    let tables = [
        near_empty_table(trainers, rollouts, small)?,
        near_empty_table(trainers, rollouts, large)?,
    ];
    let (a, b) = (
        time_syncs(&tables[0], workers).await?,
        time_syncs(&tables[1], workers).await?,
    );
    Ok(Measured {
        tables,
        tasks: [small, large],
        measured_s: [a.0, b.0],
        all_measured_s: [a.1, b.1],
    })
}

/// The near-empty syncs as measured, before the costs are derived.
#[derive(Debug)]
pub struct Measured {
    tables: [RoutingTable; 2],
    tasks: [u32; 2],
    measured_s: [f64; 2],
    all_measured_s: [Vec<f64>; 2],
}

impl Measured {
    /// Derives the per-task and per-sync costs on `cluster` (the host model of this machine's
    /// measured rates; its own fixed costs are ignored). See the module docs.
    pub fn derive(self, cluster: &ClusterModel) -> Result<Fixed, E2eError> {
        let sim = |table: &RoutingTable, task_s: f64| -> Result<f64, E2eError> {
            let mut c = *cluster;
            c.task_overhead_s = task_s;
            c.fixed = FixedCosts::default();
            simulate(table, &c)
                .map(|r| r.predicted_s)
                .map_err(|e| E2eError::Setup(format!("simulating a near-empty sync: {e}")))
        };
        let [small, large] = &self.tables;
        let [ms, ml] = self.measured_s;
        // How far the simulated difference between the sizes falls short of the measured one
        // at a per-task cost `x`; piecewise linear and rising in `x`: secant steps from 0 and
        // the probe find its root.
        let gap =
            |x: f64| -> Result<f64, E2eError> { Ok((sim(large, x)? - sim(small, x)?) - (ml - ms)) };
        let (mut x0, mut g0) = (0.0, gap(0.0)?);
        let (mut x1, mut g1) = (PROBE_S, gap(PROBE_S)?);
        for _ in 0..8 {
            if (g1 - g0).abs() <= f64::EPSILON * g1.abs().max(1e-12) {
                break;
            }
            let x2 = (x1 - g1 * (x1 - x0) / (g1 - g0)).max(0.0);
            (x0, g0) = (x1, g1);
            (x1, g1) = (x2, gap(x2)?);
            if g1.abs() < 1e-9 {
                break;
            }
        }
        let task_overhead_s = x1.max(0.0);
        let start_s = (ms - sim(small, task_overhead_s)?).max(0.0);
        Ok(Fixed {
            tasks: self.tasks,
            measured_s: self.measured_s,
            all_measured_s: self.all_measured_s,
            task_overhead_s,
            costs: FixedCosts {
                start_s,
                after_landing_s: 0.0,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightsync_schedules::simulate::{HostModel, PrepRates};

    #[test]
    fn near_empty_tables_spread_tiny_tasks_over_every_rollout() {
        let t = near_empty_table(4, 2, 10).unwrap();
        assert_eq!((t.trainers.len(), t.rollouts.len()), (4, 2));
        let p = t.trainer_plan(3).unwrap();
        assert_eq!(p.tasks.len(), 10);
        assert!(p.writes.iter().all(|w| w.len as u64 == TASK_BYTES));
        let received: u64 = t.rollout_plans().map(|r| r.mr_bytes[0]).sum();
        assert_eq!(received, 4 * 10 * TASK_BYTES);
    }

    #[test]
    fn derive_recovers_the_costs_a_known_model_produces() {
        // Measurements made by the simulator itself with known costs come back as those costs.
        let mut c = ClusterModel::default();
        c.host = Some(HostModel {
            h2d_s_per_byte: 1e-10,
            prep_s_per_byte: PrepRates::uniform(1e-10),
            net_s_per_byte: 1e-10,
        });
        c.gpus_per_node = 6;
        c.nics_per_node = 1;
        let tables = [
            near_empty_table(4, 2, 5).unwrap(),
            near_empty_table(4, 2, 40).unwrap(),
        ];
        let mut truth = c;
        truth.task_overhead_s = 80e-6;
        truth.fixed.start_s = 3e-3;
        let m = |t: &RoutingTable| simulate(t, &truth).unwrap().predicted_s;
        let measured_s = [m(&tables[0]), m(&tables[1])];
        let f = Measured {
            tables,
            tasks: [5, 40],
            measured_s,
            all_measured_s: [vec![measured_s[0]], vec![measured_s[1]]],
        }
        .derive(&c)
        .unwrap();
        assert!((f.task_overhead_s - 80e-6).abs() < 1e-8, "{f:?}");
        assert!((f.costs.start_s - 3e-3).abs() < 1e-6, "{f:?}");
        assert_eq!(f.costs.after_landing_s, 0.0);
    }
}
