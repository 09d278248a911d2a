//! Checking an inference layout before planning: every rank and tensor is where it says, every
//! piece names a real parameter and lands inside its tensors (fp8 pieces on block boundaries, with
//! f32 scales), and the pieces of each destination tensor fill it exactly once.
//!
//! Its own file because it is not a planning step: it runs once, before the steps, so that the
//! steps may index without checking and a bad layout (a hand-written one, a fuzzer's) gets an
//! error naming the rank, the tensor and what is wrong instead of a wrong table or a panic.

use rayon::prelude::*;
use weightsync_common::DType;

use super::place::{dst_box, scale_box};
use crate::error::PlanError;
use crate::layout_infer::{EnginePeriod, InferRank, InferenceLayout, Piece};
use crate::model::{Model, Param};
use crate::table::{DstTensor, FP8_BLOCK, Shape, TensorBox};

/// Checks `infer` against `model` (see the module docs). Rank by rank: the boxes placed in
/// one rank's tensors are all that is held at once (at 10,240 GPUs every rank's at once would be
/// a gigabyte). When the engines repeat engine 0 (`period`, from
/// [`InferenceLayout::engine_period`]), every rank is still checked for its place and its
/// tensors' fit, but pieces only in engine 0: the others' are the same pieces in the same
/// tensors, so they would fail where engine 0's do, and engine 0's ranks come first.
pub(super) fn validate_infer(
    model: &Model,
    infer: &InferenceLayout,
    period: Option<EnginePeriod>,
) -> Result<(), PlanError> {
    check_ranks(infer)?;
    let infer = match period {
        Some(p) => View {
            ranks: &infer.ranks[..p.ranks as usize],
            pieces: &infer.pieces[..p.pieces],
        },
        None => View {
            ranks: &infer.ranks,
            pieces: &infer.pieces,
        },
    };
    let nranks = infer.ranks.len() as u32;
    // Piece indices by rank (a counting sort; a rank a piece names must exist).
    let mut piece_first = vec![0u32; infer.ranks.len() + 1];
    for pc in infer.pieces {
        if pc.rank >= nranks {
            return Err(PlanError::NoSuchRank {
                side: "inference",
                rank: pc.rank,
                ranks: nranks,
            });
        }
        piece_first[pc.rank as usize + 1] += 1;
    }
    for r in 0..infer.ranks.len() {
        piece_first[r + 1] += piece_first[r];
    }
    let mut by_rank = vec![0u32; infer.pieces.len()];
    let mut next = piece_first.clone();
    for (i, pc) in infer.pieces.iter().enumerate() {
        by_rank[next[pc.rank as usize] as usize] = i as u32;
        next[pc.rank as usize] += 1;
    }
    let mut placed: Vec<Placed> = Vec::new();
    let mut grouped: (Vec<u32>, Vec<Placed>) = Default::default();
    let pieces_of =
        |rank: usize| &by_rank[piece_first[rank] as usize..piece_first[rank + 1] as usize];
    // Ranks checked in full, one per way of being laid out. Comparing every rank's pieces with
    // a checked rank's is most of the work at 64 engines, so it is done in parallel first
    // against the first rank sharing the rank's tensors (always a checked one: no rank before
    // it has those tensors); a rank laid out otherwise is compared with every checked rank in
    // order, as when all are compared one by one.
    let mut first_sharing: Vec<usize> = Vec::with_capacity(infer.ranks.len());
    let mut firsts: Vec<usize> = Vec::new();
    for (rank, r) in infer.ranks.iter().enumerate() {
        let same = |f: &&usize| std::sync::Arc::ptr_eq(&infer.ranks[**f].tensors, &r.tensors);
        let f = match firsts.iter().find(same) {
            Some(&f) => f,
            None => {
                firsts.push(rank);
                rank
            }
        };
        first_sharing.push(f);
    }
    let alike_first: Vec<bool> = (0..infer.ranks.len())
        .into_par_iter()
        .map(|rank| {
            let f = first_sharing[rank];
            f != rank && laid_out_alike(infer, f, pieces_of(f), rank, pieces_of(rank))
        })
        .collect();
    let mut checked: Vec<usize> = Vec::new();
    for (rank, r) in infer.ranks.iter().enumerate() {
        let mine = pieces_of(rank);
        if alike_first[rank]
            || checked
                .iter()
                .any(|&c| laid_out_alike(infer, c, pieces_of(c), rank, mine))
        {
            continue;
        }
        checked.push(rank);
        placed.clear();
        for &i in mine {
            place_piece(model, infer, &infer.pieces[i as usize], &mut placed)?;
        }
        group_by_tensor(&placed, r.tensors.len(), &mut grouped);
        let (first, by_tensor) = (&grouped.0, &mut grouped.1);
        for (k, t) in r.tensors.iter().enumerate() {
            let boxes = &mut by_tensor[first[k] as usize..first[k + 1] as usize];
            check_tensor_filled(model, rank as u32, t, boxes)?;
        }
    }
    Ok(())
}

/// Whether rank `b` (its pieces `b_pieces`) is laid out as rank `a` was: the same tensors (the
/// same list, as every engine's same rank shares it) and MRs, and the same pieces in the same
/// order but for their rank. Then checking `b` would find what checking `a` found (the checks
/// read nothing else of a rank), so at 64 engines each rank is checked once, not 64 times.
fn laid_out_alike(infer: View<'_>, a: usize, a_pieces: &[u32], b: usize, b_pieces: &[u32]) -> bool {
    let (ra, rb) = (&infer.ranks[a], &infer.ranks[b]);
    std::sync::Arc::ptr_eq(&ra.tensors, &rb.tensors)
        && ra.mr_bytes == rb.mr_bytes
        && a_pieces.len() == b_pieces.len()
        && a_pieces.iter().zip(b_pieces).all(|(&i, &j)| {
            let (x, y) = (&infer.pieces[i as usize], &infer.pieces[j as usize]);
            Piece { rank: y.rank, ..*x } == *y
        })
}

/// The ranks and pieces being checked: the whole layout, or its engine 0.
#[derive(Clone, Copy)]
struct View<'a> {
    ranks: &'a [InferRank],
    pieces: &'a [Piece],
}

/// Every rank is listed at its own index; every tensor's length matches its shape and fits
/// inside its MR.
fn check_ranks(infer: &InferenceLayout) -> Result<(), PlanError> {
    for (i, r) in infer.ranks.iter().enumerate() {
        if r.rank != i as u32 {
            return Err(PlanError::BadInferenceLayout {
                rank: i as u32,
                reason: format!("listed at index {i} but says rank {}", r.rank),
            });
        }
        for t in r.tensors.iter() {
            if t.len != t.shape.numel() * t.dtype.size() as u64
                || r.mr_bytes
                    .get(t.mr as usize)
                    .is_none_or(|&m| t.offset + t.len > m)
            {
                return Err(PlanError::BadInferenceLayout {
                    rank: r.rank,
                    reason: format!(
                        "tensor {} does not fit its MR {} or its shape",
                        t.name, t.mr
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Checks one piece (its parameter, box, tensor, fp8 alignment and scales; its rank exists)
/// and appends the boxes it fills: in its tensor and, for fp8, in its scale tensor (tensors
/// numbered within the rank).
fn place_piece(
    model: &Model,
    infer: View<'_>,
    pc: &Piece,
    placed: &mut Vec<Placed>,
) -> Result<(), PlanError> {
    let nranks = infer.ranks.len() as u32;
    let bad = |reason: String| PlanError::BadInferenceLayout {
        rank: pc.rank,
        reason,
    };
    if pc.rank >= nranks {
        return Err(PlanError::NoSuchRank {
            side: "inference",
            rank: pc.rank,
            ranks: nranks,
        });
    }
    let p = model
        .params
        .get(pc.param as usize)
        .ok_or_else(|| bad(format!("piece names parameter id {}", pc.param)))?;
    if !pc.src.fits_in(p.shape) || pc.src.is_empty() {
        return Err(bad(format!(
            "piece {} of {} is outside its shape {}",
            pc.src, p.name, p.shape
        )));
    }
    let r = &infer.ranks[pc.rank as usize];
    let t = r
        .tensors
        .get(pc.tensor as usize)
        .ok_or_else(|| bad(format!("piece of {} names tensor {}", p.name, pc.tensor)))?;
    if t.shape.ndim < p.shape.ndim {
        return Err(bad(format!(
            "tensor {} has fewer dims than {}",
            t.name, p.name
        )));
    }
    let db = dst_box(pc, &pc.src, t.shape.ndim as usize);
    if !db.fits_in(t.shape) {
        return Err(bad(format!(
            "piece {} of {} lands at {} outside tensor {} {}",
            pc.src, p.name, db, t.name, t.shape
        )));
    }
    let fp8 = t.dtype == DType::F8E4M3;
    if fp8 && p.shape.ndim >= 2 {
        check_fp8_blocks(p, pc)?;
    }
    if fp8 != pc.scale.is_some() || (fp8 && p.shape.ndim < 2) {
        return Err(bad(format!(
            "tensor {} is {} but piece of {} has {} scales",
            t.name,
            t.dtype,
            p.name,
            if pc.scale.is_some() { "" } else { "no" }
        )));
    }
    placed.push(Placed::new(pc.tensor, db, t.shape, pc.param));
    if let Some(sc) = pc.scale {
        let (st, sb) = scale_placement(r, p, pc, sc.tensor).map_err(bad)?;
        placed.push(Placed::new(sc.tensor, sb, st.shape, pc.param));
    }
    Ok(())
}

/// A quantised piece starts on a block boundary along its last two dims and ends on one or at
/// the parameter's end.
fn check_fp8_blocks(p: &Param, pc: &Piece) -> Result<(), PlanError> {
    let n = p.shape.ndim as usize;
    for d in n - 2..n {
        let (s, e) = (pc.src.start[d], pc.src.end(d));
        if s % FP8_BLOCK != 0 || (e % FP8_BLOCK != 0 && e != p.shape.dims[d]) {
            return Err(PlanError::Fp8Misaligned {
                param: p.name.to_string(),
                rank: pc.rank,
                region: pc.src.to_string(),
                block: FP8_BLOCK,
            });
        }
    }
    Ok(())
}

/// The scale tensor `tensor` of a quantised piece and the box its scales fill there, if that
/// tensor exists, is f32 and holds the box; else why not.
fn scale_placement<'r>(
    r: &'r InferRank,
    p: &Param,
    pc: &Piece,
    tensor: u32,
) -> Result<(&'r DstTensor, TensorBox), String> {
    let st = r
        .tensors
        .get(tensor as usize)
        .ok_or_else(|| format!("scales of {} name tensor {}", p.name, tensor))?;
    let sb = scale_box(pc, &pc.src, st.shape.ndim as usize, p.shape.ndim as usize);
    if !sb.fits_in(st.shape) || st.dtype != DType::F32 {
        return Err(format!(
            "scales of {} land at {} outside f32 tensor {} {}",
            p.name, sb, st.name, st.shape
        ));
    }
    Ok((st, sb))
}

/// The placed boxes grouped by destination tensor (a counting sort) into `out`: tensor `k`'s
/// are `out.1[out.0[k]..out.0[k + 1]]`, in the order they were placed.
fn group_by_tensor(placed: &[Placed], ntensors: usize, out: &mut (Vec<u32>, Vec<Placed>)) {
    let (first, by_tensor) = out;
    first.clear();
    first.resize(ntensors + 1, 0);
    for x in placed {
        first[x.tensor as usize + 1] += 1;
    }
    for k in 0..ntensors {
        first[k + 1] += first[k];
    }
    by_tensor.clear();
    by_tensor.resize(placed.len(), Placed::default());
    let mut next = first.clone();
    for x in placed {
        by_tensor[next[x.tensor as usize] as usize] = *x;
        next[x.tensor as usize] += 1;
    }
}

/// The boxes placed in tensor `t` of `rank` fill it exactly once: some box, no two overlapping,
/// their volumes adding up to the tensor's. Sorts `boxes` (a tensor has few) in row-major
/// order of their starts.
fn check_tensor_filled(
    model: &Model,
    rank: u32,
    t: &DstTensor,
    boxes: &mut [Placed],
) -> Result<(), PlanError> {
    if boxes.is_empty() {
        return Err(PlanError::BadInferenceLayout {
            rank,
            reason: format!("tensor {} is filled by no piece", t.name),
        });
    }
    if !boxes.is_sorted_by_key(|x| (x.at, x.bx.len)) {
        boxes.sort_unstable_by_key(|x| (x.at, x.bx.len));
    }
    let cover = |reason: String, param: u32| PlanError::DestinationCoverage {
        param: model.params[param as usize].name.to_string(),
        rank,
        tensor: t.name.clone(),
        reason,
    };
    for a in 0..boxes.len() {
        for b in a + 1..boxes.len() {
            if boxes[b].bx.start[0] >= boxes[a].bx.end(0) {
                break;
            }
            if boxes[a].bx.intersect(&boxes[b].bx).is_some() {
                return Err(cover(
                    format!("{} and {} overlap", boxes[a].bx, boxes[b].bx),
                    boxes[b].param,
                ));
            }
        }
    }
    let vol: u64 = boxes.iter().map(|x| x.bx.numel()).sum();
    if vol != t.shape.numel() {
        return Err(cover(
            format!(
                "pieces cover {vol} of its {} elements (every byte must be written once)",
                t.shape.numel()
            ),
            boxes[0].param,
        ));
    }
    Ok(())
}

/// A box a piece fills in a destination tensor.
#[derive(Clone, Copy, Default)]
struct Placed {
    /// The tensor, by its index in its rank's tensors.
    tensor: u32,
    /// Row-major index of the box's first element: sorting by it sorts by start.
    at: u64,
    bx: TensorBox,
    param: u32,
}

impl Placed {
    fn new(tensor: u32, bx: TensorBox, shape: Shape, param: u32) -> Placed {
        let strides = shape.strides();
        let at = (0..bx.ndim as usize)
            .map(|d| bx.start[d] as u64 * strides[d])
            .sum();
        Placed {
            tensor,
            at,
            bx,
            param,
        }
    }
}
