//! The logical model: every parameter tensor (Hugging Face name, global shape, dtype) and what
//! it *is* ([`Role`]), built from a Hugging Face `config.json`.
//!
//! Why roles: both layouts are derived from what a tensor is (a column-parallel projection, a
//! routed expert's down projection, a norm), not from its name, so the training and inference
//! sides agree by construction and names are only for people and checkpoints.
//!
//! Families: dense Llama / Qwen2 (q/k/v bias) / Qwen3 (q/k norms), Qwen3-MoE (router and routed
//! experts, `decoder_sparse_step`, `mlp_only_layers`), DeepSeek-V3 / Kimi-K2 (MLA attention with
//! optional q LoRA, first `first_k_dense_replace` layers dense, shared and routed experts, router
//! `e_score_correction_bias` in f32 when `topk_method` is `noaux_tc`). The DeepSeek MTP layer
//! (`num_nextn_predict_layers`) is not part of the synced model.

use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::sync::Arc;
use weightsync_common::DType;

use crate::error::PlanError;
pub use crate::model_config::{Family, MlaConfig, ModelConfig, MoeConfig};
use crate::table::Shape;

/// Which projection of an MLP or expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Proj {
    /// gate_proj (w1), `[I, H]`.
    Gate,
    /// up_proj (w3), `[I, H]`.
    Up,
    /// down_proj (w2), `[H, I]`.
    Down,
}

/// What a tensor inside a decoder layer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LayerKind {
    /// input_layernorm `[H]`.
    InputNorm,
    /// post_attention_layernorm `[H]`.
    PostAttnNorm,
    /// q_proj `[heads*D, H]` (dense families, or MLA without q LoRA: `[heads*qk_head_dim, H]`).
    Q,
    /// k_proj `[kv_heads*D, H]`.
    K,
    /// v_proj `[kv_heads*D, H]`.
    V,
    /// q_proj bias (Qwen2).
    QBias,
    /// k_proj bias (Qwen2).
    KBias,
    /// v_proj bias (Qwen2).
    VBias,
    /// o_proj `[H, heads*D]` (MLA: `[H, heads*v_head_dim]`).
    O,
    /// q_norm `[D]` (Qwen3).
    QNorm,
    /// k_norm `[D]` (Qwen3).
    KNorm,
    /// MLA q_a_proj `[q_lora_rank, H]`.
    QA,
    /// MLA q_a_layernorm `[q_lora_rank]`.
    QANorm,
    /// MLA q_b_proj `[heads*qk_head_dim, q_lora_rank]`.
    QB,
    /// MLA kv_a_proj_with_mqa `[kv_lora_rank + rope_dim, H]`.
    KVA,
    /// MLA kv_a_layernorm `[kv_lora_rank]`.
    KVANorm,
    /// MLA kv_b_proj `[heads*(nope+v), kv_lora_rank]`.
    KVB,
    /// Dense MLP projection.
    Mlp(Proj),
    /// Shared-expert projection (DeepSeek), `n_shared * moe_intermediate` wide.
    Shared(Proj),
    /// Router weight `mlp.gate.weight` `[E, H]`.
    Router,
    /// Router `e_score_correction_bias` `[E]` (f32).
    RouterBias,
    /// One routed expert's projection (`mlp.experts.{e}.gate_proj.weight`, 2-D).
    Expert {
        /// Expert index.
        expert: u32,
        /// Which projection.
        proj: Proj,
    },
    /// All routed experts' projection stacked (`mlp.experts.gate_proj.weight`, `[E, I, H]` or
    /// `[E, H, I]`; transformers' `mlp.experts.down_proj` `[E, H, I]` too).
    Experts(Proj),
    /// All routed experts' gate and up projections stacked and packed, as transformers holds
    /// them (`mlp.experts.gate_up_proj`, `[E, 2I, H]`: per expert the `I` gate rows, then the
    /// `I` up rows).
    ExpertsGateUp,
}

/// What a model tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Role {
    /// embed_tokens `[V, H]`.
    Embed,
    /// lm_head `[V, H]`.
    LmHead,
    /// final norm `[H]`.
    FinalNorm,
    /// A tensor of decoder layer `layer`.
    Layer {
        /// Layer index.
        layer: u32,
        /// Which tensor.
        kind: LayerKind,
    },
    /// A tensor the planner knows only by its name, shape and dtype, as the workers of a
    /// declared model ([`crate::declared`]) report it: it moves whole or in boxes by name, and
    /// neither layout is derived from it.
    Declared {
        /// The parameter's index in the model (roles stay unique).
        index: u32,
        /// Its mesh group ([`Model::mesh_group`]).
        group: u16,
    },
}

/// One logical parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Param {
    /// Hugging Face style name (shared: every trainer plan refers to it).
    pub name: Arc<str>,
    /// Global shape.
    pub shape: Shape,
    /// Element type of the training copy.
    pub dtype: DType,
    /// What it is.
    pub role: Role,
}

/// How routed experts appear as logical parameters on the training side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum ExpertForm {
    /// One 2-D tensor per expert and projection (Hugging Face checkpoints, FSDP of HF modules).
    #[default]
    PerExpert,
    /// One 3-D tensor per projection, experts stacked on dim 0 (grouped-GEMM trainers:
    /// `[E, I, H]` for gate/up, `[E, H, I]` for down).
    Stacked,
    /// Experts stacked on dim 0 with gate and up packed into one tensor, named as
    /// `named_parameters()` of a transformers 5.x model names them (no `.weight` suffix):
    /// `mlp.experts.gate_up_proj` `[E, 2I, H]` (per expert gate rows, then up rows) and
    /// `mlp.experts.down_proj` `[E, H, I]`.
    StackedGateUp,
}

impl ExpertForm {
    /// The form's name in a training spec (`experts=...`).
    pub fn spec_name(self) -> &'static str {
        match self {
            ExpertForm::PerExpert => "per-expert",
            ExpertForm::Stacked => "stacked",
            ExpertForm::StackedGateUp => "stacked-gate-up",
        }
    }
}

/// The logical model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Model {
    /// Name (preset name or file stem).
    pub name: String,
    /// The config it was built from.
    pub config: ModelConfig,
    /// How routed experts are laid out as parameters.
    pub experts: ExpertForm,
    /// Parameters, in a fixed order: embed, layers in order, final norm, lm_head.
    pub params: Vec<Param>,
}

impl Model {
    /// Builds a model from the text of a config.json.
    pub fn from_config_json(
        name: &str,
        json: &str,
        experts: ExpertForm,
    ) -> Result<Model, PlanError> {
        Ok(Model::from_config(
            name,
            ModelConfig::from_json(json)?,
            experts,
        ))
    }

    /// Builds a preset (`kimi-k2`, `qwen3-8b`, ...; see [`crate::presets::PRESETS`]).
    pub fn preset(name: &str, experts: ExpertForm) -> Result<Model, PlanError> {
        let json = crate::presets::preset_config(name).ok_or_else(|| PlanError::UnknownPreset {
            name: name.to_string(),
            known: crate::presets::PRESETS
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", "),
        })?;
        Model::from_config_json(&name.to_ascii_lowercase(), json, experts)
    }

    /// Builds the parameter list of a config.
    pub fn from_config(name: &str, c: ModelConfig, experts: ExpertForm) -> Model {
        let (dt, h) = (c.dtype, c.hidden);
        let mut params = Vec::new();
        params.push(Param::new(
            "model.embed_tokens.weight",
            &[c.vocab, h],
            dt,
            Role::Embed,
        ));
        for l in 0..c.layers {
            let mut layer = LayerParams {
                params: &mut params,
                prefix: format!("model.layers.{l}."),
                layer: l,
                dtype: dt,
            };
            layer.add("input_layernorm.weight", &[h], LayerKind::InputNorm);
            match &c.mla {
                Some(m) => layer.mla_attention(&c, m),
                None => layer.attention(&c),
            }
            layer.add(
                "post_attention_layernorm.weight",
                &[h],
                LayerKind::PostAttnNorm,
            );
            match c.moe.as_ref().filter(|m| m.moe_layers[l as usize]) {
                None => layer.mlp("mlp.", c.intermediate, h, LayerKind::Mlp),
                Some(m) => layer.moe(m, h, experts),
            }
        }
        params.push(Param::new("model.norm.weight", &[h], dt, Role::FinalNorm));
        if !c.tie_embeddings {
            params.push(Param::new(
                "lm_head.weight",
                &[c.vocab, h],
                dt,
                Role::LmHead,
            ));
        }
        Model {
            name: name.to_string(),
            config: c,
            experts,
            params,
        }
    }

    /// Total parameter elements.
    pub fn num_elements(&self) -> u64 {
        self.params.iter().map(|p| p.shape.numel()).sum()
    }

    /// Total bytes in the training dtype.
    pub fn bytes(&self) -> u64 {
        self.params
            .iter()
            .map(|p| p.shape.numel() * p.dtype.size() as u64)
            .sum()
    }

    /// The mesh group of a parameter: 0 for the embedding, `1 + layer` for decoder layers,
    /// `1 + layers` for the final norm and lm_head.
    pub fn mesh_group(&self, role: Role) -> u16 {
        match role {
            Role::Embed => 0,
            Role::Layer { layer, .. } => (1 + layer) as u16,
            Role::FinalNorm | Role::LmHead => (1 + self.config.layers) as u16,
            Role::Declared { group, .. } => group,
        }
    }

    /// Whether the model is known only from its workers' declarations ([`crate::declared`]):
    /// its layouts are theirs, never built from a spec.
    pub fn is_declared(&self) -> bool {
        self.config.family == Family::Declared
    }

    /// Number of mesh groups.
    pub fn num_mesh_groups(&self) -> u16 {
        (2 + self.config.layers) as u16
    }

    /// Human name of a mesh group.
    pub fn mesh_group_name(&self, id: u16) -> String {
        if id == 0 {
            "embed".into()
        } else if id as u32 == 1 + self.config.layers {
            "head".into()
        } else {
            format!("layer {}", id - 1)
        }
    }
}

impl Param {
    fn new(name: impl Into<Arc<str>>, dims: &[u32], dtype: DType, role: Role) -> Param {
        Param {
            name: name.into(),
            shape: Shape::new(dims),
            dtype,
            role,
        }
    }
}

/// The parameters of decoder layer `layer`, appended to a model's list in checkpoint order by
/// [`Model::from_config`]: names are `prefix` (`model.layers.{layer}.`) and their own.
struct LayerParams<'p> {
    params: &'p mut Vec<Param>,
    prefix: String,
    layer: u32,
    /// The model's dtype.
    dtype: DType,
}

impl LayerParams<'_> {
    /// Appends tensor `name` of the layer, in the model's dtype.
    fn add(&mut self, name: impl std::fmt::Display, dims: &[u32], kind: LayerKind) {
        self.add_as(name, dims, self.dtype, kind);
    }

    /// Appends tensor `name` of the layer, in `dtype`.
    fn add_as(
        &mut self,
        name: impl std::fmt::Display,
        dims: &[u32],
        dtype: DType,
        kind: LayerKind,
    ) {
        let role = Role::Layer {
            layer: self.layer,
            kind,
        };
        // Sized up front: a `format!` of two arguments would grow the string several times.
        let mut full = String::with_capacity(self.prefix.len() + 48);
        full.push_str(&self.prefix);
        write!(full, "{name}").expect("writing to a String cannot fail");
        self.params.push(Param::new(full, dims, dtype, role));
    }

    /// MLA attention (DeepSeek-V3, Kimi-K2): q (through a LoRA when `q_lora_rank` is set),
    /// the compressed kv with its norm, kv_b and o.
    fn mla_attention(&mut self, c: &ModelConfig, m: &MlaConfig) {
        let h = c.hidden;
        let qk = m.nope + m.rope;
        match m.q_lora_rank {
            Some(r) => {
                self.add("self_attn.q_a_proj.weight", &[r, h], LayerKind::QA);
                self.add("self_attn.q_a_layernorm.weight", &[r], LayerKind::QANorm);
                self.add(
                    "self_attn.q_b_proj.weight",
                    &[c.heads * qk, r],
                    LayerKind::QB,
                );
            }
            None => self.add("self_attn.q_proj.weight", &[c.heads * qk, h], LayerKind::Q),
        }
        let kv = m.kv_lora_rank;
        self.add(
            "self_attn.kv_a_proj_with_mqa.weight",
            &[kv + m.rope, h],
            LayerKind::KVA,
        );
        self.add("self_attn.kv_a_layernorm.weight", &[kv], LayerKind::KVANorm);
        self.add(
            "self_attn.kv_b_proj.weight",
            &[c.heads * (m.nope + m.v), kv],
            LayerKind::KVB,
        );
        self.add("self_attn.o_proj.weight", &[h, c.heads * m.v], LayerKind::O);
    }

    /// Dense attention: q, k, v (with Qwen2 biases and Qwen3 norms), o.
    fn attention(&mut self, c: &ModelConfig) {
        let h = c.hidden;
        let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        self.add("self_attn.q_proj.weight", &[q, h], LayerKind::Q);
        self.add("self_attn.k_proj.weight", &[kv, h], LayerKind::K);
        self.add("self_attn.v_proj.weight", &[kv, h], LayerKind::V);
        if c.attention_bias {
            self.add("self_attn.q_proj.bias", &[q], LayerKind::QBias);
            self.add("self_attn.k_proj.bias", &[kv], LayerKind::KBias);
            self.add("self_attn.v_proj.bias", &[kv], LayerKind::VBias);
        }
        if c.qk_norm {
            self.add("self_attn.q_norm.weight", &[c.head_dim], LayerKind::QNorm);
            self.add("self_attn.k_norm.weight", &[c.head_dim], LayerKind::KNorm);
        }
        self.add("self_attn.o_proj.weight", &[h, q], LayerKind::O);
    }

    /// gate, up and down projections `i` wide (a dense MLP, or the fused shared experts),
    /// named `{prefix}{gate,up,down}_proj.weight`.
    fn mlp(&mut self, prefix: &str, i: u32, h: u32, kind: fn(Proj) -> LayerKind) {
        for (proj, nm, dims) in [
            (Proj::Gate, "gate_proj", [i, h]),
            (Proj::Up, "up_proj", [i, h]),
            (Proj::Down, "down_proj", [h, i]),
        ] {
            self.add(format_args!("{prefix}{nm}.weight"), &dims, kind(proj));
        }
    }

    /// An MoE block: the router (and its f32 bias), the shared experts, the routed experts (per
    /// expert or stacked).
    fn moe(&mut self, m: &MoeConfig, h: u32, experts: ExpertForm) {
        self.add("mlp.gate.weight", &[m.experts, h], LayerKind::Router);
        if m.score_bias {
            self.add_as(
                "mlp.gate.e_score_correction_bias",
                &[m.experts],
                DType::F32,
                LayerKind::RouterBias,
            );
        }
        if m.shared > 0 {
            let i = m.intermediate * m.shared;
            self.mlp("mlp.shared_experts.", i, h, LayerKind::Shared);
        }
        let i = m.intermediate;
        match experts {
            ExpertForm::PerExpert => {
                for e in 0..m.experts {
                    for (proj, nm, dims) in [
                        (Proj::Gate, "gate_proj", [i, h]),
                        (Proj::Up, "up_proj", [i, h]),
                        (Proj::Down, "down_proj", [h, i]),
                    ] {
                        let kind = LayerKind::Expert { expert: e, proj };
                        self.add(format_args!("mlp.experts.{e}.{nm}.weight"), &dims, kind);
                    }
                }
            }
            ExpertForm::Stacked => {
                for (proj, nm, dims) in [
                    (Proj::Gate, "gate_proj", [m.experts, i, h]),
                    (Proj::Up, "up_proj", [m.experts, i, h]),
                    (Proj::Down, "down_proj", [m.experts, h, i]),
                ] {
                    self.add(
                        format_args!("mlp.experts.{nm}.weight"),
                        &dims,
                        LayerKind::Experts(proj),
                    );
                }
            }
            ExpertForm::StackedGateUp => {
                let e = m.experts;
                self.add(
                    "mlp.experts.gate_up_proj",
                    &[e, 2 * i, h],
                    LayerKind::ExpertsGateUp,
                );
                self.add(
                    "mlp.experts.down_proj",
                    &[e, h, i],
                    LayerKind::Experts(Proj::Down),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_their_published_sizes() {
        let cases = [
            ("qwen3-0.6b", 0.55e9, 0.65e9),
            ("qwen3-8b", 8.0e9, 8.4e9),
            ("qwen3-30b-a3b", 30.0e9, 31.0e9),
            ("qwen3-235b-a22b", 234.0e9, 236.0e9),
            ("deepseek-v3", 669.0e9, 673.0e9),
            ("kimi-k2", 1.02e12, 1.04e12),
        ];
        for (name, lo, hi) in cases {
            let m = Model::preset(name, ExpertForm::PerExpert).unwrap();
            let n = m.num_elements() as f64;
            assert!(n > lo && n < hi, "{name}: {n:e}");
            for form in [ExpertForm::Stacked, ExpertForm::StackedGateUp] {
                let s = Model::preset(name, form).unwrap();
                assert_eq!(s.num_elements(), m.num_elements(), "{name} {form:?}");
            }
        }
    }

    #[test]
    fn unknown_family_is_named() {
        let e = Model::from_config_json("x", r#"{"model_type":"gpt9"}"#, ExpertForm::PerExpert)
            .unwrap_err();
        assert!(e.to_string().contains("gpt9"), "{e}");
        let e = Model::preset("nope", ExpertForm::PerExpert).unwrap_err();
        assert!(e.to_string().contains("kimi-k2"), "{e}");
        let e = Model::from_config_json("x", r#"{"model_type":"qwen3"}"#, ExpertForm::PerExpert)
            .unwrap_err();
        assert!(e.to_string().contains("hidden_size"), "{e}");
    }
}
