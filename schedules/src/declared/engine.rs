//! The inference side of a declared model: each engine's tensors from its own declarations
//! ([`engine_tensors`], what an engine computes to register before the controller plans), and
//! the pieces that fill them from the trainers' parameters ([`inference_layout`], where every
//! disagreement between the two sides is refused by name).

use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Arc;
use weightsync_common::DType;
use weightsync_common::protocol::TensorMeta;

use super::{DeclaredError, MAX_DECLARED, logical_shape};
use crate::error::PlanError;
use crate::layout_infer::ScalePlace;
use crate::layout_infer::{InferDType, InferFormat, InferRank, InferSpec, InferenceLayout, Piece};
use crate::layout_train::{TrainingLayout, align_up};
use crate::model::Model;
use crate::table::{DstTensor, FP8_BLOCK, MAX_DIMS, Shape, TensorBox};

/// What one inference rank of a declared model declared.
#[derive(Debug, Clone, Copy)]
pub struct EngineDeclaration<'a> {
    /// Its tensors, whole, in the order it holds them.
    pub tensors: &'a [TensorMeta],
    /// Names it takes nothing of: a tensor of the list it declares is not filled, a trainer
    /// tensor of the list it does not declare is not asked of it.
    pub skip: &'a [String],
}

/// Refuses an inference layout string a declared model cannot be laid out by: each inference
/// rank must hold whole tensors (`tp=1`, `ep=1`; `dp` engines each hold all of them) by
/// transformers' names (`format=hf`).
pub fn check_spec(spec: &InferSpec) -> Result<(), DeclaredError> {
    let refuse = |reason: String| DeclaredError::Spec {
        spec: spec.to_string(),
        reason,
    };
    if spec.tp > 1 || spec.ep > 1 {
        return Err(refuse(format!(
            "tp={} ep={}: the model is declared (its architecture is not one the planner \
             knows), so the planner does not know which dim of each tensor an engine splits; \
             each engine of a declared model holds whole tensors (tp=1, ep=1, dp=N)",
            spec.tp, spec.ep
        )));
    }
    if spec.format != InferFormat::Hf {
        return Err(refuse(
            "format=fused fuses tensors by what they are (qkv_proj, gate_up_proj), which the \
             planner knows only for its own families; a declared model's engines take \
             transformers' tensors by name: format=hf"
                .into(),
        ));
    }
    Ok(())
}

/// One engine's tensors, laid out from its own declarations: every declared tensor not on its
/// skip list and holding bytes, in declaration order, each at the next 256-byte boundary of
/// MR 0. Returns the tensors and the MR's size.
pub fn engine_tensors(
    rank: u32,
    decl: EngineDeclaration<'_>,
) -> Result<(Vec<DstTensor>, u64), DeclaredError> {
    if decl.tensors.len() > MAX_DECLARED {
        return Err(DeclaredError::Malformed {
            tensor: decl.tensors[0].name.clone(),
            side: "inference",
            rank,
            reason: format!(
                "among {} tensors, more than the {MAX_DECLARED} a model may have",
                decl.tensors.len()
            ),
        });
    }
    let skip: FxHashSet<&str> = decl.skip.iter().map(String::as_str).collect();
    let mut seen: FxHashSet<&str> = FxHashSet::default();
    let mut out = Vec::new();
    let mut next = 0u64;
    for m in decl.tensors {
        if !seen.insert(&m.name) {
            return Err(DeclaredError::Twice {
                tensor: m.name.clone(),
                side: "inference",
                rank,
            });
        }
        let shape = logical_shape(&m.shape).map_err(|reason| DeclaredError::Malformed {
            tensor: m.name.clone(),
            side: "inference",
            rank,
            reason: format!("with shape {:?}: {reason}", m.shape),
        })?;
        if skip.contains(m.name.as_str()) || shape.numel() == 0 {
            continue;
        }
        let len = shape.numel() * m.dtype.size() as u64;
        out.push(DstTensor {
            name: m.name.clone(),
            shape,
            dtype: m.dtype,
            mr: 0,
            offset: next,
            len,
        });
        next = align_up(next + len);
    }
    Ok((out, next))
}

/// The scale tensor's shape of an fp8 tensor of `shape`: one f32 per 128x128 block of the last
/// two dims, the leading dims as they are.
fn scale_shape(shape: Shape) -> Shape {
    let mut s = shape;
    let n = shape.ndim as usize;
    for d in n - 2..n {
        s.dims[d] = shape.dims[d].div_ceil(FP8_BLOCK);
    }
    s
}

/// The inference layout of a declared model: engine `e` (inference rank `e`) holds what it
/// declared (`engines[e]`), each tensor filled whole from the trainers' parameter of its name.
/// Every disagreement is refused by name (see [`DeclaredError`]).
pub fn inference_layout(
    model: &Model,
    train: &TrainingLayout,
    spec: &InferSpec,
    engines: &[EngineDeclaration<'_>],
) -> Result<InferenceLayout, PlanError> {
    check_spec(spec)?;
    let by_name: FxHashMap<&str, u32> = model
        .params
        .iter()
        .enumerate()
        .map(|(i, p)| (&*p.name, i as u32))
        .collect();
    // The first trainer rank holding each parameter, to name it.
    let mut holder = vec![u32::MAX; model.params.len()];
    for s in &train.shards {
        let h = &mut holder[s.param as usize];
        *h = (*h).min(s.rank);
    }
    // Per parameter, the dtype the first engine taking it takes it in, and that engine.
    let mut taken: Vec<Option<(DType, u32)>> = vec![None; model.params.len()];
    let mut ranks: Vec<InferRank> = Vec::with_capacity(engines.len());
    let mut pieces = Vec::new();
    for (e, decl) in engines.iter().enumerate() {
        let rank = e as u32;
        let (tensors, bytes) = engine_tensors(rank, *decl)?;
        let mut wanted = vec![false; model.params.len()];
        let check = RankCheck {
            model,
            holder: &holder,
            spec,
            rank,
            tensors: &tensors,
        };
        let index: FxHashMap<&str, u32> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.as_str(), i as u32))
            .collect();
        let scales: FxHashSet<u32> = tensors
            .iter()
            .filter(|t| t.dtype == DType::F8E4M3)
            .filter_map(|t| index.get(format!("{}_scale_inv", t.name).as_str()).copied())
            .collect();
        for (i, t) in tensors.iter().enumerate() {
            if scales.contains(&(i as u32)) {
                continue;
            }
            let Some(&pid) = by_name.get(t.name.as_str()) else {
                return Err(DeclaredError::NoTrainerHolds {
                    tensor: t.name.clone(),
                    engine_rank: rank,
                    dtype: t.dtype,
                    shape: t.shape.to_string(),
                }
                .into());
            };
            let scale = check.tensor(t, pid, &index)?;
            match taken[pid as usize] {
                Some((d, first)) if d != t.dtype => {
                    return Err(DeclaredError::EnginesDisagree {
                        tensor: t.name.clone(),
                        rank_a: first,
                        a: d,
                        rank_b: rank,
                        b: t.dtype,
                    }
                    .into());
                }
                Some(_) => {}
                None => taken[pid as usize] = Some((t.dtype, rank)),
            }
            wanted[pid as usize] = true;
            pieces.push(Piece {
                param: pid,
                src: TensorBox::full(model.params[pid as usize].shape),
                rank,
                tensor: i as u32,
                dst_start: [0; MAX_DIMS],
                scale,
            });
        }
        let skip: FxHashSet<&str> = decl.skip.iter().map(String::as_str).collect();
        if let Some((pid, p)) = model
            .params
            .iter()
            .enumerate()
            .find(|(pid, p)| !wanted[*pid] && p.shape.numel() > 0 && !skip.contains(&*p.name))
        {
            return Err(DeclaredError::NoEngineWants {
                tensor: p.name.to_string(),
                trainer_rank: holder[pid],
                engine_rank: rank,
                dtype: p.dtype,
                shape: p.shape.to_string(),
            }
            .into());
        }
        // Engines laid out alike share one list of tensors.
        let tensors: Arc<[DstTensor]> = match ranks.first() {
            Some(r0) if *r0.tensors == *tensors => Arc::clone(&r0.tensors),
            _ => tensors.into(),
        };
        ranks.push(InferRank {
            rank,
            engine: rank,
            local_rank: 0,
            tensors,
            mr_bytes: vec![bytes],
        });
    }
    Ok(InferenceLayout {
        ranks,
        pieces,
        fp8_recipe: spec.fp8,
    })
}

/// Checks one engine tensor against the trainers' parameter of its name.
struct RankCheck<'a> {
    model: &'a Model,
    holder: &'a [u32],
    spec: &'a InferSpec,
    rank: u32,
    tensors: &'a [DstTensor],
}

impl RankCheck<'_> {
    /// Checks tensor `t` against parameter `pid`: the same shape, a dtype the job allows, and
    /// for fp8 its scale tensor; returns where its scales go.
    fn tensor(
        &self,
        t: &DstTensor,
        pid: u32,
        index: &FxHashMap<&str, u32>,
    ) -> Result<Option<ScalePlace>, DeclaredError> {
        let p = &self.model.params[pid as usize];
        let trainer_rank = self.holder[pid as usize];
        if t.shape != p.shape {
            return Err(DeclaredError::ShapeMismatch {
                tensor: t.name.clone(),
                engine_rank: self.rank,
                engine_shape: t.shape.to_string(),
                trainer_rank,
                trainer_shape: p.shape.to_string(),
            });
        }
        let mismatch = |reason: String| DeclaredError::DTypeMismatch {
            tensor: t.name.clone(),
            engine_rank: self.rank,
            engine_dtype: t.dtype,
            trainer_rank,
            trainer_dtype: p.dtype,
            reason,
        };
        let fp8_job = self.spec.dtype == InferDType::Fp8;
        if t.dtype != DType::F8E4M3 {
            if t.dtype == p.dtype || t.dtype == DType::BF16 {
                return Ok(None);
            }
            return Err(mismatch(format!(
                "an engine tensor is the trainers' dtype or bf16 (the job's inference dtype{})",
                if fp8_job {
                    ", or fp8 with its _scale_inv"
                } else {
                    ""
                }
            )));
        }
        if !fp8_job {
            return Err(mismatch(
                "fp8 engine tensors are for a job with dtype fp8; this job is bf16".into(),
            ));
        }
        if p.shape.ndim < 2 {
            return Err(mismatch(format!(
                "fp8 block quantisation needs at least two dims; {} has one",
                t.name
            )));
        }
        let want = scale_shape(t.shape);
        let sname = format!("{}_scale_inv", t.name);
        let Some(&si) = index.get(sname.as_str()) else {
            return Err(mismatch(format!(
                "an fp8 tensor needs its scales: the engine declares no {sname} (f32 {want})"
            )));
        };
        let st = &self.tensors[si as usize];
        if st.dtype != DType::F32 || st.shape != want {
            return Err(mismatch(format!(
                "its scales {sname} are declared {} {}, but its 128x128 blocks need f32 {want}",
                st.dtype, st.shape
            )));
        }
        Ok(Some(ScalePlace {
            tensor: si,
            start: [0; MAX_DIMS],
        }))
    }
}
