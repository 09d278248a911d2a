//! The inference side of a declared model: each engine's tensors from its own declarations
//! ([`engine_tensors`], what an engine computes to register before the controller plans), and
//! the pieces that fill them from the trainers' parameters ([`inference_layout`], where every
//! disagreement between the two sides is refused by name).

use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Arc;
use weightsync_common::DType;
use weightsync_common::protocol::TensorMeta;

#[cfg(doc)]
use weightsync_common::protocol::TensorSource;

use super::concat::{Names, Placed, check_fill, place};
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
/// MR 0. Returns the tensors and the MR's size. Each tensor's [`TensorSource`] is checked as
/// far as the engine's side alone can be (its parts fill it exactly along its dim: see
/// `concat::check_fill`), so an engine learns of a malformed source before it registers.
pub fn engine_tensors(
    rank: u32,
    decl: EngineDeclaration<'_>,
) -> Result<(Vec<DstTensor>, u64), DeclaredError> {
    let (tensors, from, bytes) = lay_out(rank, decl)?;
    for (t, &i) in tensors.iter().zip(&from) {
        if let Some(source) = &decl.tensors[i as usize].source {
            check_fill(&t.name, rank, t.shape, source)?;
        }
    }
    Ok((tensors, bytes))
}

/// [`engine_tensors`], with the index of each tensor's declaration.
fn lay_out(
    rank: u32,
    decl: EngineDeclaration<'_>,
) -> Result<(Vec<DstTensor>, Vec<u32>, u64), DeclaredError> {
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
    let mut from = Vec::new();
    let mut next = 0u64;
    for (i, m) in decl.tensors.iter().enumerate() {
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
        from.push(i as u32);
        next = align_up(next + len);
    }
    Ok((out, from, next))
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

/// Refuses engines of whole tensors only (none declares a [`TensorSource`]) in a job whose
/// layout is not `tp=1`, `ep=1`, `format=hf` ([`check_spec`]): their tensors could not be the
/// ranks' slices or fused tensors the layout string says they are.
pub fn check_engines(
    spec: &InferSpec,
    engines: &[EngineDeclaration<'_>],
) -> Result<(), DeclaredError> {
    if engines
        .iter()
        .any(|e| e.tensors.iter().any(|t| t.source.is_some()))
    {
        return Ok(());
    }
    check_spec(spec)
}

/// One rank of an engine as built from its declarations: what another engine's rank of the
/// same local rank, declaring the same, shares (at 64 engines, one build instead of 64).
struct BuiltRank<'a> {
    decl: EngineDeclaration<'a>,
    tensors: Arc<[DstTensor]>,
    bytes: u64,
    /// Its pieces, with the rank it was built for.
    pieces: Vec<Piece>,
    /// The parameters it takes any of.
    wanted: Vec<u32>,
}

/// Whether two ranks declared the same (the same slices, or equal ones).
fn same_declaration(a: &EngineDeclaration<'_>, b: &EngineDeclaration<'_>) -> bool {
    (std::ptr::eq(a.tensors, b.tensors) || a.tensors == b.tensors) && a.skip == b.skip
}

/// The inference layout of a declared model: inference rank `i` (engine `i / n`, local rank
/// `i % n`, `n = max(tp, ep)`) holds what it declared (`engines[i]`), each tensor filled from
/// the trainers' parameters: the one of its name, whole, or the parts its source names (see
/// [`TensorSource`]). Every trainer tensor must be taken by some rank of every engine, or
/// skipped. Every disagreement is refused by name (see [`DeclaredError`]).
pub fn inference_layout(
    model: &Model,
    train: &TrainingLayout,
    spec: &InferSpec,
    engines: &[EngineDeclaration<'_>],
) -> Result<InferenceLayout, PlanError> {
    check_engines(spec, engines)?;
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
    let names = Names {
        model,
        by_name: &by_name,
        holder: &holder,
    };
    let n = spec.engine_ranks().max(1);
    // Per parameter, the dtype the first engine taking it takes it in, and that engine.
    let mut taken: Vec<Option<(DType, u32)>> = vec![None; model.params.len()];
    let mut built: Vec<Option<BuiltRank>> = (0..n).map(|_| None).collect();
    let mut ranks: Vec<InferRank> = Vec::with_capacity(engines.len());
    let mut pieces: Vec<Piece> = Vec::new();
    let mut wanted = vec![false; model.params.len()];
    let mut skipped: FxHashSet<&str> = FxHashSet::default();
    for (i, decl) in engines.iter().enumerate() {
        let rank = i as u32;
        let local = rank % n;
        if local == 0 {
            wanted.iter_mut().for_each(|w| *w = false);
            skipped.clear();
        }
        skipped.extend(decl.skip.iter().map(String::as_str));
        let slot = &mut built[local as usize];
        let reuse = slot
            .as_ref()
            .is_some_and(|b| same_declaration(&b.decl, decl));
        if !reuse {
            let b = build_rank(&names, spec, rank, *decl, &mut taken)?;
            *slot = Some(b);
        }
        let b = slot.as_ref().expect("built above");
        for &pid in &b.wanted {
            wanted[pid as usize] = true;
        }
        let first = pieces.len();
        pieces.extend_from_slice(&b.pieces);
        if reuse {
            for p in &mut pieces[first..] {
                p.rank = rank;
            }
        }
        if pieces.len() as u64 > crate::layout_infer::MAX_PIECES {
            return Err(PlanError::TooLarge(format!(
                "the engines' declarations make more than the {} pieces one plan may hold",
                crate::layout_infer::MAX_PIECES
            )));
        }
        ranks.push(InferRank {
            rank,
            engine: rank / n,
            local_rank: local,
            tensors: Arc::clone(&b.tensors),
            mr_bytes: vec![b.bytes],
        });
        if local + 1 == n || i + 1 == engines.len() {
            check_wanted(
                model,
                &holder,
                &wanted,
                &skipped,
                rank / n,
                rank + 1 - (local + 1),
                rank,
                n,
            )?;
        }
    }
    Ok(InferenceLayout {
        ranks,
        pieces,
        fp8_recipe: spec.fp8,
    })
}

/// Refuses a trainer tensor no rank `first..=last` of engine `engine` takes any of or skips.
#[allow(clippy::too_many_arguments)]
fn check_wanted(
    model: &Model,
    holder: &[u32],
    wanted: &[bool],
    skipped: &FxHashSet<&str>,
    engine: u32,
    first: u32,
    last: u32,
    n: u32,
) -> Result<(), DeclaredError> {
    let Some((pid, p)) = model
        .params
        .iter()
        .enumerate()
        .find(|(pid, p)| !wanted[*pid] && p.shape.numel() > 0 && !skipped.contains(&*p.name))
    else {
        return Ok(());
    };
    Err(if n == 1 {
        DeclaredError::NoEngineWants {
            tensor: p.name.to_string(),
            trainer_rank: holder[pid],
            engine_rank: first,
            dtype: p.dtype,
            shape: p.shape.to_string(),
        }
    } else {
        DeclaredError::NoEngineRankWants {
            tensor: p.name.to_string(),
            trainer_rank: holder[pid],
            engine,
            first_rank: first,
            last_rank: last,
            dtype: p.dtype,
            shape: p.shape.to_string(),
        }
    })
}

/// Builds inference rank `rank` from its declarations: its tensors, and the pieces filling
/// them, each checked against the trainers' parameters (dtypes recorded in `taken`).
fn build_rank<'a>(
    names: &Names<'_>,
    spec: &InferSpec,
    rank: u32,
    decl: EngineDeclaration<'a>,
    taken: &mut [Option<(DType, u32)>],
) -> Result<BuiltRank<'a>, PlanError> {
    let model = names.model;
    let (tensors, from, bytes) = lay_out(rank, decl)?;
    let check = RankCheck {
        model,
        holder: names.holder,
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
    let mut pieces = Vec::new();
    let mut wanted = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        if scales.contains(&(i as u32)) {
            continue;
        }
        let placed = match &decl.tensors[from[i] as usize].source {
            Some(source) => place(names, rank, t, source)?,
            None => {
                let Some(&pid) = names.by_name.get(t.name.as_str()) else {
                    return Err(DeclaredError::NoTrainerHolds {
                        tensor: t.name.clone(),
                        engine_rank: rank,
                        dtype: t.dtype,
                        shape: t.shape.to_string(),
                    }
                    .into());
                };
                check.whole_shape(t, pid)?;
                vec![Placed {
                    param: pid,
                    src: TensorBox::full(model.params[pid as usize].shape),
                    dst_start: [0; MAX_DIMS],
                }]
            }
        };
        let scale_tensor = check.dtype_and_scales(t, &placed, &index)?;
        for p in placed {
            let pid = p.param;
            match taken[pid as usize] {
                Some((d, first)) if d != t.dtype => {
                    return Err(DeclaredError::EnginesDisagree {
                        tensor: model.params[pid as usize].name.to_string(),
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
            wanted.push(pid);
            let nd = t.shape.ndim as usize;
            pieces.push(Piece {
                param: pid,
                src: p.src,
                rank,
                tensor: i as u32,
                dst_start: p.dst_start,
                scale: scale_tensor.map(|st| {
                    // One scale per 128x128 block of the tensor's own grid (every part starts on
                    // it: checked), the leading dims as they are.
                    let mut start = p.dst_start;
                    for x in &mut start[nd - 2..nd] {
                        *x /= FP8_BLOCK;
                    }
                    ScalePlace { tensor: st, start }
                }),
            });
        }
    }
    wanted.sort_unstable();
    wanted.dedup();
    Ok(BuiltRank {
        decl,
        tensors: tensors.into(),
        bytes,
        pieces,
        wanted,
    })
}

/// Checks one engine tensor against the trainers' parameters it is made of.
struct RankCheck<'a> {
    model: &'a Model,
    holder: &'a [u32],
    spec: &'a InferSpec,
    rank: u32,
    tensors: &'a [DstTensor],
}

impl RankCheck<'_> {
    /// A tensor that declares no source is parameter `pid` whole: the same shape.
    fn whole_shape(&self, t: &DstTensor, pid: u32) -> Result<(), DeclaredError> {
        let p = &self.model.params[pid as usize];
        if t.shape != p.shape {
            return Err(DeclaredError::ShapeMismatch {
                tensor: t.name.clone(),
                engine_rank: self.rank,
                engine_shape: t.shape.to_string(),
                trainer_rank: self.holder[pid as usize],
                trainer_shape: p.shape.to_string(),
            });
        }
        Ok(())
    }

    /// Checks tensor `t`'s dtype against every part's parameter (the trainers' dtype or bf16,
    /// or fp8 with its scale tensor, every part on the 128x128 block grids of both sides);
    /// returns the scale tensor's index for fp8.
    fn dtype_and_scales(
        &self,
        t: &DstTensor,
        placed: &[Placed],
        index: &FxHashMap<&str, u32>,
    ) -> Result<Option<u32>, DeclaredError> {
        let fp8_job = self.spec.dtype == InferDType::Fp8;
        for part in placed {
            let p = &self.model.params[part.param as usize];
            let mismatch = |reason: String| DeclaredError::DTypeMismatch {
                tensor: t.name.clone(),
                engine_rank: self.rank,
                engine_dtype: t.dtype,
                trainer_rank: self.holder[part.param as usize],
                trainer_dtype: p.dtype,
                reason,
            };
            if t.dtype != DType::F8E4M3 {
                if t.dtype == p.dtype || t.dtype == DType::BF16 {
                    continue;
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
            if t.shape.ndim < 2 || p.shape.ndim < 2 {
                return Err(mismatch(format!(
                    "fp8 block quantisation needs at least two dims; {} has one",
                    if t.shape.ndim < 2 { &t.name } else { &*p.name }
                )));
            }
            let (pn, tn) = (p.shape.ndim as usize, t.shape.ndim as usize);
            for (pd, td) in [(pn - 2, tn - 2), (pn - 1, tn - 1)] {
                let (s, e) = (part.src.start[pd], part.src.end(pd));
                let on_grid = s % FP8_BLOCK == 0
                    && (e % FP8_BLOCK == 0 || e == p.shape.dims[pd])
                    && part.dst_start[td] % FP8_BLOCK == 0;
                if !on_grid {
                    return Err(mismatch(format!(
                        "its part {} {} lands at {:?}: an fp8 part starts on a {FP8_BLOCK}x\
                         {FP8_BLOCK} block boundary of both tensors (and ends on one or at the \
                         trainers' tensor's end), so each block is one part's",
                        p.name,
                        part.src,
                        &part.dst_start[..tn]
                    )));
                }
            }
        }
        if t.dtype != DType::F8E4M3 {
            return Ok(None);
        }
        let want = scale_shape(t.shape);
        let sname = format!("{}_scale_inv", t.name);
        let p = &self.model.params[placed[0].param as usize];
        let mismatch = |reason: String| DeclaredError::DTypeMismatch {
            tensor: t.name.clone(),
            engine_rank: self.rank,
            engine_dtype: t.dtype,
            trainer_rank: self.holder[placed[0].param as usize],
            trainer_dtype: p.dtype,
            reason,
        };
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
        Ok(Some(si))
    }
}
