//! Step 3, regions (pass 1, [`Planner::analyse`]): each destination group's box is cut along its
//! parameter's grid into regions, each inside one cell, and weighed (bytes plus work requests,
//! for all its targets). A region with one holder gets its source and its load now.
//!
//! Two kinds of region need more than one source and become *gather regions* (one owner
//! assembles them, step 4): for fp8 destinations the 128-block row or column around a cut off
//! the block grid (a quantisation block must be whole on one rank), and a small box that the
//! grid would cut into regions smaller than a work request is worth (a norm over 128 ranks).
//!
//! Its own file because this is the pass over every parameter: grids (step 2) are built here,
//! one parameter at a time, and the regions it leaves are all the later steps see.

use rayon::prelude::*;

use super::grid::{Grid, GridScratch};
use super::place::{dst_box, scale_box};
use super::{Assign, DGroup, Planner, RegionBox, RegionLoad, GATHER};
use crate::error::PlanError;
use crate::layout_infer::Piece;
use crate::runs::count_runs;
use crate::table::{Shape, TensorBox, FP8_BLOCK, MAX_DIMS};

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

/// One segment of a destination box along one dimension.
#[derive(Clone, Copy)]
struct Seg {
    start: u32,
    end: u32,
    /// Interval index in the grid along this dim, or GATHER for a band.
    cell: u32,
}

/// What pass 1 finds for a range of params, to be appended in param order to the planner's
/// lists (region numbers in `open` are relative to the range's first region).
#[derive(Default)]
struct Analysed {
    grids: Vec<Grid>,
    /// Per param of the range, its number of regions.
    counts: Vec<u32>,
    regions: Vec<RegionBox>,
    region_loads: Vec<RegionLoad>,
    assign: Vec<Assign>,
    open: Vec<u32>,
    /// Per training rank: what its single-holder regions add to its load.
    loads: Vec<u64>,
}

impl Analysed {
    /// Empties the lists (keeping their room), with `nt` zero loads.
    fn clear(&mut self, nt: usize) {
        self.grids.clear();
        self.counts.clear();
        self.regions.clear();
        self.region_loads.clear();
        self.assign.clear();
        self.open.clear();
        self.loads.clear();
        self.loads.resize(nt, 0);
    }
}

/// Params analysed together between progress reports; split among rayon's threads.
const PARAMS_PER_BATCH: usize = 4096;

impl Planner<'_> {
    /// Pass 1: grids and regions; single-replica loads.
    ///
    /// Params are independent here (a grid and regions each, and loads that add up), so they
    /// are analysed in parallel, a batch at a time, in ranges whose findings are appended in
    /// param order: the lists come out as if the params were analysed one after the other.
    pub(super) fn analyse(&mut self, progress: &mut dyn FnMut(u64, u64)) -> Result<(), PlanError> {
        let np = self.model.params.len();
        let per_range = PARAMS_PER_BATCH.div_ceil(rayon::current_num_threads().max(1));
        // Each range's lists, kept from batch to batch: grown once, not once per batch.
        let mut found: Vec<Analysed> = Vec::new();
        for batch in (0..np).step_by(PARAMS_PER_BATCH) {
            progress(batch as u64, 2 * np as u64);
            let end = (batch + PARAMS_PER_BATCH).min(np);
            let this: &Planner = self;
            let ranges: Vec<usize> = (batch..end).step_by(per_range).collect();
            if found.len() < ranges.len() {
                found.resize_with(ranges.len(), Analysed::default);
            }
            let done: Vec<Result<(), PlanError>> = ranges
                .into_par_iter()
                .zip(found.par_iter_mut())
                .map(|(a, out)| this.analyse_range(a..(a + per_range).min(end), out))
                .collect();
            for (d, f) in done.into_iter().zip(&mut found) {
                d?;
                self.append(f);
            }
        }
        Ok(())
    }

    /// Pass 1 for params `pids`, into `out` (emptied first).
    fn analyse_range(
        &self,
        pids: std::ops::Range<usize>,
        out: &mut Analysed,
    ) -> Result<(), PlanError> {
        let nt = self.train.ranks as usize;
        out.clear(nt);
        let mut segs: Vec<Vec<Seg>> = vec![Vec::new(); MAX_DIMS];
        let mut scratch = GridScratch::default();
        for pid in pids {
            let before = out.regions.len();
            let (d0, d1) = (self.dgroup_first[pid], self.dgroup_first[pid + 1]);
            if d0 == d1 {
                out.grids.push(Grid::default());
            } else {
                let grid = self.build_grid(pid, &mut scratch)?;
                for dgi in d0..d1 {
                    self.cut_dgroup(pid, dgi, &grid, &mut segs, out);
                }
                out.grids.push(grid);
            }
            out.counts.push((out.regions.len() - before) as u32);
        }
        Ok(())
    }

    /// Appends what pass 1 found for the params after those already analysed, and empties
    /// `a` (keeping its room for the next batch).
    fn append(&mut self, a: &mut Analysed) {
        let base = self.regions.len() as u32;
        for (pid, &n) in (self.grids.len()..).zip(&a.counts) {
            self.region_first[pid + 1] = self.region_first[pid] + n;
        }
        self.grids.append(&mut a.grids);
        self.regions.extend_from_slice(&a.regions);
        self.region_loads.extend_from_slice(&a.region_loads);
        self.assign.extend_from_slice(&a.assign);
        self.open.extend(a.open.iter().map(|&ri| base + ri));
        for (x, y) in self.loads.iter_mut().zip(&a.loads) {
            *x += y;
        }
        a.clear(0);
    }

    /// Cuts dgroup `dgi` (of param `pid`) into regions along `grid`, or makes it one gather
    /// region when those would be tiny. `segs` is scratch, one list per dim.
    fn cut_dgroup(
        &self,
        pid: usize,
        dgi: u32,
        grid: &Grid,
        segs: &mut [Vec<Seg>],
        out: &mut Analysed,
    ) {
        let nd = grid.cells.ndim;
        let dg = &self.dgroups[dgi as usize];
        let reach = self.reach(dg);
        let bx = dg.bx;
        for (d, seg) in segs.iter_mut().enumerate().take(nd) {
            let block = dg.fp8 && d + 2 >= nd;
            segments(grid, d, bx.start[d], bx.end(d), block, seg);
        }
        // Many tiny regions (a norm cut over 128 ranks): gather the box to one owner so each
        // destination gets one write instead of one per source.
        let nregions: usize = segs[..nd].iter().map(Vec::len).product();
        let wr = self.wr_bytes;
        let out_bytes = bx.numel() * dg.dtype.size() as u64;
        let src_bytes = bx.numel() * self.model.params[pid].dtype.size() as u64;
        if nregions > 1 && out_bytes / (nregions as u64) < wr && src_bytes <= 64 * wr {
            let w = self.weight(&reach, &bx);
            out.open.push(out.regions.len() as u32);
            out.assign.push(Assign::Shard(0));
            out.regions.push(RegionBox { dgroup: dgi, bx });
            out.region_loads.push(RegionLoad {
                cell: GATHER,
                weight: w,
            });
            return;
        }
        // Every combination of one segment per dim, in row-major order (an odometer).
        let mut i = [0usize; MAX_DIMS];
        loop {
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
            self.push_region(dgi, &reach, grid, r, cell, out);
            let mut d = nd;
            loop {
                if d == 0 {
                    return;
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

    /// Adds region `r` of dgroup `dgi` in `cell` (or GATHER). One holder: its source is fixed
    /// and its load counted now; the rest wait for every load (step 4).
    #[inline]
    fn push_region(
        &self,
        dgi: u32,
        reach: &Reach,
        grid: &Grid,
        r: TensorBox,
        cell: u32,
        out: &mut Analysed,
    ) {
        let w = self.weight(reach, &r);
        match (cell != GATHER).then(|| grid.holders(cell)) {
            Some(&[only]) => {
                let rank = self.shard(only).rank as usize;
                out.loads[rank] += w;
                out.assign.push(Assign::Shard(only));
            }
            _ => {
                out.open.push(out.regions.len() as u32);
                out.assign.push(Assign::Shard(0));
            }
        }
        out.regions.push(RegionBox { dgroup: dgi, bx: r });
        out.region_loads.push(RegionLoad { cell, weight: w });
    }

    /// What the load of a region of dgroup `dg` depends on: its first target's tensors (every
    /// target is laid out alike). Looked up once per dgroup, not once per region.
    fn reach(&self, dg: &DGroup) -> Reach {
        let pc = self.target_piece(dg, 0);
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

    /// Load weight of sending region `r` to all the targets of a dgroup: bytes plus work
    /// requests at [`CostModel::wr_equiv_bytes`](crate::CostModel::wr_equiv_bytes) each.
    #[inline]
    fn weight(&self, reach: &Reach, r: &TensorBox) -> u64 {
        let pc = &reach.pc;
        let db = dst_box(pc, r, reach.shape.ndim as usize);
        let mut wrs = count_runs(&db, &reach.shape);
        let mut bytes = r.numel() * reach.elem;
        if let Some(ss) = reach.scales {
            let sb = scale_box(pc, r, ss.ndim as usize, r.ndim as usize);
            wrs += count_runs(&sb, &ss);
            bytes += sb.numel() * 4;
        }
        (bytes + wrs * self.wr_bytes) * reach.n
    }
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
