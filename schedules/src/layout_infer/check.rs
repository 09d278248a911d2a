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
    let (tp, ep) = (spec.tp, spec.ep);
    if ep > 1 && ep % tp != 0 {
        return Err(PlanError::BadSpec {
            spec: spec.to_string(),
            reason: format!("ep={ep} must be 1 or a multiple of tp={tp}"),
        });
    }
    let names = Names { model, spec };
    check_attention(&names)?;
    check_mlp(&names)
}

/// Names the destination tensor a refusal is about, in the spec's format.
struct Names<'a> {
    model: &'a Model,
    spec: &'a InferSpec,
}

impl Names<'_> {
    /// `fused` / `hf_name` of a tensor of the first (dense or MoE) layer that has it.
    fn what(&self, moe: bool, fused: &str, hf_name: &str) -> String {
        let c = &self.model.config;
        let layer = (0..c.layers)
            .find(|&l| c.moe.as_ref().is_some_and(|m| m.moe_layers[l as usize]) == moe)
            .unwrap_or(0);
        let hf = self.spec.format == InferFormat::Hf;
        format!(
            "inference tensor model.layers.{layer}.{} of {} (format {}, tp={}, ep={})",
            if hf { hf_name } else { fused },
            self.model.name,
            self.spec.format.name(),
            self.spec.tp,
            self.spec.ep,
        )
    }
}

/// Attention heads split by tp; kv heads split or replicated evenly.
fn check_attention(names: &Names) -> Result<(), PlanError> {
    let c = &names.model.config;
    let tp = names.spec.tp;
    if !c.heads.is_multiple_of(tp) {
        let (fused, hf_name) = match &c.mla {
            None => ("self_attn.qkv_proj.weight", "self_attn.q_proj.weight"),
            Some(m) if m.q_lora_rank.is_some() => {
                ("self_attn.q_b_proj.weight", "self_attn.q_b_proj.weight")
            }
            Some(_) => ("self_attn.q_proj.weight", "self_attn.q_proj.weight"),
        };
        return Err(not_div(
            names.what(false, fused, hf_name),
            "tp",
            tp,
            "num_attention_heads",
            c.heads,
        ));
    }
    let kv = c.kv_heads;
    if c.mla.is_none()
        && ((tp <= kv && !kv.is_multiple_of(tp)) || (tp > kv && !tp.is_multiple_of(kv)))
    {
        return Err(not_div(
            names.what(
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
    Ok(())
}

/// The dense MLP split by tp; routed experts by ep (or their width by tp when ep = 1); shared
/// experts by tp.
fn check_mlp(names: &Names) -> Result<(), PlanError> {
    let c = &names.model.config;
    let (tp, ep) = (names.spec.tp, names.spec.ep);
    let has_dense = c
        .moe
        .as_ref()
        .is_none_or(|m| m.moe_layers.iter().any(|&x| !x));
    if has_dense && !c.intermediate.is_multiple_of(tp) {
        return Err(not_div(
            names.what(false, "mlp.gate_up_proj.weight", "mlp.gate_proj.weight"),
            "tp",
            tp,
            "intermediate_size",
            c.intermediate,
        ));
    }
    let Some(m) = &c.moe else {
        return Ok(());
    };
    let experts = names.what(true, "mlp.experts.w13_weight", "mlp.experts.gate_up_proj");
    if ep > 1 && m.experts % ep != 0 {
        return Err(not_div(experts, "ep", ep, "num_experts", m.experts));
    }
    if ep == 1 && m.intermediate % tp != 0 {
        return Err(not_div(
            experts,
            "tp",
            tp,
            "moe_intermediate_size",
            m.intermediate,
        ));
    }
    if m.shared > 0 && (m.intermediate * m.shared) % tp != 0 {
        return Err(not_div(
            names.what(
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
    Ok(())
}
