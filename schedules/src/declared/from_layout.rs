//! The declarations a known family's workers send: every trainer's shards of a training layout
//! ([`trainer_declarations`]) and every engine rank's tensors of an inference layout, each
//! with what it is made of ([`engine_declarations`]).
//!
//! Why: a serving engine knows what each of its tensors is made of (vLLM's loader narrows each
//! checkpoint tensor to its rank's box and copies it to its shard's offset in the fused
//! parameter: `qkv_proj` from q, k and v, `w13_weight` from every local expert's gate and up),
//! and that is exactly what a [`TensorSource`] says. Declaring the known families' own layouts
//! this way, and planning them as declared models, shows that one path plans both: the same
//! routing table, byte for byte (`tests/declared_fused.rs`), and a worker of a known family
//! could declare instead of the controller deriving.

use weightsync_common::protocol::{SourceBox, TensorMeta, TensorSource};

use crate::layout_infer::{InferenceLayout, Piece};
use crate::layout_train::TrainingLayout;
use crate::model::Model;
use crate::table::{DstTensor, TensorBox};

fn dims(d: &[u32]) -> Vec<u64> {
    d.iter().map(|&x| u64::from(x)).collect()
}

/// Every training rank's declarations of `train`, in the order it holds its shards: the box of
/// the parameter each shard is.
pub fn trainer_declarations(model: &Model, train: &TrainingLayout) -> Vec<Vec<TensorMeta>> {
    let mut out = vec![Vec::new(); train.ranks as usize];
    for s in &train.shards {
        let p = &model.params[s.param as usize];
        let n = s.global.ndim as usize;
        out[s.rank as usize].push(TensorMeta {
            name: p.name.to_string(),
            shape: dims(&s.global.len[..n]),
            dtype: s.dtype,
            bytes: s.global.numel() * s.dtype.size() as u64,
            global_shape: dims(p.shape.dims()),
            offset: dims(&s.global.start[..n]),
            source: None,
        });
    }
    out
}

/// The declarations of engine 0's ranks of `infer` (`out[r]`: local rank `r`'s; every engine's
/// rank of the same local rank declares the same): each tensor in arena order, an fp8 tensor's
/// `_scale_inv` after it. A tensor that is the parameter of its name, whole, declares no source
/// (as a transformers engine's); any other names its parts, in the order they fill it, and the
/// dim they are concatenated along.
pub fn engine_declarations(model: &Model, infer: &InferenceLayout) -> Vec<Vec<TensorMeta>> {
    let n = infer.ranks.iter().take_while(|r| r.engine == 0).count();
    let mut out = Vec::with_capacity(n);
    let mut rest: &[Piece] = &infer.pieces;
    for r in &infer.ranks[..n] {
        let k = rest.iter().take_while(|p| p.rank == r.rank).count();
        let (mine, after) = rest.split_at(k);
        rest = after;
        out.push(rank_declarations(model, &r.tensors, mine));
    }
    out
}

/// One rank's declarations from its tensors and pieces (in tensor order).
fn rank_declarations(model: &Model, tensors: &[DstTensor], pieces: &[Piece]) -> Vec<TensorMeta> {
    let mut by_tensor: Vec<&[Piece]> = vec![&[]; tensors.len()];
    let mut rest = pieces;
    while let Some(first) = rest.first() {
        let k = rest.iter().take_while(|p| p.tensor == first.tensor).count();
        let (these, after) = rest.split_at(k);
        by_tensor[first.tensor as usize] = these;
        rest = after;
    }
    tensors
        .iter()
        .zip(by_tensor)
        .map(|(t, parts)| TensorMeta {
            name: t.name.clone(),
            shape: dims(t.shape.dims()),
            dtype: t.dtype,
            bytes: t.len,
            global_shape: Vec::new(),
            offset: Vec::new(),
            source: source_of(model, t, parts),
        })
        .collect()
}

/// What tensor `t` is made of, from its pieces: `None` for a scale tensor (no pieces) or the
/// parameter of its name, whole.
fn source_of(model: &Model, t: &DstTensor, parts: &[Piece]) -> Option<TensorSource> {
    let first = parts.first()?;
    let p0 = &model.params[first.param as usize];
    if parts.len() == 1 && *p0.name == t.name && first.src == TensorBox::full(p0.shape) {
        return None;
    }
    let n = t.shape.ndim as usize;
    let lead = n - first.src.ndim as usize;
    // The dim consecutive parts of one stacked slice move along; a slice of one part each
    // (per-expert `w2_weight`) concatenates along the first dim the parts span.
    let dim = parts
        .windows(2)
        .filter(|w| w[0].dst_start[..lead] == w[1].dst_start[..lead])
        .find_map(|w| (lead..n).find(|&d| w[0].dst_start[d] != w[1].dst_start[d]))
        .unwrap_or(lead);
    Some(TensorSource {
        dim: dim as u32,
        parts: parts
            .iter()
            .map(|p| {
                let k = p.src.ndim as usize;
                SourceBox {
                    tensor: model.params[p.param as usize].name.to_string(),
                    offset: dims(&p.src.start[..k]),
                    shape: dims(&p.src.len[..k]),
                }
            })
            .collect(),
    })
}
