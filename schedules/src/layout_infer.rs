//! The inference layout: every inference rank's tensors in the engine's own format, and which
//! box of which logical parameter lands where in them ([`Piece`]).
//!
//! # Layout strings ([`InferSpec`]): `tp=8,ep=32,dp=4[,dtype=bf16|fp8][,format=fused|hf]`
//! An engine has `max(tp, ep)` ranks; `dp` engines each hold the whole model, so there are
//! `dp * max(tp, ep)` inference ranks, engine-major. With `ep > 1`, `ep` must be a multiple of
//! `tp`: attention and dense weights are tensor-parallel over `tp` (rank `r` of the engine has
//! tp rank `r % tp`) and replicated across the `ep / tp` groups (data-parallel attention);
//! routed experts are spread over the `ep` ranks (`E/ep` consecutive experts each, unsplit).
//! With `ep = 1` experts are tensor-parallel like dense MLPs (`I/tp` each). `format` names the
//! tensors a rank holds (below; `format=transformers` is `hf`); it is part of the string so a
//! job's `--infer` (and the control protocol's `WorldSpec.infer`) carries it, and it is printed
//! back only when it is not the default.
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
//! - `model.embed_tokens.weight` whole on every rank (transformers does not split it);
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
//! # Arena
//! Each rank's tensors are placed in MR 0 in the order listed, each at the next 256-byte aligned
//! offset.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use weightsync_common::DType;

use crate::error::PlanError;
use crate::layout_train::{align_up, parse_degree, parse_kv};
use crate::model::{ExpertForm, LayerKind, MlaConfig, Model, MoeConfig, Proj, Role};
use crate::table::{DstTensor, Shape, TensorBox, FP8_BLOCK, MAX_DIMS};

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
    /// Tensors, in arena order.
    pub tensors: Vec<DstTensor>,
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
}

impl Default for InferSpec {
    fn default() -> Self {
        InferSpec {
            tp: 1,
            ep: 1,
            dp: 1,
            dtype: InferDType::Bf16,
            format: InferFormat::Fused,
        }
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
                _ => {
                    return Err(PlanError::BadSpec {
                        spec: spec.to_string(),
                        reason: format!("unknown key {k:?} (known: tp, ep, dp, dtype, format)"),
                    })
                }
            }
        }
        if s.ep > 1 && s.ep % s.tp != 0 {
            return Err(PlanError::BadSpec {
                spec: spec.to_string(),
                reason: format!("ep={} must be 1 or a multiple of tp={}", s.ep, s.tp),
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
        Ok(())
    }
}

impl InferSpec {
    /// Ranks per engine.
    pub fn engine_ranks(&self) -> u32 {
        self.tp.max(self.ep)
    }
}

/// One part of a destination tensor being built.
struct Part {
    param: u32,
    src: TensorBox,
    dst_start: [u32; MAX_DIMS],
}

fn part(param: u32, src: TensorBox, dst_start: &[u32]) -> Part {
    let mut d = [0; MAX_DIMS];
    d[..dst_start.len()].copy_from_slice(dst_start);
    Part {
        param,
        src,
        dst_start: d,
    }
}

/// Builds one rank's tensors and pieces.
struct RankBuilder<'m> {
    model: &'m Model,
    /// Parameter index by role.
    index: &'m HashMap<Role, u32>,
    /// Rank within the engine.
    rank: u32,
    tp: u32,
    ep: u32,
    fp8: bool,
    /// The spec being built (format, and for errors).
    spec: InferSpec,
    tensors: Vec<DstTensor>,
    pieces: Vec<Piece>,
    next: u64,
}

impl RankBuilder<'_> {
    fn push_tensor(&mut self, name: String, shape: Shape, dtype: DType) -> u32 {
        let len = shape.numel() * dtype.size() as u64;
        self.tensors.push(DstTensor {
            name,
            shape,
            dtype,
            mr: 0,
            offset: self.next,
            len,
        });
        self.next = align_up(self.next + len);
        (self.tensors.len() - 1) as u32
    }

    /// Adds a tensor made of `parts`; `quantise` asks for fp8 (honoured only in fp8 layouts).
    fn add(
        &mut self,
        name: String,
        shape: &[u32],
        quantise: bool,
        parts: Vec<Part>,
    ) -> Result<(), PlanError> {
        let shape = Shape::new(shape);
        let pdtype = self.model.params[parts[0].param as usize].dtype;
        let quant = quantise && self.fp8 && shape.ndim >= 2;
        if !quant {
            let t = self.push_tensor(name, shape, pdtype);
            for p in parts {
                self.pieces.push(Piece {
                    param: p.param,
                    src: p.src,
                    rank: self.rank,
                    tensor: t,
                    dst_start: p.dst_start,
                    scale: None,
                });
            }
            return Ok(());
        }
        let nd = shape.ndim as usize;
        let (rd, cd) = (nd - 2, nd - 1);
        if self.hf() {
            // transformers' scales are the tensor's own block grid: a part placed off it would
            // share a block with its neighbour.
            if let Some(p) = parts.iter().find(|p| {
                !p.dst_start[rd].is_multiple_of(FP8_BLOCK)
                    || !p.dst_start[cd].is_multiple_of(FP8_BLOCK)
            }) {
                let param = &self.model.params[p.param as usize];
                return Err(self.refuse(
                    &name,
                    format!(
                        "its {FP8_BLOCK}x{FP8_BLOCK} fp8 blocks are the tensor's own, but the part \
                         from {} starts at row {} / column {}, inside a block it would share with \
                         another training tensor",
                        param.name, p.dst_start[rd], p.dst_start[cd]
                    ),
                ));
            }
        }
        // Scale rows: per lead coordinate, parts' ceil(rows/128) in row order.
        let mut scale_rows: Vec<(Vec<u32>, u32)> = Vec::new();
        let mut places = Vec::with_capacity(parts.len());
        for p in &parts {
            let param = &self.model.params[p.param as usize];
            let pn = param.shape.ndim as usize;
            let (pr, pc) = (pn - 2, pn - 1);
            for d in [pr, pc] {
                let s = p.src.start[d];
                let e = p.src.end(d);
                if s % FP8_BLOCK != 0 || (e % FP8_BLOCK != 0 && e != param.shape.dims[d]) {
                    return Err(PlanError::Fp8Misaligned {
                        param: param.name.to_string(),
                        rank: self.rank,
                        region: p.src.to_string(),
                        block: FP8_BLOCK,
                    });
                }
            }
            let lead: Vec<u32> = p.dst_start[..rd].to_vec();
            let acc = match scale_rows.iter_mut().find(|(l, _)| *l == lead) {
                Some((_, a)) => a,
                None => {
                    scale_rows.push((lead.clone(), 0));
                    &mut scale_rows.last_mut().expect("just pushed").1
                }
            };
            let mut start = p.dst_start;
            start[rd] = *acc;
            start[cd] = p.dst_start[cd] / FP8_BLOCK;
            *acc += p.src.len[pr].div_ceil(FP8_BLOCK);
            places.push(start);
        }
        let srows = scale_rows.iter().map(|(_, a)| *a).max().unwrap_or(0);
        let mut sdims = shape.dims;
        sdims[rd] = srows;
        sdims[cd] = shape.dims[cd].div_ceil(FP8_BLOCK);
        let sname = format!("{name}_scale_inv");
        let t = self.push_tensor(name, shape, DType::F8E4M3);
        let st = self.push_tensor(
            sname,
            Shape {
                ndim: shape.ndim,
                dims: sdims,
            },
            DType::F32,
        );
        for (p, start) in parts.into_iter().zip(places) {
            self.pieces.push(Piece {
                param: p.param,
                src: p.src,
                rank: self.rank,
                tensor: t,
                dst_start: p.dst_start,
                scale: Some(ScalePlace { tensor: st, start }),
            });
        }
        Ok(())
    }
}

impl RankBuilder<'_> {
    /// Whether the rank holds transformers' tensors.
    #[inline]
    fn hf(&self) -> bool {
        self.spec.format == InferFormat::Hf
    }

    /// The error for a destination tensor the format cannot be built with: names the tensor,
    /// the spec (with its format) and why.
    fn refuse(&self, tensor: &str, why: String) -> PlanError {
        PlanError::BadSpec {
            spec: self.spec.to_string(),
            reason: format!(
                "inference tensor {tensor} (format {}, {}): {why}",
                self.spec.format.name(),
                match self.spec.dtype {
                    InferDType::Bf16 => "bf16",
                    InferDType::Fp8 => "fp8",
                }
            ),
        }
    }
}

fn not_div(
    what: String,
    degree_name: &'static str,
    degree: u32,
    dividend_name: &'static str,
    dividend: u32,
) -> PlanError {
    PlanError::NotDivisible {
        what,
        degree_name,
        degree,
        dividend_name,
        dividend: dividend as u64,
    }
}

/// `[start, start+len)` rows of a 2-D parameter, all columns.
fn rows(shape: Shape, start: u32, len: u32) -> TensorBox {
    TensorBox::new(&[start, 0], &[len, shape.dims[1]])
}

/// All rows, columns `[start, start+len)`.
fn cols(shape: Shape, start: u32, len: u32) -> TensorBox {
    TensorBox::new(&[0, start], &[shape.dims[0], len])
}

impl InferenceLayout {
    /// Builds the layout an [`InferSpec`] describes (see the module docs).
    pub fn build(model: &Model, spec: &InferSpec) -> Result<InferenceLayout, PlanError> {
        check_divisible(model, spec)?;
        let index: HashMap<Role, u32> = model
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.role, i as u32))
            .collect();
        let n = spec.engine_ranks();
        let mut ranks = Vec::with_capacity((n * spec.dp) as usize);
        let mut pieces = Vec::new();
        let mut engine0: Vec<(Vec<DstTensor>, Vec<Piece>, u64)> = Vec::new();
        for r in 0..n {
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
            engine0.push((b.tensors, b.pieces, b.next));
        }
        for e in 0..spec.dp {
            for (r, (tensors, ps, bytes)) in engine0.iter().enumerate() {
                let g = e * n + r as u32;
                ranks.push(InferRank {
                    rank: g,
                    engine: e,
                    local_rank: r as u32,
                    tensors: tensors.clone(),
                    mr_bytes: vec![*bytes],
                });
                pieces.extend(ps.iter().map(|p| Piece { rank: g, ..*p }));
            }
        }
        Ok(InferenceLayout { ranks, pieces })
    }
}

/// Refuses a spec whose degrees do not divide what they split: ep by tp, attention heads (and
/// kv heads, split or replicated evenly) by tp, the dense MLP by tp, routed experts by ep (or
/// their width by tp when ep = 1), shared experts by tp. The error names the first destination
/// tensor affected, in the spec's format.
fn check_divisible(model: &Model, spec: &InferSpec) -> Result<(), PlanError> {
    let c = &model.config;
    let (tp, ep) = (spec.tp, spec.ep);
    if ep > 1 && ep % tp != 0 {
        return Err(PlanError::BadSpec {
            spec: spec.to_string(),
            reason: format!("ep={ep} must be 1 or a multiple of tp={tp}"),
        });
    }
    let hf = spec.format == InferFormat::Hf;
    let moe_layer = |moe: bool| {
        (0..c.layers)
            .find(|&l| c.moe.as_ref().is_some_and(|m| m.moe_layers[l as usize]) == moe)
            .unwrap_or(0)
    };
    // `fused` / `hf` name of a tensor of the first (dense or MoE) layer that has it.
    let what = |moe: bool, fused: &str, hf_name: &str| {
        format!(
            "inference tensor model.layers.{}.{} of {} (format {}, tp={tp}, ep={ep})",
            moe_layer(moe),
            if hf { hf_name } else { fused },
            model.name,
            spec.format.name()
        )
    };
    if !c.heads.is_multiple_of(tp) {
        let (fused, hf_name) = match &c.mla {
            None => ("self_attn.qkv_proj.weight", "self_attn.q_proj.weight"),
            Some(m) if m.q_lora_rank.is_some() => {
                ("self_attn.q_b_proj.weight", "self_attn.q_b_proj.weight")
            }
            Some(_) => ("self_attn.q_proj.weight", "self_attn.q_proj.weight"),
        };
        return Err(not_div(
            what(false, fused, hf_name),
            "tp",
            tp,
            "num_attention_heads",
            c.heads,
        ));
    }
    if c.mla.is_none() {
        let kv = c.kv_heads;
        if (tp <= kv && !kv.is_multiple_of(tp)) || (tp > kv && tp % kv != 0) {
            return Err(not_div(
                what(
                    false,
                    "self_attn.qkv_proj.weight",
                    "self_attn.k_proj.weight",
                ) + " (kv heads neither split evenly nor replicated evenly)",
                "tp",
                tp,
                "num_key_value_heads",
                kv,
            ));
        }
    }
    let dense_i = c.intermediate;
    let has_dense = c
        .moe
        .as_ref()
        .is_none_or(|m| m.moe_layers.iter().any(|&x| !x));
    if has_dense && !dense_i.is_multiple_of(tp) {
        return Err(not_div(
            what(false, "mlp.gate_up_proj.weight", "mlp.gate_proj.weight"),
            "tp",
            tp,
            "intermediate_size",
            dense_i,
        ));
    }
    if let Some(m) = &c.moe {
        let experts = ("mlp.experts.w13_weight", "mlp.experts.gate_up_proj");
        if ep > 1 && m.experts % ep != 0 {
            return Err(not_div(
                what(true, experts.0, experts.1),
                "ep",
                ep,
                "num_experts",
                m.experts,
            ));
        }
        if ep == 1 && m.intermediate % tp != 0 {
            return Err(not_div(
                what(true, experts.0, experts.1),
                "tp",
                tp,
                "moe_intermediate_size",
                m.intermediate,
            ));
        }
        if m.shared > 0 && (m.intermediate * m.shared) % tp != 0 {
            return Err(not_div(
                what(
                    true,
                    "mlp.shared_experts.gate_up_proj.weight",
                    "mlp.shared_experts.gate_proj.weight",
                ),
                "tp",
                tp,
                "moe_intermediate_size*n_shared_experts",
                m.intermediate * m.shared,
            ));
        }
    }
    Ok(())
}

impl RankBuilder<'_> {
    /// The rank's tp rank within its engine.
    #[inline]
    fn tp_rank(&self) -> u32 {
        self.rank % self.tp
    }

    /// The index of the parameter that is `role`.
    #[inline]
    fn param(&self, role: Role) -> u32 {
        self.index[&role]
    }

    fn shape(&self, p: u32) -> Shape {
        self.model.params[p as usize].shape
    }

    /// Every tensor of the rank, in the engine's order: embedding, decoder layers, final norm,
    /// lm_head.
    fn build_rank(&mut self) -> Result<(), PlanError> {
        let model = self.model;
        let c = &model.config;
        let h = c.hidden;
        let emb = self.param(Role::Embed);
        // transformers' tp plan leaves the embedding whole; engines split it by vocab.
        let (bx, n) = if self.hf() {
            (TensorBox::full(self.shape(emb)), c.vocab)
        } else {
            self.vocab_rows(emb)
        };
        if n > 0 {
            self.add(
                "model.embed_tokens.weight".into(),
                &[n, h],
                false,
                vec![part(emb, bx, &[0, 0])],
            )?;
        }
        for l in 0..c.layers {
            let mut layer = LayerTensors {
                pre: format!("model.layers.{l}."),
                l,
                b: self,
            };
            layer.build()?;
        }
        let norm = self.param(Role::FinalNorm);
        self.add(
            "model.norm.weight".into(),
            &[h],
            false,
            vec![part(norm, TensorBox::full(self.shape(norm)), &[0])],
        )?;
        if let Some(&lm) = self.index.get(&Role::LmHead) {
            let (bx, n) = self.vocab_rows(lm);
            if n > 0 {
                self.add(
                    "lm_head.weight".into(),
                    &[n, h],
                    false,
                    vec![part(lm, bx, &[0, 0])],
                )?;
            }
        }
        Ok(())
    }

    /// This rank's rows of vocab-parallel parameter `p` (no padding rows), and how many.
    fn vocab_rows(&self, p: u32) -> (TensorBox, u32) {
        let (vocab, t) = (self.model.config.vocab, self.tp_rank());
        let ch = vocab.div_ceil(self.tp);
        let s = (t * ch).min(vocab);
        let e = ((t + 1) * ch).min(vocab);
        (rows(self.shape(p), s, e - s), e - s)
    }
}

/// The tensors of decoder layer `l` on one rank, added to its [`RankBuilder`].
struct LayerTensors<'b, 'm> {
    b: &'b mut RankBuilder<'m>,
    /// `model.layers.{l}.`
    pre: String,
    l: u32,
}

impl LayerTensors<'_, '_> {
    /// Every tensor of the layer: norms, attention, then the dense MLP or the MoE block.
    fn build(&mut self) -> Result<(), PlanError> {
        let c = &self.b.model.config;
        self.full(LayerKind::InputNorm, "input_layernorm.weight")?;
        match &c.mla {
            Some(m) => self.mla_attention(m)?,
            None => self.attention()?,
        }
        self.full(LayerKind::PostAttnNorm, "post_attention_layernorm.weight")?;
        match c.moe.as_ref().filter(|m| m.moe_layers[self.l as usize]) {
            None => self.mlp(LayerKind::Mlp, "mlp"),
            Some(m) => self.moe(m),
        }
    }

    /// The parameter that is `kind` in this layer.
    fn param(&self, kind: LayerKind) -> u32 {
        self.b.param(Role::Layer {
            layer: self.l,
            kind,
        })
    }

    fn shape(&self, p: u32) -> Shape {
        self.b.shape(p)
    }

    /// Adds tensor `{pre}{name}` of the layout (see [`RankBuilder::add`]).
    fn add(
        &mut self,
        name: impl std::fmt::Display,
        shape: &[u32],
        quantise: bool,
        parts: Vec<Part>,
    ) -> Result<(), PlanError> {
        // Sized up front: a `format!` of two arguments would grow the string more than once.
        let mut full = String::with_capacity(self.pre.len() + 48);
        full.push_str(&self.pre);
        write!(full, "{name}").expect("writing to a String cannot fail");
        self.b.add(full, shape, quantise, parts)
    }

    /// The whole parameter, replicated (norms, the router).
    fn full(&mut self, kind: LayerKind, name: &str) -> Result<(), PlanError> {
        let p = self.param(kind);
        let s = self.shape(p);
        let at = &[0; MAX_DIMS][..s.ndim as usize];
        self.add(name, s.dims(), false, vec![part(p, TensorBox::full(s), at)])
    }

    /// Whole, but quantised (replicated projections such as q_a_proj).
    fn full_q(&mut self, kind: LayerKind, name: &str) -> Result<(), PlanError> {
        let p = self.param(kind);
        let s = self.shape(p);
        self.add(
            name,
            s.dims(),
            true,
            vec![part(p, TensorBox::full(s), &[0, 0])],
        )
    }

    /// Column-parallel: this rank's tp share of the rows.
    fn col_split(&mut self, kind: LayerKind, name: &str) -> Result<(), PlanError> {
        let (tp, t) = (self.b.tp, self.b.tp_rank());
        let p = self.param(kind);
        let s = self.shape(p);
        let n = s.dims[0] / tp;
        self.add(
            name,
            &[n, s.dims[1]],
            true,
            vec![part(p, rows(s, t * n, n), &[0, 0])],
        )
    }

    /// Row-parallel: this rank's tp share of the columns.
    fn row_split(&mut self, kind: LayerKind, name: &str) -> Result<(), PlanError> {
        let (tp, t) = (self.b.tp, self.b.tp_rank());
        let p = self.param(kind);
        let s = self.shape(p);
        let n = s.dims[1] / tp;
        self.add(
            name,
            &[s.dims[0], n],
            true,
            vec![part(p, cols(s, t * n, n), &[0, 0])],
        )
    }

    /// MLA attention: q (through a LoRA when `q_lora_rank` is set) and kv_b split by heads, the
    /// compressed kv and its norm replicated, o row-parallel.
    fn mla_attention(&mut self, m: &MlaConfig) -> Result<(), PlanError> {
        if m.q_lora_rank.is_some() {
            self.full_q(LayerKind::QA, "self_attn.q_a_proj.weight")?;
            self.full(LayerKind::QANorm, "self_attn.q_a_layernorm.weight")?;
            self.col_split(LayerKind::QB, "self_attn.q_b_proj.weight")?;
        } else {
            self.col_split(LayerKind::Q, "self_attn.q_proj.weight")?;
        }
        self.full_q(LayerKind::KVA, "self_attn.kv_a_proj_with_mqa.weight")?;
        self.full(LayerKind::KVANorm, "self_attn.kv_a_layernorm.weight")?;
        self.col_split(LayerKind::KVB, "self_attn.kv_b_proj.weight")?;
        self.row_split(LayerKind::O, "self_attn.o_proj.weight")
    }

    /// Dense attention: q, k and v (kv heads split, or replicated when tp exceeds them) fused
    /// into `qkv_proj` (hf: `q_proj`, `k_proj`, `v_proj`), biases alike, q/k norms replicated,
    /// o row-parallel.
    fn attention(&mut self) -> Result<(), PlanError> {
        let c = &self.b.model.config;
        let (tp, t) = (self.b.tp, self.b.tp_rank());
        let (h, d) = (c.hidden, c.head_dim);
        let qn = c.heads / tp * d;
        let (ks, kn) = if tp <= c.kv_heads {
            let per = c.kv_heads / tp;
            (t * per * d, per * d)
        } else {
            ((t / (tp / c.kv_heads)) * d, d)
        };
        let (q, k, v) = (
            self.param(LayerKind::Q),
            self.param(LayerKind::K),
            self.param(LayerKind::V),
        );
        let (qb, kb, vb) = (
            TensorBox::new(&[t * qn], &[qn]),
            TensorBox::new(&[ks], &[kn]),
            TensorBox::new(&[ks], &[kn]),
        );
        if self.b.hf() {
            for (p, start, n, nm) in [
                (q, t * qn, qn, "q_proj"),
                (k, ks, kn, "k_proj"),
                (v, ks, kn, "v_proj"),
            ] {
                let parts = vec![part(p, rows(self.shape(p), start, n), &[0, 0])];
                self.add(format_args!("self_attn.{nm}.weight"), &[n, h], true, parts)?;
            }
            if c.attention_bias {
                for (kind, bx, nm) in [
                    (LayerKind::QBias, qb, "q_proj"),
                    (LayerKind::KBias, kb, "k_proj"),
                    (LayerKind::VBias, vb, "v_proj"),
                ] {
                    let p = self.param(kind);
                    let n = bx.len[0];
                    self.add(
                        format_args!("self_attn.{nm}.bias"),
                        &[n],
                        false,
                        vec![part(p, bx, &[0])],
                    )?;
                }
            }
        } else {
            let parts = vec![
                part(q, rows(self.shape(q), t * qn, qn), &[0, 0]),
                part(k, rows(self.shape(k), ks, kn), &[qn, 0]),
                part(v, rows(self.shape(v), ks, kn), &[qn + kn, 0]),
            ];
            self.add("self_attn.qkv_proj.weight", &[qn + 2 * kn, h], true, parts)?;
            if c.attention_bias {
                let parts = vec![
                    part(self.param(LayerKind::QBias), qb, &[0]),
                    part(self.param(LayerKind::KBias), kb, &[qn]),
                    part(self.param(LayerKind::VBias), vb, &[qn + kn]),
                ];
                self.add("self_attn.qkv_proj.bias", &[qn + 2 * kn], false, parts)?;
            }
        }
        if c.qk_norm {
            self.full(LayerKind::QNorm, "self_attn.q_norm.weight")?;
            self.full(LayerKind::KNorm, "self_attn.k_norm.weight")?;
        }
        self.row_split(LayerKind::O, "self_attn.o_proj.weight")
    }

    /// gate_up (gate rows then up rows; hf: `gate_proj` and `up_proj`) and down of a dense MLP
    /// or the shared experts, split by tp, named `{prefix}.gate_up_proj.weight` and
    /// `{prefix}.down_proj.weight`.
    fn mlp(&mut self, mk: fn(Proj) -> LayerKind, prefix: &str) -> Result<(), PlanError> {
        let h = self.b.model.config.hidden;
        let (tp, t) = (self.b.tp, self.b.tp_rank());
        let (g, u, dn) = (
            self.param(mk(Proj::Gate)),
            self.param(mk(Proj::Up)),
            self.param(mk(Proj::Down)),
        );
        let i = self.shape(g).dims[0] / tp;
        let (gate, up) = (rows(self.shape(g), t * i, i), rows(self.shape(u), t * i, i));
        if self.b.hf() {
            let parts = vec![part(g, gate, &[0, 0])];
            self.add(
                format_args!("{prefix}.gate_proj.weight"),
                &[i, h],
                true,
                parts,
            )?;
            let parts = vec![part(u, up, &[0, 0])];
            self.add(
                format_args!("{prefix}.up_proj.weight"),
                &[i, h],
                true,
                parts,
            )?;
        } else {
            let parts = vec![part(g, gate, &[0, 0]), part(u, up, &[i, 0])];
            self.add(
                format_args!("{prefix}.gate_up_proj.weight"),
                &[2 * i, h],
                true,
                parts,
            )?;
        }
        let parts = vec![part(dn, cols(self.shape(dn), t * i, i), &[0, 0])];
        self.add(
            format_args!("{prefix}.down_proj.weight"),
            &[h, i],
            true,
            parts,
        )
    }

    /// An MoE block: the router and its bias replicated, the shared experts split like a dense
    /// MLP, then the routed experts.
    fn moe(&mut self, m: &MoeConfig) -> Result<(), PlanError> {
        self.full(LayerKind::Router, "mlp.gate.weight")?;
        if m.score_bias {
            self.full(LayerKind::RouterBias, "mlp.gate.e_score_correction_bias")?;
        }
        if m.shared > 0 {
            self.mlp(LayerKind::Shared, "mlp.shared_experts")?;
        }
        self.routed_experts(m)
    }

    /// `w13_weight` `[E_local, 2I_local, H]` and `w2_weight` `[E_local, H, I_local]` (hf:
    /// `gate_up_proj` and `down_proj`): with ep > 1 this rank's `E/ep` consecutive experts
    /// whole, else every expert's tp share (its gate rows, then its up rows).
    fn routed_experts(&mut self, m: &MoeConfig) -> Result<(), PlanError> {
        let h = self.b.model.config.hidden;
        let i = m.intermediate;
        let (r, t) = (self.b.rank, self.b.tp_rank());
        let (e0, el, i0, il) = if self.b.ep > 1 {
            let el = m.experts / self.b.ep;
            (r * el, el, 0, i)
        } else {
            let il = i / self.b.tp;
            (0, m.experts, t * il, il)
        };
        let (gate_up_name, down_name) = if self.b.hf() {
            ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
        } else {
            ("mlp.experts.w13_weight", "mlp.experts.w2_weight")
        };
        let mut gate_up = Vec::new();
        let mut down = Vec::new();
        match self.b.model.experts {
            ExpertForm::PerExpert => {
                for j in 0..el {
                    let e = e0 + j;
                    let proj = |proj| LayerKind::Expert { expert: e, proj };
                    let pg = self.param(proj(Proj::Gate));
                    let pu = self.param(proj(Proj::Up));
                    let pd = self.param(proj(Proj::Down));
                    gate_up.push(part(pg, rows(self.shape(pg), i0, il), &[j, 0, 0]));
                    gate_up.push(part(pu, rows(self.shape(pu), i0, il), &[j, il, 0]));
                    down.push(part(pd, cols(self.shape(pd), i0, il), &[j, 0, 0]));
                }
            }
            ExpertForm::Stacked => {
                let pg = self.param(LayerKind::Experts(Proj::Gate));
                let pu = self.param(LayerKind::Experts(Proj::Up));
                let pd = self.param(LayerKind::Experts(Proj::Down));
                let half = TensorBox::new(&[e0, i0, 0], &[el, il, h]);
                gate_up.push(part(pg, half, &[0, 0, 0]));
                gate_up.push(part(pu, half, &[0, il, 0]));
                let bx = TensorBox::new(&[e0, 0, i0], &[el, h, il]);
                down.push(part(pd, bx, &[0, 0, 0]));
            }
            ExpertForm::StackedGateUp => {
                let pgu = self.param(LayerKind::ExpertsGateUp);
                let pd = self.param(LayerKind::Experts(Proj::Down));
                if il == i {
                    // Whole experts: the packed rows as they are.
                    let bx = TensorBox::new(&[e0, 0, 0], &[el, 2 * i, h]);
                    gate_up.push(part(pgu, bx, &[0, 0, 0]));
                } else {
                    let gate = TensorBox::new(&[e0, i0, 0], &[el, il, h]);
                    let up = TensorBox::new(&[e0, i + i0, 0], &[el, il, h]);
                    gate_up.push(part(pgu, gate, &[0, 0, 0]));
                    gate_up.push(part(pgu, up, &[0, il, 0]));
                }
                let bx = TensorBox::new(&[e0, 0, i0], &[el, h, il]);
                down.push(part(pd, bx, &[0, 0, 0]));
            }
        }
        if self.b.fp8 {
            self.check_fp8_gate_up(gate_up_name, &gate_up, i, il)?;
        }
        self.add(gate_up_name, &[el, 2 * il, h], true, gate_up)?;
        self.add(down_name, &[el, h, il], true, down)
    }

    /// Refuses, by the tensor's name, an fp8 gate_up whose block grid the format cannot give:
    /// - fused: the engines' w13 keeps gate and up on separate block grids, so a packed training
    ///   tensor kept whole must have `I % 128 == 0`;
    /// - hf: one `[2I_local, H]` grid per expert, which parts from separate gate and up tensors
    ///   (or the tp halves of the packed one) fill only when `I_local % 128 == 0`, and whose
    ///   transformers scale tensor has a padding row when `2I_local <= 128`.
    fn check_fp8_gate_up(
        &self,
        name: &str,
        parts: &[Part],
        i: u32,
        il: u32,
    ) -> Result<(), PlanError> {
        let full = format!("{}{name}", self.pre);
        let whole_packed = parts.len() == 1;
        let training = |p: &Part| self.b.model.params[p.param as usize].name.to_string();
        if !self.b.hf() {
            if whole_packed && !i.is_multiple_of(FP8_BLOCK) {
                return Err(self.b.refuse(
                    &full,
                    format!(
                        "engines quantise w13's gate and up rows on separate {FP8_BLOCK}-row block \
                         grids, but the training tensor {} packs them with \
                         moe_intermediate_size={i}, not a multiple of {FP8_BLOCK}, so a block of it \
                         mixes gate and up rows; use format=hf (one grid over the packed rows, as \
                         transformers) or dtype=bf16",
                        training(&parts[0])
                    ),
                ));
            }
            return Ok(());
        }
        if !whole_packed && !il.is_multiple_of(FP8_BLOCK) {
            let (from, fix) = if parts[0].param == parts[1].param {
                (
                    format!(
                        "the tp={} halves of {} ({il} gate rows, {il} up rows per expert)",
                        self.b.tp,
                        training(&parts[0])
                    ),
                    "hold whole experts (ep > 1, or tp=1)",
                )
            } else {
                (
                    format!(
                        "separate training tensors ({} and {}, {il} rows each)",
                        training(&parts[0]),
                        training(&parts[1])
                    ),
                    "train with experts=stacked-gate-up (transformers' packed tensor) and hold \
                     whole experts (ep > 1, or tp=1)",
                )
            };
            return Err(self.b.refuse(
                &full,
                format!(
                    "transformers quantises it as one [2I, H] grid of {FP8_BLOCK}x{FP8_BLOCK} \
                     blocks per expert; its gate and up rows come from {from}, and {il} is not a \
                     multiple of {FP8_BLOCK}, so a block would mix them; {fix}, or use dtype=bf16"
                ),
            ));
        }
        if 2 * il <= FP8_BLOCK {
            return Err(self.b.refuse(
                &full,
                format!(
                    "transformers allocates {full}_scale_inv with 2 block rows per expert when \
                     2*I = {} <= {FP8_BLOCK}, one more than its block grid has; weightsync writes \
                     every byte it plans and cannot leave that row, so fp8 in format hf needs \
                     moe_intermediate_size > {} (per tp rank)",
                    2 * il,
                    FP8_BLOCK / 2
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ExpertForm;

    #[test]
    fn kimi_fp8_engine_shapes() {
        let m = Model::preset("kimi-k2", ExpertForm::PerExpert).unwrap();
        let s: InferSpec = "tp=8,ep=32,dp=4,dtype=fp8".parse().unwrap();
        let l = InferenceLayout::build(&m, &s).unwrap();
        assert_eq!(l.ranks.len(), 128);
        let r5 = &l.ranks[5];
        let w13 = r5
            .tensors
            .iter()
            .find(|t| t.name == "model.layers.1.mlp.experts.w13_weight")
            .unwrap();
        assert_eq!(w13.shape, Shape::new(&[12, 4096, 7168]));
        assert_eq!(w13.dtype, DType::F8E4M3);
        let sc = r5
            .tensors
            .iter()
            .find(|t| t.name == "model.layers.1.mlp.experts.w13_weight_scale_inv")
            .unwrap();
        assert_eq!(sc.shape, Shape::new(&[12, 32, 56]));
        // Every engine's rank needs ~32-34 GB (the physical bound of the anchor case).
        let gb = r5.mr_bytes[0] as f64 / 1e9;
        assert!(gb > 31.0 && gb < 35.0, "{gb}");
    }

    #[test]
    fn gqa_kv_heads_are_replicated_when_tp_exceeds_them() {
        let m = Model::preset("qwen3-30b-a3b", ExpertForm::PerExpert).unwrap();
        let s: InferSpec = "tp=8,ep=8".parse().unwrap();
        let l = InferenceLayout::build(&m, &s).unwrap();
        let k = m
            .params
            .iter()
            .position(|p| &*p.name == "model.layers.0.self_attn.k_proj.weight")
            .unwrap() as u32;
        let starts: Vec<u32> = l
            .pieces
            .iter()
            .filter(|p| p.param == k)
            .map(|p| p.src.start[0])
            .collect();
        assert_eq!(starts, vec![0, 0, 128, 128, 256, 256, 384, 384]);
        let e = InferenceLayout::build(&m, &"tp=3".parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("num_attention_heads"), "{e}");
    }
}
