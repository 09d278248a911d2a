//! A trainer's tasks in compact form: each task shape stored once as a [`TaskPattern`], and the
//! tasks themselves as packed records naming a pattern, a parameter, a source and where each
//! write lands.
//!
//! Why: a trainer's tasks are a handful of shapes repeated. The tasks of the experts of a layer
//! share their region, transform and the sizes and source offsets of their writes; only the
//! parameter, the shard and the destination (rank and offset) move, by the same amount from one
//! expert to the next. So a task is a record `[pattern, param, source]` and each of its writes
//! a record `[rank, dst_offset]` (a *base*), both lists [`Packed`] as progressions, and what is
//! the same for every task of a shape is its pattern. The further ranks that receive a copy of a
//! task's writes (other engines, attention replicas) are a pattern's [`PatternCopy`]s, relative
//! to the rank of the write they repeat, so a copy is part of the shape too.
//!
//! What a record means (the contract [`crate::slice::TrainerSlice::expand`] implements):
//! - task record `[pattern, param, source]`: a [`Task`] of `patterns[pattern]`'s region and
//!   transform, of parameter `param` (an index into the plan's parameters), reading shard
//!   `source` or, for a pattern that reads the gather arena, the gather arena at byte `source`.
//! - the task's `num_writes` writes take the next `num_writes` base records `[rank, dst_offset]`
//!   in order: write `k` goes to `rank` (a rollout rank, or a trainer's gather arena when
//!   [`PatternWrite::to_trainer`]) at `dst_offset`, with the pattern write's region, length and
//!   source offset. Its immediate unit is 0 for a rollout and the id of the task's mesh group
//!   for a trainer (the only units the planner uses, so they are not stored).
//! - then each [`PatternCopy`]: ranks `first + i * stride`, `i < count`, with `first` the rank of
//!   write `from` plus `rank_offset`, each receiving writes `from..from + num` again, only the
//!   rank changed (a rollout rank).
//!
//! Shards are packed too (`[param, ndim, start x3, len x3, dtype, offset]`): the experts of a
//! layer are shards of the same box one after the other.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use weightsync_common::DType;

use crate::error::PlanError;
use crate::packed::Packed;
use crate::table::{
    LocalShard, MAX_DIMS, Source, Task, TensorBox, TrainerPlan, Transform, Write, WriteTarget,
};

/// Fields of a task record: pattern, parameter, source.
pub const TASK_FIELDS: usize = 3;
/// Fields of a base record: rank, destination offset.
pub const BASE_FIELDS: usize = 2;
/// Fields of a shard record: parameter, ndim, start (3), len (3), dtype, arena offset.
pub const SHARD_FIELDS: usize = 4 + 2 * MAX_DIMS;

/// What every task of one shape shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TaskPattern {
    /// The box of the parameter the task covers.
    pub region: TensorBox,
    /// How it is prepared.
    pub transform: Transform,
    /// Whether the task reads the gather arena (its record's source is a byte offset there)
    /// rather than a shard (its record's source is a shard index).
    pub gather: bool,
    /// The pattern's writes: `writes[first_write..first_write + num_writes]`.
    pub first_write: u32,
    /// Number of writes (and of base records a task of this pattern takes).
    pub num_writes: u32,
    /// The pattern's copies: `copies[first_copy..first_copy + num_copies]`.
    pub first_copy: u32,
    /// Number of copies.
    pub num_copies: u32,
}

/// A write of a pattern, its destination left to the task's base record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PatternWrite {
    /// Whether it lands in a trainer's gather arena (else in a rollout).
    pub to_trainer: bool,
    /// Destination memory region.
    pub mr: u16,
    /// Length in bytes.
    pub len: u32,
    /// Byte offset within the task's prepared output.
    pub src_offset: u64,
}

/// Writes `from..from + num` of a pattern repeated to further rollout ranks laid out alike:
/// `first + i * stride` for `i < count`, `first` being the rank of write `from` plus
/// `rank_offset` (wrapping).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PatternCopy {
    /// First write repeated.
    pub from: u32,
    /// Writes repeated.
    pub num: u32,
    /// First receiving rank, relative to the rank of write `from`.
    pub rank_offset: u32,
    /// Distance between receiving ranks.
    pub stride: u32,
    /// Receiving ranks.
    pub count: u32,
}

impl PatternCopy {
    /// The receiving ranks when write `from` goes to `base_rank`.
    pub fn ranks(&self, base_rank: u32) -> impl Iterator<Item = u32> + '_ {
        let first = base_rank.wrapping_add(self.rank_offset);
        (0..self.count).map(move |i| first.wrapping_add(i.wrapping_mul(self.stride)))
    }
}

/// A trainer's shards and tasks, compact (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TrainerRoutes {
    /// Shards in the source arena, packed ([`SHARD_FIELDS`] fields).
    pub shards: Packed,
    /// Task shapes.
    pub patterns: Vec<TaskPattern>,
    /// Writes of all patterns.
    pub writes: Vec<PatternWrite>,
    /// Copies of all patterns.
    pub copies: Vec<PatternCopy>,
    /// Tasks in execution order, packed ([`TASK_FIELDS`] fields).
    pub tasks: Packed,
    /// Where each write of each task lands, in task order, packed ([`BASE_FIELDS`] fields).
    pub bases: Packed,
}

impl TrainerRoutes {
    /// The writes of a pattern; empty if the pattern is malformed.
    pub fn pattern_writes(&self, p: &TaskPattern) -> &[PatternWrite] {
        let a = p.first_write as usize;
        self.writes
            .get(a..a.saturating_add(p.num_writes as usize))
            .unwrap_or_default()
    }

    /// The copies of a pattern; empty if the pattern is malformed.
    pub fn pattern_copies(&self, p: &TaskPattern) -> &[PatternCopy] {
        let a = p.first_copy as usize;
        self.copies
            .get(a..a.saturating_add(p.num_copies as usize))
            .unwrap_or_default()
    }

    /// The tasks with their base records, in order: [`TaskCursor`].
    pub fn cursor(&self) -> TaskCursor<'_> {
        TaskCursor {
            routes: self,
            tasks: self.tasks.iter(),
            bases: self.bases.iter(),
            buf: Vec::new(),
        }
    }

    /// The explicit shards. Records that cannot be shards (more than [`MAX_DIMS`] dims, an
    /// unknown dtype, a field beyond `u32`) are an error naming the shard.
    pub fn local_shards(&self) -> Result<Vec<LocalShard>, String> {
        let mut out = Vec::with_capacity(self.shards.len().min(1 << 20) as usize);
        for (i, f) in self.shards.iter::<SHARD_FIELDS>().enumerate() {
            out.push(shard_from_record(&f).ok_or_else(|| format!("shard {i} is malformed"))?);
        }
        Ok(out)
    }
}

/// One task and its base records, as [`TaskCursor::next`] yields them.
#[derive(Debug, Clone, Copy)]
pub struct CompactTask<'a> {
    /// The pattern's index (not checked).
    pub pattern: u64,
    /// The parameter index (not checked).
    pub param: u64,
    /// Shard index or gather offset (see [`TaskPattern::gather`]).
    pub source: u64,
    /// The task's base records: as many as its pattern has writes, or fewer where the list
    /// ends or the pattern does not exist (then none).
    pub bases: &'a [[u64; BASE_FIELDS]],
}

/// Walks a trainer's tasks and deals each its base records (see the module docs).
#[derive(Debug, Clone)]
pub struct TaskCursor<'a> {
    routes: &'a TrainerRoutes,
    tasks: crate::packed::Records<'a, TASK_FIELDS>,
    bases: crate::packed::Records<'a, BASE_FIELDS>,
    buf: Vec<[u64; BASE_FIELDS]>,
}

impl TaskCursor<'_> {
    /// The next task, or `None` at the end.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Option<CompactTask<'_>> {
        let [pattern, param, source] = self.tasks.next()?;
        let n = usize::try_from(pattern)
            .ok()
            .and_then(|p| self.routes.patterns.get(p))
            .map_or(0, |p| p.num_writes);
        self.buf.clear();
        self.buf.extend(self.bases.by_ref().take(n as usize));
        Some(CompactTask {
            pattern,
            param,
            source,
            bases: &self.buf,
        })
    }
}

/// Dtypes by their code in a shard record.
const DTYPES: [DType; 4] = [DType::BF16, DType::F16, DType::F32, DType::F8E4M3];

fn shard_record(s: &LocalShard) -> [u64; SHARD_FIELDS] {
    let mut f = [0u64; SHARD_FIELDS];
    f[0] = s.param as u64;
    f[1] = s.global.ndim as u64;
    for d in 0..MAX_DIMS {
        f[2 + d] = s.global.start[d] as u64;
        f[2 + MAX_DIMS + d] = s.global.len[d] as u64;
    }
    f[2 + 2 * MAX_DIMS] = DTYPES.iter().position(|&d| d == s.dtype).unwrap_or(0) as u64;
    f[3 + 2 * MAX_DIMS] = s.offset;
    f
}

fn shard_from_record(f: &[u64; SHARD_FIELDS]) -> Option<LocalShard> {
    let small = |x: u64| u32::try_from(x).ok();
    let ndim = u8::try_from(f[1])
        .ok()
        .filter(|&n| n as usize <= MAX_DIMS)?;
    let mut global = TensorBox {
        ndim,
        start: [0; MAX_DIMS],
        len: [0; MAX_DIMS],
    };
    for d in 0..MAX_DIMS {
        global.start[d] = small(f[2 + d])?;
        global.len[d] = small(f[2 + MAX_DIMS + d])?;
    }
    Some(LocalShard {
        param: small(f[0])?,
        global,
        dtype: *DTYPES.get(usize::try_from(f[2 + 2 * MAX_DIMS]).ok()?)?,
        offset: f[3 + 2 * MAX_DIMS],
    })
}

/// A hasher for keys that are already hashes.
#[derive(Default)]
struct WordHasher(u64);

impl Hasher for WordHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = mix(self.0, b as u64);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
}

#[inline]
fn mix(h: u64, w: u64) -> u64 {
    (h.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95)
}

/// One write of a task being added, as [`RoutesBuilder::push_task`] takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TaskWrite {
    pub to_trainer: bool,
    pub rank: u32,
    pub mr: u16,
    pub len: u32,
    pub src_offset: u64,
    pub dst_offset: u64,
}

/// Builds a trainer's [`TrainerRoutes`] task by task: finds or adds each task's pattern and
/// records the task and its bases; [`RoutesBuilder::flush`] packs what was added since.
#[derive(Debug, Default)]
pub(crate) struct RoutesBuilder {
    routes: TrainerRoutes,
    /// Pattern ids by the hash of their content.
    index: HashMap<u64, SmallVec<[u32; 2]>, BuildHasherDefault<WordHasher>>,
    tasks: Vec<[u64; TASK_FIELDS]>,
    bases: Vec<[u64; BASE_FIELDS]>,
    /// Tasks added so far.
    pub(crate) num_tasks: u64,
}

impl std::fmt::Debug for WordHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WordHasher")
    }
}

impl RoutesBuilder {
    /// A builder for a trainer holding `shards`.
    pub(crate) fn new(shards: &[LocalShard]) -> RoutesBuilder {
        let recs: Vec<[u64; SHARD_FIELDS]> = shards.iter().map(shard_record).collect();
        RoutesBuilder {
            routes: TrainerRoutes {
                shards: Packed::of(&recs),
                ..TrainerRoutes::default()
            },
            ..RoutesBuilder::default()
        }
    }

    /// Adds a task: its region, source, transform, writes (in order) and copies (`from`,
    /// `num`, first rank, stride, count; each repeating writes of one rank). Copies repeating
    /// nothing are left out (they stand for no write). Returns the id of the task's pattern,
    /// which [`RoutesBuilder::push_known`] takes for further tasks of the same shape.
    pub(crate) fn push_task(
        &mut self,
        param: u32,
        region: TensorBox,
        source: Source,
        transform: Transform,
        writes: &[TaskWrite],
        copies: &[(u32, u32, u32, u32, u32)],
    ) -> u32 {
        let (gather, src) = match source {
            Source::Shard { shard } => (false, shard as u64),
            Source::Gather { offset } => (true, offset),
        };
        let rel = |&(from, num, first, stride, count): &(u32, u32, u32, u32, u32)| {
            let base = writes.get(from as usize).map_or(0, |w| w.rank);
            PatternCopy {
                from,
                num,
                rank_offset: first.wrapping_sub(base),
                stride,
                count,
            }
        };
        let keep = |c: &&(u32, u32, u32, u32, u32)| c.1 > 0 && c.4 > 0;
        let h = pattern_hash(
            region,
            transform,
            gather,
            writes,
            copies.iter().filter(keep).map(rel),
        );
        let routes = &self.routes;
        let same = |id: &u32| {
            let p = &routes.patterns[*id as usize];
            p.region == region
                && p.transform == transform
                && p.gather == gather
                && p.num_writes as usize == writes.len()
                && routes.pattern_writes(p).iter().zip(writes).all(|(a, b)| {
                    a.to_trainer == b.to_trainer
                        && a.mr == b.mr
                        && a.len == b.len
                        && a.src_offset == b.src_offset
                })
                && routes
                    .pattern_copies(p)
                    .iter()
                    .copied()
                    .eq(copies.iter().filter(keep).map(rel))
        };
        let found = self
            .index
            .get(&h)
            .and_then(|ids| ids.iter().find(|id| same(id)));
        let id = match found {
            Some(&id) => id,
            None => {
                let id = self.routes.patterns.len() as u32;
                let first_copy = self.routes.copies.len() as u32;
                self.routes
                    .copies
                    .extend(copies.iter().filter(keep).map(rel));
                self.routes.patterns.push(TaskPattern {
                    region,
                    transform,
                    gather,
                    first_write: self.routes.writes.len() as u32,
                    num_writes: writes.len() as u32,
                    first_copy,
                    num_copies: self.routes.copies.len() as u32 - first_copy,
                });
                self.routes
                    .writes
                    .extend(writes.iter().map(|w| PatternWrite {
                        to_trainer: w.to_trainer,
                        mr: w.mr,
                        len: w.len,
                        src_offset: w.src_offset,
                    }));
                self.index.entry(h).or_default().push(id);
                id
            }
        };
        self.tasks.push([id as u64, param as u64, src]);
        self.bases
            .extend(writes.iter().map(|w| [w.rank as u64, w.dst_offset]));
        self.num_tasks += 1;
        id
    }

    /// Adds a task of pattern `id`, which [`RoutesBuilder::push_task`] returned for a task of
    /// the same region, transform, writes (but for their ranks and destination offsets) and
    /// copies: `source` is the shard index or gather offset, `bases` the `(rank, dst_offset)`
    /// of each of the pattern's writes, in order.
    pub(crate) fn push_known(
        &mut self,
        id: u32,
        param: u32,
        source: u64,
        bases: impl Iterator<Item = [u64; BASE_FIELDS]>,
    ) {
        debug_assert!((id as usize) < self.routes.patterns.len());
        self.tasks.push([id as u64, param as u64, source]);
        let before = self.bases.len();
        self.bases.extend(bases);
        debug_assert_eq!(
            self.bases.len() - before,
            self.routes.patterns[id as usize].num_writes as usize
        );
        self.num_tasks += 1;
    }

    /// Packs the tasks added since the last flush (runs never span a flush), and frees what
    /// held them: a planner keeps thousands of builders open at once, each busy in only some
    /// of its flushes, and kept buffers would add up to tens of megabytes.
    pub(crate) fn flush(&mut self) {
        self.routes.tasks.push(&std::mem::take(&mut self.tasks));
        self.routes.bases.push(&std::mem::take(&mut self.bases));
    }

    /// The finished routes.
    pub(crate) fn finish(mut self) -> TrainerRoutes {
        self.flush();
        let r = &mut self.routes;
        r.tasks.shrink_to_fit();
        r.bases.shrink_to_fit();
        r.patterns.shrink_to_fit();
        r.writes.shrink_to_fit();
        r.copies.shrink_to_fit();
        self.routes
    }
}

/// The hash [`RoutesBuilder`] finds a task's pattern by: everything a pattern holds.
fn pattern_hash(
    region: TensorBox,
    transform: Transform,
    gather: bool,
    writes: &[TaskWrite],
    copies: impl Iterator<Item = PatternCopy>,
) -> u64 {
    let mut h = mix(0, gather as u64);
    for w in [
        region.ndim as u64,
        region.start[0] as u64,
        region.start[1] as u64,
        region.start[2] as u64,
        region.len[0] as u64,
        region.len[1] as u64,
        region.len[2] as u64,
        transform_code(transform),
    ] {
        h = mix(h, w);
    }
    for w in writes {
        h = mix(
            h,
            (w.to_trainer as u64) << 48 | (w.mr as u64) << 32 | w.len as u64,
        );
        h = mix(h, w.src_offset);
    }
    for c in copies {
        h = mix(h, (c.from as u64) << 32 | c.num as u64);
        h = mix(h, (c.rank_offset as u64) << 32 | c.stride as u64);
        h = mix(h, c.count as u64);
    }
    h
}

/// A transform as one word (for hashing).
fn transform_code(t: Transform) -> u64 {
    let d = |x: DType| DTYPES.iter().position(|&y| y == x).unwrap_or(0) as u64;
    match t {
        Transform::Copy { dtype } => d(dtype),
        Transform::Cast { from, to } => 1 << 8 | d(from) << 4 | d(to),
        Transform::Fp8Block { from, recipe } => 2 << 8 | (recipe.code() as u64) << 4 | d(from),
    }
}

impl TrainerRoutes {
    /// The compact form of an explicit plan (its write copies expanded first). Writes must
    /// carry the units the compact form implies (0 to rollouts, the mesh group's id to
    /// trainers), and the plan's groups must tile its tasks in order.
    pub fn from_plan(plan: &TrainerPlan) -> Result<TrainerRoutes, PlanError> {
        let plan = plan.expanded()?;
        let bad = |task: usize, reason: String| PlanError::BadTable {
            rank: plan.rank,
            task: task as u32,
            reason,
        };
        let mut b = RoutesBuilder::new(&plan.shards);
        let mut next = 0u32;
        let mut writes: Vec<TaskWrite> = Vec::new();
        for g in &plan.groups {
            if g.first_task != next {
                return Err(bad(
                    next as usize,
                    format!("group {} starts at task {}, not {next}", g.id, g.first_task),
                ));
            }
            next = g.first_task.saturating_add(g.num_tasks);
            let tasks: &[Task] = plan
                .tasks
                .get(g.first_task as usize..next as usize)
                .ok_or_else(|| bad(next as usize, format!("group {} ends past the tasks", g.id)))?;
            for (k, t) in tasks.iter().enumerate() {
                let i = g.first_task as usize + k;
                writes.clear();
                for w in plan.task_direct_writes(t) {
                    let (to_trainer, rank, unit) = match w.dst {
                        WriteTarget::Rollout(r) => (false, r, 0),
                        WriteTarget::Trainer(r) => (true, r, g.id),
                    };
                    if w.unit != unit {
                        return Err(bad(
                            i,
                            format!("a write counts on unit {}, not {unit}", w.unit),
                        ));
                    }
                    writes.push(TaskWrite {
                        to_trainer,
                        rank,
                        mr: w.mr,
                        len: w.len,
                        src_offset: w.src_offset,
                        dst_offset: w.dst_offset,
                    });
                }
                b.push_task(t.param, t.region, t.source, t.transform, &writes, &[]);
            }
            b.flush();
        }
        if next as usize != plan.tasks.len() {
            return Err(bad(
                next as usize,
                format!("groups cover {next} of {} tasks", plan.tasks.len()),
            ));
        }
        Ok(b.finish())
    }
}

/// The explicit write of base record `base` for pattern write `w` of a task in group `unit`.
pub(crate) fn write_of(w: &PatternWrite, base: &[u64; BASE_FIELDS], unit: u16) -> Option<Write> {
    let rank = u32::try_from(base[0]).ok()?;
    Some(Write {
        dst: if w.to_trainer {
            WriteTarget::Trainer(rank)
        } else {
            WriteTarget::Rollout(rank)
        },
        mr: w.mr,
        unit: if w.to_trainer { unit } else { 0 },
        len: w.len,
        src_offset: w.src_offset,
        dst_offset: base[1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_round_trip_through_records() {
        let s = LocalShard {
            param: 7,
            global: TensorBox::new(&[4, 0, 128], &[1, 96, 128]),
            dtype: DType::F32,
            offset: 1 << 40,
        };
        assert_eq!(shard_from_record(&shard_record(&s)), Some(s));
        let mut bad = shard_record(&s);
        bad[1] = 4;
        assert_eq!(shard_from_record(&bad), None);
        bad[1] = 3;
        bad[2 + 2 * MAX_DIMS] = 9;
        assert_eq!(shard_from_record(&bad), None);
    }

    #[test]
    fn tasks_of_one_shape_share_a_pattern() {
        let region = TensorBox::new(&[0, 0], &[128, 256]);
        let mut b = RoutesBuilder::new(&[]);
        for e in 0..20u32 {
            let w = |dst: u64, len: u32, src: u64| TaskWrite {
                to_trainer: false,
                rank: e / 10,
                mr: 0,
                len,
                src_offset: src,
                dst_offset: dst,
            };
            let writes = [
                w(1000 + 32768 * e as u64, 32768, 0),
                w(9000 + 8 * e as u64, 8, 32768),
            ];
            b.push_task(
                e,
                region,
                Source::Shard { shard: e },
                Transform::Fp8Block {
                    from: DType::BF16,
                    recipe: weightsync_common::Fp8Recipe::Vllm,
                },
                &writes,
                &[(0, 2, e / 10 + 4, 4, 3)],
            );
        }
        let r = b.finish();
        assert_eq!(r.patterns.len(), 1);
        assert_eq!(r.copies[0].rank_offset, 4);
        assert_eq!(r.tasks.len(), 20);
        assert_eq!(r.bases.len(), 40);
        // One run of tasks; the bases move rank after ten experts: two runs.
        assert_eq!(r.tasks.runs.len(), 1);
        assert_eq!(r.bases.runs.len(), 2);
        let mut c = r.cursor();
        let mut n = 0;
        while let Some(t) = c.next() {
            assert_eq!((t.pattern, t.param, t.source), (0, n, n));
            assert_eq!(
                t.bases,
                &[[n / 10, 1000 + 32768 * n], [n / 10, 9000 + 8 * n]]
            );
            n += 1;
        }
        assert_eq!(n, 20);
    }
}
