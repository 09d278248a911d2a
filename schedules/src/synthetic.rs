//! Hand-built routing tables of uniform copy tasks.
//!
//! Why: the simulator's exact-answer tests and the calibration's near-empty syncs need tables
//! the planner would never produce (thousands of tiny tasks, every write to a chosen rollout),
//! built the same way in both places so a measured table and a tested one mean the same thing.
//! Each trainer copies `tasks` bf16 tasks of `task_bytes` from its own source arena, each task
//! cut into `writes` equal writes appended to one region per rollout; the result goes through
//! [`RoutingTable::from_plans`], so it is checked and compacted like any other table.

use weightsync_common::DType;

use crate::RoutingTable;
use crate::error::PlanError;
use crate::table::{
    LocalShard, MeshGroup, ParamRef, RolloutPlan, Shape, Source, Task, TensorBox, TrainerPlan,
    Transform, UnitExpect, Write, WriteTarget,
};

/// The shape of a uniform copy table.
#[derive(Debug, Clone, Copy)]
pub struct CopyTable {
    /// Trainer ranks.
    pub trainers: u32,
    /// Rollout ranks (one engine).
    pub rollouts: u32,
    /// Tasks per trainer.
    pub tasks: u32,
    /// Bytes of each task (bf16: even).
    pub task_bytes: u64,
    /// Equal writes each task is cut into (at least 1; `task_bytes` divisible by it).
    pub writes: u32,
}

impl CopyTable {
    /// The table named `name`, where write `j` of task `k` of trainer `t` goes to rollout
    /// `dst(t, k, j)` (taken modulo `rollouts`).
    pub fn build(
        &self,
        name: &str,
        dst: impl Fn(u32, u32, u32) -> u32,
    ) -> Result<RoutingTable, PlanError> {
        let writes = self.writes.max(1);
        if self.task_bytes == 0
            || !self.task_bytes.is_multiple_of(2)
            || !self.task_bytes.is_multiple_of(writes as u64)
            || self.task_bytes / writes as u64 > u32::MAX as u64
            || self.rollouts == 0
        {
            return Err(PlanError::Synthetic(format!(
                "task_bytes {} must be even, > 0, divisible by writes {} and \
                 each write under 4 GiB, with at least one rollout (got {})",
                self.task_bytes, writes, self.rollouts
            )));
        }
        let write_len = self.task_bytes / writes as u64;
        let elems = (self.task_bytes / 2) as u32;
        let mut rolls: Vec<RolloutPlan> = (0..self.rollouts)
            .map(|r| RolloutPlan {
                rank: r,
                engine: 0,
                local_rank: r,
                mr_bytes: vec![0],
                tensors: vec![],
                expect: vec![UnitExpect { unit: 0, writes: 0 }],
            })
            .collect();
        let mut plans = Vec::with_capacity(self.trainers as usize);
        for t in 0..self.trainers {
            let mut p = TrainerPlan {
                rank: t,
                params: vec![],
                shards: vec![],
                source_arena_bytes: self.tasks as u64 * self.task_bytes,
                gather_arena_bytes: 0,
                groups: vec![MeshGroup {
                    id: 0,
                    name: name.into(),
                    first_task: 0,
                    num_tasks: self.tasks,
                    gather_sends: 0,
                    local_tasks: self.tasks,
                    gather_expect: 0,
                }],
                tasks: vec![],
                copies: Vec::new(),
                writes: vec![],
            };
            for k in 0..self.tasks {
                p.params.push(ParamRef {
                    id: k,
                    name: format!("p{k}").into(),
                    shape: Shape::new(&[elems]),
                });
                p.shards.push(LocalShard {
                    param: k,
                    global: TensorBox::new(&[0], &[elems]),
                    dtype: DType::BF16,
                    offset: k as u64 * self.task_bytes,
                });
                for j in 0..writes {
                    let r = dst(t, k, j) % self.rollouts;
                    let roll = &mut rolls[r as usize];
                    p.writes.push(Write {
                        dst: WriteTarget::Rollout(r),
                        mr: 0,
                        unit: 0,
                        len: write_len as u32,
                        src_offset: j as u64 * write_len,
                        dst_offset: roll.mr_bytes[0],
                    });
                    roll.mr_bytes[0] += write_len;
                    roll.expect[0].writes += 1;
                }
                p.tasks.push(Task {
                    param: k,
                    region: TensorBox::new(&[0], &[elems]),
                    source: Source::Shard { shard: k },
                    transform: Transform::Copy { dtype: DType::BF16 },
                    first_write: k * writes,
                    num_writes: writes,
                    first_copy: 0,
                    num_copies: 0,
                });
            }
            plans.push(p);
        }
        RoutingTable::from_plans(name, self.tasks as u64, 0, &plans, &rolls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_write_lands_where_dst_says_and_each_rollout_expects_its_count() {
        let shape = CopyTable {
            trainers: 3,
            rollouts: 2,
            tasks: 5,
            task_bytes: 4096,
            writes: 2,
        };
        let table = shape.build("t", |t, k, j| t + k + j).unwrap();
        let plans = table.trainer_plans().unwrap();
        assert_eq!(plans.len(), 3);
        let mut per_rollout = [0u64; 2];
        for p in &plans {
            assert_eq!(p.tasks.len(), 5);
            assert_eq!(p.writes.len(), 10);
            for (i, w) in p.writes.iter().enumerate() {
                let (k, j) = (i as u32 / 2, i as u32 % 2);
                assert_eq!(w.dst, WriteTarget::Rollout((p.rank + k + j) % 2));
                assert_eq!(w.len, 2048);
                per_rollout[((p.rank + k + j) % 2) as usize] += 1;
            }
        }
        for r in table.rollout_plans() {
            assert_eq!(r.expect[0].writes, per_rollout[r.rank as usize]);
            assert_eq!(r.mr_bytes[0], per_rollout[r.rank as usize] * 2048);
        }
    }

    #[test]
    fn a_task_that_does_not_cut_evenly_is_refused_by_name() {
        let shape = CopyTable {
            trainers: 1,
            rollouts: 1,
            tasks: 1,
            task_bytes: 4096,
            writes: 3,
        };
        let err = shape.build("t", |_, _, _| 0).unwrap_err().to_string();
        assert!(
            err.contains("task_bytes 4096") && err.contains("writes 3"),
            "{err}"
        );
    }
}
