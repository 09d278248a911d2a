//! Write copies, read back: every write of a task, and the expanded plan a worker executes.
//!
//! The planner stores a box's writes once and names the further identically laid-out rollout
//! ranks as [`WriteCopies`] (see the table's module docs for why). Everything that needs the
//! individual writes (the worker, the simulator, the summary, the tests) reads them through
//! [`TrainerPlan::task_writes`] or gets an expanded plan from [`TrainerPlan::expanded`]. A table
//! decoded from bytes may be malformed: expansion checks every index and never panics.

use crate::error::PlanError;
use crate::table::{Task, TrainerPlan, Write, WriteCopies, WriteTarget};

/// Most rollout ranks a task's copies may name (more than any inference world has).
pub const MAX_COPY_RANKS: u64 = 1 << 16;

impl WriteCopies {
    /// The last rollout rank receiving this copy (as u64: a malformed copy may overflow u32).
    pub fn last_rank(&self) -> u64 {
        self.first_rank as u64 + (self.count as u64).saturating_sub(1) * self.stride as u64
    }

    /// The rollout ranks receiving this copy.
    pub fn ranks(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.count as u64).map(|i| (self.first_rank as u64 + i * self.stride as u64) as u32)
    }

    /// Writes this entry stands for (`num * count`).
    pub fn total_writes(&self) -> u64 {
        self.num as u64 * self.count as u64
    }
}

impl TrainerPlan {
    /// The writes stored for `task` (not counting copies); empty if the task is malformed.
    pub fn task_direct_writes(&self, task: &Task) -> &[Write] {
        let a = task.first_write as usize;
        self.writes
            .get(a..a + task.num_writes as usize)
            .unwrap_or_default()
    }

    /// The copy entries of `task`; empty if the task is malformed.
    pub fn task_copies(&self, task: &Task) -> &[WriteCopies] {
        let a = task.first_copy as usize;
        self.copies
            .get(a..a + task.num_copies as usize)
            .unwrap_or_default()
    }

    /// Every write of `task`, copies included: its stored writes, then each copy's writes rank
    /// by rank. A copy naming writes the task does not have yields nothing (see
    /// [`TrainerPlan::expanded`], which reports it).
    pub fn task_writes<'a>(&'a self, task: &Task) -> impl Iterator<Item = Write> + 'a {
        let direct = self.task_direct_writes(task);
        let copies = self.task_copies(task);
        direct
            .iter()
            .copied()
            .chain(copies.iter().flat_map(move |c| {
                let a = c.from as usize;
                let part = direct.get(a..a + c.num as usize).unwrap_or_default();
                c.ranks().flat_map(move |r| {
                    part.iter().map(move |w| Write {
                        dst: WriteTarget::Rollout(r),
                        ..*w
                    })
                })
            }))
    }

    /// Number of writes of `task`, copies included (saturating: a malformed task can't overflow).
    pub fn task_write_count(&self, task: &Task) -> u64 {
        self.task_copies(task)
            .iter()
            .fold(task.num_writes as u64, |n, c| {
                n.saturating_add(c.total_writes())
            })
    }

    /// Every write of every task, in task order, copies included.
    pub fn all_writes(&self) -> impl Iterator<Item = Write> + '_ {
        self.tasks.iter().flat_map(|t| self.task_writes(t))
    }

    /// Number of writes (work requests) this trainer posts per sync, copies included.
    pub fn num_writes(&self) -> u64 {
        self.tasks
            .iter()
            .fold(0u64, |n, t| n.saturating_add(self.task_write_count(t)))
    }

    /// The same plan with every copy written out: each task's writes explicit and contiguous,
    /// `copies` empty. A plan decoded from bytes is checked first, so that expansion is bounded
    /// by what the bytes describe: tasks' write and copy ranges in bounds and in order, no
    /// copy repeating writes its task lacks, at most [`MAX_COPY_RANKS`] copy ranks per task.
    /// Errors name the task.
    pub fn expanded(&self) -> Result<TrainerPlan, PlanError> {
        self.expanded_within(MAX_COPY_RANKS)
    }

    /// [`TrainerPlan::expanded`], with at most `max_copy_ranks` copy ranks per task (a table
    /// knows its number of rollout ranks: see [`crate::RoutingTable::slice`]).
    pub fn expanded_within(&self, max_copy_ranks: u64) -> Result<TrainerPlan, PlanError> {
        let bad = |task: usize, reason: String| PlanError::BadTable {
            rank: self.rank,
            task: task as u32,
            reason,
        };
        // A task's range `[a, a + n)` of a list of `len`: after the previous task's (`end`).
        let in_order = |what: &str, a: u64, n: u64, end: &mut u64, len: usize| {
            if a < *end || a + n > len as u64 {
                return Err(format!(
                    "{what} {a}..{} overlap an earlier task's or lie beyond the plan's {len}",
                    a + n
                ));
            }
            *end = a + n;
            Ok(())
        };
        let (mut write_end, mut copy_end) = (0u64, 0u64);
        let mut total = 0u64;
        for (i, t) in self.tasks.iter().enumerate() {
            let n = t.num_writes as u64;
            in_order(
                "writes",
                t.first_write as u64,
                n,
                &mut write_end,
                self.writes.len(),
            )
            .map_err(|e| bad(i, e))?;
            let (ca, cn) = (t.first_copy as u64, t.num_copies as u64);
            in_order("copies", ca, cn, &mut copy_end, self.copies.len()).map_err(|e| bad(i, e))?;
            let mut ranks = 0u64;
            for c in self.task_copies(t) {
                if c.from as u64 + c.num as u64 > n {
                    return Err(bad(
                        i,
                        format!(
                            "a copy repeats writes {}..{} of a task with {n}",
                            c.from,
                            c.from as u64 + c.num as u64
                        ),
                    ));
                }
                let last = c.last_rank();
                if last > u32::MAX as u64 {
                    return Err(bad(i, format!("a copy reaches rollout rank {last}")));
                }
                ranks += c.count as u64;
            }
            if ranks > max_copy_ranks {
                return Err(bad(
                    i,
                    format!("copies name {ranks} ranks (at most {max_copy_ranks})"),
                ));
            }
            total += self.task_write_count(t);
        }
        if total > u32::MAX as u64 {
            return Err(PlanError::TooLarge(format!(
                "training rank {} would have {total} writes (more than 2^32)",
                self.rank
            )));
        }
        if self.copies.is_empty() {
            return Ok(self.clone());
        }
        let mut writes = Vec::with_capacity(total as usize);
        let mut tasks = Vec::with_capacity(self.tasks.len());
        for t in &self.tasks {
            let first_write = writes.len() as u32;
            writes.extend(self.task_writes(t));
            tasks.push(Task {
                first_write,
                num_writes: writes.len() as u32 - first_write,
                first_copy: 0,
                num_copies: 0,
                ..*t
            });
        }
        Ok(TrainerPlan {
            rank: self.rank,
            params: self.params.clone(),
            shards: self.shards.clone(),
            source_arena_bytes: self.source_arena_bytes,
            gather_arena_bytes: self.gather_arena_bytes,
            groups: self.groups.clone(),
            tasks,
            writes,
            copies: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{plan, CostModel, ExpertForm, InferenceLayout, Model, TrainingLayout};

    fn table(infer: &str) -> crate::RoutingTable {
        let m = Model::preset("qwen3-0.6b", ExpertForm::PerExpert).unwrap();
        let t = TrainingLayout::build(&m, &"fsdp=4".parse().unwrap()).unwrap();
        let i = InferenceLayout::build(&m, &infer.parse().unwrap()).unwrap();
        plan(&m, &t, &i, &CostModel::default()).unwrap()
    }

    #[test]
    fn engines_are_stored_once_and_expand_to_every_rank() {
        let one = table("tp=2,dp=1");
        let four = table("tp=2,dp=4");
        let sum = |t: &crate::RoutingTable, f: &dyn Fn(&TrainerPlan) -> u64| -> u64 {
            t.trainers.iter().map(f).sum()
        };
        let to_rollouts = |p: &TrainerPlan| {
            p.all_writes()
                .filter(|w| matches!(w.dst, WriteTarget::Rollout(_)))
                .count() as u64
        };
        // Four engines store as many writes as one engine, plus copy entries...
        assert_eq!(
            sum(&one, &|p| p.writes.len() as u64),
            sum(&four, &|p| p.writes.len() as u64)
        );
        // ...which stand for three more engines' writes, with ranks two apart (tp=2).
        assert_eq!(sum(&four, &to_rollouts), 4 * sum(&one, &to_rollouts));
        for p in &four.trainers {
            assert!(p.copies.iter().all(|c| c.stride > 0 && c.count > 0));
            let x = p.expanded().unwrap();
            assert!(x.copies.is_empty());
            assert_eq!(x.writes, p.all_writes().collect::<Vec<_>>());
            // Every engine gets engine 0's writes with only the rank moved by 2 per engine.
            for task in &x.tasks {
                let ws: Vec<Write> = x.task_writes(task).collect();
                let engine0: Vec<&Write> = ws
                    .iter()
                    .filter(|w| matches!(w.dst, WriteTarget::Rollout(r) if r < 2))
                    .collect();
                for e in 1..4u32 {
                    for w in &engine0 {
                        let WriteTarget::Rollout(r) = w.dst else {
                            unreachable!()
                        };
                        let moved = Write {
                            dst: WriteTarget::Rollout(r + 2 * e),
                            ..**w
                        };
                        assert!(ws.contains(&moved), "{moved:?} missing");
                    }
                }
            }
        }
    }

    #[test]
    fn malformed_copies_are_refused_naming_the_task() {
        let t = table("tp=2,dp=2");
        let r = (0..t.trainers.len())
            .find(|&r| !t.trainers[r].copies.is_empty())
            .unwrap();
        let task = t.trainers[r]
            .tasks
            .iter()
            .position(|k| k.num_copies > 0)
            .unwrap();
        let first = t.trainers[r].tasks[task].first_copy as usize;
        type Spoil = fn(&mut WriteCopies);
        let cases: [(&str, Spoil); 3] = [
            ("repeats writes", |c| c.num += 1_000_000),
            ("reaches rollout rank", |c| c.first_rank = 1 << 20),
            ("ranks", |c| {
                c.stride = 0;
                c.count = 5
            }),
        ];
        for (want, spoil) in cases {
            let mut bad = t.clone();
            spoil(&mut bad.trainers[r].copies[first]);
            let e = bad.slice(r as u32).unwrap_err().to_string();
            assert!(
                e.contains(want) && e.contains(&format!("task {task}")),
                "{e}"
            );
        }
        let mut bad = t.clone();
        bad.trainers[r].tasks[task].num_copies = u32::MAX;
        let e = bad.slice(r as u32).unwrap_err().to_string();
        assert!(e.contains("beyond"), "{e}");
    }
}
