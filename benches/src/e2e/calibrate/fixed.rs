//! The per-sync fixed costs, measured into the simulator's model from near-empty syncs.
//!
//! Why: a sync pays, whatever its bytes, for starting (spawning the trainers' runs, each run's
//! setup), for every task it executes (a piece's spawn, its staging lease, the thread hops of its
//! stages, posting and acknowledging its write) and for finishing (the landing notices). On a
//! 1.5 GB sync these are a few percent, more than the 10% check can leave to an assumption.
//!
//! How, without fitting the runs being checked: the same loopback cluster shape (as many
//! trainers and rollouts as the configuration, the same worker options) runs a synthetic table
//! of tiny tasks ([`TASK_BYTES`] each, every trainer's task `k` written to rollout
//! `(t + k) % R`, or split in two writes to that rollout and the next: bytes cost nothing here)
//! three times: the configuration's most tasks on one trainer (`n_large`) with one write per
//! task and with two, and an eighth of the tasks (`n_small`) with one. Each is the median of
//! [`SYNCS`] syncs after a warm-up. They are a regression over sizes of the same
//! configuration, solved on the simulator itself (given this machine's measured rates, it is
//! piecewise linear in each cost on such tables; secant steps find each one):
//! - the per-write host cost (`HostModel::net_s_per_write`) is the one that reproduces the
//!   measured difference between two writes per task and one at `n_large`;
//! - with it, the per-task cost is the one that reproduces `m(n_large) - m(n_small)`;
//! - the per-sync cost is what is left of `m(n_small)` beyond the simulation of that table with
//!   the per-task cost found: the sync start, the landing notices and the driver's joins. The
//!   loopback driver has no controller, so there is no commit round trip or verification pass
//!   to tell apart from the start: all of it goes into `FixedCosts::start_s`, and
//!   `after_landing_s` stays 0 (on a deployment, the controller's `after_landing_ms` is that
//!   figure).

use serde::Serialize;
use weightsync_schedules::RoutingTable;
use weightsync_schedules::simulate::{ClusterModel, FixedCosts, simulate};
use weightsync_schedules::synthetic::CopyTable;

use super::super::E2eError;
use super::super::loopback::{LoopbackCluster, WorkerOptions};

/// Bytes of one synthetic task (bf16): small enough that its copy and write cost nothing next
/// to what is being measured.
pub const TASK_BYTES: u64 = 4096;

/// Timed syncs per size (median), after one warm-up.
pub const SYNCS: usize = 7;

/// Per-task cost the search for it starts from (beside 0), seconds.
const PROBE_S: f64 = 100e-6;

/// What the near-empty syncs measured and the fixed costs derived from them.
#[derive(Debug, Clone, Serialize)]
pub struct Fixed {
    /// Tasks per trainer of the small and large near-empty syncs (the third has as many as the
    /// large one, two writes each).
    pub tasks: [u32; 2],
    /// Their measured seconds (medians): small, large, large with two writes per task.
    pub measured_s: [f64; 3],
    /// Every timed sync of each.
    pub all_measured_s: [Vec<f64>; 3],
    /// Per-task cost found (the model's `task_overhead_s`), seconds.
    pub task_overhead_s: f64,
    /// Host cost per write found (the model's `HostModel::net_s_per_write`), seconds.
    pub write_s: f64,
    /// Per-sync costs found.
    pub costs: FixedCosts,
}

/// A table where each of `trainers` trainers copies `tasks` tiny bf16 tasks, task `k` of
/// trainer `t` cut in `writes` equal writes, write `j` to rollout `(t + k + j) % rollouts`.
pub fn near_empty_table(
    trainers: u32,
    rollouts: u32,
    tasks: u32,
    writes: u32,
) -> Result<RoutingTable, E2eError> {
    CopyTable {
        trainers,
        rollouts,
        tasks,
        task_bytes: TASK_BYTES,
        writes: writes.max(1),
    }
    .build("near-empty", |t, k, j| t + k + j)
    .map_err(|e| E2eError::Setup(format!("the near-empty table: {e}")))
}

/// Runs the three near-empty syncs for `trainers` x `rollouts` with `max_tasks` tasks on the
/// busiest trainer (at least 8 per rollout, and an eighth of it). The three clusters run one
/// sync each in turn, so a load spike of the shared machine hits all three alike rather than
/// one of them.
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
        near_empty_table(trainers, rollouts, small, 1)?,
        near_empty_table(trainers, rollouts, large, 1)?,
        near_empty_table(trainers, rollouts, large, 2)?,
    ];
    let mut clusters = Vec::with_capacity(tables.len());
    for t in &tables {
        let mut c = LoopbackCluster::start(t, workers).await?;
        c.sync().await?; // warm-up
        clusters.push(c);
    }
    let mut all: [Vec<f64>; 3] = Default::default();
    for _ in 0..SYNCS {
        for (c, v) in clusters.iter_mut().zip(all.iter_mut()) {
            v.push(c.sync().await?.seconds);
        }
    }
    let median = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        s[s.len() / 2]
    };
    Ok(Measured {
        tables,
        tasks: [small, large],
        measured_s: [median(&all[0]), median(&all[1]), median(&all[2])],
        all_measured_s: all,
    })
}

/// The near-empty syncs as measured, before the costs are derived.
#[derive(Debug)]
pub struct Measured {
    tables: [RoutingTable; 3],
    tasks: [u32; 2],
    measured_s: [f64; 3],
    all_measured_s: [Vec<f64>; 3],
}

impl Measured {
    /// Derives the per-task and per-sync costs on `cluster` (the host model of this machine's
    /// measured rates; its own fixed costs are ignored). See the module docs.
    pub fn derive(self, cluster: &ClusterModel) -> Result<Fixed, E2eError> {
        let sim = |table: &RoutingTable, task_s: f64, write_s: f64| -> Result<f64, E2eError> {
            let mut c = *cluster;
            c.task_overhead_s = task_s;
            c.fixed = FixedCosts::default();
            if let Some(h) = c.host.as_mut() {
                h.net_s_per_write = write_s;
            }
            simulate(table, &c)
                .map(|r| r.predicted_s)
                .map_err(|e| E2eError::Setup(format!("simulating a near-empty sync: {e}")))
        };
        let [small, large, split] = &self.tables;
        let [ms, ml, m2] = self.measured_s;
        // Per write: how far the simulated two-writes-minus-one-write difference falls short
        // of the measured one (the per-task cost is the same in both and left at 0).
        let write_s = solve(|y| Ok((sim(split, 0.0, y)? - sim(large, 0.0, y)?) - (m2 - ml)))?;
        let task_overhead_s =
            solve(|x| Ok((sim(large, x, write_s)? - sim(small, x, write_s)?) - (ml - ms)))?;
        let start_s = (ms - sim(small, task_overhead_s, write_s)?).max(0.0);
        Ok(Fixed {
            tasks: self.tasks,
            measured_s: self.measured_s,
            all_measured_s: self.all_measured_s,
            task_overhead_s,
            write_s,
            costs: FixedCosts {
                start_s,
                after_landing_s: 0.0,
            },
        })
    }
}

/// The non-negative root of `gap`, rising and piecewise linear: secant steps from 0 and
/// [`PROBE_S`] (0 when even 0 overshoots).
fn solve(gap: impl Fn(f64) -> Result<f64, E2eError>) -> Result<f64, E2eError> {
    let (mut x0, mut g0) = (0.0, gap(0.0)?);
    if g0 >= 0.0 {
        return Ok(0.0);
    }
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
    Ok(x1.max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightsync_schedules::simulate::{HostModel, PrepRates};

    #[test]
    fn near_empty_tables_spread_tiny_tasks_over_every_rollout() {
        let t = near_empty_table(4, 2, 10, 1).unwrap();
        assert_eq!((t.trainers.len(), t.rollouts.len()), (4, 2));
        let p = t.trainer_plan(3).unwrap();
        assert_eq!(p.tasks.len(), 10);
        assert!(p.writes.iter().all(|w| w.len as u64 == TASK_BYTES));
        let received: u64 = t.rollout_plans().map(|r| r.mr_bytes[0]).sum();
        assert_eq!(received, 4 * 10 * TASK_BYTES);
        let two = near_empty_table(4, 2, 10, 2).unwrap();
        let p = two.trainer_plan(1).unwrap();
        assert_eq!((p.tasks.len(), p.writes.len()), (10, 20));
        let received: u64 = two.rollout_plans().map(|r| r.mr_bytes[0]).sum();
        assert_eq!(received, 4 * 10 * TASK_BYTES);
    }

    #[test]
    fn derive_recovers_the_costs_a_known_model_produces() {
        // Measurements made by the simulator itself with known costs come back as those costs.
        let c = ClusterModel {
            host: Some(HostModel {
                h2d_s_per_byte: 1e-10,
                prep_s_per_byte: PrepRates::uniform(1e-10),
                net_s_per_byte: 1e-10,
                net_s_per_write: 0.0,
            }),
            gpus_per_node: 6,
            nics_per_node: 1,
            ..ClusterModel::default()
        };
        let tables = [
            near_empty_table(4, 2, 5, 1).unwrap(),
            near_empty_table(4, 2, 40, 1).unwrap(),
            near_empty_table(4, 2, 40, 2).unwrap(),
        ];
        let mut truth = c;
        truth.task_overhead_s = 80e-6;
        truth.fixed.start_s = 3e-3;
        if let Some(h) = truth.host.as_mut() {
            h.net_s_per_write = 30e-6;
        }
        let m = |t: &RoutingTable| simulate(t, &truth).unwrap().predicted_s;
        let measured_s = [m(&tables[0]), m(&tables[1]), m(&tables[2])];
        let f = Measured {
            tables,
            tasks: [5, 40],
            measured_s,
            all_measured_s: measured_s.map(|x| vec![x]),
        }
        .derive(&c)
        .unwrap();
        assert!((f.write_s - 30e-6).abs() < 1e-8, "{f:?}");
        assert!((f.task_overhead_s - 80e-6).abs() < 1e-8, "{f:?}");
        assert!((f.costs.start_s - 3e-3).abs() < 1e-6, "{f:?}");
        assert_eq!(f.costs.after_landing_s, 0.0);
    }
}
