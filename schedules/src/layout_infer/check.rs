//! The degree checks an [`InferSpec`] must pass before any rank is built, so a spec that
//! cannot be laid out is refused with the first destination tensor it breaks, not half-built.

use super::rank::not_div;
use super::{InferFormat, InferSpec};
use crate::error::PlanError;
use crate::model::Model;

/// Refuses a spec whose degrees do not divide what they split: ep by tp, attention heads (and
/// kv heads, split or replicated evenly) by tp, the dense MLP by tp, routed experts by ep (or
/// their width by tp when ep = 1), shared experts by tp. The error names the first destination
/// tensor affected, in the spec's format.
pub(super) fn check_divisible(model: &Model, spec: &InferSpec) -> Result<(), PlanError> {
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
