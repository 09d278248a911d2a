//! The inference layout: every inference rank's tensors in the engine's own format, and which
//! box of which logical parameter lands where in them ([`Piece`]).
//!
//! # Layout strings ([`InferSpec`]): `tp=8,ep=32,dp=4[,dtype=bf16|fp8][,format=fused|hf][,embed=vocab][,fp8=vllm|transformers|deepgemm]`
//! An engine has `max(tp, ep)` ranks; `dp` engines each hold the whole model, so there are
//! `dp * max(tp, ep)` inference ranks, engine-major. With `ep > 1`, `ep` must be a multiple of
//! `tp`: attention and dense weights are tensor-parallel over `tp` (rank `r` of the engine has
//! tp rank `r % tp`) and replicated across the `ep / tp` groups (data-parallel attention);
//! routed experts are spread over the `ep` ranks (`E/ep` consecutive experts each, unsplit).
//! With `ep = 1` experts are tensor-parallel like dense MLPs (`I/tp` each). `format` names the
//! tensors a rank holds (below; `format=transformers` is `hf`); it is part of the string so a
//! job's `--infer` (and the control protocol's `WorldSpec.infer`) carries it, and it is printed
//! back only when it is not the default. `fp8` names the engine's fp8 block-quantisation recipe
//! ([`Fp8Recipe`]: whose arithmetic the block scales follow, so an engine holds bit for bit what
//! its own loader makes; default `vllm`), carried the same way.
//!
//! # `format=fused` (default): the serving engines' layout (vLLM / SGLang names)
//! - `model.embed_tokens.weight`, `lm_head.weight`: vocab-parallel, rank `t` holds rows
//!   `[t*c, min(V,(t+1)*c))` with `c = ceil(V/tp)` (no padding rows).
//! - dense attention: `self_attn.qkv_proj.weight` = rows of q (heads `t*nh/tp..`), then k,
//!   then v; with `tp > kv_heads` (GQA/MQA) each rank takes kv head `t / (tp/kv_heads)`,
//!   replicated. Qwen2 biases fuse the same way into `qkv_proj.bias`; Qwen3 `q_norm`/`k_norm`
//!   are replicated; `o_proj.weight` is row-parallel (`[H, nh/tp*D]`).
//! - MLA: `q_a_proj`, `q_a_layernorm`, `kv_a_proj_with_mqa`, `kv_a_layernorm` replicated;
//!   `q_b_proj` (or `q_proj`) and `kv_b_proj` split by heads; `o_proj` row-parallel.
//! - dense MLP and shared experts: `gate_up_proj.weight` `[2I/tp, H]` (gate rows then up rows),
//!   `down_proj.weight` `[H, I/tp]`.
//! - MoE: `mlp.gate.weight` (router) and `mlp.gate.e_score_correction_bias` replicated;
//!   `mlp.experts.w13_weight` `[E_local, 2I_local, H]` (per expert: gate rows then up rows) and
//!   `mlp.experts.w2_weight` `[E_local, H, I_local]`.
//! - norms replicated.
//!
//! # `format=hf`: the Hugging Face layout, as a `transformers` model holds it in memory
//! The names, shapes and dtypes of `named_parameters()` of a transformers 5.x model of the
//! family (checked against transformers 5.19 by `tests/hf_format.rs`), each rank holding its
//! slice as transformers' own tensor-parallel plan (`base_model_tp_plan`) cuts it:
//! - `model.embed_tokens.weight` whole on every rank (transformers does not split it; with
//!   `embed=vocab` split by vocab rows as `lm_head` is, for engines that split it themselves);
//!   `lm_head.weight` rows `[t*c, min(V,(t+1)*c))`, `c = ceil(V/tp)` (torch.chunk; a rank
//!   whose chunk is empty holds no lm_head); no lm_head when the embeddings are tied.
//! - dense attention unfused: `self_attn.q_proj.weight` `[nh/tp*D, H]`, `k_proj.weight` and
//!   `v_proj.weight` `[kv/tp*D, H]` (with `tp > kv_heads`: kv head `t / (tp/kv_heads)`, whole,
//!   as in the fused format; transformers itself needs `tp <= kv_heads`), Qwen2 biases
//!   `{q,k,v}_proj.bias` alike, `q_norm`/`k_norm` replicated, `o_proj.weight` `[H, nh/tp*D]`.
//! - MLA as in the fused format (the same names).
//! - dense MLP and shared experts unfused: `gate_proj.weight`, `up_proj.weight` `[I/tp, H]`,
//!   `down_proj.weight` `[H, I/tp]`.
//! - MoE: router `mlp.gate.weight` (and `mlp.gate.e_score_correction_bias`) replicated; the
//!   routed experts stacked, no `.weight` suffix: `mlp.experts.gate_up_proj`
//!   `[E_local, 2I_local, H]` (per expert its gate rows, then its up rows: with `ep = 1` and
//!   `tp > 1` the rank's tp share of each, as transformers' `packed_colwise` gives) and
//!   `mlp.experts.down_proj` `[E_local, H, I_local]`; with `ep > 1` a rank holds `E/ep`
//!   consecutive experts whole (transformers' `grouped_gemm` expert sharding).
//! - norms replicated.
//!
//! # fp8 (`dtype=fp8`; DeepSeek-V3 / transformers `FineGrainedFP8Config` convention)
//! Every linear projection inside decoder layers (q/k/v/o, q_a/q_b/kv_a/kv_b, MLP, shared and
//! routed experts) is float8 e4m3 with a `<name>_scale_inv` f32 tensor (for `x.weight`:
//! `x.weight_scale_inv`; for `mlp.experts.gate_up_proj`: `mlp.experts.gate_up_proj_scale_inv`),
//! one scale per 128x128 block: `[ceil(rows/128), ceil(cols/128)]`, `[E, ...]` leading for
//! experts. Embedding, lm_head, norms, router and biases stay in the model dtype (what
//! transformers' `replace_with_fp8_linear(modules_to_not_convert=["lm_head"])` leaves).
//! - fused: blocks of the *logical* (training) tensor; a fused tensor's scales are its parts'
//!   scales concatenated in the same order (per part `ceil(rows/128)` rows), as engines build
//!   them from checkpoints. So w13 from `experts=stacked-gate-up` needs `I % 128 == 0`.
//! - hf: blocks of the destination tensor itself, as transformers holds it: the stacked
//!   `gate_up_proj` is ONE `[2I_local, H]` block grid per expert, whose blocks mix gate and up
//!   rows when `I_local % 128 != 0`. From `experts=stacked-gate-up` (whole experts) that is
//!   the training tensor's own grid, for any `I`; from separate gate and up tensors it needs
//!   `I_local % 128 == 0`. transformers allocates `gate_up_proj_scale_inv` with at least two
//!   block rows, one more than the grid when `2I_local <= 128`: that case is refused (the row
//!   would never be written).
//!
//! Every quantised part must start on a block boundary and end on one or at the tensor's end
//! (else [`PlanError::Fp8Misaligned`] names it); an hf or format-specific refusal is a
//! [`PlanError::BadSpec`] naming the destination tensor and the format.
//!
//! # Files
//! `mod.rs` the types, the spec and [`InferenceLayout::build`]; `check` the degree checks run
//! first; `rank` one rank's builder (tensors from parts, refusals); `rank_tensors` the walk over
//! a whole rank; `layer` a decoder layer's tensors in either format; `param_box` where a rank's
//! tensor sits in the parameter it is cut from ([`InferenceLayout::param_boxes`]); `period`
//! whether the engines repeat the first one
//! ([`InferenceLayout::engine_period`]).
//!
//! # Arena
//! Each rank's tensors are placed in MR 0 in the order listed, each at the next 256-byte aligned
//! offset.

mod check;
mod layer;
mod param_box;
mod period;
mod rank;
mod rank_tensors;
#[cfg(test)]
mod tests;

use rayon::prelude::*;
use rustc_hash::FxHashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
pub use weightsync_common::Fp8Recipe;

use crate::error::PlanError;
use crate::layout_train::{parse_degree, parse_kv};
use crate::model::{Model, Role};
use crate::table::{DstTensor, MAX_DIMS, TensorBox};
use check::check_divisible;
pub use param_box::ParamBox;
pub use period::EnginePeriod;
use rank::RankBuilder;

/// Where the fp8 scales of a piece go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ScalePlace {
    /// Index of the scale tensor in the rank's tensors.
    pub tensor: u32,
    /// Scale-tensor coordinates of the piece's first block.
    pub start: [u32; MAX_DIMS],
}

/// One box of one logical parameter placed into one destination tensor.
///
/// The box's dims map onto the destination's *trailing* dims: destination coordinate
/// `dst_start[lead + i] + (x[i] - src.start[i])` for parameter dim `i`, with the
/// `lead = dst.ndim - param.ndim` leading destination coordinates fixed at `dst_start[..lead]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Piece {
    /// Parameter index in the model.
    pub param: u32,
    /// Box of the parameter, global coordinates.
    pub src: TensorBox,
    /// Global inference rank.
    pub rank: u32,
    /// Index of the destination tensor in the rank's tensors.
    pub tensor: u32,
    /// Destination coordinates of the box's origin.
    pub dst_start: [u32; MAX_DIMS],
    /// For quantised tensors: where the box's scales go.
    pub scale: Option<ScalePlace>,
}

/// One inference rank's tensors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InferRank {
    /// Global inference rank.
    pub rank: u32,
    /// Engine index.
    pub engine: u32,
    /// Rank within the engine.
    pub local_rank: u32,
    /// Tensors, in arena order. Shared by the ranks of every engine that hold the same ones
    /// (every engine is laid out alike): at 64 engines, one copy instead of 64.
    pub tensors: Arc<[DstTensor]>,
    /// Bytes per MR.
    pub mr_bytes: Vec<u64>,
}

/// Every inference rank's tensors and the pieces that fill them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InferenceLayout {
    /// Ranks, indexed by global rank.
    pub ranks: Vec<InferRank>,
    /// All pieces, in rank then tensor order.
    pub pieces: Vec<Piece>,
    /// Whose arithmetic the fp8 pieces' block quantisation follows (the spec's `fp8=`).
    pub fp8_recipe: Fp8Recipe,
}

/// Destination weight format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum InferDType {
    /// Model dtype (bf16) everywhere.
    Bf16,
    /// fp8 e4m3 with 128x128 block scales for linear projections.
    Fp8,
}

impl std::str::FromStr for InferDType {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(InferDType::Bf16),
            "fp8" | "f8" | "e4m3" | "f8_e4m3" => Ok(InferDType::Fp8),
            other => Err(PlanError::BadSpec {
                spec: s.to_string(),
                reason: format!("dtype {other:?}: expected bf16 or fp8"),
            }),
        }
    }
}

/// Which tensors an inference rank holds (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum InferFormat {
    /// The serving engines' fused layout: `qkv_proj`, `gate_up_proj`, `experts.w13_weight`.
    #[default]
    Fused,
    /// The Hugging Face layout as a `transformers` model holds it: unfused q/k/v and gate/up,
    /// experts stacked as `mlp.experts.gate_up_proj` / `down_proj`.
    Hf,
}

impl InferFormat {
    /// The format's name in a layout string (`format=...`).
    pub fn name(self) -> &'static str {
        match self {
            InferFormat::Fused => "fused",
            InferFormat::Hf => "hf",
        }
    }
}

impl std::str::FromStr for InferFormat {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        match s.to_ascii_lowercase().as_str() {
            "fused" => Ok(InferFormat::Fused),
            "hf" | "transformers" => Ok(InferFormat::Hf),
            other => Err(PlanError::BadSpec {
                spec: s.to_string(),
                reason: format!(
                    "format {other:?}: expected fused (the engines' qkv_proj / gate_up_proj / \
                     w13_weight) or hf (transformers' own parameters)"
                ),
            }),
        }
    }
}

/// How the embedding lies over an engine's tensor-parallel ranks (`embed=...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum EmbedLayout {
    /// The format's own: vocab-parallel in `fused`, whole on every rank in `hf` (transformers'
    /// tensor-parallel plan does not split it).
    #[default]
    FormatDefault,
    /// Vocab-parallel in `hf` too (`embed=vocab`): rank `t` holds rows `[t*c, min(V,(t+1)*c))`,
    /// `c = ceil(V/tp)`, as for `lm_head`. For engines that take transformers' tensors but split
    /// the embedding themselves (vLLM's loader narrows it to its rank's rows): each rank then
    /// receives `1/tp` of it instead of all of it, every sync.
    Vocab,
}

/// A structured inference layout (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct InferSpec {
    /// Tensor parallelism of attention and dense weights.
    pub tp: u32,
    /// Expert parallelism.
    pub ep: u32,
    /// Engines.
    pub dp: u32,
    /// Destination format.
    pub dtype: InferDType,
    /// Tensor names and fusion.
    pub format: InferFormat,
    /// The embedding's split (`hf` only; `fused` always splits it by vocab).
    #[serde(default)]
    pub embed: EmbedLayout,
    /// Whose arithmetic fp8 block quantisation follows (`fp8=...`; only with `dtype=fp8`).
    #[serde(default)]
    pub fp8: Fp8Recipe,
}

impl Default for InferSpec {
    fn default() -> Self {
        InferSpec {
            tp: 1,
            ep: 1,
            dp: 1,
            dtype: InferDType::Bf16,
            format: InferFormat::Fused,
            embed: EmbedLayout::FormatDefault,
            fp8: Fp8Recipe::Vllm,
        }
    }
}

impl InferSpec {
    /// Refuses an fp8 recipe (`fp8=transformers`) on a bf16 layout. Checked once the dtype is
    /// settled (a job's `--dtype` is applied after the spec string is parsed), not at parse.
    pub fn check_fp8_recipe(&self) -> Result<(), PlanError> {
        if self.fp8 != Fp8Recipe::Vllm && self.dtype != InferDType::Fp8 {
            return Err(PlanError::BadSpec {
                spec: self.to_string(),
                reason: format!(
                    "fp8={} names an fp8 recipe, but the dtype is bf16",
                    self.fp8
                ),
            });
        }
        Ok(())
    }
}

impl std::str::FromStr for InferSpec {
    type Err = PlanError;
    fn from_str(spec: &str) -> Result<InferSpec, PlanError> {
        let mut s = InferSpec::default();
        for (k, v) in parse_kv(spec)? {
            match k.as_str() {
                "tp" => s.tp = parse_degree(spec, &k, &v)?,
                "ep" => s.ep = parse_degree(spec, &k, &v)?,
                "dp" => s.dp = parse_degree(spec, &k, &v)?,
                "dtype" => s.dtype = v.parse()?,
                "format" => {
                    s.format = v.parse().map_err(|e| match e {
                        PlanError::BadSpec { reason, .. } => PlanError::BadSpec {
                            spec: spec.to_string(),
                            reason,
                        },
                        other => other,
                    })?
                }
                "embed" => {
                    s.embed = match v.to_ascii_lowercase().as_str() {
                        "vocab" => EmbedLayout::Vocab,
                        "default" => EmbedLayout::FormatDefault,
                        other => {
                            return Err(PlanError::BadSpec {
                                spec: spec.to_string(),
                                reason: format!(
                                    "embed {other:?}: expected vocab (each tp rank holds only \
                                     its vocabulary rows, for engines such as vLLM that split \
                                     the embedding themselves) or default (the format's own)"
                                ),
                            });
                        }
                    }
                }
                "fp8" => {
                    s.fp8 = v
                        .to_ascii_lowercase()
                        .parse()
                        .map_err(|reason| PlanError::BadSpec {
                            spec: spec.to_string(),
                            reason,
                        })?
                }
                _ => {
                    return Err(PlanError::BadSpec {
                        spec: spec.to_string(),
                        reason: format!(
                            "unknown key {k:?} (known: tp, ep, dp, dtype, format, embed, fp8)"
                        ),
                    });
                }
            }
        }
        if s.format == InferFormat::Fused {
            // The fused format splits the embedding by vocab already: one spelling per layout,
            // so that workers stating the same job agree.
            s.embed = EmbedLayout::FormatDefault;
        }
        if s.ep > 1 && s.ep % s.tp != 0 {
            return Err(PlanError::BadSpec {
                spec: spec.to_string(),
                reason: format!("ep={} must be 1 or a multiple of tp={}", s.ep, s.tp),
            });
        }
        let ranks = u64::from(s.engine_ranks()) * u64::from(s.dp);
        if ranks > u64::from(crate::layout_train::MAX_RANKS) {
            return Err(PlanError::BadSpec {
                spec: spec.to_string(),
                reason: format!(
                    "max(tp, ep) * dp = {ranks} inference ranks, more than the {} a job may have",
                    crate::layout_train::MAX_RANKS
                ),
            });
        }
        Ok(s)
    }
}

impl std::fmt::Display for InferSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tp={},ep={},dp={},dtype={}",
            self.tp,
            self.ep,
            self.dp,
            match self.dtype {
                InferDType::Bf16 => "bf16",
                InferDType::Fp8 => "fp8",
            }
        )?;
        if self.format != InferFormat::Fused {
            write!(f, ",format={}", self.format.name())?;
        }
        if self.embed == EmbedLayout::Vocab {
            write!(f, ",embed=vocab")?;
        }
        if self.fp8 != Fp8Recipe::Vllm {
            write!(f, ",fp8={}", self.fp8)?;
        }
        Ok(())
    }
}

impl InferSpec {
    /// Ranks per engine.
    pub fn engine_ranks(&self) -> u32 {
        self.tp.max(self.ep)
    }
}

/// Most destination pieces (a tensor's box on one inference rank) one layout may hold: 5.4 times
/// Kimi-K2 on 2,048 inference ranks (6.2 M pieces, the 10,240-GPU job), about 2.4 GB of pieces
/// and several times that while planning; past it a plan would exhaust a controller's memory
/// rather than fail with a reason.
pub const MAX_PIECES: u64 = 1 << 25;

/// One rank of engine 0 as its builder left it: every engine's rank of the same local rank
/// holds the same tensors and pieces (only the global rank differs).
struct EngineRank {
    tensors: Arc<[DstTensor]>,
    pieces: Vec<Piece>,
    bytes: u64,
}

impl InferenceLayout {
    /// Builds the layout an [`InferSpec`] describes (see the module docs).
    pub fn build(model: &Model, spec: &InferSpec) -> Result<InferenceLayout, PlanError> {
        if model.is_declared() {
            return Err(crate::declared_error::DeclaredError::LayoutFromSpec {
                side: "inference layout",
                model: model.name.clone(),
            }
            .into());
        }
        spec.check_fp8_recipe()?;
        check_divisible(model, spec)?;
        // FxHash: looked up once per tensor part (SipHash here was 2 % of planning Kimi-K2).
        let index: FxHashMap<Role, u32> = model
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.role, i as u32))
            .collect();
        let n = spec.engine_ranks();
        // Engine 0's ranks are built on their own, in parallel; the first error in rank order
        // is the one reported, as when they were built one after another.
        let built: Vec<Result<EngineRank, PlanError>> = (0..n)
            .into_par_iter()
            .map(|r| {
                let mut b = RankBuilder {
                    model,
                    index: &index,
                    rank: r,
                    tp: spec.tp,
                    ep: spec.ep,
                    fp8: spec.dtype == InferDType::Fp8,
                    spec: *spec,
                    tensors: Vec::new(),
                    pieces: Vec::new(),
                    next: 0,
                };
                b.build_rank()?;
                Ok(EngineRank {
                    tensors: b.tensors.into(),
                    pieces: b.pieces,
                    bytes: b.next,
                })
            })
            .collect();
        let engine0 = built.into_iter().collect::<Result<Vec<_>, _>>()?;
        let per_engine: u64 = engine0.iter().map(|r| r.pieces.len() as u64).sum();
        if per_engine * u64::from(spec.dp) > MAX_PIECES {
            return Err(PlanError::TooLarge(format!(
                "the inference layout {spec} of {} would hold {per_engine} pieces per engine \
                 times dp={} engines, more than the {MAX_PIECES} one plan may hold",
                model.name, spec.dp
            )));
        }
        let mut ranks = Vec::with_capacity((n * spec.dp) as usize);
        for e in 0..spec.dp {
            for (r, er) in engine0.iter().enumerate() {
                ranks.push(InferRank {
                    rank: e * n + r as u32,
                    engine: e,
                    local_rank: r as u32,
                    tensors: Arc::clone(&er.tensors),
                    mr_bytes: vec![er.bytes],
                });
            }
        }
        // Every engine's pieces are engine 0's with the rank moved by `e * n`; they are written
        // straight into one list of the final size, engines in parallel (at 64 engines the
        // pieces are 445 MB, written once, not grown and copied).
        let first: Vec<Piece> = engine0.into_iter().flat_map(|r| r.pieces).collect();
        if spec.dp == 1 {
            return Ok(InferenceLayout {
                ranks,
                pieces: first,
                fp8_recipe: spec.fp8,
            });
        }
        let per = first.len();
        let mut pieces = Vec::with_capacity(per * spec.dp as usize);
        (0..per * spec.dp as usize)
            .into_par_iter()
            .map(|i| {
                let p = &first[i % per];
                Piece {
                    rank: (i / per) as u32 * n + p.rank,
                    ..*p
                }
            })
            .collect_into_vec(&mut pieces);
        Ok(InferenceLayout {
            ranks,
            pieces,
            fp8_recipe: spec.fp8,
        })
    }
}
