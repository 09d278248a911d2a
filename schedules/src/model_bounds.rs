//! The bounds a config.json must keep for its model to be built: every tensor dimension fits
//! the `u32` of a [`crate::table::Shape`], the tensor count and the total size stay far from
//! what the planner's `u64` byte offsets and `u16` mesh groups can hold, and building the
//! parameter list cannot exhaust memory.
//!
//! Why a separate check: [`crate::Model::from_config`] multiplies config fields as `u32`
//! (`num_attention_heads * head_dim`, `moe_intermediate_size * n_shared_experts`) and appends a
//! tensor per routed expert per layer. A config.json is user input (`--model path`), so
//! [`crate::model::ModelConfig::from_json`] runs this check and names the field that is out of
//! range instead of letting an overflow panic or a billion-tensor list take the machine. The
//! sizes here are worked out in closed form (no tensor is built); a test holds them equal to
//! the built models' for every preset and family.
//!
//! [`ModelConfig::from_json`], the checked entry (parse, then these bounds), lives here so that
//! the parse ([`crate::model_config`]) need not know the bounds: the bounds read the config,
//! never the other way round.

use crate::error::PlanError;
pub use crate::model_config::MAX_LAYERS;
use crate::model_config::{MlaConfig, ModelConfig, check_layers};

/// Most tensors a model may have (counting routed experts one tensor per expert and
/// projection, the largest of the expert forms). Kimi-K2 has about 71,000; two million keep
/// the parameter list of any model under a few hundred MB.
pub const MAX_TENSORS: u64 = 1 << 21;

/// Most bytes a model may have in its dtype: 1 PiB, a thousand times Kimi-K2. Every sum of
/// sizes, offsets and per-rank shares then stays far inside `u64`.
pub const MAX_MODEL_BYTES: u128 = 1 << 50;

/// What the bounds check found a config to hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSize {
    /// Tensors, routed experts counted one per expert and projection.
    pub tensors: u64,
    /// Elements of every tensor together (the same in every expert form).
    pub elements: u128,
}

/// `a * b` (or a sum) as a tensor dimension: it must fit `u32`.
fn dim(value: u64, what: &str) -> Result<u64, PlanError> {
    if value > u32::MAX as u64 {
        return Err(PlanError::BadConfig(format!(
            "{what} = {value} does not fit a tensor dimension (at most {})",
            u32::MAX
        )));
    }
    Ok(value)
}

/// Tensors and elements of one decoder layer's attention.
fn attention(c: &ModelConfig) -> Result<(u64, u128), PlanError> {
    let h = c.hidden as u64;
    let head_dim = c.head_dim as u64;
    let q = dim(c.heads as u64 * head_dim, "num_attention_heads * head_dim")?;
    let kv = dim(
        c.kv_heads as u64 * head_dim,
        "num_key_value_heads * head_dim",
    )?;
    let (mut tensors, mut elements) = (4u64, (2 * q * h + 2 * kv * h) as u128);
    if c.attention_bias {
        tensors += 3;
        elements += (q + 2 * kv) as u128;
    }
    if c.qk_norm {
        tensors += 2;
        elements += 2 * head_dim as u128;
    }
    Ok((tensors, elements))
}

/// Tensors and elements of one decoder layer's multi-head latent attention.
fn mla_attention(c: &ModelConfig, m: &MlaConfig) -> Result<(u64, u128), PlanError> {
    let (h, heads) = (c.hidden as u128, c.heads as u64);
    let qk = dim(
        m.nope as u64 + m.rope as u64,
        "qk_nope_head_dim + qk_rope_head_dim",
    )?;
    let q_rows = dim(
        heads * qk,
        "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)",
    )? as u128;
    let kv_a = dim(
        m.kv_lora_rank as u64 + m.rope as u64,
        "kv_lora_rank + qk_rope_head_dim",
    )? as u128;
    let kv_b = dim(
        heads * (m.nope as u64 + m.v as u64),
        "num_attention_heads * (qk_nope_head_dim + v_head_dim)",
    )? as u128;
    let o = dim(heads * m.v as u64, "num_attention_heads * v_head_dim")? as u128;
    let kv = m.kv_lora_rank as u128;
    let (mut tensors, mut elements) = (4u64, kv_a * h + kv + kv_b * kv + h * o);
    match m.q_lora_rank {
        Some(r) => {
            let r = r as u128;
            tensors += 3;
            elements += r * h + r + q_rows * r;
        }
        None => {
            tensors += 1;
            elements += q_rows * h;
        }
    }
    Ok((tensors, elements))
}

impl ModelConfig {
    /// Parses the text of a Hugging Face config.json ([`ModelConfig::parse_json`]) and checks
    /// the bounds in this module's docs, naming the field that is out of range.
    pub fn from_json(text: &str) -> Result<ModelConfig, PlanError> {
        let config = ModelConfig::parse_json(text)?;
        config.check_bounds()?;
        Ok(config)
    }

    /// Checks the bounds in this module's docs and returns the model's size, or names the
    /// field (or product of fields) that is out of range.
    pub fn check_bounds(&self) -> Result<ModelSize, PlanError> {
        check_layers(self.layers)?;
        let h = self.hidden as u128;
        let (attn_tensors, attn_elements) = match &self.mla {
            Some(m) => mla_attention(self, m)?,
            None => attention(self)?,
        };
        // Two norms and the attention in every layer.
        let common = (2 + attn_tensors, 2 * h + attn_elements);
        let dense = (common.0 + 3, common.1 + 3 * self.intermediate as u128 * h);
        let moe_layers = self.moe.as_ref().map_or(0, |m| {
            m.moe_layers
                .iter()
                .take(self.layers as usize)
                .filter(|&&x| x)
                .count() as u64
        });
        let dense_layers = self.layers as u64 - moe_layers;
        let mut tensors = dense_layers * dense.0;
        let mut elements = dense_layers as u128 * dense.1;
        if let Some(m) = &self.moe {
            let experts = m.experts as u128;
            let shared = dim(
                m.intermediate as u64 * m.shared as u64,
                "moe_intermediate_size * n_shared_experts",
            )? as u128;
            // StackedGateUp packs gate and up into one tensor `2 * moe_intermediate_size` wide.
            dim(
                2 * m.intermediate as u64,
                "2 * moe_intermediate_size (experts' packed gate_up_proj)",
            )?;
            let mut layer_tensors = common.0 + 1 + 3 * m.experts as u64;
            let mut layer_elements =
                common.1 + experts * h + 3 * experts * m.intermediate as u128 * h;
            if m.score_bias {
                layer_tensors += 1;
                layer_elements += experts;
            }
            if m.shared > 0 {
                layer_tensors += 3;
                layer_elements += 3 * shared * h;
            }
            tensors += moe_layers * layer_tensors;
            elements += moe_layers as u128 * layer_elements;
        }
        // Embedding, final norm, lm_head.
        tensors += 2 + u64::from(!self.tie_embeddings);
        elements += h + (1 + u128::from(!self.tie_embeddings)) * self.vocab as u128 * h;
        if tensors > MAX_TENSORS {
            return Err(PlanError::BadConfig(format!(
                "the model would have {tensors} tensors (num_hidden_layers = {}, routed experts \
                 one per expert and projection), more than the {MAX_TENSORS} a model may have",
                self.layers
            )));
        }
        let bytes = elements * self.dtype.size() as u128;
        if bytes > MAX_MODEL_BYTES {
            return Err(PlanError::BadConfig(format!(
                "the model would be {bytes} bytes in {}, more than the {MAX_MODEL_BYTES} (1 PiB) \
                 a model may be",
                self.dtype
            )));
        }
        Ok(ModelSize { tensors, elements })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::PRESETS;
    use crate::{ExpertForm, Model};

    /// Small configs of the shapes the presets lack: Llama, Qwen2 with biases, tied
    /// embeddings, MLA without q LoRA, Qwen3-MoE with dense layers.
    const SMALL: &[&str] = &[
        r#"{"model_type":"llama","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":2,
            "num_hidden_layers":3,"intermediate_size":96,"vocab_size":100,"tie_word_embeddings":true}"#,
        r#"{"model_type":"qwen2","hidden_size":64,"num_attention_heads":4,"num_hidden_layers":2,
            "intermediate_size":96,"vocab_size":100}"#,
        r#"{"model_type":"deepseek_v3","hidden_size":64,"num_attention_heads":4,"num_hidden_layers":4,
            "intermediate_size":96,"vocab_size":100,"kv_lora_rank":16,"qk_nope_head_dim":8,
            "qk_rope_head_dim":4,"v_head_dim":8,"n_routed_experts":6,"moe_intermediate_size":16,
            "n_shared_experts":2,"first_k_dense_replace":1,"moe_layer_freq":2,"topk_method":"noaux_tc"}"#,
        r#"{"model_type":"qwen3_moe","hidden_size":64,"num_attention_heads":4,"num_hidden_layers":5,
            "intermediate_size":96,"vocab_size":100,"num_experts":8,"moe_intermediate_size":16,
            "decoder_sparse_step":2,"mlp_only_layers":[3],"head_dim":32}"#,
    ];

    #[test]
    fn closed_form_sizes_are_the_built_models() {
        let configs = PRESETS
            .iter()
            .map(|(name, _)| crate::presets::preset_config(name).unwrap())
            .chain(SMALL.iter().copied());
        for json in configs {
            let config = ModelConfig::from_json(json).unwrap();
            let size = config.check_bounds().unwrap();
            let per_expert = Model::from_config("m", config.clone(), ExpertForm::PerExpert);
            assert_eq!(size.tensors, per_expert.params.len() as u64, "{json}");
            for form in [
                ExpertForm::PerExpert,
                ExpertForm::Stacked,
                ExpertForm::StackedGateUp,
            ] {
                let model = Model::from_config("m", config.clone(), form);
                assert!(model.params.len() as u64 <= size.tensors, "{json} {form:?}");
                assert_eq!(
                    size.elements,
                    model.num_elements() as u128,
                    "{json} {form:?}"
                );
            }
        }
    }

    /// `SMALL[0]` (Llama) with `fields` replaced.
    fn llama_with(fields: &str) -> String {
        format!(
            r#"{{"model_type":"llama","hidden_size":64,"num_attention_heads":4,"num_hidden_layers":3,
                "intermediate_size":96,"vocab_size":100,{fields}}}"#
        )
    }

    fn error_of(json: &str) -> String {
        ModelConfig::from_json(json).unwrap_err().to_string()
    }

    #[test]
    fn products_that_overflow_a_dimension_are_named() {
        // The input the fuzzer found: heads * head_dim past u32 panicked in from_config.
        let e = error_of(&llama_with(
            r#""num_attention_heads":70000,"head_dim":70000"#,
        ));
        assert!(
            e.contains("num_attention_heads * head_dim = 4900000000"),
            "{e}"
        );
        let e = error_of(&llama_with(
            r#""num_key_value_heads":70000,"head_dim":70000,"num_attention_heads":1"#,
        ));
        assert!(e.contains("num_key_value_heads * head_dim"), "{e}");
        let ds = SMALL[2].replace(
            r#""n_shared_experts":2"#,
            r#""n_shared_experts":4000000000"#,
        );
        assert!(error_of(&ds).contains("moe_intermediate_size * n_shared_experts"));
        let ds = SMALL[2].replace(r#""v_head_dim":8"#, r#""v_head_dim":4294967295"#);
        assert!(error_of(&ds).contains("num_attention_heads * (qk_nope_head_dim + v_head_dim)"));
        let ds = SMALL[2].replace(r#""n_shared_experts":2"#, r#""n_shared_experts":-1"#);
        assert!(
            ModelConfig::from_json(&ds).is_ok(),
            "a negative count is read as none"
        );
        let ds = SMALL[2].replace(
            r#""n_shared_experts":2"#,
            r#""n_shared_experts":8589934592"#,
        );
        assert!(
            error_of(&ds).contains("n_shared_experts"),
            "not truncated to u32"
        );
    }

    #[test]
    fn models_too_big_to_build_are_refused() {
        let e = error_of(&llama_with(r#""num_hidden_layers":4000000000"#));
        assert!(e.contains("num_hidden_layers = 4000000000"), "{e}");
        let many_experts = SMALL[3].replace(r#""num_experts":8"#, r#""num_experts":3000000"#);
        let e = error_of(&many_experts);
        assert!(
            e.contains("tensors") && e.contains(&MAX_TENSORS.to_string()),
            "{e}"
        );
        let huge =
            llama_with(r#""hidden_size":4000000000,"head_dim":1,"intermediate_size":4000000000"#);
        let e = error_of(&huge);
        assert!(e.contains("bytes") && e.contains("1 PiB"), "{e}");
    }
}
