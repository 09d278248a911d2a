//! The planner: `(model, training layout, inference layout, cost model) -> RoutingTable`.
//!
//! # How
//! 1. **Destination groups.** Inference pieces with the same parameter box (the same bytes for
//!    several ranks: dp engines, attention replicated across ep groups, kv heads replicated) are
//!    grouped, so each box is read and prepared once and written to every rank that needs it.
//! 2. **Source grid.** Each parameter's training shards cut it into a grid of cells; every cell
//!    must be held by at least one rank (else an error names the region), and the ranks holding
//!    a cell are its replicas.
//! 3. **Regions.** A destination box is cut along the grid into regions, each inside one cell.
//!    For fp8 destinations a cut that is not on a 128 boundary would split a quantisation block,
//!    so the block row (or column) around it becomes a *gather region*: one owner quantises it
//!    after every holder has written its part into the owner's gather arena. A small box cut
//!    into many regions smaller than a work request is worth (a norm over 128 ranks) is made
//!    one gather region too, so each destination gets one write instead of one per source.
//! 4. **Sources.** Single-replica regions are fixed. Gather owners go to the least loaded holder
//!    of the largest part. Small replicated regions go whole to the least loaded replica; the
//!    rest are spread exactly by the min-max flow of [`crate::balance`], cutting regions along
//!    dimension 0 (in whole blocks for fp8). Load = bytes sent plus work requests times
//!    [`CostModel::wr_equiv_bytes`].
//! 5. **Emission.** Tasks per trainer in mesh-group order (gather sends, local tasks,
//!    gather-sourced tasks), each with its writes as maximal contiguous runs.
//!
//! Pure and deterministic: no hash-map iteration, no clock, and threads only where the result
//! cannot depend on them (rayon; the table is the same with one thread or many):
//! - both layouts are validated at once; the inference side compares ranks laid out alike in
//!   parallel, then checks in rank order;
//! - step 1 sorts each parameter's pieces on their own, in parallel, beside the shards' order;
//! - where the engines repeat engine 0 ([`InferenceLayout::engine_period`]), validation, step 1
//!   and every later step read engine 0's pieces only: another engine's target is engine 0's
//!   with its rank moved ([`Planner::target_piece`]), so 64 engines cost what one does;
//! - steps 2-3 (`analyse`) take ranges of parameters in parallel and append what each range
//!   found in parameter order; the single-holder loads they add are sums;
//! - where parameters repeat one another (the experts of a layer: the same boxes on the same
//!   trainers, placed alike), steps 2-3 run once for the first and the others reuse its regions
//!   moved to themselves; those whose regions all have one holder store none of their own, and
//!   emission reads the first's (`Planner::param_regions`; see `regions`);
//! - step 4 (sourcing) stays sequential: each choice depends on the loads of those before it;
//!   the trainers' empty parts that step 5 fills, which only the training layout decides, are
//!   built beside it on the other threads;
//! - step 5 deals the trainers into parts (rank `r` to part `r % parts`); each part walks every
//!   region in the same order and emits only its own trainers' tasks, so each trainer gets the
//!   same tasks in the same order as with one part, and the writes each rollout receives are
//!   summed over the parts. The trainers' parts are built and finished in parallel.
//!
//! # Layout
//! This file holds [`plan`], the `Planner` state the steps share and the order they run in;
//! each step is a file adding its methods to `Planner`:
//! - `validate`: the inference layout checked before any step (not a step: it only refuses).
//! - `dgroups` (1), `grid` (2), `regions` (3, pass 1 `analyse`), `assign` (4, pass 2),
//!   `emit` (5, pass 3) with `targets` (which targets get listed writes, which copies) and
//!   `shapes` (each task shape's writes cut once, not once per task).
//! - `place`: where a parameter box lands in a piece's tensors (validation, regions, emission).
//! - `tests`: what the steps' shortcuts must not change (repeats reused or not, the same table).

mod assign;
mod dgroups;
mod emit;
mod grid;
mod place;
mod regions;
mod shapes;
mod targets;
#[cfg(test)]
mod tests;
mod validate;

use weightsync_common::DType;

use self::emit::EmissionStart;
use self::grid::Grid;
use self::validate::validate_infer;
use crate::cost::CostModel;
use crate::error::PlanError;
use crate::layout_infer::{EnginePeriod, InferenceLayout, Piece};
use crate::layout_train::{ShardSpec, TrainingLayout};
use crate::model::Model;
use crate::table::{RoutingTable, TensorBox};

/// Plans without progress reports.
pub fn plan(
    model: &Model,
    train: &TrainingLayout,
    infer: &InferenceLayout,
    cost: &CostModel,
) -> Result<RoutingTable, PlanError> {
    plan_with_progress(model, train, infer, cost, &mut |_, _| {})
}

/// Plans, calling `progress(done, total)` now and then (work units are parameters, visited
/// twice: analysis then emission).
pub fn plan_with_progress(
    model: &Model,
    train: &TrainingLayout,
    infer: &InferenceLayout,
    cost: &CostModel,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RoutingTable, PlanError> {
    plan_steps(model, train, infer, cost, progress, Reuse::Repeats).map(|(table, _)| table)
}

/// Whether `analyse` reuses the regions of parameters that repeat one another (see the
/// `regions` module): always, but for the tests that check it changes nothing.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Reuse {
    Repeats,
    #[cfg_attr(not(test), allow(dead_code))]
    Nothing,
}

/// The steps of [`plan_with_progress`], which also returns how many params reused another's
/// regions.
fn plan_steps(
    model: &Model,
    train: &TrainingLayout,
    infer: &InferenceLayout,
    cost: &CostModel,
    progress: &mut dyn FnMut(u64, u64),
    reuse: Reuse,
) -> Result<(RoutingTable, usize), PlanError> {
    // Engines repeating engine 0 are checked and grouped as engine 0 (see `EnginePeriod`).
    let period = infer.engine_period().filter(|p| p.engines > 1);
    // Both sides are checked at once; the training side's error is the one reported when
    // both are wrong, as when they were checked one after the other.
    let (trained, inferred) = rayon::join(
        || train.validate(model),
        || validate_infer(model, infer, period),
    );
    trained?;
    inferred?;
    let sorted;
    let train = if train
        .shards
        .windows(2)
        .all(|w| (w[0].rank, w[0].offset) <= (w[1].rank, w[1].offset))
    {
        train
    } else {
        let mut t = train.clone();
        t.shards.sort_by_key(|s| (s.rank, s.offset));
        sorted = t;
        &sorted
    };
    let mut p = Planner::new(model, train, infer, cost, period)?;
    p.reuse = reuse;
    p.analyse(progress)?;
    // What emission starts from needs only the training layout: built while sources are
    // chosen (a sequential step, so the other threads are free).
    let ((), start) = rayon::join(|| p.assign(), || EmissionStart::new(model, train));
    let reused = p.reused;
    Ok((p.emit(start, progress)?, reused))
}

/// Marker for "gather region" in `Region::cell`.
const GATHER: u32 = u32::MAX;

/// Marker for "analysed in full" in `Planner::repeat_of`.
const NO_REPEAT: u32 = u32::MAX;

/// A group of destination pieces sharing one parameter box (step 1, `dgroups`).
struct DGroup {
    bx: TensorBox,
    first: u32,
    /// Its targets, in every engine.
    n: u32,
    /// Its targets in one engine: `sorted[first..first + engine_n]` (all of them, `n`, when
    /// the engines are not planned as repeats of engine 0).
    engine_n: u32,
    fp8: bool,
    /// Destination element type (of the weight tensor).
    dtype: DType,
}

/// One region: a box inside one destination group, inside one cell (or a gather region), with
/// what sourcing it weighs ([`Planner::region`] assembles it from the two lists that hold it).
#[derive(Clone, Copy)]
struct Region {
    dgroup: u32,
    bx: TensorBox,
    cell: u32,
    weight: u64,
}

/// What emission needs of a region: its destination group and box. Kept apart from its
/// [`RegionLoad`] so the loads, which only sourcing reads, are freed before emission.
#[derive(Clone, Copy)]
struct RegionBox {
    dgroup: u32,
    bx: TensorBox,
}

/// What sourcing a region needs beyond its box: its cell (or GATHER) and its weight.
#[derive(Clone, Copy)]
struct RegionLoad {
    cell: u32,
    weight: u64,
}

/// What assignment and emission need of a planner shard: its rank and element type (the
/// boxes are read from the layout while grids are built, param by param).
#[derive(Clone, Copy)]
struct SourceShard {
    rank: u32,
    dtype: DType,
}

/// How a region is sourced.
#[derive(Clone, Copy)]
enum Assign {
    /// Whole from one shard (global shard index).
    Shard(u32),
    /// Split: `splits[first..first+n]`.
    Split { first: u32, n: u32 },
    /// Gathered to `owner_shard`'s rank from `gather_parts[first..first+n]`.
    Gather {
        owner_shard: u32,
        first: u32,
        n: u32,
    },
}

/// What the steps know and build, from [`Planner::new`] to [`Planner::emit`].
struct Planner<'a> {
    model: &'a Model,
    train: &'a TrainingLayout,
    infer: &'a InferenceLayout,
    cost: &'a CostModel,
    /// Indices of the pieces sorted by (param, box, rank, tensor).
    sorted: Vec<u32>,
    dgroups: Vec<DGroup>,
    /// Per param, its dgroups range.
    dgroup_first: Vec<u32>,
    /// The layout's shards in (param, index) order, as rank and element type (a full copy of
    /// a million shards would cost as much as the layout). Planner-internal shard numbers (grid
    /// holders, assignments) are positions in this list.
    shards: Vec<SourceShard>,
    /// Position -> index in the layout's shard list.
    shard_order: Vec<u32>,
    /// Per param, its first position.
    shard_first: Vec<u32>,
    /// Per param, its grid (built by `analyse`, read by `assign`, then freed).
    grids: Vec<Grid>,
    regions: Vec<RegionBox>,
    /// Per param, the param whose regions it repeats (it has none of its own), or
    /// [`NO_REPEAT`] (see the `regions` module: repeats).
    repeat_of: Vec<u32>,
    /// Per region, its cell and weight (built by `analyse`, read by `assign`, then freed).
    region_loads: Vec<RegionLoad>,
    region_first: Vec<u32>,
    /// Per region, its source (fixed by `analyse` for single holders, by `assign` otherwise).
    assign: Vec<Assign>,
    /// Regions `assign` must source (gathers and replicated cells), in region order.
    open: Vec<u32>,
    /// Gather regions, in region order.
    gathers: Vec<u32>,
    splits: Vec<(TensorBox, u32)>,
    gather_parts: Vec<(TensorBox, u32)>,
    /// Per gather part, the cell it lies in (`gather_parts` holds its sender once `assign`
    /// chose it): what a copy of its region reuses. Freed after `assign`.
    gather_cells: Vec<u32>,
    /// Open regions copied from an earlier param's, in region order: (region, the one it
    /// copies), for `assign` to reuse the parts of copied gather regions. Freed after `assign`.
    copied_open: Vec<(u32, u32)>,
    loads: Vec<u64>,
    /// Inference ranks with identical tensor layouts share a class (same id).
    layout_class: Vec<u32>,
    /// What one work request costs, in bytes of bandwidth ([`CostModel::wr_equiv_bytes`]).
    wr_bytes: u64,
    /// Ranks per engine when the engines are planned as repeats of engine 0 (`sorted` then
    /// holds engine 0's pieces only), else 0.
    engine_ranks: u32,
    /// Whether `analyse` reuses repeated params' regions, and how many did.
    reuse: Reuse,
    reused: usize,
}

impl<'a> Planner<'a> {
    /// Groups the destinations (step 1) and orders the shards by parameter (for step 2).
    fn new(
        model: &'a Model,
        train: &'a TrainingLayout,
        infer: &'a InferenceLayout,
        cost: &'a CostModel,
        period: Option<EnginePeriod>,
    ) -> Result<Planner<'a>, PlanError> {
        let np = model.params.len();
        if train.shards.len() > u32::MAX as usize || infer.pieces.len() > u32::MAX as usize {
            return Err(PlanError::TooLarge(
                "more than 2^32 shards or pieces".into(),
            ));
        }
        // The destination side's grouping and the source side's order are independent: built
        // at once.
        let ((sorted, dgroups, dgroup_first), ((shard_first, shard_order), layout_class)) =
            rayon::join(
                || dgroups::destination_groups(np, infer, period),
                || {
                    (
                        grid::shards_by_param(np, train),
                        targets::layout_classes(infer),
                    )
                },
            );
        Ok(Planner {
            model,
            train,
            infer,
            cost,
            sorted,
            dgroups,
            dgroup_first,
            shards: shard_order
                .iter()
                .map(|&i| {
                    let s = &train.shards[i as usize];
                    SourceShard {
                        rank: s.rank,
                        dtype: s.dtype,
                    }
                })
                .collect(),
            shard_order,
            shard_first,
            grids: Vec::with_capacity(np),
            regions: Vec::new(),
            repeat_of: Vec::with_capacity(np),
            region_loads: Vec::new(),
            region_first: vec![0; np + 1],
            assign: Vec::new(),
            open: Vec::new(),
            gathers: Vec::new(),
            splits: Vec::new(),
            gather_parts: Vec::new(),
            gather_cells: Vec::new(),
            copied_open: Vec::new(),
            loads: vec![0; train.ranks as usize],
            layout_class,
            engine_ranks: period.map_or(0, |p| p.ranks),
            reuse: Reuse::Repeats,
            reused: 0,
            wr_bytes: cost.wr_equiv_bytes(),
        })
    }

    /// Positions of a param's shards.
    #[inline]
    fn param_shards(&self, pid: usize) -> std::ops::Range<u32> {
        self.shard_first[pid]..self.shard_first[pid + 1]
    }

    /// The shard at a position.
    #[inline]
    fn shard(&self, s: u32) -> &SourceShard {
        &self.shards[s as usize]
    }

    /// The layout's shard at a position.
    #[inline]
    fn layout_shard(&self, s: u32) -> &ShardSpec {
        &self.train.shards[self.shard_order[s as usize] as usize]
    }

    /// Region `ri` with its load (while `assign` runs; the loads are freed after it).
    #[inline]
    fn region(&self, ri: u32) -> Region {
        let RegionBox { dgroup, bx } = self.regions[ri as usize];
        let RegionLoad { cell, weight } = self.region_loads[ri as usize];
        Region {
            dgroup,
            bx,
            cell,
            weight,
        }
    }

    /// Target `k` of a dgroup (its pieces are in rank, then tensor order): engine `k / engine_n`'s
    /// copy of engine 0's target `k % engine_n` (the target itself when the dgroup is all of its
    /// targets, `engine_n == n`). Engine 0's piece with the rank moved: the other engines' pieces
    /// are never read (at 64 engines they are 445 MB, and reading them was a cache miss each).
    #[inline]
    fn target_piece(&self, dg: &DGroup, k: u32) -> Piece {
        let (e, k) = (k / dg.engine_n, k % dg.engine_n);
        let p = &self.infer.pieces[self.sorted[(dg.first + k) as usize] as usize];
        Piece {
            rank: p.rank + e * self.engine_ranks,
            ..*p
        }
    }

    /// Param `pid`'s regions: its own, or, for a repeat, those of the param it repeats with how
    /// far their dgroups and single sources move to be its own.
    #[inline]
    fn param_regions(&self, pid: usize) -> (std::ops::Range<u32>, Option<(u32, u32)>) {
        match self.repeat_of[pid] {
            NO_REPEAT => (self.region_first[pid]..self.region_first[pid + 1], None),
            q => {
                let q = q as usize;
                (
                    self.region_first[q]..self.region_first[q + 1],
                    Some((
                        self.dgroup_first[pid] - self.dgroup_first[q],
                        self.shard_first[pid] - self.shard_first[q],
                    )),
                )
            }
        }
    }

    /// The parameter of a dgroup.
    #[inline]
    fn dgroup_param(&self, dgi: u32) -> usize {
        let dg = &self.dgroups[dgi as usize];
        self.target_piece(dg, 0).param as usize
    }
}
