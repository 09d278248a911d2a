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
//!
//! **Repeats.** The experts of a layer are parameters sharded alike on the same trainers and
//! placed alike on the same rollouts: their regions, weights and single holders are the same
//! but for the parameter they belong to. A parameter that `Planner::repeats` one analysed
//! shortly before it (in the same range) is not cut again; it adds that one's single-holder
//! loads once more and
//! - when those regions all have one holder, keeps no regions of its own: it records which
//!   parameter it repeats, and emission reads that one's regions with the dgroups and shards
//!   moved to its own (`Planner::param_regions`);
//! - else copies them, moved to itself, with its open regions (gathers, replicas) open again:
//!   their sources depend on the loads when `assign` reaches them.
//!
//! Every later step sees what analysing each parameter would have given (the tables are the
//! same byte for byte), and a Kimi-K2 plan stores half of its 1.4 million regions and weighs a
//! few percent of them.

use rayon::prelude::*;

use super::grid::{Grid, GridScratch};
use super::place::{dst_box, scale_box};
use super::{Assign, DGroup, GATHER, NO_REPEAT, Planner, RegionBox, RegionLoad, Reuse};
use crate::error::PlanError;
use crate::layout_infer::Piece;
use crate::runs::count_runs;
use crate::table::{FP8_BLOCK, MAX_DIMS, Shape, TensorBox};

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
    /// Per param of the range: the param it repeats, or [`NO_REPEAT`].
    repeats: Vec<u32>,
    /// Params of the range that reused another's regions (repeats and copies).
    reused: usize,
    /// Per open region copied from another param's (in region order): (it, the one it copies).
    copied_open: Vec<(u32, u32)>,
    /// Per training rank: what its single-holder regions add to its load.
    loads: Vec<u64>,
}

/// A param analysed in full (in the current range) that a later param may repeat.
struct Repeatable {
    pid: usize,
    /// Its regions in the range's lists, and its open ones among the range's open regions.
    regions: std::ops::Range<usize>,
    open: std::ops::Range<usize>,
    /// What its single-holder regions add to each rank's load, per rank it loads.
    loads: Vec<(u32, u64)>,
}

/// Params analysed in full that a param is compared with before it is cut (most recent first):
/// a layer's experts repeat with period 3 (gate, up, down), of which one or two qualify.
const REPEAT_CANDIDATES: usize = 4;

impl Analysed {
    /// Empties the lists (keeping their room), with `nt` zero loads.
    fn clear(&mut self, nt: usize) {
        self.grids.clear();
        self.counts.clear();
        self.regions.clear();
        self.region_loads.clear();
        self.assign.clear();
        self.open.clear();
        self.repeats.clear();
        self.reused = 0;
        self.copied_open.clear();
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
        let mut recent: Vec<Repeatable> = Vec::with_capacity(REPEAT_CANDIDATES);
        for pid in pids {
            let before = out.regions.len();
            let open_before = out.open.len();
            let (d0, d1) = (self.dgroup_first[pid], self.dgroup_first[pid + 1]);
            if d0 == d1 {
                out.grids.push(Grid::default());
                out.repeats.push(NO_REPEAT);
            } else if let Some(k) = (self.reuse == Reuse::Repeats)
                .then(|| recent.iter().position(|c| self.repeats(pid, c.pid)))
                .flatten()
            {
                let c = recent.remove(k);
                out.reused += 1;
                for &(rank, w) in &c.loads {
                    out.loads[rank as usize] += w;
                }
                if c.open.is_empty() {
                    // Nothing for `assign` to choose: no regions of its own (see the module docs).
                    out.grids.push(Grid::default());
                    out.repeats.push(c.pid as u32);
                } else {
                    // Its open regions are sourced on their own: the regions are copied, moved
                    // to this param, and its grid (their holders) built.
                    let grid = self.build_grid(pid, &mut scratch)?;
                    self.copy_regions(pid, &c, out);
                    out.grids.push(grid);
                    out.repeats.push(NO_REPEAT);
                }
                recent.insert(0, c);
            } else {
                let grid = self.build_grid(pid, &mut scratch)?;
                for dgi in d0..d1 {
                    self.cut_dgroup(pid, dgi, &grid, &mut segs, out);
                }
                out.grids.push(grid);
                out.repeats.push(NO_REPEAT);
                if out.regions.len() > before {
                    recent.truncate(REPEAT_CANDIDATES - 1);
                    recent.insert(
                        0,
                        Repeatable {
                            pid,
                            regions: before..out.regions.len(),
                            open: open_before..out.open.len(),
                            loads: self.region_loads_by_rank(out, before, open_before),
                        },
                    );
                }
            }
            out.counts.push((out.regions.len() - before) as u32);
        }
        Ok(())
    }

    /// What the single-holder regions of `out` from `first` on (one param's; its open ones are
    /// those listed in `out.open` from `open_first` on) add to each rank's load.
    fn region_loads_by_rank(
        &self,
        out: &Analysed,
        first: usize,
        open_first: usize,
    ) -> Vec<(u32, u64)> {
        let mut open = out.open[open_first..]
            .iter()
            .map(|&ri| ri as usize)
            .peekable();
        let mut by_rank: Vec<(u32, u64)> = Vec::new();
        for (ri, (a, l)) in
            (first..).zip(out.assign[first..].iter().zip(&out.region_loads[first..]))
        {
            if open.peek() == Some(&ri) {
                open.next();
                continue;
            }
            let Assign::Shard(s) = *a else {
                continue;
            };
            let rank = self.shard(s).rank;
            match by_rank.iter_mut().find(|(r, _)| *r == rank) {
                Some(e) => e.1 += l.weight,
                None => by_rank.push((rank, l.weight)),
            }
        }
        by_rank
    }

    /// Appends the regions of `c` (analysed in this range) as param `pid`'s, which
    /// [`repeats`](Self::repeats) it: dgroups and single sources moved to `pid`'s, cells and
    /// weights as they are, its open regions open again.
    fn copy_regions(&self, pid: usize, c: &Repeatable, out: &mut Analysed) {
        let q = c.pid;
        let dgroup_shift = self.dgroup_first[pid] - self.dgroup_first[q];
        let shard_shift = self.shard_first[pid] - self.shard_first[q];
        let base = out.regions.len();
        for ri in c.regions.clone() {
            let r = out.regions[ri];
            out.regions.push(RegionBox {
                dgroup: r.dgroup + dgroup_shift,
                bx: r.bx,
            });
            let load = out.region_loads[ri];
            out.region_loads.push(load);
            let a = match out.assign[ri] {
                Assign::Shard(s) => Assign::Shard(s + shard_shift),
                other => other,
            };
            out.assign.push(a);
        }
        for oi in c.open.clone() {
            let from = out.open[oi] as usize;
            let at = base + (from - c.regions.start);
            out.assign[at] = Assign::Shard(0);
            out.open.push(at as u32);
            out.copied_open.push((at as u32, from as u32));
        }
    }

    /// Whether analysing param `p` would give param `q`'s regions (dgroups and shards moved
    /// to `p`'s), weights and single holders: the same shape and element type, the same shard
    /// boxes on the same ranks in the same order (the same grid, holders moved), and dgroups of
    /// the same boxes, targets and formats whose first targets lie in tensors of the same
    /// shapes (what a region's weight reads). What `p`'s targets are does not matter here:
    /// emission reads them from `p`'s own dgroups.
    fn repeats(&self, p: usize, q: usize) -> bool {
        let (mp, mq) = (&self.model.params[p], &self.model.params[q]);
        if mp.shape != mq.shape || mp.dtype != mq.dtype {
            return false;
        }
        let (sp, sq) = (self.param_shards(p), self.param_shards(q));
        let (gp, gq) = (
            self.dgroup_first[p]..self.dgroup_first[p + 1],
            self.dgroup_first[q]..self.dgroup_first[q + 1],
        );
        if sp.len() != sq.len() || gp.len() != gq.len() {
            return false;
        }
        let shards_alike = sp.zip(sq).all(|(a, b)| {
            let (x, y) = (self.layout_shard(a), self.layout_shard(b));
            x.global == y.global && x.rank == y.rank && x.dtype == y.dtype
        });
        shards_alike
            && gp.zip(gq).all(|(a, b)| {
                let (g, h) = (&self.dgroups[a as usize], &self.dgroups[b as usize]);
                if (g.bx, g.n, g.engine_n, g.fp8, g.dtype)
                    != (h.bx, h.n, h.engine_n, h.fp8, h.dtype)
                {
                    return false;
                }
                // Where a target sits in its tensor does not matter: a weight counts the runs of
                // boxes that lie inside their tensors, which their lengths and the tensor's
                // shape decide ([`count_runs`]; an expert's slot in a stacked tensor moves its
                // box, not its runs).
                let (x, y) = (self.reach(g), self.reach(h));
                (
                    x.pc.src,
                    x.pc.scale.is_some(),
                    x.shape,
                    x.elem,
                    x.scales,
                    x.n,
                ) == (
                    y.pc.src,
                    y.pc.scale.is_some(),
                    y.shape,
                    y.elem,
                    y.scales,
                    y.n,
                )
            })
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
        self.repeat_of.extend_from_slice(&a.repeats);
        self.reused += a.reused;
        self.copied_open.extend(
            a.copied_open
                .iter()
                .map(|&(at, from)| (base + at, base + from)),
        );
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
