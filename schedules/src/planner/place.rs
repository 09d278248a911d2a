//! Where a box of a parameter lands inside a [`Piece`]: its coordinates in the destination
//! tensor and, for fp8, in the scale tensor.
//!
//! Its own file because three steps ask it: validation checks that every piece fits its tensors,
//! region weighing counts the runs a box becomes, and emission turns those runs into writes
//! (once per task and target, so both functions are `#[inline]`).

use crate::layout_infer::Piece;
use crate::table::{FP8_BLOCK, MAX_DIMS, TensorBox};

/// A parameter box inside a piece, in destination-tensor coordinates.
#[inline]
pub(super) fn dst_box(pc: &Piece, r: &TensorBox, dst_ndim: usize) -> TensorBox {
    // Every index below is then provably in bounds (this runs once per task and target).
    let dst_ndim = dst_ndim.min(MAX_DIMS);
    let pn = (r.ndim as usize).min(dst_ndim);
    let lead = dst_ndim - pn;
    let mut b = TensorBox {
        ndim: dst_ndim as u8,
        start: [0; MAX_DIMS],
        len: [0; MAX_DIMS],
    };
    for d in 0..dst_ndim {
        if d < lead {
            b.start[d] = pc.dst_start[d];
            b.len[d] = 1;
        } else {
            let i = d - lead;
            b.start[d] = pc.dst_start[d] + r.start[i] - pc.src.start[i];
            b.len[d] = r.len[i];
        }
    }
    b
}

/// The scales of a block-aligned parameter box inside a piece, in scale-tensor coordinates.
#[inline]
pub(super) fn scale_box(pc: &Piece, r: &TensorBox, dst_ndim: usize, pn: usize) -> TensorBox {
    let place = pc.scale.expect("scale_box of a quantised piece");
    // Every index below is then provably in bounds (this runs once per task and target).
    let dst_ndim = dst_ndim.min(MAX_DIMS);
    let pn = pn.min(dst_ndim);
    let lead = dst_ndim - pn;
    let mut b = TensorBox {
        ndim: dst_ndim as u8,
        start: [0; MAX_DIMS],
        len: [0; MAX_DIMS],
    };
    for d in 0..dst_ndim {
        if d < lead {
            b.start[d] = place.start[d];
            b.len[d] = 1;
            continue;
        }
        let i = d - lead;
        let rel = r.start[i] - pc.src.start[i];
        // The last two dims count blocks, the leading ones elements.
        if i + 2 >= pn {
            b.start[d] = place.start[d] + rel / FP8_BLOCK;
            b.len[d] = r.len[i].div_ceil(FP8_BLOCK);
        } else {
            b.start[d] = place.start[d] + rel;
            b.len[d] = r.len[i];
        }
    }
    b
}
