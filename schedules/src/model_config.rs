//! A Hugging Face `config.json` read into the fields the planner needs ([`ModelConfig`]): the
//! family (`model_type`), the sizes, and the mixture-of-experts and latent-attention settings.
//!
//! Why its own file: reading a config (which keys, their transformers 4 and 5 spellings, each
//! family's defaults) is one idea; what tensors a config makes is another ([`crate::model`]),
//! and what sizes a config may have a third ([`crate::model_bounds`], which holds the checked
//! entry [`ModelConfig::from_json`]). Parsing here checks only what must hold before a per-layer
//! list is allocated (the layer count); [`ModelConfig::parse_json`] is the unchecked parse.
//! A `model_type` outside the seven known families is [`PlanError::UnknownFamily`]; the job
//! then plans it from what its workers declare ([`crate::declared`]).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use weightsync_common::DType;

use crate::error::PlanError;

/// Most decoder layers: mesh groups are `u16` and there are two besides the layers.
pub const MAX_LAYERS: u32 = u16::MAX as u32 - 2;

/// `num_hidden_layers` at most [`MAX_LAYERS`] (checked by [`ModelConfig::parse_json`] before
/// any per-layer list is allocated, and again with the rest of the bounds).
pub(crate) fn check_layers(layers: u32) -> Result<(), PlanError> {
    if layers > MAX_LAYERS {
        return Err(PlanError::BadConfig(format!(
            "num_hidden_layers = {layers} is more than the {MAX_LAYERS} layers a model may have"
        )));
    }
    Ok(())
}

/// Model family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Family {
    /// Llama and Llama-like (Mistral).
    Llama,
    /// Qwen2 (q/k/v bias).
    Qwen2,
    /// Qwen3 (q/k norm).
    Qwen3,
    /// Qwen3-MoE.
    Qwen3Moe,
    /// DeepSeek-V3 (and V2-style MLA).
    DeepseekV3,
    /// Kimi-K2 (DeepSeek-V3 architecture).
    KimiK2,
    /// Any other architecture: a model known only from what its workers declare
    /// ([`crate::declared`]), never read from a config.json (its [`ModelConfig`] is
    /// [`ModelConfig::declared`]: no sizes, only the number of numbered blocks).
    Declared,
}

/// Mixture-of-experts settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Routed experts per MoE layer.
    pub experts: u32,
    /// Intermediate size of one expert.
    pub intermediate: u32,
    /// Shared experts (DeepSeek), fused into one MLP `shared * intermediate` wide.
    pub shared: u32,
    /// Which layers are MoE (the rest are dense).
    pub moe_layers: Vec<bool>,
    /// Router has an f32 `e_score_correction_bias`.
    pub score_bias: bool,
}

/// Multi-head latent attention settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlaConfig {
    /// q LoRA rank (None: plain q_proj).
    pub q_lora_rank: Option<u32>,
    /// kv LoRA rank.
    pub kv_lora_rank: u32,
    /// Non-rotary part of a q/k head.
    pub nope: u32,
    /// Rotary part.
    pub rope: u32,
    /// v head dim.
    pub v: u32,
}

/// The fields of config.json the planner reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Family.
    pub family: Family,
    /// hidden_size.
    pub hidden: u32,
    /// intermediate_size (dense MLPs).
    pub intermediate: u32,
    /// num_hidden_layers.
    pub layers: u32,
    /// num_attention_heads.
    pub heads: u32,
    /// num_key_value_heads.
    pub kv_heads: u32,
    /// head_dim.
    pub head_dim: u32,
    /// vocab_size.
    pub vocab: u32,
    /// tie_word_embeddings.
    pub tie_embeddings: bool,
    /// q/k/v biases (Qwen2, or `attention_bias`).
    pub attention_bias: bool,
    /// q/k norms (Qwen3).
    pub qk_norm: bool,
    /// MoE settings.
    pub moe: Option<MoeConfig>,
    /// MLA settings.
    pub mla: Option<MlaConfig>,
    /// Parameter dtype (torch_dtype).
    pub dtype: DType,
}

fn field_u32(v: &Value, key: &str) -> Result<u32, PlanError> {
    let x = v
        .get(key)
        .ok_or_else(|| PlanError::BadConfig(format!("missing field {key:?}")))?;
    let n = x
        .as_u64()
        .ok_or_else(|| PlanError::BadConfig(format!("field {key:?} is not a whole number: {x}")))?;
    if n == 0 || n > u32::MAX as u64 {
        return Err(PlanError::BadConfig(format!(
            "field {key:?} = {n} is out of range"
        )));
    }
    Ok(n as u32)
}

fn opt_u32(v: &Value, key: &str) -> Result<Option<u32>, PlanError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => field_u32(v, key).map(Some),
    }
}

fn opt_bool(v: &Value, key: &str, default: bool) -> bool {
    v.get(key).and_then(Value::as_bool).unwrap_or(default)
}

impl ModelConfig {
    /// Parses the text of a Hugging Face config.json, without the size bounds of
    /// [`crate::model_bounds`] (use [`ModelConfig::from_json`], which checks them).
    pub fn parse_json(text: &str) -> Result<ModelConfig, PlanError> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| PlanError::BadConfig(format!("not JSON: {e}")))?;
        let family = family_of(&v)?;
        let hidden = field_u32(&v, "hidden_size")?;
        let heads = field_u32(&v, "num_attention_heads")?;
        let kv_heads = opt_u32(&v, "num_key_value_heads")?.unwrap_or(heads);
        let layers = field_u32(&v, "num_hidden_layers")?;
        // Before the per-layer lists below are allocated.
        check_layers(layers)?;
        let head_dim = match opt_u32(&v, "head_dim")? {
            Some(d) => d,
            None => {
                if hidden % heads != 0 {
                    return Err(PlanError::BadConfig(format!(
                        "no head_dim and hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
                    )));
                }
                hidden / heads
            }
        };
        // transformers 5 writes `dtype`, earlier versions `torch_dtype`.
        let dtype = match ["torch_dtype", "dtype"]
            .iter()
            .find_map(|k| v.get(*k).and_then(Value::as_str))
        {
            None => DType::BF16,
            Some(s) => s
                .parse::<DType>()
                .map_err(|e| PlanError::BadConfig(format!("torch_dtype: {e}")))?,
        };
        let is_ds = matches!(family, Family::DeepseekV3 | Family::KimiK2);
        let moe = match family {
            Family::Qwen3Moe => Some(qwen3_moe(&v, layers)?),
            _ if is_ds => deepseek_moe(&v, layers)?,
            _ => None,
        };
        let mla = if is_ds { Some(mla_of(&v)?) } else { None };
        let needs_intermediate = moe
            .as_ref()
            .is_none_or(|m| m.moe_layers.iter().any(|&x| !x));
        let intermediate = if needs_intermediate {
            field_u32(&v, "intermediate_size")?
        } else {
            opt_u32(&v, "intermediate_size")?.unwrap_or(0)
        };
        let config = ModelConfig {
            family,
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            head_dim,
            vocab: field_u32(&v, "vocab_size")?,
            tie_embeddings: opt_bool(&v, "tie_word_embeddings", false),
            attention_bias: opt_bool(&v, "attention_bias", family == Family::Qwen2),
            qk_norm: family == Family::Qwen3 || family == Family::Qwen3Moe,
            moe,
            mla,
            dtype,
        };
        Ok(config)
    }
}

/// The family a config.json names in `model_type` (or, without one, in `architectures`).
fn family_of(v: &Value) -> Result<Family, PlanError> {
    let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
    let arch = v
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .unwrap_or("");
    Ok(match model_type {
        "llama" | "mistral" => Family::Llama,
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        "qwen3_moe" => Family::Qwen3Moe,
        "deepseek_v3" | "deepseek_v2" => Family::DeepseekV3,
        "kimi_k2" => Family::KimiK2,
        "" if arch == "DeepseekV3ForCausalLM" => Family::DeepseekV3,
        other => {
            return Err(PlanError::UnknownFamily {
                family: if other.is_empty() {
                    arch.to_string()
                } else {
                    other.to_string()
                },
            });
        }
    })
}

/// Qwen3-MoE experts: every `decoder_sparse_step`-th layer is MoE, except `mlp_only_layers`.
fn qwen3_moe(v: &Value, layers: u32) -> Result<MoeConfig, PlanError> {
    // transformers 5 saves `num_experts` under its attribute-map name `num_local_experts`.
    let key = match (v.get("num_experts"), v.get("num_local_experts")) {
        (None | Some(Value::Null), Some(_)) => "num_local_experts",
        _ => "num_experts",
    };
    let experts = field_u32(v, key)?;
    let step = opt_u32(v, "decoder_sparse_step")?.unwrap_or(1);
    let only: Vec<u64> = v
        .get("mlp_only_layers")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let moe_layers = (0..layers)
        .map(|l| !only.contains(&(l as u64)) && (l + 1) % step == 0)
        .collect();
    Ok(MoeConfig {
        experts,
        intermediate: field_u32(v, "moe_intermediate_size")?,
        shared: 0,
        moe_layers,
        score_bias: false,
    })
}

/// DeepSeek-V3 / Kimi-K2 experts (none without `n_routed_experts`): layers from
/// `first_k_dense_replace` on, every `moe_layer_freq`-th, with shared experts and the router
/// bias of `noaux_tc`.
fn deepseek_moe(v: &Value, layers: u32) -> Result<Option<MoeConfig>, PlanError> {
    let Some(experts) = opt_u32(v, "n_routed_experts")? else {
        return Ok(None);
    };
    let first = v
        .get("first_k_dense_replace")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let freq = opt_u32(v, "moe_layer_freq")?.unwrap_or(1) as u64;
    let moe_layers = (0..layers as u64)
        .map(|l| l >= first && l % freq == 0)
        .collect();
    Ok(Some(MoeConfig {
        experts,
        intermediate: field_u32(v, "moe_intermediate_size")?,
        shared: match v.get("n_shared_experts").and_then(Value::as_u64) {
            None | Some(0) => 0,
            Some(_) => field_u32(v, "n_shared_experts")?,
        },
        moe_layers,
        score_bias: v.get("topk_method").and_then(Value::as_str) == Some("noaux_tc"),
    }))
}

/// MLA attention settings (DeepSeek-V3 / Kimi-K2).
fn mla_of(v: &Value) -> Result<MlaConfig, PlanError> {
    Ok(MlaConfig {
        q_lora_rank: opt_u32(v, "q_lora_rank")?,
        kv_lora_rank: field_u32(v, "kv_lora_rank")?,
        nope: field_u32(v, "qk_nope_head_dim")?,
        rope: field_u32(v, "qk_rope_head_dim")?,
        v: field_u32(v, "v_head_dim")?,
    })
}

impl ModelConfig {
    /// The config of a declared model ([`Family::Declared`]): `blocks` numbered blocks (the
    /// mesh groups between the first and the last, see [`crate::declared`]) and the dtype most
    /// of its tensors are in; every size is 0, since nothing reads them for such a model.
    pub fn declared(blocks: u32, dtype: DType) -> ModelConfig {
        ModelConfig {
            family: Family::Declared,
            hidden: 0,
            intermediate: 0,
            layers: blocks,
            heads: 0,
            kv_heads: 0,
            head_dim: 0,
            vocab: 0,
            tie_embeddings: false,
            attention_bias: false,
            qk_norm: false,
            moe: None,
            mla: None,
            dtype,
        }
    }
}
