//! Declared models: a model the planner knows only from what its workers register, so that any
//! architecture (Gemma, Phi, GLM, OLMo, gpt-oss, a vision tower...) plans without model
//! knowledge, by tensor name.
//!
//! # When
//! A job's model is declared when its `config.json` names a `model_type` outside the seven
//! known families ([`crate::model_config`]), or when the job says so (`--model declared` or
//! `declared:NAME`): see [`crate::job::is_declared`]. Known families keep their config-derived,
//! fused and tensor-parallel layouts; nothing here touches them.
//!
//! # What workers declare (the registration's `TensorMeta`s)
//! - **Trainers**: every parameter shard they hold: `name`, `dtype`, the local `shape`, the
//!   parameter's `global_shape` and the box's `offset` in it (both empty: the tensor is whole).
//!   Replicas (HSDP, tensor-parallel copies of a norm) declare the same box; shards declare
//!   disjoint boxes that together cover the tensor exactly ([`DeclaredError::Overlap`],
//!   [`DeclaredError::Gap`] otherwise). Empty shards (FSDP2's trailing ranks) may be declared
//!   or left out. Ranks must agree on a tensor's dtype and whole shape.
//! - **Engines**: every destination tensor each inference rank holds (`name`, `dtype`,
//!   `shape`), and a `skip` list of names it takes nothing of. A tensor that declares no
//!   `source` is the trainers' tensor of its name, whole; one that does is made of boxes of
//!   trainers' tensors concatenated along a dim ([`TensorSource`], placed by `concat`): a fused
//!   `qkv_proj`, a tensor-parallel rank's slice, experts stacked into one tensor. Inference rank
//!   `i` is engine `i / n`'s local rank `i % n` (`n = max(tp, ep)` of the layout string). Engines
//!   of whole tensors only need `format=hf`, `tp=1`, `ep=1` ([`check_engines`]). A declared
//!   tensor or part no trainer holds, a trainer tensor no rank of an engine takes or skips, a
//!   part outside its tensor, parts that overlap or leave a gap, a shape or dtype the two sides
//!   disagree on: each is a named error ([`DeclaredError`]) naming the tensor and both sides,
//!   before any byte moves. Known families' layouts are declared by [`engine_declarations`]
//!   (what their engines would send) and plan the same table as from their config.
//!
//! # Dtypes
//! An engine tensor's dtype is the trainers' (a copy) or bf16 (the job's inference dtype: a
//! cast, e.g. from FSDP2's f32 shards), or, in an fp8 job, float8 e4m3 for a tensor of at least
//! two dims whose `<name>_scale_inv` the engine declares too, f32 of shape
//! `[lead..., ceil(rows/128), ceil(cols/128)]`: the tensor is then block-quantised as the
//! known families' hf format quantises its own (blocks of the destination tensor, one scale per
//! 128x128 block). The engine decides which tensors are fp8 by declaring them so.
//!
//! # Dims
//! The table holds at most three dims. A declared tensor of more (a Conv2d/Conv3d patch
//! embedding) is taken as `[d0, d1, d2 * d3 * ...]` (the same bytes, row-major); a trainer's box
//! of it must then cover its trailing dims whole (FSDP2 shards dim 0). A 0-D tensor is `[1]`.
//! [`logical_shape`] is the one rule, used by workers and the controller alike.
//!
//! # The model and its layouts
//! Parameters are numbered in the trainers' declaration orders merged (rank 0's in order; a
//! name a later rank declares first goes just before the next name of its list an earlier rank
//! declared, or last: see `order`), each with [`Role::Declared`]. Mesh groups follow the
//! names: the first all-digit component of a name (`model.layers.7.mlp...` → block 7) puts a
//! tensor in group `1 + block`; unnumbered tensors before the first numbered one are group 0
//! (`embed`), the rest the last group (`head`). A trainer's shards sit in its arena in its
//! declaration order, each at the next 256-byte boundary (as [`TrainingLayout`]s do); an
//! engine's tensors likewise ([`engine_tensors`], which the engine computes itself from its own
//! declarations, so it can register before the controller plans).
//!
//! # Files
//! `mod.rs` the rule for shapes, the model and training layout from trainers; `tiling` the
//! exact-cover check; `order` the parameters' order; `engine` the inference layout from
//! engines; `concat` an engine tensor's parts placed; `from_layout` a known layout's
//! declarations; `error` the named errors.

mod concat;
mod engine;
mod from_layout;
mod order;
#[cfg(test)]
mod tests;
mod tiling;

use rustc_hash::FxHashMap;
use std::sync::Arc;
use weightsync_common::DType;
use weightsync_common::protocol::TensorMeta;
#[cfg(doc)]
use weightsync_common::protocol::TensorSource;

pub use crate::declared_error::DeclaredError;
pub use engine::{EngineDeclaration, check_engines, check_spec, engine_tensors, inference_layout};
pub use from_layout::{engine_declarations, trainer_declarations};

use crate::error::PlanError;
use crate::layout_train::{ShardSpec, TrainingLayout, align_up};
use crate::model::{Model, Param, Role};
use crate::model_config::{MAX_LAYERS, ModelConfig};
use crate::table::{MAX_DIMS, Shape, TensorBox};

/// Most tensors one worker may declare (a model's bound, [`crate::model_bounds::MAX_TENSORS`]).
pub const MAX_DECLARED: usize = crate::model_bounds::MAX_TENSORS as usize;

/// A declared tensor's dims as the table holds them (see the module docs): at most three, a
/// 0-D tensor as `[1]`, more than three with the trailing ones merged. Refused when a dim (or
/// the merged one) does not fit `u32`.
pub fn logical_shape(dims: &[u64]) -> Result<Shape, String> {
    let fit = |d: u64| u32::try_from(d).map_err(|_| format!("dim {d} is more than {}", u32::MAX));
    match dims.len() {
        0 => Ok(Shape::new(&[1])),
        n if n <= MAX_DIMS => {
            let d: Vec<u32> = dims.iter().map(|&d| fit(d)).collect::<Result<_, _>>()?;
            Ok(Shape::new(&d))
        }
        _ => {
            let merged = dims[2..]
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| format!("shape {dims:?} overflows"))?;
            Ok(Shape::new(&[fit(dims[0])?, fit(dims[1])?, fit(merged)?]))
        }
    }
}

/// The box a trainer's declaration holds and the whole tensor's shape, in the table's dims;
/// refused (why, naming no tensor: the caller does) when its dims disagree, the box lies
/// outside the tensor, or a box of a tensor of more than three dims cuts its trailing dims.
pub fn shard_box(m: &TensorMeta) -> Result<(Shape, TensorBox), String> {
    let whole = if m.global_shape.is_empty() {
        &m.shape
    } else {
        &m.global_shape
    };
    let n = whole.len();
    let offset: Vec<u64> = if m.offset.is_empty() {
        vec![0; n]
    } else {
        m.offset.clone()
    };
    if m.shape.len() != n || offset.len() != n {
        return Err(format!(
            "with {} dims of local shape {:?}, {} of global shape {whole:?} and {} of offset {offset:?}",
            m.shape.len(),
            m.shape,
            n,
            offset.len()
        ));
    }
    for d in 0..n {
        if offset[d]
            .checked_add(m.shape[d])
            .is_none_or(|e| e > whole[d])
        {
            return Err(format!(
                "as the box at {offset:?} of shape {:?}, outside its global shape {whole:?}",
                m.shape
            ));
        }
    }
    let global = logical_shape(whole).map_err(|e| format!("with global shape {whole:?}: {e}"))?;
    if n > MAX_DIMS && (2..n).any(|d| offset[d] != 0 || m.shape[d] != whole[d]) {
        return Err(format!(
            "as the box at {offset:?} of shape {:?} of a {n}-D tensor {whole:?}: a box of a \
             tensor of more than {MAX_DIMS} dims must hold its trailing dims whole",
            m.shape
        ));
    }
    let bx = if n == 0 {
        TensorBox::new(&[0], &[1])
    } else {
        // Dims past the second are whole when there are more than three (checked above), so
        // the merged dim's box is all of it.
        let k = n.min(MAX_DIMS);
        let mut start = [0u32; MAX_DIMS];
        let mut len = global.dims;
        for d in 0..if n > MAX_DIMS { 2 } else { n } {
            start[d] = offset[d] as u32;
            len[d] = m.shape[d] as u32;
        }
        TensorBox::new(&start[..k], &len[..k])
    };
    Ok((global, bx))
}

/// The block number of a name: its first all-digit dotted component, if one is a block the
/// mesh groups can hold.
fn block_of(name: &str) -> Option<u32> {
    name.split('.')
        .find(|c| !c.is_empty() && c.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|c| c.parse::<u32>().ok())
        .filter(|&b| b < MAX_LAYERS)
}

/// The model and the training layout of a declared model, from every trainer's declarations
/// (`trainers[r]`: training rank `r`'s), checked: each declaration well formed, no rank
/// declaring a name twice, ranks agreeing on dtype and whole shape, and each tensor's boxes
/// tiling it exactly.
pub fn from_trainers(
    name: &str,
    trainers: &[&[TensorMeta]],
) -> Result<(Model, TrainingLayout), PlanError> {
    let mut params: Vec<Param> = Vec::new();
    // Per parameter: the first rank that declared it, and every (box, rank) declared.
    let mut first: Vec<u32> = Vec::new();
    let mut boxes: Vec<Vec<(TensorBox, u32)>> = Vec::new();
    let mut by_name: FxHashMap<&str, u32> = FxHashMap::default();
    let mut shards: Vec<ShardSpec> = Vec::new();
    let mut order = order::MergedOrder::default();
    for (rank, decls) in trainers.iter().enumerate() {
        let rank = rank as u32;
        let known = params.len() as u32;
        if decls.len() > MAX_DECLARED {
            return Err(PlanError::TooLarge(format!(
                "trainer rank {rank} declares {} tensors, more than the {MAX_DECLARED} a model \
                 may have",
                decls.len()
            )));
        }
        let mut mine: FxHashMap<&str, ()> = FxHashMap::default();
        let mut next = 0u64;
        for m in decls.iter() {
            if mine.insert(&m.name, ()).is_some() {
                return Err(DeclaredError::Twice {
                    tensor: m.name.clone(),
                    side: "trainer",
                    rank,
                }
                .into());
            }
            let (global, bx) = shard_box(m).map_err(|reason| DeclaredError::Malformed {
                tensor: m.name.clone(),
                side: "trainer",
                rank,
                reason,
            })?;
            let pid = match by_name.get(m.name.as_str()) {
                Some(&pid) => {
                    let p = &params[pid as usize];
                    let disagree = |what, a: String, b: String| DeclaredError::TrainersDisagree {
                        tensor: m.name.clone(),
                        what,
                        rank_a: first[pid as usize],
                        a,
                        rank_b: rank,
                        b,
                    };
                    if p.dtype != m.dtype {
                        return Err(
                            disagree("dtype", p.dtype.to_string(), m.dtype.to_string()).into()
                        );
                    }
                    if p.shape != global {
                        return Err(disagree(
                            "global shape",
                            p.shape.to_string(),
                            global.to_string(),
                        )
                        .into());
                    }
                    pid
                }
                None => {
                    let pid = params.len() as u32;
                    params.push(Param {
                        name: Arc::from(m.name.as_str()),
                        shape: global,
                        dtype: m.dtype,
                        role: Role::Declared {
                            index: pid,
                            group: 0,
                        },
                    });
                    first.push(rank);
                    boxes.push(Vec::new());
                    by_name.insert(&m.name, pid);
                    order.new_param(pid);
                    pid
                }
            };
            if pid < known {
                order.known(pid);
            }
            if bx.is_empty() {
                continue;
            }
            boxes[pid as usize].push((bx, rank));
            shards.push(ShardSpec {
                rank,
                param: pid,
                global: bx,
                dtype: m.dtype,
                offset: next,
            });
            next = align_up(next + bx.numel() * m.dtype.size() as u64);
        }
        order.end_rank();
    }
    if let Some(merged) = order.finish() {
        // Renumber the parameters in merged order (see `order`).
        let mut new_index = vec![0u32; merged.len()];
        for (i, &p) in merged.iter().enumerate() {
            new_index[p as usize] = i as u32;
        }
        let mut old_params: Vec<Option<Param>> = params.into_iter().map(Some).collect();
        let mut old_boxes: Vec<Option<Vec<(TensorBox, u32)>>> =
            boxes.into_iter().map(Some).collect();
        params = Vec::with_capacity(merged.len());
        boxes = Vec::with_capacity(merged.len());
        for (i, &p) in merged.iter().enumerate() {
            let mut param = old_params[p as usize].take().expect("each once");
            param.role = Role::Declared {
                index: i as u32,
                group: 0,
            };
            params.push(param);
            boxes.push(old_boxes[p as usize].take().expect("each once"));
        }
        for s in &mut shards {
            s.param = new_index[s.param as usize];
        }
    }
    for (p, b) in params.iter().zip(boxes.iter_mut()) {
        tiling::check(p, b)?;
    }
    let blocks = assign_groups(&mut params);
    let dtype = main_dtype(&params);
    let model = Model {
        name: name.to_string(),
        config: ModelConfig::declared(blocks, dtype),
        experts: Default::default(),
        params,
    };
    let train = TrainingLayout {
        ranks: trainers.len() as u32,
        shards,
    };
    Ok((model, train))
}

/// Puts every parameter in its mesh group (see the module docs); returns the number of blocks.
fn assign_groups(params: &mut [Param]) -> u32 {
    let blocks: Vec<Option<u32>> = params.iter().map(|p| block_of(&p.name)).collect();
    let n = blocks.iter().flatten().max().map_or(0, |&b| b + 1);
    let first_numbered = blocks.iter().position(Option::is_some);
    for (i, (p, b)) in params.iter_mut().zip(&blocks).enumerate() {
        let group = match (b, first_numbered) {
            (Some(b), _) => 1 + b,
            (None, Some(f)) if i > f => 1 + n,
            (None, _) => 0,
        };
        if let Role::Declared { group: g, .. } = &mut p.role {
            *g = group as u16;
        }
    }
    n
}

/// The dtype most of the model's elements are in (bf16 for an empty model).
fn main_dtype(params: &[Param]) -> DType {
    let mut by: Vec<(DType, u64)> = Vec::new();
    for p in params {
        match by.iter_mut().find(|(d, _)| *d == p.dtype) {
            Some((_, n)) => *n += p.shape.numel(),
            None => by.push((p.dtype, p.shape.numel())),
        }
    }
    by.into_iter()
        .max_by_key(|&(_, n)| n)
        .map_or(DType::BF16, |(d, _)| d)
}
