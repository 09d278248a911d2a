//! Step 2, source grids: a parameter's training shards cut it into a grid of cells; the shards
//! holding a cell are its replicas, and a cell no shard holds is an error naming it.
//!
//! Its own file because the grid is the planner's view of the source side: regions are cut
//! along it (step 3) and sources chosen among its holders (step 4). Grids are built param by
//! param in one pass, so the few shardings a model repeats (every expert of a layer, every
//! layer) are built once and shared ([`GridScratch::recent`]).

use std::sync::Arc;

use super::Planner;
use crate::error::PlanError;
use crate::layout_train::{ShardSpec, TrainingLayout};
use crate::model::Param;
use crate::table::{MAX_DIMS, Shape, TensorBox};

/// The source grid of one parameter: its cells and who holds each.
#[derive(Default)]
pub(super) struct Grid {
    /// Where the shards cut the parameter. Parameters whose shards have the same boxes (the
    /// experts of a layer, the layers of a model) share one.
    pub(super) cells: Arc<GridCells>,
    /// Holders of each cell (planner shard positions), grouped as `cells.holder_first` says.
    holders: Vec<u32>,
}

/// The cells of a grid, and its holders numbered within the parameter's own shard list.
#[derive(Default)]
pub(super) struct GridCells {
    pub(super) ndim: usize,
    cut_first: [u32; MAX_DIMS + 1],
    cuts: Vec<u32>,
    pub(super) strides: [u32; MAX_DIMS],
    holder_first: Vec<u32>,
    /// Holders as indices into the parameter's shard list.
    local: Vec<u32>,
    /// What the grid was built from: the parameter's shape and its shards' boxes, in order.
    shape: Shape,
    boxes: Vec<TensorBox>,
}

impl GridCells {
    /// The cuts along dim `d`, from 0 to the parameter's extent.
    #[inline]
    pub(super) fn cuts(&self, d: usize) -> &[u32] {
        &self.cuts[self.cut_first[d] as usize..self.cut_first[d + 1] as usize]
    }

    /// The box of a cell.
    pub(super) fn cell_box(&self, cell: u32) -> TensorBox {
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
    #[inline]
    pub(super) fn interval(&self, d: usize, x: u32) -> u32 {
        let c = self.cuts(d);
        (c.partition_point(|&v| v <= x) - 1) as u32
    }

    /// Calls `f(cell)` for every cell whose interval along each dim `d` is in `lo[d]..hi[d]`,
    /// in cell order (`lo < hi` along every dim).
    pub(super) fn for_each_cell(
        &self,
        lo: [u32; MAX_DIMS],
        hi: [u32; MAX_DIMS],
        mut f: impl FnMut(u32),
    ) {
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

    /// Cuts every dim at the shards' starts and ends; returns the dims no shard cuts (FSDP cuts
    /// dim 0 only): nothing to sort or search along them.
    fn cut_at_shards(&mut self, shards: &[ShardSpec], cuts: &mut Vec<u32>) -> [bool; MAX_DIMS] {
        let dims = self.shape.dims;
        let mut whole = [false; MAX_DIMS];
        for (d, whole) in whole.iter_mut().enumerate().take(self.ndim) {
            cuts.clear();
            cuts.push(0);
            cuts.push(dims[d]);
            *whole = dims[d] > 0
                && shards
                    .iter()
                    .all(|s| s.global.start[d] == 0 && s.global.len[d] == dims[d]);
            if !*whole {
                for s in shards {
                    cuts.push(s.global.start[d]);
                    cuts.push(s.global.end(d));
                }
                cuts.sort_unstable();
            }
            cuts.dedup();
            self.cuts.extend_from_slice(cuts);
            self.cut_first[d + 1] = self.cuts.len() as u32;
        }
        whole
    }

    /// Row-major strides of the cells; returns their number, or `None` when there are too many
    /// to number in a `u32`.
    fn number_cells(&mut self) -> Option<u64> {
        let mut ncells: u64 = 1;
        for d in (0..self.ndim).rev() {
            self.strides[d] = ncells as u32;
            ncells *= (self.cuts(d).len() - 1) as u64;
            if ncells > u32::MAX as u64 / 2 {
                return None;
            }
        }
        Some(ncells)
    }

    /// `(cell, shard)` for every cell of every shard, in shard order.
    fn cells_of_shards(
        &self,
        shards: &[ShardSpec],
        whole: [bool; MAX_DIMS],
        pairs: &mut Vec<(u32, u32)>,
    ) {
        pairs.clear();
        for (j, sh) in shards.iter().enumerate() {
            let mut lo = [0u32; MAX_DIMS];
            let mut hi = [1u32; MAX_DIMS];
            for d in (0..self.ndim).filter(|&d| !whole[d]) {
                let c = self.cuts(d);
                lo[d] = c.partition_point(|&v| v < sh.global.start[d]) as u32;
                hi[d] = c.partition_point(|&v| v < sh.global.end(d)) as u32;
            }
            self.for_each_cell(lo, hi, |cell| pairs.push((cell, j as u32)));
        }
    }

    /// Holders grouped by cell, each cell's in shard order (a counting sort of `pairs`); fails
    /// with the first cell no shard holds.
    fn group_holders(
        &mut self,
        ncells: usize,
        pairs: &[(u32, u32)],
        next: &mut Vec<u32>,
    ) -> Result<(), u32> {
        self.holder_first = vec![0; ncells + 1];
        for &(c, _) in pairs {
            self.holder_first[c as usize + 1] += 1;
        }
        for c in 0..ncells {
            if self.holder_first[c + 1] == 0 {
                return Err(c as u32);
            }
            self.holder_first[c + 1] += self.holder_first[c];
        }
        self.local = vec![0; pairs.len()];
        next.clear();
        next.extend_from_slice(&self.holder_first[..ncells]);
        for &(c, j) in pairs {
            self.local[next[c as usize] as usize] = j;
            next[c as usize] += 1;
        }
        Ok(())
    }
}

impl Grid {
    /// The holders of a cell (planner shard positions), in shard order.
    #[inline]
    pub(super) fn holders(&self, cell: u32) -> &[u32] {
        let f = &self.cells.holder_first;
        &self.holders[f[cell as usize] as usize..f[cell as usize + 1] as usize]
    }
}

/// Buffers [`Planner::build_grid`] reuses from param to param, and the grids it built last.
#[derive(Default)]
pub(super) struct GridScratch {
    /// The current param's shards.
    shards: Vec<ShardSpec>,
    cuts: Vec<u32>,
    pairs: Vec<(u32, u32)>,
    next: Vec<u32>,
    /// Recently built cells, most recent first (a model repeats a handful of shardings).
    recent: Vec<Arc<GridCells>>,
}

/// How many recent grids [`GridScratch`] keeps.
const RECENT_GRIDS: usize = 8;

/// The layout's shards grouped by param, in layout order within a param (a counting sort):
/// per param its first position (`np + 1` entries), and per position the shard's index in the
/// layout.
pub(super) fn shards_by_param(np: usize, train: &TrainingLayout) -> (Vec<u32>, Vec<u32>) {
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
    (shard_first, shard_order)
}

impl Planner<'_> {
    /// The grid of param `pid`'s shards. `scratch` is reused from param to param (a large model
    /// has tens of thousands).
    pub(super) fn build_grid(
        &self,
        pid: usize,
        scratch: &mut GridScratch,
    ) -> Result<Grid, PlanError> {
        let p = &self.model.params[pid];
        let idx = self.param_shards(pid);
        // The param's shards, gathered from the layout (they lie on many ranks).
        let mut gathered = std::mem::take(&mut scratch.shards);
        gathered.clear();
        gathered.extend(idx.clone().map(|s| *self.layout_shard(s)));
        let grid = self.grid_of(p, idx.start, &gathered, scratch);
        scratch.shards = gathered;
        grid
    }

    /// The grid of parameter `p` with shards `shards` (planner positions from `first` on).
    fn grid_of(
        &self,
        p: &Param,
        first: u32,
        shards: &[ShardSpec],
        scratch: &mut GridScratch,
    ) -> Result<Grid, PlanError> {
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
                let c = Arc::new(grid_cells(p, shards, scratch)?);
                scratch.recent.insert(0, c.clone());
                scratch.recent.truncate(RECENT_GRIDS);
                c
            }
        };
        let holders = cells.local.iter().map(|&j| first + j).collect();
        Ok(Grid { cells, holders })
    }
}

/// The cells of parameter `p`'s grid, with holders numbered within its shard list `shards`.
fn grid_cells(
    p: &Param,
    shards: &[ShardSpec],
    scratch: &mut GridScratch,
) -> Result<GridCells, PlanError> {
    let mut g = GridCells {
        ndim: p.shape.ndim as usize,
        shape: p.shape,
        boxes: shards.iter().map(|s| s.global).collect(),
        ..GridCells::default()
    };
    let whole = g.cut_at_shards(shards, &mut scratch.cuts);
    let ncells = g
        .number_cells()
        .ok_or_else(|| PlanError::TooLarge(format!("{}: too many grid cells", p.name)))?;
    g.cells_of_shards(shards, whole, &mut scratch.pairs);
    g.group_holders(ncells as usize, &scratch.pairs, &mut scratch.next)
        .map_err(|cell| uncovered(p, shards, g.cell_box(cell)))?;
    Ok(g)
}

/// The error for a cell of `p` no shard holds, naming the ranks that hold any of it (at most 16).
fn uncovered(p: &Param, shards: &[ShardSpec], cell: TensorBox) -> PlanError {
    let mut holders: Vec<u32> = shards.iter().map(|s| s.rank).collect();
    holders.sort_unstable();
    holders.dedup();
    let shown: Vec<String> = holders.iter().take(16).map(|r| r.to_string()).collect();
    PlanError::Uncovered {
        param: p.name.to_string(),
        region: cell.to_string(),
        holders: if shown.is_empty() {
            "none".into()
        } else if holders.len() > 16 {
            format!("{}, ... ({} ranks)", shown.join(", "), holders.len())
        } else {
            shown.join(", ")
        },
    }
}
