//! Write copies, read back: every write of a task, and the expanded plan a worker executes.
//!
//! An explicit plan may name the further identically laid-out rollout ranks of a task's writes
//! as [`WriteCopies`] rather than listing them (the routing table's compact form does the same
//! with [`crate::compact::PatternCopy`]; what [`crate::slice::TrainerSlice::expand`] returns
//! has none). Whatever needs the individual writes reads them through
//! [`TrainerPlan::task_writes`] or gets an expanded plan from [`TrainerPlan::expanded`]. A plan
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
    pub fn task_writes<'a>(&'a self, task: &Task) -> impl Iterator<Item = Write> + 'a + use<'a> {
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
    use crate::table::{LocalShard, MeshGroup, ParamRef, Shape, Source, TensorBox, Transform};
    use weightsync_common::DType;

    /// One task of two writes (to rank 0), repeated to ranks 2, 4 and 6.
    fn plan() -> TrainerPlan {
        let w = |len: u32, src: u64, dst: u64| Write {
            dst: WriteTarget::Rollout(0),
            mr: 0,
            unit: 0,
            len,
            src_offset: src,
            dst_offset: dst,
        };
        TrainerPlan {
            rank: 0,
            params: vec![ParamRef {
                id: 0,
                name: "w".into(),
                shape: Shape::new(&[4, 8]),
            }],
            shards: vec![LocalShard {
                param: 0,
                global: TensorBox::new(&[0, 0], &[4, 8]),
                dtype: DType::BF16,
                offset: 0,
            }],
            source_arena_bytes: 64,
            gather_arena_bytes: 0,
            groups: vec![MeshGroup {
                id: 0,
                name: "g".into(),
                first_task: 0,
                num_tasks: 1,
                gather_sends: 0,
                local_tasks: 1,
                gather_expect: 0,
            }],
            tasks: vec![Task {
                param: 0,
                region: TensorBox::new(&[0, 0], &[4, 8]),
                source: Source::Shard { shard: 0 },
                transform: Transform::Copy { dtype: DType::BF16 },
                first_write: 0,
                num_writes: 2,
                first_copy: 0,
                num_copies: 1,
            }],
            writes: vec![w(32, 0, 100), w(32, 32, 300)],
            copies: vec![WriteCopies {
                from: 0,
                num: 2,
                first_rank: 2,
                stride: 2,
                count: 3,
            }],
        }
    }

    #[test]
    fn copies_expand_rank_by_rank_after_the_stored_writes() {
        let p = plan();
        assert_eq!(p.num_writes(), 8);
        let x = p.expanded().unwrap();
        assert!(x.copies.is_empty());
        assert_eq!(x.writes, p.all_writes().collect::<Vec<_>>());
        let ranks: Vec<WriteTarget> = x.writes.iter().map(|w| w.dst).collect();
        let r = WriteTarget::Rollout;
        assert_eq!(ranks, [r(0), r(0), r(2), r(2), r(4), r(4), r(6), r(6)]);
        assert!(
            x.writes
                .chunks(2)
                .all(|c| c[0].dst_offset == 100 && c[1].dst_offset == 300)
        );
    }

    #[test]
    fn malformed_copies_are_refused_naming_the_task() {
        type Spoil = fn(&mut WriteCopies);
        let cases: [(&str, Spoil); 3] = [
            ("repeats writes", |c| c.num += 1_000_000),
            ("reaches rollout rank", |c| c.first_rank = u32::MAX),
            ("ranks", |c| {
                c.stride = 0;
                c.count = MAX_COPY_RANKS as u32 + 1
            }),
        ];
        for (want, spoil) in cases {
            let mut bad = plan();
            spoil(&mut bad.copies[0]);
            let e = bad.expanded().unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("task 0"), "{e}");
        }
        let mut bad = plan();
        bad.tasks[0].num_copies = u32::MAX;
        let e = bad.expanded().unwrap_err().to_string();
        assert!(e.contains("beyond"), "{e}");
    }
}
