//! Step 1, destination groups: the inference pieces that want the same box of the same
//! parameter (dp engines, attention replicated across ep groups, replicated kv heads) form one
//! [`DGroup`], so each box is read and prepared once and written to every rank of the group.
//!
//! Its own file because the grouping is the planner's view of the destination side: every
//! later step walks dgroups, never pieces.

use rayon::prelude::*;

use super::DGroup;
use crate::layout_infer::{EnginePeriod, InferenceLayout, Piece};

/// The indices of the pieces sorted by (param, box, rank, tensor), the dgroups (runs of equal
/// (param, box) in that order) and, per param, the first of its dgroups (`np + 1` entries).
/// Indices, not a sorted copy of the pieces: at 10,240 GPUs the pieces are 450 MB.
///
/// With `period` (engines repeating engine 0) only engine 0's pieces are sorted and grouped:
/// a dgroup's targets in (rank, tensor) order are its engine-0 targets, then the same in
/// engine 1 (each rank moved by an engine), and so on, so a dgroup is its engine-0 run
/// (`engine_n` targets) taken `engines` times ([`super::Planner::target_piece`]).
pub(super) fn destination_groups(
    np: usize,
    infer: &InferenceLayout,
    period: Option<EnginePeriod>,
) -> (Vec<u32>, Vec<DGroup>, Vec<u32>) {
    let (pieces, engines) = match period {
        Some(p) => (&infer.pieces[..p.pieces], p.engines),
        None => (&infer.pieces[..], 1),
    };
    let order = pieces_by_param_and_box(np, pieces);
    let mut dgroups = Vec::new();
    let mut dgroup_first = vec![0u32; np + 1];
    let mut i = 0;
    while i < order.len() {
        let p = &pieces[order[i] as usize];
        let mut j = i + 1;
        while j < order.len() {
            let q = &pieces[order[j] as usize];
            if q.param != p.param || q.src != p.src {
                break;
            }
            j += 1;
        }
        dgroup_first[p.param as usize + 1] += 1;
        dgroups.push(DGroup {
            bx: p.src,
            first: i as u32,
            n: (j - i) as u32 * engines,
            engine_n: (j - i) as u32,
            fp8: p.scale.is_some(),
            dtype: infer.ranks[p.rank as usize].tensors[p.tensor as usize].dtype,
        });
        i = j;
    }
    for k in 0..np {
        dgroup_first[k + 1] += dgroup_first[k];
    }
    (order, dgroups, dgroup_first)
}

/// Indices of the pieces by param (a counting sort), then by (box, rank, tensor) within a param.
fn pieces_by_param_and_box(np: usize, pieces: &[Piece]) -> Vec<u32> {
    let mut piece_first = vec![0usize; np + 1];
    for p in pieces {
        piece_first[p.param as usize + 1] += 1;
    }
    for k in 0..np {
        piece_first[k + 1] += piece_first[k];
    }
    let mut order = vec![0u32; pieces.len()];
    let mut next = piece_first.clone();
    for (i, p) in pieces.iter().enumerate() {
        order[next[p.param as usize]] = i as u32;
        next[p.param as usize] += 1;
    }
    // Each param's pieces sorted on their own, params in parallel.
    let mut by_param: Vec<&mut [u32]> = Vec::with_capacity(np);
    let mut rest = order.as_mut_slice();
    for k in 0..np {
        let (mine, after) = rest.split_at_mut(piece_first[k + 1] - piece_first[k]);
        by_param.push(mine);
        rest = after;
    }
    by_param.into_par_iter().for_each(|mine| {
        mine.sort_unstable_by_key(|&i| {
            let p = &pieces[i as usize];
            (p.src.start, p.src.len, p.rank, p.tensor)
        })
    });
    order
}
