//! Where an inference rank's tensor sits in the training parameter it is cut from.
//!
//! An engine whose loader takes whole checkpoint tensors and narrows them to its own
//! tensor-parallel rank (vLLM's `load_weights`) needs more than the extents of what it holds: it
//! needs the box's place in the whole tensor, to hand the loader a whole-shaped tensor whose box
//! holds the rank's bytes (or to check that the loader's narrowing reads exactly that box).
//!
//! A tensor has such a box when it is one box of one parameter placed as is: its pieces all come
//! from the same parameter, with as many dims as the tensor, each at the same offset (parameter
//! coordinate minus tensor coordinate), and together they fill the tensor. That holds for every
//! tensor of the hf format but a tp-split packed expert tensor (`mlp.experts.gate_up_proj` with
//! `ep = 1`, `tp > 1`: gate rows and up rows of the parameter, two boxes) and fp8 scales, and
//! for the fused format's unfused tensors (norms, embeddings, `o_proj`, `down_proj`). Fused
//! tensors (`qkv_proj`, `gate_up_proj`, `w13_weight`) have none.

use super::InferenceLayout;
use crate::error::PlanError;
use crate::model::Model;
use crate::table::{MAX_DIMS, Shape};

/// One inference tensor as a box of one training parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamBox {
    /// Parameter index in the model.
    pub param: u32,
    /// The parameter's (whole) shape.
    pub global: Shape,
    /// Where the tensor starts in the parameter (entries at `global.ndim..` are 0).
    pub offset: [u32; MAX_DIMS],
}

impl InferenceLayout {
    /// For each tensor of inference rank `rank`, in the rank's order, its box in the parameter
    /// it is cut from, or `None` when it is not one box of one parameter (see the module docs).
    pub fn param_boxes(
        &self,
        model: &Model,
        rank: u32,
    ) -> Result<Vec<Option<ParamBox>>, PlanError> {
        let r = self.ranks.get(rank as usize).ok_or(PlanError::NoSuchRank {
            side: "inference",
            rank,
            ranks: self.ranks.len() as u32,
        })?;
        // Pieces are in rank, then tensor order.
        let from = self.pieces.partition_point(|p| p.rank < rank);
        let to = self.pieces.partition_point(|p| p.rank <= rank);
        let mine = &self.pieces[from..to];
        let mut boxes = Vec::with_capacity(r.tensors.len());
        let mut at = 0;
        for (i, t) in r.tensors.iter().enumerate() {
            let n = mine[at..]
                .iter()
                .take_while(|p| p.tensor as usize == i)
                .count();
            let pieces = &mine[at..at + n];
            at += n;
            boxes.push(one_box(model, t.shape, pieces));
        }
        Ok(boxes)
    }
}

/// The box of a tensor of `shape` filled by `pieces`, when they make one.
fn one_box(model: &Model, shape: Shape, pieces: &[super::Piece]) -> Option<ParamBox> {
    let first = pieces.first()?;
    let global = model.params.get(first.param as usize)?.shape;
    let nd = shape.ndim as usize;
    if global.ndim != shape.ndim {
        return None;
    }
    let mut offset = [0u32; MAX_DIMS];
    for (d, off) in offset.iter_mut().enumerate().take(nd) {
        *off = first.src.start[d].checked_sub(first.dst_start[d])?;
        if off.checked_add(shape.dims[d])? > global.dims[d] {
            return None;
        }
    }
    let mut filled = 0u64;
    for p in pieces {
        let same_place =
            (0..nd).all(|d| p.src.start[d].checked_sub(p.dst_start[d]) == Some(offset[d]));
        if p.param != first.param || !same_place {
            return None;
        }
        filled += p.src.numel();
    }
    (filled == shape.numel()).then_some(ParamBox {
        param: first.param,
        global,
        offset,
    })
}
