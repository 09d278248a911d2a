//! Step 4, sources (pass 2, [`Planner::assign`]): every region still open after pass 1 gets its
//! source, now that the single-holder load of every trainer is known.
//!
//! In order: gather regions (an owner among the holders of any part, least loaded first; then
//! a sender per part), small replicated regions whole to their least loaded replica (largest
//! first), and the rest split exactly by the min-max flow of [`crate::balance`] per replica set,
//! cut along their outermost dimension with enough units (whole blocks for fp8).
//!
//! Its own file because it is the one step that looks at every trainer's load at once: the
//! other steps see one parameter at a time.

use std::collections::BTreeMap;

use super::grid::Grid;
use super::{Assign, GATHER, Planner, Region};
use crate::balance::balance;
use crate::runs::count_runs;
use crate::table::{FP8_BLOCK, MAX_DIMS};

impl Planner<'_> {
    /// Pass 2: choose sources.
    pub(super) fn assign(&mut self) {
        // Grids and region loads are only read here: freed before emission, which builds the
        // table beside what remains.
        let grids = std::mem::take(&mut self.grids);
        self.assign_with(&grids);
        drop(grids);
        self.region_loads = Vec::new();
        self.gather_cells = Vec::new();
        self.copied_open = Vec::new();
    }

    fn assign_with(&mut self, grids: &[Grid]) {
        let mut small: Vec<u32> = Vec::new();
        let mut big: Vec<u32> = Vec::new();
        // Gathers first (single holders were fixed by `analyse`), in region order.
        let open = std::mem::take(&mut self.open);
        let copied = std::mem::take(&mut self.copied_open);
        let mut copied = copied.iter().peekable();
        for &ri in &open {
            let reg = self.region(ri);
            // The region it copies, when it is a copy (both lists are in region order).
            let mut from = None;
            while let Some(&&(at, f)) = copied.peek() {
                if at > ri {
                    break;
                }
                copied.next();
                if at == ri {
                    from = Some(f);
                }
            }
            if reg.cell == GATHER {
                let grid = &grids[self.dgroup_param(reg.dgroup)];
                self.assign_gather(ri, &reg, grid, from);
            } else if reg.weight < self.cost.min_split_bytes() {
                small.push(ri);
            } else {
                big.push(ri);
            }
        }
        self.assign_small(small, grids);
        self.assign_big(&big, grids);
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

    /// Gather region `ri` (`reg`): its parts are the cells it touches; an owner assembles and
    /// prepares it, each part comes from the owner's own shard if it holds one, else from the
    /// least loaded holder. A region copied from another param's (`copy_of`, a repeat: the same
    /// box in a grid of the same cells) has that one's parts, which are not cut again.
    fn assign_gather(&mut self, ri: u32, reg: &Region, grid: &Grid, copy_of: Option<u32>) {
        let (first, big_cell) = match copy_of.map(|f| self.assign[f as usize]) {
            Some(Assign::Gather { first, n, .. }) => self.push_copied_parts(first, n),
            _ => self.push_gather_parts(reg, grid),
        };
        let owner_shard = self.gather_owner(grid, first, big_cell);
        let owner = self.shard(owner_shard).rank;
        self.loads[owner as usize] += reg.weight;
        let n = self.gather_parts.len() as u32 - first;
        self.choose_part_senders(reg, grid, owner_shard, first, n);
        self.assign[ri as usize] = Assign::Gather {
            owner_shard,
            first,
            n,
        };
        self.gathers.push(ri);
    }

    /// Appends the parts of gather region `reg` (its intersection with each cell it touches,
    /// tagged with the cell) to `gather_parts`; returns where they start and the cell of the
    /// largest part.
    fn push_gather_parts(&mut self, reg: &Region, grid: &Grid) -> (u32, u32) {
        let nd = grid.cells.ndim;
        let mut lo = [0u32; MAX_DIMS];
        let mut hi = [0u32; MAX_DIMS];
        for d in 0..nd {
            lo[d] = grid.cells.interval(d, reg.bx.start[d]);
            hi[d] = grid.cells.interval(d, reg.bx.end(d) - 1) + 1;
        }
        let first = self.gather_parts.len() as u32;
        let mut best: Option<(u64, u32)> = None;
        let (parts, cells) = (&mut self.gather_parts, &mut self.gather_cells);
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
            cells.push(cell);
        });
        let (_, big_cell) = best.expect("a part");
        (first, big_cell)
    }

    /// [`push_gather_parts`](Self::push_gather_parts) for a region whose parts are those at
    /// `from..from + n` (another region's, of the same box in a grid of the same cells): the
    /// same parts and cells in the same order, and the same largest.
    fn push_copied_parts(&mut self, from: u32, n: u32) -> (u32, u32) {
        let first = self.gather_parts.len() as u32;
        let mut best: Option<(u64, u32)> = None;
        for k in from as usize..(from + n) as usize {
            let (part, cell) = (self.gather_parts[k].0, self.gather_cells[k]);
            if best.is_none_or(|(m, _)| part.numel() > m) {
                best = Some((part.numel(), cell));
            }
            self.gather_parts.push((part, cell));
            self.gather_cells.push(cell);
        }
        let (_, big_cell) = best.expect("a gather region has a part");
        (first, big_cell)
    }

    /// Owner of the gather region whose parts start at `first`: the least loaded rank holding
    /// any part (ties: the holder of the largest part, which then has the least to receive).
    /// Choosing only among the largest part's holders would pin every such region of every
    /// layer on the same few ranks.
    fn gather_owner(&self, grid: &Grid, first: u32, big_cell: u32) -> u32 {
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
        owner_shard
    }

    /// Replaces the cell of each of the `n` parts at `first` by the shard that sends it to the
    /// owner (the owner's own, else the least loaded holder), counting what the senders send.
    fn choose_part_senders(
        &mut self,
        reg: &Region,
        grid: &Grid,
        owner_shard: u32,
        first: u32,
        n: u32,
    ) {
        let wr = self.wr_bytes;
        let owner = self.shard(owner_shard).rank;
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
            if srank != owner {
                self.loads[srank as usize] += part.numel() * elem + runs * wr;
            }
            self.gather_parts[k as usize].1 = sender;
        }
    }

    /// Small replicated regions: whole, to the least loaded replica, largest first.
    fn assign_small(&mut self, mut small: Vec<u32>, grids: &[Grid]) {
        small.sort_by_key(|&ri| (std::cmp::Reverse(self.region_loads[ri as usize].weight), ri));
        for ri in small {
            let reg = self.region(ri);
            let pid = self.dgroup_param(reg.dgroup);
            let s = self.least_loaded(grids[pid].holders(reg.cell));
            let r = self.shard(s).rank as usize;
            self.loads[r] += reg.weight;
            self.assign[ri as usize] = Assign::Shard(s);
        }
    }

    /// Big replicated regions: the exact min-max split of each replica set's total among its
    /// members, then each region cut into the members' shares in order.
    fn assign_big(&mut self, big: &[u32], grids: &[Grid]) {
        let (sets, set_regions) = self.replica_sets(big, grids);
        let (amounts, _) = balance(&self.loads, &sets);
        for (j, (ranks, _)) in sets.iter().enumerate() {
            for (k, &r) in ranks.iter().enumerate() {
                self.loads[r as usize] += amounts[j][k];
            }
            let mut quota: Vec<i128> = amounts[j].iter().map(|&a| a as i128).collect();
            let mut cur = 0usize;
            for &ri in &set_regions[j] {
                self.split_region(ri, ranks, &mut quota, &mut cur, grids);
            }
        }
    }

    /// The regions `big` by replica set (the sorted ranks holding their cell), sets in order of
    /// first appearance: each set with its total weight, and its regions in order.
    #[allow(clippy::type_complexity)]
    fn replica_sets(&self, big: &[u32], grids: &[Grid]) -> (Vec<(Vec<u32>, u64)>, Vec<Vec<u32>>) {
        let mut set_ids: BTreeMap<Vec<u32>, usize> = BTreeMap::new();
        let mut sets: Vec<(Vec<u32>, u64)> = Vec::new();
        let mut set_regions: Vec<Vec<u32>> = Vec::new();
        let mut key: Vec<u32> = Vec::new();
        for &ri in big {
            let reg = self.region(ri);
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
        (sets, set_regions)
    }

    /// Cuts big region `ri` among the members `ranks` of its replica set, from member `cur`
    /// on, taking from each member's `quota` (bytes of load still to give it) what it gets.
    fn split_region(
        &mut self,
        ri: u32,
        ranks: &[u32],
        quota: &mut [i128],
        cur: &mut usize,
        grids: &[Grid],
    ) {
        let reg = self.region(ri);
        let fp8 = self.dgroups[reg.dgroup as usize].fp8;
        let pid = self.dgroup_param(reg.dgroup);
        let h = grids[pid].holders(reg.cell);
        let shards = &self.shards;
        let shard_of = |rank: u32| -> u32 {
            *h.iter()
                .find(|&&s| shards[s as usize].rank == rank)
                .expect("set member holds the cell")
        };
        let (sd, unit, n_units) = split_dim(&reg, fp8, ranks.len() as u32);
        let per_unit = (reg.weight / n_units as u64).max(1) as i128;
        let first = self.splits.len() as u32;
        let mut done = 0u32;
        while done < n_units {
            let last = *cur + 1 >= ranks.len();
            let k = if last {
                n_units - done
            } else {
                let want = (quota[*cur] + per_unit / 2) / per_unit;
                want.clamp(0, (n_units - done) as i128) as u32
            };
            if k == 0 {
                *cur += 1;
                continue;
            }
            let mut sub = reg.bx;
            sub.start[sd] = reg.bx.start[sd] + done * unit;
            sub.len[sd] = ((done + k) * unit).min(reg.bx.len[sd]) - done * unit;
            self.splits.push((sub, shard_of(ranks[*cur])));
            quota[*cur] -= k as i128 * per_unit;
            done += k;
        }
        self.assign[ri as usize] = Assign::Split {
            first,
            n: self.splits.len() as u32 - first,
        };
    }
}

/// Where to cut a region shared by `members` ranks: `(dim, unit, units along it)`, the outermost
/// dimension with enough units to level the members (outer cuts keep sub-boxes contiguous at
/// the destination), else the one with the most; in whole blocks for fp8.
fn split_dim(reg: &Region, fp8: bool, members: u32) -> (usize, u32, u32) {
    let nd = reg.bx.ndim as usize;
    let unit_of = |d: usize| if fp8 && d + 2 >= nd { FP8_BLOCK } else { 1 };
    let units = |d: usize| reg.bx.len[d].div_ceil(unit_of(d));
    let want_units = 8 * members;
    let sd = (0..nd)
        .find(|&d| units(d) >= want_units)
        .unwrap_or_else(|| (0..nd).rev().max_by_key(|&d| units(d)).unwrap_or(0));
    (sd, unit_of(sd), units(sd))
}
