//! The routing table: the planner's whole output, and the only thing workers execute.
//!
//! Why a static table: every sync moves the same bytes between the same addresses, so all the
//! thinking (which replica sends, where each byte lands, what to gather first) happens once, in
//! the controller, and workers replay it with no coordination beyond immediate counters.
//!
//! # Memory model (the contract with the worker)
//!
//! **Trainer source arena.** Each training rank exposes its training shards as ONE flat byte
//! arena. The training layout places every local shard (a box of one logical parameter, in one
//! dtype, row-major, dense) at a byte offset in that arena: [`LocalShard`]. A task reads its
//! region from one shard that contains it ([`Source::Shard`]); the element at local index `i`
//! (row-major over `shard.global.len`) lives at `shard.offset + i * dtype.size()`, and
//! [`TrainerPlan::source_box`] gives the region in the shard's local coordinates.
//!
//! **Trainer gather arena.** Some regions are prepared by one trainer from rows that live on
//! several: an fp8 block (128x128) straddling training shards must be quantised by one owner,
//! and a small tensor cut into many tiny shards (a norm over 128 ranks) is cheaper to collect
//! once than to write to every destination in pieces. The owner prepares such a region from its
//! *gather arena*: a flat byte region (registered as MR [`TRAINER_GATHER_MR`] on the trainer,
//! size [`TrainerPlan::gather_arena_bytes`]) into which every contributing rank (including the
//! owner itself) first writes its part with an ordinary Copy task whose writes target
//! [`WriteTarget::Trainer`]. The gathered region is a dense row-major box in the source dtype at
//! [`Source::Gather::offset`]. Gather bytes are never reused within a sync.
//!
//! **Rollout arena.** Each inference rank holds all of its destination tensors (weights and fp8
//! `weight_scale_inv` tensors alike) in flat memory regions, in practice one: MR 0, of
//! [`RolloutPlan::mr_bytes`]`[0]` bytes. [`RolloutPlan::tensors`] lists every tensor with its
//! name, shape, dtype, MR and byte offset, so a rollout can allocate and register everything once
//! and a test can read each tensor back.
//!
//! # Execution semantics of one sync, per trainer
//!
//! A trainer executes its [`MeshGroup`]s in order. Within group `g`:
//! 1. the group's first `gather_sends` tasks are gather sends (Copy tasks whose writes go to
//!    trainers' gather arenas); run them first, they are on other trainers' critical path;
//! 2. then the tasks that read only local shards ([`Source::Shard`]);
//! 3. then the tasks that read the gather arena ([`Source::Gather`]): before the first of them,
//!    wait until this trainer's immediate counter for unit `g` (on [`WriteTarget::Trainer`]) has
//!    counted `gather_expect` writes. Writes a trainer sends to itself count too (a worker may
//!    execute them as a local copy and bump its own counter).
//!
//! Groups need no barrier between them: gather sends of group `g` are issued before anything that
//! can wait in group `g`, so by induction over groups no trainer waits forever.
//!
//! For every task: read the source box, apply the [`Transform`] producing exactly
//! [`Task::prepared_bytes`] contiguous bytes, then post the task's writes: write `w` copies prepared bytes
//! `[w.src_offset, w.src_offset + w.len)` to `w.dst`'s MR `w.mr` at `w.dst_offset`, with an
//! immediate counted on the destination's unit `w.unit`. Each rollout rank knows from
//! [`RolloutPlan::expect`] how many writes land per unit per sync; every destination byte is
//! written exactly once per sync.
//!
//! # Write copies (why the table is compact)
//! Most destination boxes go to several rollout ranks laid out identically: every dp engine,
//! and attention weights replicated across the ep/tp groups of an engine. Their writes differ
//! only in the destination rank, so the table stores them once, in the task's own writes, plus a
//! [`WriteCopies`] entry naming the further ranks as an arithmetic progression. Kimi-K2 over 4
//! engines would otherwise list 14 million writes (4.7x more than it stores); listing them is
//! most of what planning costs. [`TrainerPlan::task_writes`] yields every write, copies
//! included, and [`RoutingTable::slice`] hands a worker an *expanded* plan (no copies: every
//! write explicit, the form the worker executes).
//!
//! # Layout
//! - this file: the contract a worker executes ([`TrainerPlan`], [`Task`], [`Write`], [`Source`],
//!   [`Transform`]) and a rollout holds ([`RolloutPlan`]);
//! - `routing`: the whole table as the planner stores it, compact ([`RoutingTable`],
//!   [`CompactTrainer`]), re-exported here.
//!
//! # Determinism
//! The same inputs give a byte-identical table under bincode (no hash-map iteration anywhere).

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use weightsync_common::{DType, Fp8Recipe};

mod routing;

pub(crate) use routing::RolloutLayouts;
pub use routing::{CompactTrainer, GROUP_FIELDS, RolloutEntry, RolloutLayout, RoutingTable};

/// Most dimensions a tensor may have here: experts stacked over a 2-D weight (and their fp8
/// scales) need 3, and no supported family has more. Every box and shape in the table carries
/// this many slots, so one more would cost every task 8 bytes (80 instead of 72).
pub const MAX_DIMS: usize = 3;

/// Edge of a quantisation block, in elements, along each of the last two dimensions.
pub const FP8_BLOCK: u32 = 128;

/// MR id of a trainer's gather arena (the only trainer memory peers write into).
pub const TRAINER_GATHER_MR: u16 = 0;

/// A tensor shape: up to [`MAX_DIMS`] dimensions, row-major.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct Shape {
    /// Number of dimensions in use (0 = scalar).
    pub ndim: u8,
    /// Sizes; entries at `ndim..` are 0 and ignored.
    pub dims: [u32; MAX_DIMS],
}

impl Shape {
    /// A shape from its dimensions. Panics only on more than [`MAX_DIMS`] dims, which the
    /// model builders never produce (their input is checked first).
    pub fn new(dims: &[u32]) -> Shape {
        assert!(dims.len() <= MAX_DIMS, "at most {MAX_DIMS} dims");
        let mut d = [0; MAX_DIMS];
        d[..dims.len()].copy_from_slice(dims);
        Shape {
            ndim: dims.len() as u8,
            dims: d,
        }
    }

    /// The dimensions in use.
    pub fn dims(&self) -> &[u32] {
        &self.dims[..self.ndim as usize]
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.dims().iter().map(|&d| d as u64).product()
    }

    /// Row-major element strides.
    pub fn strides(&self) -> [u64; MAX_DIMS] {
        let mut s = [0u64; MAX_DIMS];
        let mut acc = 1u64;
        for d in (0..self.ndim as usize).rev() {
            s[d] = acc;
            acc *= self.dims[d] as u64;
        }
        s
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.dims().iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

/// A box (hyper-rectangle) of a tensor: `start[d] .. start[d] + len[d]` along each dimension.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct TensorBox {
    /// Number of dimensions in use.
    pub ndim: u8,
    /// First index along each dimension.
    pub start: [u32; MAX_DIMS],
    /// Extent along each dimension.
    pub len: [u32; MAX_DIMS],
}

impl TensorBox {
    /// A box from its starts and lengths (same number of dims, at most [`MAX_DIMS`]).
    pub fn new(start: &[u32], len: &[u32]) -> TensorBox {
        assert_eq!(start.len(), len.len());
        assert!(start.len() <= MAX_DIMS, "at most {MAX_DIMS} dims");
        let mut s = [0; MAX_DIMS];
        let mut l = [0; MAX_DIMS];
        s[..start.len()].copy_from_slice(start);
        l[..len.len()].copy_from_slice(len);
        TensorBox {
            ndim: start.len() as u8,
            start: s,
            len: l,
        }
    }

    /// The whole of a tensor of this shape.
    pub fn full(shape: Shape) -> TensorBox {
        TensorBox {
            ndim: shape.ndim,
            start: [0; MAX_DIMS],
            len: shape.dims,
        }
    }

    /// The box's extents as a shape.
    pub fn shape(&self) -> Shape {
        Shape {
            ndim: self.ndim,
            dims: self.len,
        }
    }

    /// One past the last index along `d`.
    pub fn end(&self, d: usize) -> u32 {
        self.start[d] + self.len[d]
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape().numel()
    }

    /// Whether the box has no elements.
    pub fn is_empty(&self) -> bool {
        self.numel() == 0
    }

    /// The common part of two boxes of the same rank (`None` when empty).
    pub fn intersect(&self, other: &TensorBox) -> Option<TensorBox> {
        debug_assert_eq!(self.ndim, other.ndim);
        let mut out = *self;
        for d in 0..self.ndim as usize {
            let s = self.start[d].max(other.start[d]);
            let e = self.end(d).min(other.end(d));
            if e <= s {
                return None;
            }
            out.start[d] = s;
            out.len[d] = e - s;
        }
        Some(out)
    }

    /// Whether `other` lies inside this box.
    pub fn contains(&self, other: &TensorBox) -> bool {
        self.ndim == other.ndim
            && (0..self.ndim as usize)
                .all(|d| other.start[d] >= self.start[d] && other.end(d) <= self.end(d))
    }

    /// Whether the box lies inside a tensor of `shape`.
    pub fn fits_in(&self, shape: Shape) -> bool {
        self.ndim == shape.ndim
            && (0..self.ndim as usize).all(|d| self.end(d) as u64 <= shape.dims[d] as u64)
    }

    /// This box expressed relative to `origin` (which must contain it).
    pub fn relative_to(&self, origin: &TensorBox) -> TensorBox {
        let mut out = *self;
        for d in 0..self.ndim as usize {
            out.start[d] = self.start[d] - origin.start[d];
        }
        out
    }

    /// Whether this box of a dense row-major tensor of shape `dims` is one contiguous range of
    /// its elements: every dim before some `d` has extent 1 and every dim after `d` is whole
    /// (an empty box is, trivially).
    pub fn is_contiguous_in(&self, dims: &[u32]) -> bool {
        let n = self.ndim as usize;
        if self.len[..n].contains(&0) {
            return true;
        }
        let Some(d) = (0..n).find(|&i| self.len[i] != 1) else {
            return true;
        };
        (d + 1..n).all(|i| self.start[i] == 0 && dims.get(i) == Some(&self.len[i]))
    }

    /// This box of a dense row-major tensor of shape `dims` as equal runs at one stride:
    /// `(run, stride)` in elements, such that the box's element `k` (row-major) lies at
    /// [`first_element_in`](Self::first_element_in)` + (k / run) * stride + k % run`. A
    /// contiguous box is one run (`stride == run`). `None` for an empty box, or one whose runs
    /// are not evenly spaced (a box cut in two dims besides its last partial one, e.g. rows
    /// `2..4` and columns `0..4` of each of several matrices).
    pub fn strided_in(&self, dims: &[u32]) -> Option<(u64, u64)> {
        let n = self.ndim as usize;
        if dims.len() != n || self.len[..n].contains(&0) {
            return None;
        }
        let whole = |d: usize| self.start[d] == 0 && self.len[d] == dims[d];
        let after = |d: usize| dims[d + 1..].iter().map(|&x| u64::from(x)).product::<u64>();
        let numel = self.numel();
        let Some(d) = (0..n).rev().find(|&d| !whole(d)) else {
            return Some((numel, numel));
        };
        let run = u64::from(self.len[d]) * after(d);
        let outer: Vec<usize> = (0..d).filter(|&k| self.len[k] > 1).collect();
        let (Some(&k0), Some(&m)) = (outer.first(), outer.last()) else {
            return Some((run, run));
        };
        (k0 + 1..=m).all(whole).then(|| (run, after(m)))
    }

    /// Row-major index of this box's first element in a tensor of shape `dims`.
    pub fn first_element_in(&self, dims: &[u32]) -> u64 {
        let n = self.ndim as usize;
        (0..n).fold(0u64, |acc, i| {
            acc * dims.get(i).copied().unwrap_or(1) as u64 + self.start[i] as u64
        })
    }
}

impl std::fmt::Display for TensorBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[")?;
        for d in 0..self.ndim as usize {
            if d > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{}..{}", self.start[d], self.end(d))?;
        }
        write!(f, "]")
    }
}

/// Whose memory a write lands in. (Not a fabric endpoint: the table names ranks; which
/// address each rank listens on is the fabric's business, exchanged at registration.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum WriteTarget {
    /// An inference (rollout) rank, by its global index in [`RoutingTable::rollouts`].
    Rollout(u32),
    /// A training rank's gather arena, by training rank.
    Trainer(u32),
}

/// One RDMA WRITE (with immediate): a contiguous run on both sides.
///
/// Runs contiguous on both sides are already merged: one `Write` is one work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Write {
    /// Destination endpoint.
    pub dst: WriteTarget,
    /// Destination memory region (rollouts: see [`DstTensor::mr`]; trainers: [`TRAINER_GATHER_MR`]).
    pub mr: u16,
    /// Immediate-counter unit at the destination this write counts toward. Rollouts: always 0
    /// (one counter per rank). Trainers: the mesh group id.
    pub unit: u16,
    /// Length in bytes (the planner splits runs so this fits; at most [`MAX_WRITE_BYTES`]).
    pub len: u32,
    /// Byte offset within the task's prepared output.
    pub src_offset: u64,
    /// Byte offset within the destination MR.
    pub dst_offset: u64,
}

/// Longest single write the planner emits (longer runs are split).
pub const MAX_WRITE_BYTES: u64 = 1 << 30;

/// Where a task reads its input. Either way the input is exactly the task's `region`; what the
/// table does not store (the shard-local box, the gathered shape and dtype) follows from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Source {
    /// The region, read from one of the trainer's own shards ([`TrainerPlan::shards`]`[shard]`),
    /// which must contain it: [`TrainerPlan::source_box`] gives it in the shard's coordinates.
    Shard {
        /// Index into [`TrainerPlan::shards`].
        shard: u32,
    },
    /// The region gathered, dense and row-major, in the transform's input dtype, in this
    /// trainer's gather arena. Usable only after the mesh group's `gather_expect` writes arrived
    /// (see the module docs).
    Gather {
        /// Byte offset in the gather arena.
        offset: u64,
    },
}

/// How source elements become prepared bytes. [`Task::prepared_bytes`] and
/// [`Task::fp8_scales`] give the size and layout of the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Transform {
    /// Bytes unchanged; prepared output = the source box, dense row-major.
    Copy {
        /// Element type (source and destination).
        dtype: DType,
    },
    /// Element-wise conversion; prepared output = the source box in `to`, dense row-major.
    Cast {
        /// Source element type.
        from: DType,
        /// Destination element type.
        to: DType,
    },
    /// fp8 e4m3 block quantisation (DeepSeek-V3 checkpoint convention).
    ///
    /// The source box is block-aligned in the parameter's coordinates: blocks of
    /// [`FP8_BLOCK`] x [`FP8_BLOCK`] over the LAST TWO dimensions start at the box origin, one
    /// 2-D matrix per index of the leading dimensions; a trailing block may be partial only where
    /// the box ends at the tensor's end. Per block, as `recipe` computes them (vLLM's:
    /// `scale_inv = amax / 448` (f32) and values `x * (448 / amax)` rounded to e4m3,
    /// saturating), as the worker's kernel defines exactly.
    ///
    /// Prepared output: fp8 values of the box, dense row-major, at offset 0 (`numel` bytes);
    /// then f32 `weight_scale_inv` values, dense row-major over the scale shape
    /// (`[leading dims..., ceil(rows/128), ceil(cols/128)]`), at the first 16-byte boundary
    /// after the values: [`Task::fp8_scales`].
    Fp8Block {
        /// Source element type.
        from: DType,
        /// Whose arithmetic the block scales follow (the engine's own loader's).
        recipe: Fp8Recipe,
    },
}

impl Transform {
    /// Element type the transform reads (the source's dtype).
    pub fn input_dtype(&self) -> DType {
        match *self {
            Transform::Copy { dtype } => dtype,
            Transform::Cast { from, .. } | Transform::Fp8Block { from, .. } => from,
        }
    }

    /// Element type of the prepared values (fp8 scales aside).
    pub fn output_dtype(&self) -> DType {
        match *self {
            Transform::Copy { dtype } => dtype,
            Transform::Cast { to, .. } => to,
            Transform::Fp8Block { .. } => DType::F8E4M3,
        }
    }
}

/// One logical parameter a trainer's tasks refer to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParamRef {
    /// Index of the parameter in the model.
    pub id: u32,
    /// Its (Hugging Face style) name.
    pub name: Arc<str>,
    /// Its global shape.
    pub shape: Shape,
}

/// One shard of a parameter held by a trainer in its source arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LocalShard {
    /// Index into [`TrainerPlan::params`].
    pub param: u32,
    /// The box of the global tensor this shard holds.
    pub global: TensorBox,
    /// Element type as stored.
    pub dtype: DType,
    /// Byte offset in the source arena; the shard is dense row-major over `global.len`.
    pub offset: u64,
}

impl LocalShard {
    /// Size of the shard in bytes.
    pub fn bytes(&self) -> u64 {
        self.global.numel() * self.dtype.size() as u64
    }
}

/// One unit of work on a trainer: read a box, transform it, write it to one or more places.
///
/// Only what cannot be derived is stored (a task is 72 bytes, and Kimi-K2 plans 2 million):
/// the prepared size, the fp8 scale layout and the shard-local box all follow from the region,
/// the transform and the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Task {
    /// Index into [`TrainerPlan::params`].
    pub param: u32,
    /// The box of the parameter this task covers, in global coordinates.
    pub region: TensorBox,
    /// Where the input is read.
    pub source: Source,
    /// How it is prepared.
    pub transform: Transform,
    /// Index of the first write in [`TrainerPlan::writes`].
    pub first_write: u32,
    /// Number of writes stored for this task (not counting copies).
    pub num_writes: u32,
    /// Index of the task's first entry in [`TrainerPlan::copies`].
    pub first_copy: u32,
    /// Number of [`WriteCopies`] entries (0 in an expanded plan).
    pub num_copies: u32,
}

impl Task {
    /// Byte offset and shape of the fp8 scales in the prepared output (see
    /// [`Transform::Fp8Block`]); `None` for other transforms and for a region of fewer than two
    /// dimensions, which cannot be block-quantised.
    pub fn fp8_scales(&self) -> Option<(u64, Shape)> {
        let n = self.region.ndim as usize;
        if !matches!(self.transform, Transform::Fp8Block { .. }) || !(2..=MAX_DIMS).contains(&n) {
            return None;
        }
        let mut shape = self.region.shape();
        for d in n - 2..n {
            shape.dims[d] = self.region.len[d].div_ceil(FP8_BLOCK);
        }
        Some((self.region.numel().div_ceil(16) * 16, shape))
    }

    /// Bytes of input the task reads (its region in the transform's input dtype).
    pub fn source_bytes(&self) -> u64 {
        self.region.numel() * self.transform.input_dtype().size() as u64
    }

    /// Bytes of prepared output the writes read from.
    pub fn prepared_bytes(&self) -> u64 {
        let values = self.region.numel() * self.transform.output_dtype().size() as u64;
        match self.fp8_scales() {
            Some((offset, shape)) => offset + shape.numel() * 4,
            None => values,
        }
    }
}

/// Some of a task's writes repeated to further rollout ranks laid out identically (other dp
/// engines, attention replicas): ranks `first_rank + i * stride` for `i` in `0..count`, each
/// receiving the task's writes `[from, from + num)` (indices relative to the task's first
/// write) with only the destination rank changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WriteCopies {
    /// First of the task's writes repeated (relative to [`Task::first_write`]).
    pub from: u32,
    /// Number of writes repeated.
    pub num: u32,
    /// First rollout rank receiving the copy.
    pub first_rank: u32,
    /// Distance between consecutive ranks.
    pub stride: u32,
    /// Number of ranks.
    pub count: u32,
}

/// A mesh group: a contiguous run of a trainer's tasks, executed in group order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshGroup {
    /// Group id (same on every trainer; also the immediate unit of gathers into this group).
    pub id: u16,
    /// Human name (`embed`, `layer 3`, `head`).
    pub name: String,
    /// Index of the group's first task in [`TrainerPlan::tasks`].
    pub first_task: u32,
    /// Number of tasks.
    pub num_tasks: u32,
    /// The first `gather_sends` tasks of the group are gather sends.
    pub gather_sends: u32,
    /// Number of local-source tasks that follow them; the rest of the group reads the gather arena.
    pub local_tasks: u32,
    /// Writes into this trainer's gather arena (unit = `id`) to wait for before gather-sourced tasks.
    pub gather_expect: u32,
}

/// Everything one training rank needs for a sync: [`RoutingTable::slice`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TrainerPlan {
    /// Training rank.
    pub rank: u32,
    /// Parameters referred to by this plan's shards and tasks.
    pub params: Vec<ParamRef>,
    /// Shards in the source arena that tasks read (all of the rank's shards, sorted by offset).
    pub shards: Vec<LocalShard>,
    /// Size the source arena must have (end of the last shard).
    pub source_arena_bytes: u64,
    /// Size of the gather arena (MR [`TRAINER_GATHER_MR`]); 0 when no gathers land here.
    pub gather_arena_bytes: u64,
    /// Mesh groups in execution order.
    pub groups: Vec<MeshGroup>,
    /// Tasks, grouped as `groups` says.
    pub tasks: Vec<Task>,
    /// All writes stored for all tasks, in task order (copies not expanded).
    pub writes: Vec<Write>,
    /// Write copies of all tasks, in task order; empty in an expanded plan.
    pub copies: Vec<WriteCopies>,
}

impl TrainerPlan {
    /// The box a shard-sourced task reads, in its shard's coordinates; `None` for a gathered
    /// source, or when the shard does not exist or does not contain the task's region.
    pub fn source_box(&self, task: &Task) -> Option<TensorBox> {
        match task.source {
            Source::Shard { shard } => {
                let global = &self.shards.get(shard as usize)?.global;
                global
                    .contains(&task.region)
                    .then(|| task.region.relative_to(global))
            }
            Source::Gather { .. } => None,
        }
    }

    /// Where a cast or fp8 task reads its input in place: the byte offset of its box in its
    /// shard, when the box is one contiguous range of a shard already in the input dtype. Such
    /// a task is prepared reading the shard where it lies, straight into its staging, with no
    /// copy into staging first (what workers do, and what the simulator charges). `None` for a
    /// plain copy (staged or written from the source as it is), a gathered input, or a box that
    /// strides through its shard.
    pub fn in_place_input(&self, task: &Task) -> Option<u64> {
        let from = match task.transform {
            Transform::Cast { from, .. } | Transform::Fp8Block { from, .. } => from,
            Transform::Copy { .. } => return None,
        };
        let Source::Shard { shard } = task.source else {
            return None;
        };
        let s = self.shards.get(shard as usize)?;
        let sub = self.source_box(task)?;
        let dims = s.global.shape();
        if s.dtype != from || !sub.is_contiguous_in(dims.dims()) {
            return None;
        }
        let offset = sub.first_element_in(dims.dims()) * from.size() as u64;
        (offset + sub.numel() * from.size() as u64 <= s.bytes()).then_some(offset)
    }

    /// Where a cast or fp8 task whose box strides through its shard (a column slice) reads its
    /// runs in place, each where it lies rather than gathered into staging first (what workers
    /// do on host sources, and what the simulator charges): the box is evenly spaced runs of
    /// whole rows of its shard's trailing dims. A cast takes any such runs (it is elementwise,
    /// and a task's pieces hold whole dim-0 rows of its box, so whole runs); fp8 needs each run
    /// to be one row of the box's last dim, the rows its block quantiser reads at a pitch.
    /// `None` where [`Self::in_place_input`] answers (a contiguous box), for a plain copy, a
    /// gathered input, and where the runs are not evenly spaced or not in the input dtype.
    pub fn in_place_runs(&self, task: &Task) -> Option<InPlaceRuns> {
        let (from, rows_only) = match task.transform {
            Transform::Fp8Block { from, .. } => (from, true),
            Transform::Cast { from, .. } => (from, false),
            Transform::Copy { .. } => return None,
        };
        let Source::Shard { shard } = task.source else {
            return None;
        };
        let s = self.shards.get(shard as usize)?;
        let sub = self.source_box(task)?;
        let dims = s.global.shape();
        let n = sub.ndim as usize;
        if s.dtype != from || n == 0 || sub.is_contiguous_in(dims.dims()) {
            return None;
        }
        let (run, stride) = sub.strided_in(dims.dims())?;
        if rows_only && run != u64::from(sub.len[n - 1]) {
            return None; // runs of several rows: not one pitch
        }
        let size = from.size() as u64;
        let offset = sub.first_element_in(dims.dims()) * size;
        let runs = sub.numel() / run;
        let end = offset + ((runs - 1) * stride + run) * size;
        (end <= s.bytes()).then_some(InPlaceRuns {
            offset,
            run: run * size,
            pitch: stride * size,
        })
    }

    /// The tasks of one group.
    pub fn group_tasks(&self, group: &MeshGroup) -> &[Task] {
        let a = group.first_task as usize;
        &self.tasks[a..a + group.num_tasks as usize]
    }
}

/// Where a task's box lies in its shard as evenly spaced runs ([`TrainerPlan::in_place_runs`]),
/// in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InPlaceRuns {
    /// Offset of the box's first element in its shard.
    pub offset: u64,
    /// Length of each run.
    pub run: u64,
    /// From one run's start to the next.
    pub pitch: u64,
}

/// One destination tensor on an inference rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DstTensor {
    /// Engine-format name, e.g. `model.layers.3.mlp.experts.w13_weight` or its
    /// `..._scale_inv`.
    pub name: String,
    /// Shape.
    pub shape: Shape,
    /// Element type (fp8 weights, f32 scales, bf16 for unquantised tensors).
    pub dtype: DType,
    /// Memory region.
    pub mr: u16,
    /// Byte offset in the MR (256-byte aligned).
    pub offset: u64,
    /// Length in bytes (`shape.numel() * dtype.size()`).
    pub len: u64,
}

/// How many writes an endpoint receives on one immediate unit per sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct UnitExpect {
    /// Unit id.
    pub unit: u16,
    /// Writes per sync.
    pub writes: u64,
}

/// Everything an inference rank needs: its tensors and what to expect.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RolloutPlan {
    /// Global inference rank (index in [`RoutingTable::rollouts`]).
    pub rank: u32,
    /// Engine (dp replica) index.
    pub engine: u32,
    /// Rank within the engine.
    pub local_rank: u32,
    /// Size in bytes of each MR (index = MR id).
    pub mr_bytes: Vec<u64>,
    /// Destination tensors, sorted by (mr, offset).
    pub tensors: Vec<DstTensor>,
    /// Writes to expect per unit per sync.
    pub expect: Vec<UnitExpect>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_boxes_are_rows_of_whole_trailing_dims() {
        let dims = [4, 6, 8];
        let contiguous =
            |start: &[u32], len: &[u32]| TensorBox::new(start, len).is_contiguous_in(&dims);
        assert!(contiguous(&[1, 0, 0], &[2, 6, 8]));
        assert!(contiguous(&[1, 2, 0], &[1, 3, 8]));
        assert!(contiguous(&[1, 2, 3], &[1, 1, 4]));
        assert!(!contiguous(&[1, 2, 0], &[2, 3, 8]));
        assert!(!contiguous(&[0, 0, 0], &[4, 6, 4]));
        assert_eq!(
            TensorBox::new(&[1, 2, 3], &[1, 1, 4]).first_element_in(&dims),
            48 + 16 + 3
        );
    }

    #[test]
    fn strided_boxes_are_evenly_spaced_runs() {
        let dims = [4u32, 6, 8];
        let strided = |start: &[u32], len: &[u32]| TensorBox::new(start, len).strided_in(&dims);
        // Every element of each box, by the formula, equals a direct enumeration.
        for (start, len) in [
            ([0u32, 0, 0], [4u32, 6, 4]),
            ([1, 2, 0], [2, 3, 8]),
            ([1, 2, 3], [1, 1, 4]),
            ([2, 0, 1], [1, 6, 5]),
            ([0, 0, 0], [4, 6, 8]),
            ([0, 3, 0], [4, 1, 8]),
        ] {
            let b = TensorBox::new(&start, &len);
            let (run, stride) = b.strided_in(&dims).expect("evenly spaced");
            let first = b.first_element_in(&dims);
            let mut k = 0u64;
            for i in start[0]..start[0] + len[0] {
                for j in start[1]..start[1] + len[1] {
                    for l in start[2]..start[2] + len[2] {
                        let at = u64::from((i * 6 + j) * 8 + l);
                        assert_eq!(first + (k / run) * stride + k % run, at, "{b} k {k}");
                        k += 1;
                    }
                }
            }
        }
        assert_eq!(strided(&[0, 0, 0], &[4, 6, 8]), Some((192, 192)));
        assert_eq!(strided(&[1, 2, 0], &[2, 3, 8]), Some((24, 48)));
        // Cut in rows and columns of several matrices: runs not evenly spaced.
        assert_eq!(strided(&[0, 1, 2], &[2, 2, 4]), None);
        assert_eq!(strided(&[0, 0, 0], &[0, 6, 8]), None);
    }

    #[test]
    fn boxes_intersect_and_contain() {
        let a = TensorBox::new(&[0, 0], &[10, 8]);
        let b = TensorBox::new(&[5, 4], &[10, 10]);
        let c = a.intersect(&b).unwrap();
        assert_eq!(c, TensorBox::new(&[5, 4], &[5, 4]));
        assert!(a.contains(&c) && b.contains(&c));
        assert!(a.intersect(&TensorBox::new(&[10, 0], &[1, 1])).is_none());
        assert_eq!(c.relative_to(&b), TensorBox::new(&[0, 0], &[5, 4]));
        assert_eq!(Shape::new(&[2, 3, 4]).strides()[..3], [12, 4, 1]);
        assert_eq!(format!("{c}"), "[5..10, 4..8]");
    }

    #[test]
    fn slice_of_missing_rank_is_an_error() {
        let t = RoutingTable::from_plans("m", 0, 0, &[], &[]).unwrap();
        let e = t.slice(3).unwrap_err();
        assert!(e.to_string().contains('3'), "{e}");
        let bytes = t.to_bincode();
        assert_eq!(RoutingTable::from_bincode(&bytes).unwrap(), t);
    }
}
