//! The exact-cover check of a declared tensor: the distinct boxes the trainers hold of it
//! (replicas declare the same box) must not overlap and must cover it whole.
//!
//! Why not leave it to the planner's grid (which refuses a cell nobody holds): an overlap of two
//! different boxes is not a gap, and is the sign of two trainers that disagree on the sharding
//! (one chunking by 4, one by 3); it must be named with both ranks and both boxes. With no
//! overlap and every box inside the tensor, the boxes cover it iff their sizes add up to it, so
//! the sweep below is the whole check; locating a gap is done only to name it.

use super::DeclaredError;
use crate::model::Param;
use crate::table::TensorBox;

/// Checks that `boxes` (each with the rank declaring it) tile `p`; sorts and de-duplicates them.
pub(super) fn check(p: &Param, boxes: &mut Vec<(TensorBox, u32)>) -> Result<(), DeclaredError> {
    boxes.sort_unstable_by_key(|&(b, rank)| (b.start, b.len, rank));
    // The same box on several ranks is one box held by replicas (the lowest rank kept).
    boxes.dedup_by(|later, kept| later.0 == kept.0);
    // Sweep along dim 0: a box can overlap only the earlier ones still open at its first row.
    let mut open: Vec<usize> = Vec::new();
    for i in 0..boxes.len() {
        let (b, rank) = boxes[i];
        open.retain(|&j| boxes[j].0.end(0) > b.start[0]);
        if let Some(&j) = open.iter().find(|&&j| boxes[j].0.intersect(&b).is_some()) {
            let (a, rank_a) = boxes[j];
            return Err(DeclaredError::Overlap {
                tensor: p.name.to_string(),
                shape: p.shape.to_string(),
                rank_a,
                box_a: a.to_string(),
                rank_b: rank,
                box_b: b.to_string(),
            });
        }
        open.push(i);
    }
    let covered: u64 = boxes.iter().map(|(b, _)| b.numel()).sum();
    let total = p.shape.numel();
    if covered != total {
        return Err(DeclaredError::Gap {
            tensor: p.name.to_string(),
            shape: p.shape.to_string(),
            gap: find_gap(p, boxes).map_or_else(|| "part of it".to_string(), |g| g.to_string()),
            covered,
            total,
        });
    }
    Ok(())
}

/// Most cells times boxes [`find_gap`] looks through before it gives up naming the gap.
const GAP_SEARCH_LIMIT: u64 = 50_000_000;

/// A cell of the grid the boxes' edges cut the tensor into that no box holds, if the search is
/// small enough to run.
fn find_gap(p: &Param, boxes: &[(TensorBox, u32)]) -> Option<TensorBox> {
    let nd = p.shape.ndim as usize;
    let cuts: Vec<Vec<u32>> = (0..nd)
        .map(|d| {
            let mut c: Vec<u32> = boxes
                .iter()
                .flat_map(|(b, _)| [b.start[d], b.end(d)])
                .chain([0, p.shape.dims[d]])
                .collect();
            c.sort_unstable();
            c.dedup();
            c
        })
        .collect();
    let cells: u64 = cuts.iter().map(|c| c.len() as u64 - 1).product();
    if cells.saturating_mul(boxes.len().max(1) as u64) > GAP_SEARCH_LIMIT {
        return None;
    }
    let mut at = vec![0usize; nd];
    loop {
        let start: Vec<u32> = (0..nd).map(|d| cuts[d][at[d]]).collect();
        let len: Vec<u32> = (0..nd).map(|d| cuts[d][at[d] + 1] - start[d]).collect();
        let cell = TensorBox::new(&start, &len);
        if !boxes.iter().any(|(b, _)| b.contains(&cell)) {
            return Some(cell);
        }
        // Next cell, last dim fastest.
        let mut d = nd;
        loop {
            if d == 0 {
                return None;
            }
            d -= 1;
            at[d] += 1;
            if at[d] + 1 < cuts[d].len() {
                break;
            }
            at[d] = 0;
        }
    }
}
