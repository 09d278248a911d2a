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
//! Pure and deterministic: no hash-map iteration, no clock, no threads.

mod place;
mod validate;

use std::collections::BTreeMap;
use std::rc::Rc;

use smallvec::SmallVec;

use weightsync_common::DType;

use self::place::{dst_box, scale_box};
use self::validate::validate_infer;
use crate::balance::balance;
use crate::cost::CostModel;
use crate::error::PlanError;
use crate::layout_infer::{InferenceLayout, Piece};
use crate::layout_train::{align_up, ShardSpec, TrainingLayout};
use crate::model::Model;
use crate::runs::{count_runs, for_each_run};
use crate::table::{
    Endpoint, LocalShard, MeshGroup, ParamRef, RolloutPlan, RoutingTable, Shape, Source, Task,
    TensorBox, TrainerPlan, Transform, UnitExpect, Write, WriteCopies, FP8_BLOCK, MAX_DIMS,
    MAX_WRITE_BYTES, TRAINER_GATHER_MR,
};

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
    train.validate(model)?;
    validate_infer(model, infer)?;
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
    let mut p = Planner::new(model, train, infer, cost)?;
    p.analyse(progress)?;
    p.assign();
    p.emit(progress)
}

/// Marker for "gather region" in `Region::cell`.
const GATHER: u32 = u32::MAX;

/// A group of destination pieces sharing one parameter box.
struct DGroup {
    bx: TensorBox,
    first: u32,
    n: u32,
    fp8: bool,
    /// Destination element type (of the weight tensor).
    dtype: DType,
}

/// The source grid of one parameter: its cells and who holds each.
#[derive(Default)]
struct Grid {
    /// Where the shards cut the parameter. Parameters whose shards have the same boxes (the
    /// experts of a layer, the layers of a model) share one.
    cells: Rc<GridCells>,
    /// Holders of each cell (planner shard positions), grouped as `cells.holder_first` says.
    holders: Vec<u32>,
}

/// The cells of a grid, and its holders numbered within the parameter's own shard list.
#[derive(Default)]
struct GridCells {
    ndim: usize,
    cut_first: [u32; MAX_DIMS + 1],
    cuts: Vec<u32>,
    strides: [u32; MAX_DIMS],
    holder_first: Vec<u32>,
    /// Holders as indices into the parameter's shard list.
    local: Vec<u32>,
    /// What the grid was built from: the parameter's shape and its shards' boxes, in order.
    shape: Shape,
    boxes: Vec<TensorBox>,
}

impl GridCells {
    fn cuts(&self, d: usize) -> &[u32] {
        &self.cuts[self.cut_first[d] as usize..self.cut_first[d + 1] as usize]
    }

    /// The box of a cell.
    fn cell_box(&self, cell: u32) -> TensorBox {
        let mut b = TensorBox::new(&[0; MAX_DIMS][..self.ndim], &[0; MAX_DIMS][..self.ndim]);
        let mut rest = cell;
        for d in 0..self.ndim {
            let i = rest / self.strides[d];
            rest %= self.strides[d];
            let c = self.cuts(d);
            b.start[d] = c[i as usize];
            b.len[d] = c[i as usize + 1] - c[i as usize];
        }
        b
    }

    /// Index along `d` of the interval containing `x`.
    fn interval(&self, d: usize, x: u32) -> u32 {
        let c = self.cuts(d);
        (c.partition_point(|&v| v <= x) - 1) as u32
    }

    /// Calls `f(cell)` for every cell whose interval along each dim `d` is in `lo[d]..hi[d]`,
    /// in cell order (`lo < hi` along every dim).
    fn for_each_cell(&self, lo: [u32; MAX_DIMS], hi: [u32; MAX_DIMS], mut f: impl FnMut(u32)) {
        let nd = self.ndim;
        let mut i = lo;
        loop {
            f((0..nd).map(|d| i[d] * self.strides[d]).sum());
            // Advance the odometer; done when every dim wrapped.
            let mut d = nd;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                i[d] += 1;
                if i[d] < hi[d] {
                    break;
                }
                i[d] = lo[d];
            }
        }
    }
}

impl Grid {
    fn holders(&self, cell: u32) -> &[u32] {
        let f = &self.cells.holder_first;
        &self.holders[f[cell as usize] as usize..f[cell as usize + 1] as usize]
    }
}

/// A dgroup's first target, as [`Planner::weight`] needs it.
struct Reach {
    pc: Piece,
    /// Shape and element size of the destination tensor.
    shape: Shape,
    elem: u64,
    /// Shape of the scale tensor (fp8).
    scales: Option<Shape>,
    /// Number of targets.
    n: u64,
}

/// Buffers [`Planner::build_grid`] reuses from param to param, and the grids it built last.
#[derive(Default)]
struct GridScratch {
    cuts: Vec<u32>,
    pairs: Vec<(u32, u32)>,
    next: Vec<u32>,
    /// Recently built cells, most recent first (a model repeats a handful of shardings).
    recent: Vec<Rc<GridCells>>,
}

/// How many recent grids [`GridScratch`] keeps.
const RECENT_GRIDS: usize = 8;

/// One region: a box inside one destination group, inside one cell (or a gather region).
#[derive(Clone, Copy)]
struct Region {
    dgroup: u32,
    bx: TensorBox,
    cell: u32,
    /// Writes to destinations (all targets).
    writes: u32,
    weight: u64,
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

struct Planner<'a> {
    model: &'a Model,
    train: &'a TrainingLayout,
    infer: &'a InferenceLayout,
    cost: &'a CostModel,
    /// Pieces sorted by (param, box, rank, tensor).
    sorted: Vec<Piece>,
    dgroups: Vec<DGroup>,
    /// Per param, its dgroups range.
    dgroup_first: Vec<u32>,
    /// The layout's shards in (param, index) order: planning visits them param by param, so
    /// this copy keeps those visits sequential in memory. Planner-internal shard numbers
    /// (grid holders, assignments) are positions in this list.
    shards: Vec<ShardSpec>,
    /// Position -> index in the layout's shard list.
    shard_order: Vec<u32>,
    /// Per param, its first position.
    shard_first: Vec<u32>,
    grids: Vec<Grid>,
    regions: Vec<Region>,
    region_first: Vec<u32>,
    /// Per region, its source (fixed by `analyse` for single holders, by `assign` otherwise).
    assign: Vec<Assign>,
    /// Regions `assign` must source (gathers and replicated cells), in region order.
    open: Vec<u32>,
    /// Gather regions, in region order.
    gathers: Vec<u32>,
    splits: Vec<(TensorBox, u32)>,
    gather_parts: Vec<(TensorBox, u32)>,
    loads: Vec<u64>,
    /// Inference ranks with identical tensor layouts share a class (same id).
    layout_class: Vec<u32>,
    /// What one work request costs, in bytes of bandwidth ([`CostModel::wr_equiv_bytes`]).
    wr_bytes: u64,
    /// Expected tasks and writes per trainer (capacity hints).
    est_tasks: Vec<u64>,
    est_writes: Vec<u64>,
}

/// The transform for a region from `from` to a destination of `to` (fp8: block-quantised).
fn transform_for(fp8: bool, from: DType, to: DType) -> Transform {
    if fp8 {
        Transform::Fp8Block { from }
    } else if from == to {
        Transform::Copy { dtype: from }
    } else {
        Transform::Cast { from, to }
    }
}

/// One segment of a destination box along one dimension.
#[derive(Clone, Copy)]
struct Seg {
    start: u32,
    end: u32,
    /// Interval index in the grid along this dim, or GATHER for a band.
    cell: u32,
}

/// Cuts `[a, b)` along dim `d` at the grid's cuts; with `block`, a cut off the 128 grid turns
/// the block around it into a band.
fn segments(grid: &Grid, d: usize, a: u32, b: u32, block: bool, out: &mut Vec<Seg>) {
    out.clear();
    let cuts = grid.cells.cuts(d);
    let lo = cuts.partition_point(|&c| c <= a);
    let hi = cuts.partition_point(|&c| c < b);
    let inner = &cuts[lo..hi];
    let push_normal = |s: u32, e: u32, out: &mut Vec<Seg>| {
        if s < e {
            out.push(Seg {
                start: s,
                end: e,
                cell: grid.cells.interval(d, s),
            });
        }
    };
    if !block {
        let mut s = a;
        for &c in inner {
            push_normal(s, c, out);
            s = c;
        }
        push_normal(s, b, out);
        return;
    }
    let mut pos = a;
    let mut i = 0;
    while i < inner.len() {
        let c = inner[i];
        if c.is_multiple_of(FP8_BLOCK) {
            push_normal(pos, c, out);
            pos = c;
            i += 1;
            continue;
        }
        let bs = c / FP8_BLOCK * FP8_BLOCK;
        let be = (bs + FP8_BLOCK).min(b);
        push_normal(pos, bs, out);
        out.push(Seg {
            start: bs,
            end: be,
            cell: GATHER,
        });
        pos = be;
        while i < inner.len() && inner[i] < be {
            i += 1;
        }
        // A cut exactly at `be` is a boundary already.
        while i < inner.len() && inner[i] == be {
            i += 1;
        }
    }
    push_normal(pos, b, out);
}

impl<'a> Planner<'a> {
    fn new(
        model: &'a Model,
        train: &'a TrainingLayout,
        infer: &'a InferenceLayout,
        cost: &'a CostModel,
    ) -> Result<Planner<'a>, PlanError> {
        let np = model.params.len();
        // Pieces by param (a counting sort), then by (box, rank, tensor) within a param.
        let mut piece_first = vec![0usize; np + 1];
        for p in &infer.pieces {
            piece_first[p.param as usize + 1] += 1;
        }
        for k in 0..np {
            piece_first[k + 1] += piece_first[k];
        }
        let mut order = vec![0u32; infer.pieces.len()];
        let mut next = piece_first.clone();
        for (i, p) in infer.pieces.iter().enumerate() {
            order[next[p.param as usize]] = i as u32;
            next[p.param as usize] += 1;
        }
        for k in 0..np {
            order[piece_first[k]..piece_first[k + 1]].sort_unstable_by_key(|&i| {
                let p = &infer.pieces[i as usize];
                (p.src.start, p.src.len, p.rank, p.tensor)
            });
        }
        let mut dgroups = Vec::new();
        let mut dgroup_first = vec![0u32; np + 1];
        let mut i = 0;
        while i < order.len() {
            let p = &infer.pieces[order[i] as usize];
            let mut j = i + 1;
            while j < order.len() {
                let q = &infer.pieces[order[j] as usize];
                if q.param != p.param || q.src != p.src {
                    break;
                }
                j += 1;
            }
            dgroup_first[p.param as usize + 1] += 1;
            dgroups.push(DGroup {
                bx: p.src,
                first: i as u32,
                n: (j - i) as u32,
                fp8: p.scale.is_some(),
                dtype: infer.ranks[p.rank as usize].tensors[p.tensor as usize].dtype,
            });
            i = j;
        }
        for k in 0..np {
            dgroup_first[k + 1] += dgroup_first[k];
        }
        // Shards grouped by param, in layout order within a param (a counting sort).
        let mut shard_first = vec![0u32; np + 1];
        for s in &train.shards {
            shard_first[s.param as usize + 1] += 1;
        }
        for k in 0..np {
            shard_first[k + 1] += shard_first[k];
        }
        let mut shard_order = vec![0u32; train.shards.len()];
        let mut next = shard_first.clone();
        for (i, s) in train.shards.iter().enumerate() {
            shard_order[next[s.param as usize] as usize] = i as u32;
            next[s.param as usize] += 1;
        }
        if train.shards.len() > u32::MAX as usize || infer.pieces.len() > u32::MAX as usize {
            return Err(PlanError::TooLarge(
                "more than 2^32 shards or pieces".into(),
            ));
        }
        Ok(Planner {
            model,
            train,
            infer,
            cost,
            sorted: order.iter().map(|&i| infer.pieces[i as usize]).collect(),
            dgroups,
            dgroup_first,
            shards: shard_order
                .iter()
                .map(|&i| train.shards[i as usize])
                .collect(),
            shard_order,
            shard_first,
            grids: Vec::with_capacity(np),
            regions: Vec::new(),
            region_first: vec![0; np + 1],
            assign: Vec::new(),
            open: Vec::new(),
            gathers: Vec::new(),
            splits: Vec::new(),
            gather_parts: Vec::new(),
            loads: vec![0; train.ranks as usize],
            est_tasks: vec![0; train.ranks as usize],
            est_writes: vec![0; train.ranks as usize],
            layout_class: layout_classes(infer),
            wr_bytes: cost.wr_equiv_bytes(),
        })
    }

    /// Positions of a param's shards.
    fn param_shards(&self, pid: usize) -> std::ops::Range<u32> {
        self.shard_first[pid]..self.shard_first[pid + 1]
    }

    /// The shard at a position.
    fn shard(&self, s: u32) -> &ShardSpec {
        &self.shards[s as usize]
    }

    /// The grid of param `pid`'s shards. `scratch` is reused from param to param (a large model
    /// has tens of thousands).
    fn build_grid(&self, pid: usize, scratch: &mut GridScratch) -> Result<Grid, PlanError> {
        let p = &self.model.params[pid];
        let idx = self.param_shards(pid);
        let shards = &self.shards[idx.start as usize..idx.end as usize];
        if let Some(sh) = shards.iter().find(|s| s.dtype != shards[0].dtype) {
            return Err(PlanError::DtypeMismatch {
                param: p.name.to_string(),
                a: shards[0].rank,
                b: sh.rank,
            });
        }
        // Sharded like a recent parameter (the same boxes): the same cells.
        let same = |c: &GridCells| {
            c.shape == p.shape
                && c.boxes.len() == shards.len()
                && c.boxes.iter().zip(shards).all(|(b, s)| *b == s.global)
        };
        let cells = match scratch.recent.iter().position(|c| same(c)) {
            Some(k) => {
                let c = scratch.recent.remove(k);
                scratch.recent.insert(0, c.clone());
                c
            }
            None => {
                let c = Rc::new(self.grid_cells(pid, scratch)?);
                scratch.recent.insert(0, c.clone());
                scratch.recent.truncate(RECENT_GRIDS);
                c
            }
        };
        let holders = cells.local.iter().map(|&j| idx.start + j).collect();
        Ok(Grid { cells, holders })
    }

    /// The cells of param `pid`'s grid, with holders numbered within its shard list.
    fn grid_cells(&self, pid: usize, scratch: &mut GridScratch) -> Result<GridCells, PlanError> {
        let p = &self.model.params[pid];
        let nd = p.shape.ndim as usize;
        let idx = self.param_shards(pid);
        let shards = &self.shards[idx.start as usize..idx.end as usize];
        let mut g = GridCells {
            ndim: nd,
            shape: p.shape,
            boxes: shards.iter().map(|s| s.global).collect(),
            ..GridCells::default()
        };
        let cuts = &mut scratch.cuts;
        // Dims no shard cuts (FSDP cuts dim 0 only): nothing to sort or search along them.
        let mut whole = [false; MAX_DIMS];
        for (d, whole) in whole.iter_mut().enumerate().take(nd) {
            cuts.clear();
            cuts.push(0);
            cuts.push(p.shape.dims[d]);
            *whole = p.shape.dims[d] > 0
                && shards
                    .iter()
                    .all(|s| s.global.start[d] == 0 && s.global.len[d] == p.shape.dims[d]);
            if !*whole {
                for s in shards {
                    cuts.push(s.global.start[d]);
                    cuts.push(s.global.end(d));
                }
                cuts.sort_unstable();
            }
            cuts.dedup();
            g.cuts.extend_from_slice(cuts);
            g.cut_first[d + 1] = g.cuts.len() as u32;
        }
        let mut ncells: u64 = 1;
        for d in (0..nd).rev() {
            g.strides[d] = ncells as u32;
            ncells *= (g.cuts(d).len() - 1) as u64;
            if ncells > u32::MAX as u64 / 2 {
                return Err(PlanError::TooLarge(format!(
                    "{}: too many grid cells",
                    p.name
                )));
            }
        }
        // (cell, shard) for every cell of every shard, in shard order.
        let pairs = &mut scratch.pairs;
        pairs.clear();
        for (j, sh) in shards.iter().enumerate() {
            let mut lo = [0u32; MAX_DIMS];
            let mut hi = [1u32; MAX_DIMS];
            for d in (0..nd).filter(|&d| !whole[d]) {
                let c = g.cuts(d);
                lo[d] = c.partition_point(|&v| v < sh.global.start[d]) as u32;
                hi[d] = c.partition_point(|&v| v < sh.global.end(d)) as u32;
            }
            g.for_each_cell(lo, hi, |cell| pairs.push((cell, j as u32)));
        }
        // Holders grouped by cell, each cell's in shard order: a counting sort.
        g.holder_first = vec![0; ncells as usize + 1];
        for &(c, _) in pairs.iter() {
            g.holder_first[c as usize + 1] += 1;
        }
        for c in 0..ncells as usize {
            if g.holder_first[c + 1] == 0 {
                let mut holders: Vec<u32> = shards.iter().map(|s| s.rank).collect();
                holders.sort_unstable();
                holders.dedup();
                let shown: Vec<String> = holders.iter().take(16).map(|r| r.to_string()).collect();
                return Err(PlanError::Uncovered {
                    param: p.name.to_string(),
                    region: g.cell_box(c as u32).to_string(),
                    holders: if shown.is_empty() {
                        "none".into()
                    } else if holders.len() > 16 {
                        format!("{}, ... ({} ranks)", shown.join(", "), holders.len())
                    } else {
                        shown.join(", ")
                    },
                });
            }
            g.holder_first[c + 1] += g.holder_first[c];
        }
        g.local = vec![0; pairs.len()];
        let next = &mut scratch.next;
        next.clear();
        next.extend_from_slice(&g.holder_first[..ncells as usize]);
        for &(c, j) in pairs.iter() {
            g.local[next[c as usize] as usize] = j;
            next[c as usize] += 1;
        }
        Ok(g)
    }

    fn target_piece(&self, dg: &DGroup, k: u32) -> &Piece {
        &self.sorted[(dg.first + k) as usize]
    }

    /// What the load of a region of dgroup `dg` depends on: its first target's tensors (every
    /// target is laid out alike). Looked up once per dgroup, not once per region.
    fn reach(&self, dg: &DGroup) -> Reach {
        let pc = *self.target_piece(dg, 0);
        let rank = &self.infer.ranks[pc.rank as usize];
        let t = &rank.tensors[pc.tensor as usize];
        Reach {
            pc,
            shape: t.shape,
            elem: t.dtype.size() as u64,
            scales: pc
                .scale
                .filter(|_| dg.fp8)
                .map(|sc| rank.tensors[sc.tensor as usize].shape),
            n: dg.n as u64,
        }
    }

    /// Load weight of sending region `r` to all the targets of a dgroup, and the number of
    /// writes.
    fn weight(&self, reach: &Reach, r: &TensorBox) -> (u64, u64) {
        let pc = &reach.pc;
        let db = dst_box(pc, r, reach.shape.ndim as usize);
        let mut wrs = count_runs(&db, &reach.shape);
        let mut bytes = r.numel() * reach.elem;
        if let Some(ss) = reach.scales {
            let sb = scale_box(pc, r, ss.ndim as usize, r.ndim as usize);
            wrs += count_runs(&sb, &ss);
            bytes += sb.numel() * 4;
        }
        ((bytes + wrs * self.wr_bytes) * reach.n, wrs * reach.n)
    }

    /// Pass 1: grids and regions; single-replica loads.
    fn analyse(&mut self, progress: &mut dyn FnMut(u64, u64)) -> Result<(), PlanError> {
        let np = self.model.params.len();
        let mut segs: Vec<Vec<Seg>> = vec![Vec::new(); MAX_DIMS];
        let mut scratch = GridScratch::default();
        for pid in 0..np {
            if pid % 4096 == 0 {
                progress(pid as u64, 2 * np as u64);
            }
            let (d0, d1) = (self.dgroup_first[pid], self.dgroup_first[pid + 1]);
            if d0 == d1 {
                self.grids.push(Grid::default());
                self.region_first[pid + 1] = self.regions.len() as u32;
                continue;
            }
            let grid = self.build_grid(pid, &mut scratch)?;
            let nd = grid.cells.ndim;
            for dgi in d0..d1 {
                let dg = &self.dgroups[dgi as usize];
                let reach = self.reach(dg);
                let bx = dg.bx;
                for (d, seg) in segs.iter_mut().enumerate().take(nd) {
                    let block = dg.fp8 && d + 2 >= nd;
                    segments(&grid, d, bx.start[d], bx.end(d), block, seg);
                }
                // Many tiny regions (a norm cut over 128 ranks): gather the box to one owner
                // so each destination gets one write instead of one per source.
                let nregions: usize = segs[..nd].iter().map(Vec::len).product();
                let wr = self.wr_bytes;
                let dgr = &self.dgroups[dgi as usize];
                let out_bytes = bx.numel() * dgr.dtype.size() as u64;
                let src_bytes = bx.numel() * self.model.params[pid].dtype.size() as u64;
                if nregions > 1 && out_bytes / (nregions as u64) < wr && src_bytes <= 64 * wr {
                    let (w, wrs) = self.weight(&reach, &bx);
                    self.open.push(self.regions.len() as u32);
                    self.assign.push(Assign::Shard(0));
                    self.regions.push(Region {
                        dgroup: dgi,
                        bx,
                        cell: GATHER,
                        writes: wrs as u32,
                        weight: w,
                    });
                    continue;
                }
                let mut i = [0usize; MAX_DIMS];
                'regions: loop {
                    let mut r = bx;
                    let mut cell = 0u32;
                    for d in 0..nd {
                        let s = segs[d][i[d]];
                        r.start[d] = s.start;
                        r.len[d] = s.end - s.start;
                        if s.cell == GATHER || cell == GATHER {
                            cell = GATHER;
                        } else {
                            cell += s.cell * grid.cells.strides[d];
                        }
                    }
                    let (w, wrs) = self.weight(&reach, &r);
                    // One holder: the source is fixed now; the rest wait for every load.
                    match (cell != GATHER).then(|| grid.holders(cell)) {
                        Some(&[only]) => {
                            let rank = self.shard(only).rank as usize;
                            self.loads[rank] += w;
                            self.est_tasks[rank] += 1;
                            self.est_writes[rank] += wrs;
                            self.assign.push(Assign::Shard(only));
                        }
                        _ => {
                            self.open.push(self.regions.len() as u32);
                            self.assign.push(Assign::Shard(0));
                        }
                    }
                    self.regions.push(Region {
                        dgroup: dgi,
                        bx: r,
                        cell,
                        writes: wrs as u32,
                        weight: w,
                    });
                    let mut d = nd;
                    loop {
                        if d == 0 {
                            break 'regions;
                        }
                        d -= 1;
                        i[d] += 1;
                        if i[d] < segs[d].len() {
                            break;
                        }
                        i[d] = 0;
                    }
                }
            }
            self.grids.push(grid);
            self.region_first[pid + 1] = self.regions.len() as u32;
        }
        Ok(())
    }

    /// The least loaded of some shards' ranks (ties: first listed).
    fn least_loaded(&self, shards: &[u32]) -> u32 {
        let mut best = shards[0];
        for &s in &shards[1..] {
            if self.loads[self.shard(s).rank as usize] < self.loads[self.shard(best).rank as usize]
            {
                best = s;
            }
        }
        best
    }

    /// Pass 2: choose sources.
    fn assign(&mut self) {
        let grids = std::mem::take(&mut self.grids);
        self.assign_with(&grids);
        self.grids = grids;
    }

    fn assign_with(&mut self, grids: &[Grid]) {
        let wr = self.wr_bytes;
        let mut small: Vec<u32> = Vec::new();
        let mut big: Vec<u32> = Vec::new();
        // Gathers first (single holders were fixed by `analyse`), in region order.
        let open = std::mem::take(&mut self.open);
        for &ri in &open {
            let reg = self.regions[ri as usize];
            let grid = &grids[self.dgroup_param(reg.dgroup)];
            if reg.cell != GATHER {
                if reg.weight < self.cost.min_split_bytes() {
                    small.push(ri);
                } else {
                    big.push(ri);
                }
                continue;
            }
            // Gather region: parts = cells it touches.
            let nd = grid.cells.ndim;
            let mut lo = [0u32; MAX_DIMS];
            let mut hi = [0u32; MAX_DIMS];
            for d in 0..nd {
                lo[d] = grid.cells.interval(d, reg.bx.start[d]);
                hi[d] = grid.cells.interval(d, reg.bx.end(d) - 1) + 1;
            }
            let first = self.gather_parts.len() as u32;
            let mut best: Option<(u64, u32)> = None;
            let parts = &mut self.gather_parts;
            grid.cells.for_each_cell(lo, hi, |cell| {
                let part = grid
                    .cells
                    .cell_box(cell)
                    .intersect(&reg.bx)
                    .expect("cells in range intersect");
                if best.is_none_or(|(n, _)| part.numel() > n) {
                    best = Some((part.numel(), cell));
                }
                parts.push((part, cell));
            });
            // Owner: the least loaded rank holding any part (ties: the holder of the
            // largest part, which then has the least to receive). Choosing only among the
            // largest part's holders would pin every such region of every layer on the same
            // few ranks.
            let (_, big_cell) = best.expect("a part");
            let mut owner_shard = self.least_loaded(grid.holders(big_cell));
            for k in first as usize..self.gather_parts.len() {
                let cell = self.gather_parts[k].1;
                for &s in grid.holders(cell) {
                    let r = self.shard(s).rank as usize;
                    if self.loads[r] < self.loads[self.shard(owner_shard).rank as usize] {
                        owner_shard = s;
                    }
                }
            }
            let owner = self.shard(owner_shard).rank;
            self.loads[owner as usize] += reg.weight;
            self.est_tasks[owner as usize] += 1;
            self.est_writes[owner as usize] += reg.writes as u64;
            let n = self.gather_parts.len() as u32 - first;
            let elem = self.shard(owner_shard).dtype.size() as u64;
            for k in first..first + n {
                let (part, cell) = self.gather_parts[k as usize];
                let h = grid.holders(cell);
                let sender = h
                    .iter()
                    .copied()
                    .find(|&s| self.shard(s).rank == owner)
                    .unwrap_or_else(|| self.least_loaded(h));
                let srank = self.shard(sender).rank;
                let runs = count_runs(&part.relative_to(&reg.bx), &reg.bx.shape());
                self.est_tasks[srank as usize] += 1;
                self.est_writes[srank as usize] += runs;
                if srank != owner {
                    self.loads[srank as usize] += part.numel() * elem + runs * wr;
                }
                self.gather_parts[k as usize].1 = sender;
            }
            self.assign[ri as usize] = Assign::Gather {
                owner_shard,
                first,
                n,
            };
            self.gathers.push(ri);
        }
        // Small replicated regions: whole, to the least loaded replica, largest first.
        small.sort_by_key(|&ri| (std::cmp::Reverse(self.regions[ri as usize].weight), ri));
        for ri in small {
            let reg = self.regions[ri as usize];
            let pid = self.dgroup_param(reg.dgroup);
            let s = self.least_loaded(grids[pid].holders(reg.cell));
            let r = self.shard(s).rank as usize;
            self.loads[r] += reg.weight;
            self.est_tasks[r] += 1;
            self.est_writes[r] += reg.writes as u64;
            self.assign[ri as usize] = Assign::Shard(s);
        }
        // Big replicated regions: exact min-max split by replica set.
        let mut set_ids: BTreeMap<Vec<u32>, usize> = BTreeMap::new();
        let mut sets: Vec<(Vec<u32>, u64)> = Vec::new();
        let mut set_regions: Vec<Vec<u32>> = Vec::new();
        let mut key: Vec<u32> = Vec::new();
        for &ri in &big {
            let reg = self.regions[ri as usize];
            let pid = self.dgroup_param(reg.dgroup);
            let h = grids[pid].holders(reg.cell);
            key.clear();
            key.extend(h.iter().map(|&s| self.shard(s).rank));
            key.sort_unstable();
            key.dedup();
            let id = match set_ids.get(&key) {
                Some(&id) => id,
                None => {
                    set_ids.insert(key.clone(), sets.len());
                    sets.push((key.clone(), 0));
                    set_regions.push(Vec::new());
                    sets.len() - 1
                }
            };
            sets[id].1 += reg.weight;
            set_regions[id].push(ri);
        }
        let (amounts, _) = balance(&self.loads, &sets);
        for (j, (ranks, _)) in sets.iter().enumerate() {
            for (k, &r) in ranks.iter().enumerate() {
                self.loads[r as usize] += amounts[j][k];
            }
            let mut quota: Vec<i128> = amounts[j].iter().map(|&a| a as i128).collect();
            let mut cur = 0usize;
            for &ri in &set_regions[j] {
                let reg = self.regions[ri as usize];
                let dg = &self.dgroups[reg.dgroup as usize];
                let pid = self.dgroup_param(reg.dgroup);
                let h = grids[pid].holders(reg.cell);
                let shards = &self.shards;
                let shard_of = |rank: u32| -> u32 {
                    *h.iter()
                        .find(|&&s| shards[s as usize].rank == rank)
                        .expect("set member holds the cell")
                };
                // Split along the outermost dimension with enough units to level the members
                // (outer cuts keep sub-boxes contiguous at the destination); whole blocks for
                // fp8.
                let nd = reg.bx.ndim as usize;
                let unit_of = |d: usize| if dg.fp8 && d + 2 >= nd { FP8_BLOCK } else { 1 };
                let units = |d: usize| reg.bx.len[d].div_ceil(unit_of(d));
                let want_units = 8 * ranks.len() as u32;
                let sd = (0..nd)
                    .find(|&d| units(d) >= want_units)
                    .unwrap_or_else(|| (0..nd).rev().max_by_key(|&d| units(d)).unwrap_or(0));
                let unit = unit_of(sd);
                let n_units = units(sd);
                let per_unit = (reg.weight / n_units as u64).max(1) as i128;
                let first = self.splits.len() as u32;
                let mut done = 0u32;
                while done < n_units {
                    let last = cur + 1 >= ranks.len();
                    let k = if last {
                        n_units - done
                    } else {
                        let want = (quota[cur] + per_unit / 2) / per_unit;
                        want.clamp(0, (n_units - done) as i128) as u32
                    };
                    if k == 0 {
                        cur += 1;
                        continue;
                    }
                    let mut sub = reg.bx;
                    sub.start[sd] = reg.bx.start[sd] + done * unit;
                    sub.len[sd] = ((done + k) * unit).min(reg.bx.len[sd]) - done * unit;
                    self.splits.push((sub, shard_of(ranks[cur])));
                    self.est_tasks[ranks[cur] as usize] += 1;
                    self.est_writes[ranks[cur] as usize] += reg.writes as u64;
                    quota[cur] -= k as i128 * per_unit;
                    done += k;
                }
                self.assign[ri as usize] = Assign::Split {
                    first,
                    n: self.splits.len() as u32 - first,
                };
            }
        }
    }

    fn dgroup_param(&self, dgi: u32) -> usize {
        let dg = &self.dgroups[dgi as usize];
        self.target_piece(dg, 0).param as usize
    }

    /// Pass 3: tasks and writes, appended to each trainer's plan directly in execution order:
    /// per mesh group, gather sends, then local tasks, then gather-sourced tasks.
    fn emit(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<RoutingTable, PlanError> {
        let model = self.model;
        let np = model.params.len();
        let nt = self.train.ranks as usize;
        let ngroups = model.num_mesh_groups();
        // Per trainer: its shards (train.shards is sorted by rank, offset) and params.
        let mut rank_first = vec![0usize; nt + 1];
        for s in &self.train.shards {
            rank_first[s.rank as usize + 1] += 1;
        }
        for r in 0..nt {
            rank_first[r + 1] += rank_first[r];
        }
        // Param id -> index in the current rank's params (valid for the rank's own params).
        let mut local_param = vec![0u32; np];
        let mut pids: Vec<u32> = Vec::new();
        let builders: Vec<TrainerBuilder> = (0..nt)
            .map(|r| {
                let shards = &self.train.shards[rank_first[r]..rank_first[r + 1]];
                pids.clear();
                pids.extend(shards.iter().map(|s| s.param));
                if !pids.is_sorted() {
                    pids.sort_unstable();
                }
                pids.dedup();
                for (i, &p) in pids.iter().enumerate() {
                    local_param[p as usize] = i as u32;
                }
                let local = |p: u32| local_param[p as usize];
                let plan = TrainerPlan {
                    rank: r as u32,
                    params: pids
                        .iter()
                        .map(|&p| ParamRef {
                            id: p,
                            name: model.params[p as usize].name.clone(),
                            shape: model.params[p as usize].shape,
                        })
                        .collect(),
                    shards: shards
                        .iter()
                        .map(|s| LocalShard {
                            param: local(s.param),
                            global: s.global,
                            dtype: s.dtype,
                            offset: s.offset,
                        })
                        .collect(),
                    source_arena_bytes: shards
                        .last()
                        .map_or(0, |s| s.offset + s.global.numel() * s.dtype.size() as u64),
                    gather_arena_bytes: 0,
                    groups: Vec::with_capacity(ngroups as usize),
                    tasks: Vec::with_capacity(self.est_tasks[r] as usize),
                    writes: Vec::with_capacity(self.est_writes[r] as usize),
                    copies: Vec::with_capacity(self.est_tasks[r] as usize),
                };
                TrainerBuilder {
                    plan,
                    first_shard: rank_first[r],
                    gather_expect: 0,
                }
            })
            .collect();
        // Shard position -> (index in its rank's shard list, index of its param in the rank's
        // params): looked up once per task, so dense arrays in position order.
        let mut by_index = vec![0u32; self.train.shards.len()];
        for b in &builders {
            for (i, sh) in b.plan.shards.iter().enumerate() {
                by_index[b.first_shard + i] = sh.param;
            }
        }
        let mut first_shard = vec![0u32; nt];
        for b in &builders {
            first_shard[b.plan.rank as usize] = b.first_shard as u32;
        }
        let (shard_local, shard_param) = self
            .shard_order
            .iter()
            .zip(&self.shards)
            .map(|(&g, sh)| (g - first_shard[sh.rank as usize], by_index[g as usize]))
            .unzip();
        let mut out = Emission {
            builders,
            shard_local,
            shard_param,
            rollout_writes: vec![0u64; self.infer.ranks.len()],
            targets: TargetPlan {
                dgroup: u32::MAX,
                listed: SmallVec::new(),
                copies: SmallVec::new(),
            },
        };
        // Params in (mesh group, id) order.
        let mut by_group: Vec<u32> = (0..np as u32).collect();
        by_group.sort_by_key(|&p| (model.mesh_group(model.params[p as usize].role), p));
        // Gather regions by mesh group, in region (so param) order.
        let mut group_gathers: Vec<Vec<u32>> = vec![Vec::new(); ngroups as usize];
        for &ri in &self.gathers {
            let pid = self.dgroup_param(self.regions[ri as usize].dgroup);
            group_gathers[model.mesh_group(model.params[pid].role) as usize].push(ri);
        }
        let mut gather_offs: Vec<u64> = Vec::new();
        let mut starts = vec![[0u32; 3]; nt];
        let mut gi = 0usize;
        for g in 0..ngroups {
            let g0 = gi;
            while gi < by_group.len()
                && model.mesh_group(model.params[by_group[gi] as usize].role) == g
            {
                gi += 1;
            }
            let params = &by_group[g0..gi];
            if gi / 4096 != g0 / 4096 {
                progress((np + gi) as u64, 2 * np as u64);
            }
            for (r, b) in out.builders.iter().enumerate() {
                starts[r][0] = b.plan.tasks.len() as u32;
            }
            // Class 0: gather sends (and the owners' arena space).
            gather_offs.clear();
            let gathers = &group_gathers[g as usize];
            for &ri in gathers {
                if let Assign::Gather {
                    owner_shard,
                    first,
                    n,
                } = self.assign[ri as usize]
                {
                    let reg = &self.regions[ri as usize];
                    gather_offs.push(self.emit_gather_sends(
                        &mut out,
                        reg,
                        owner_shard,
                        &self.gather_parts[first as usize..(first + n) as usize],
                        g,
                    ));
                }
            }
            for (r, b) in out.builders.iter().enumerate() {
                starts[r][1] = b.plan.tasks.len() as u32;
            }
            // Class 1: tasks reading local shards.
            for &pid in params {
                for ri in self.region_first[pid as usize]..self.region_first[pid as usize + 1] {
                    let reg = &self.regions[ri as usize];
                    match self.assign[ri as usize] {
                        Assign::Shard(s) => self.emit_task(&mut out, reg, &reg.bx, s, None),
                        Assign::Split { first, n } => {
                            for &(sub, s) in &self.splits[first as usize..(first + n) as usize] {
                                self.emit_task(&mut out, reg, &sub, s, None);
                            }
                        }
                        Assign::Gather { .. } => {}
                    }
                }
            }
            for (r, b) in out.builders.iter().enumerate() {
                starts[r][2] = b.plan.tasks.len() as u32;
            }
            // Class 2: tasks reading the gather arena.
            for (&ri, &off) in gathers.iter().zip(&gather_offs) {
                if let Assign::Gather { owner_shard, .. } = self.assign[ri as usize] {
                    let reg = &self.regions[ri as usize];
                    self.emit_task(&mut out, reg, &reg.bx, owner_shard, Some(off));
                }
            }
            let name = model.mesh_group_name(g);
            for (r, b) in out.builders.iter_mut().enumerate() {
                let end = b.plan.tasks.len() as u32;
                let [s0, s1, s2] = starts[r];
                b.plan.groups.push(MeshGroup {
                    id: g,
                    name: name.clone(),
                    first_task: s0,
                    num_tasks: end - s0,
                    gather_sends: s1 - s0,
                    local_tasks: s2 - s1,
                    gather_expect: b.gather_expect,
                });
                b.gather_expect = 0;
            }
        }
        out.targets.flush(&mut out.rollout_writes);
        let mut trainers = Vec::with_capacity(nt);
        for b in out.builders {
            if b.plan.writes.len() > u32::MAX as usize || b.plan.tasks.len() > u32::MAX as usize {
                return Err(PlanError::TooLarge(format!(
                    "training rank {} would have more than 2^32 writes",
                    b.plan.rank
                )));
            }
            trainers.push(b.plan);
        }
        let rollouts = self
            .infer
            .ranks
            .iter()
            .map(|r| RolloutPlan {
                rank: r.rank,
                engine: r.engine,
                local_rank: r.local_rank,
                mr_bytes: r.mr_bytes.clone(),
                tensors: r.tensors.clone(),
                expect: vec![UnitExpect {
                    unit: 0,
                    writes: out.rollout_writes[r.rank as usize],
                }],
            })
            .collect();
        progress(2 * np as u64, 2 * np as u64);
        Ok(RoutingTable {
            model: model.name.clone(),
            num_params: np as u64,
            num_elements: model.num_elements(),
            trainers,
            rollouts,
        })
    }

    /// Emits the Copy tasks that assemble gather region `reg` in its owner's gather arena;
    /// returns the region's offset there.
    fn emit_gather_sends(
        &self,
        out: &mut Emission,
        reg: &Region,
        owner_shard: u32,
        parts: &[(TensorBox, u32)],
        g: u16,
    ) -> u64 {
        let owner = self.shard(owner_shard);
        let elem = owner.dtype.size() as u64;
        let ob = &mut out.builders[owner.rank as usize];
        let goff = ob.plan.gather_arena_bytes;
        ob.plan.gather_arena_bytes = align_up(goff + reg.bx.numel() * elem);
        let shape = reg.bx.shape();
        let mut received = 0;
        for &(part, s) in parts {
            let sh = self.shard(s);
            let b = &mut out.builders[sh.rank as usize];
            let first_write = b.plan.writes.len() as u32;
            let rel = part.relative_to(&reg.bx);
            let mut nw = 0u32;
            let writes = &mut b.plan.writes;
            for_each_run(&rel, &shape, elem, |so, d, len| {
                push_split(
                    writes,
                    &mut nw,
                    Endpoint::Trainer(owner.rank),
                    TRAINER_GATHER_MR,
                    g,
                    so,
                    goff + d,
                    len,
                );
            });
            let task = Task {
                param: out.shard_param[s as usize],
                region: part,
                source: Source::Shard {
                    shard: out.shard_local[s as usize],
                },
                transform: Transform::Copy { dtype: sh.dtype },
                first_write,
                num_writes: nw,
                first_copy: b.plan.copies.len() as u32,
                num_copies: 0,
            };
            b.plan.tasks.push(task);
            received += nw;
        }
        out.builders[owner.rank as usize].gather_expect += received;
        goff
    }

    /// Which targets of dgroup `dgi` get their writes listed and which repeat a listed one's
    /// (another engine, another attention replica, laid out alike): the same for every task of
    /// the group, so worked out once per group. Copies are extended while their ranks stay
    /// evenly spaced; they come out in the order they close, then the still open ones in the
    /// order of their listed targets.
    fn target_plan(&self, dgi: u32, plan: &mut TargetPlan, rollout_writes: &mut [u64]) {
        plan.flush(rollout_writes);
        let dg = &self.dgroups[dgi as usize];
        plan.dgroup = dgi;
        plan.listed.clear();
        plan.copies.clear();
        // Per listed target: the copy being extended.
        let mut open: SmallVec<[Option<TargetCopy>; 4]> = SmallVec::new();
        for k in 0..dg.n {
            let pc = self.target_piece(dg, k);
            let same = plan.listed.iter().position(|b| {
                let bp = &b.piece;
                self.layout_class[bp.rank as usize] == self.layout_class[pc.rank as usize]
                    && bp.tensor == pc.tensor
                    && bp.dst_start == pc.dst_start
                    && bp.scale == pc.scale
            });
            let Some(base) = same else {
                let rk = &self.infer.ranks[pc.rank as usize];
                let t = &rk.tensors[pc.tensor as usize];
                plan.listed.push(ListedDst {
                    piece: *pc,
                    shape: t.shape,
                    elem: t.dtype.size() as u64,
                    mr: t.mr,
                    offset: t.offset,
                    scales: pc.scale.map(|sc| {
                        let st = &rk.tensors[sc.tensor as usize];
                        (st.shape, st.mr, st.offset)
                    }),
                    task_writes: (0, 0),
                });
                open.push(None);
                continue;
            };
            if let Some(c) = open[base].as_mut() {
                let next = c.first_rank as u64 + c.count as u64 * c.stride as u64;
                if c.count == 1 && pc.rank > c.first_rank {
                    c.stride = pc.rank - c.first_rank;
                    c.count = 2;
                    continue;
                }
                if c.count > 1 && pc.rank as u64 == next {
                    c.count += 1;
                    continue;
                }
            }
            plan.copies.extend(open[base].replace(TargetCopy {
                base: base as u32,
                first_rank: pc.rank,
                stride: 1,
                count: 1,
                writes: 0,
            }));
        }
        plan.copies.extend(open.into_iter().flatten());
    }

    /// Emits the task that prepares box `bx` of region `reg` (from shard `s`, or from the
    /// gather arena at `gather` on `s`'s rank) and writes it to every target of its group.
    fn emit_task(
        &self,
        out: &mut Emission,
        reg: &Region,
        bx: &TensorBox,
        s: u32,
        gather: Option<u64>,
    ) {
        if out.targets.dgroup != reg.dgroup {
            self.target_plan(reg.dgroup, &mut out.targets, &mut out.rollout_writes);
        }
        let sh = self.shard(s);
        let dg = &self.dgroups[reg.dgroup as usize];
        let pn = bx.ndim as usize;
        let transform = transform_for(dg.fp8, sh.dtype, dg.dtype);
        let b = &mut out.builders[sh.rank as usize];
        let first_write = b.plan.writes.len() as u32;
        let first_copy = b.plan.copies.len() as u32;
        let writes = &mut b.plan.writes;
        let mut nw = 0u32;
        // Where the scales sit in the prepared output (Task::fp8_scales).
        let scale_offset = bx.numel().div_ceil(16) * 16;
        for l in out.targets.listed.iter_mut() {
            let pc = &l.piece;
            let before = nw;
            let dst = Endpoint::Rollout(pc.rank);
            let db = dst_box(pc, bx, l.shape.ndim as usize);
            for_each_run(&db, &l.shape, l.elem, |so, d, len| {
                push_split(writes, &mut nw, dst, l.mr, 0, so, l.offset + d, len);
            });
            if let Some((shape, mr, offset)) = l.scales {
                let sb = scale_box(pc, bx, shape.ndim as usize, pn);
                for_each_run(&sb, &shape, 4, |so, d, len| {
                    push_split(
                        writes,
                        &mut nw,
                        dst,
                        mr,
                        0,
                        scale_offset + so,
                        offset + d,
                        len,
                    );
                });
            }
            out.rollout_writes[pc.rank as usize] += (nw - before) as u64;
            l.task_writes = (before, nw - before);
        }
        for c in out.targets.copies.iter_mut() {
            let (from, num) = out.targets.listed[c.base as usize].task_writes;
            // Counted toward each rank when the dgroup's tasks are done (TargetPlan::flush).
            c.writes += num as u64;
            b.plan.copies.push(WriteCopies {
                from,
                num,
                first_rank: c.first_rank,
                stride: c.stride,
                count: c.count,
            });
        }
        let source = match gather {
            Some(offset) => Source::Gather { offset },
            None => Source::Shard {
                shard: out.shard_local[s as usize],
            },
        };
        let task = Task {
            param: out.shard_param[s as usize],
            region: *bx,
            source,
            transform,
            first_write,
            num_writes: nw,
            first_copy,
            num_copies: out.targets.copies.len() as u32,
        };
        b.plan.tasks.push(task);
    }
}

/// Groups inference ranks whose tensors have the same shapes, dtypes, MRs and offsets (names may
/// differ: expert contents do, not their layout).
fn layout_classes(infer: &InferenceLayout) -> Vec<u32> {
    let mut reps: Vec<usize> = Vec::new();
    let same = |a: &crate::layout_infer::InferRank, b: &crate::layout_infer::InferRank| {
        a.mr_bytes == b.mr_bytes
            && a.tensors.len() == b.tensors.len()
            && a.tensors.iter().zip(&b.tensors).all(|(x, y)| {
                x.shape == y.shape && x.dtype == y.dtype && x.mr == y.mr && x.offset == y.offset
            })
    };
    infer
        .ranks
        .iter()
        .map(
            |r| match reps.iter().position(|&k| same(&infer.ranks[k], r)) {
                Some(c) => c as u32,
                None => {
                    reps.push(r.rank as usize);
                    (reps.len() - 1) as u32
                }
            },
        )
        .collect()
}

/// Pushes one run as writes of at most [`MAX_WRITE_BYTES`].
#[allow(clippy::too_many_arguments)]
#[inline]
fn push_split(
    out: &mut Vec<Write>,
    count: &mut u32,
    dst: Endpoint,
    mr: u16,
    unit: u16,
    src: u64,
    dst_off: u64,
    len: u64,
) {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(MAX_WRITE_BYTES);
        out.push(Write {
            dst,
            mr,
            unit,
            len: n as u32,
            src_offset: src + done,
            dst_offset: dst_off + done,
        });
        *count += 1;
        done += n;
    }
}

/// A trainer's plan under construction.
struct TrainerBuilder {
    plan: TrainerPlan,
    /// Index in the layout's shard list of this rank's first shard.
    first_shard: usize,
    /// Gather writes into this trainer in the current group.
    gather_expect: u32,
}

/// How the tasks of one dgroup reach its targets: [`Planner::target_plan`].
struct TargetPlan {
    /// The dgroup this is for (`u32::MAX`: none yet).
    dgroup: u32,
    /// Targets whose writes are listed, in target order, with their destination tensors (looked
    /// up once per dgroup rather than once per task).
    listed: SmallVec<[ListedDst; 2]>,
    /// The other targets, as copies of a listed one's writes.
    copies: SmallVec<[TargetCopy; 4]>,
}

impl TargetPlan {
    /// Counts the copied writes of the dgroup's tasks so far toward each receiving rank.
    fn flush(&mut self, rollout_writes: &mut [u64]) {
        for c in &mut self.copies {
            for i in 0..c.count {
                rollout_writes[(c.first_rank + i * c.stride) as usize] += c.writes;
            }
            c.writes = 0;
        }
    }
}

/// A listed target: its piece and where its tensor (and scale tensor) lie.
struct ListedDst {
    piece: Piece,
    shape: Shape,
    elem: u64,
    mr: u16,
    offset: u64,
    /// Shape, MR and offset of the scale tensor (fp8).
    scales: Option<(Shape, u16, u64)>,
    /// The current task's writes to it: first (relative to the task) and count.
    task_writes: (u32, u32),
}

/// Ranks `first_rank + i * stride`, `i < count`, receiving the writes of listed target `base`
/// (an index into [`TargetPlan::listed`]); `writes` counts them for the dgroup's tasks so far.
#[derive(Clone, Copy)]
struct TargetCopy {
    base: u32,
    first_rank: u32,
    stride: u32,
    count: u32,
    writes: u64,
}

/// What emission builds: the trainers' plans and the rollouts' expected counts.
struct Emission {
    builders: Vec<TrainerBuilder>,
    /// Shard position -> index in its rank's `plan.shards`.
    shard_local: Vec<u32>,
    /// Shard position -> index of its param in its rank's `plan.params`.
    shard_param: Vec<u32>,
    /// Writes each rollout rank receives per sync.
    rollout_writes: Vec<u64>,
    /// The target plan of the dgroup last emitted (tasks of a dgroup come together).
    targets: TargetPlan,
}
