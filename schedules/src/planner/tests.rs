//! The planner's shortcuts change nothing: a table planned reusing the regions of parameters
//! that repeat one another is the one planned analysing every parameter, byte for byte.

use super::{Planner, Reuse, plan_steps};
use crate::cost::CostModel;
use crate::layout_infer::{InferDType, InferSpec, InferenceLayout};
use crate::layout_train::{TrainSpec, TrainingLayout};
use crate::model::{ExpertForm, Model};

/// Qwen3-MoE-like, 3 layers of 16 experts (`{I}`: the experts' width).
const MOE: &str = r#"{"model_type":"qwen3_moe","hidden_size":256,"intermediate_size":512,
 "moe_intermediate_size":{I},"num_experts":16,"num_experts_per_tok":2,"decoder_sparse_step":1,
 "mlp_only_layers":[0],"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,
 "head_dim":128,"vocab_size":300}"#;

/// DeepSeek-V3-like: MLA, a dense first layer, then 8 routed experts and a shared one.
const MLA: &str = r#"{"model_type":"deepseek_v3","hidden_size":256,"intermediate_size":512,
 "moe_intermediate_size":256,"n_routed_experts":8,"n_shared_experts":1,"first_k_dense_replace":1,
 "num_experts_per_tok":2,"topk_method":"noaux_tc","num_hidden_layers":3,"num_attention_heads":4,
 "num_key_value_heads":4,"q_lora_rank":256,"kv_lora_rank":128,"qk_nope_head_dim":128,
 "qk_rope_head_dim":64,"v_head_dim":128,"vocab_size":300}"#;

/// Plans `(model, train, infer, dtype)` both ways; returns how many params reused another's
/// regions.
fn same_table_both_ways(model: &Model, train: &str, infer: &str, dtype: &str) -> usize {
    let case = format!("{} {train} -> {infer} {dtype}", model.name);
    let tspec: TrainSpec = train.parse().unwrap();
    let mut ispec: InferSpec = infer.parse().unwrap();
    ispec.dtype = dtype.parse::<InferDType>().unwrap();
    let t = TrainingLayout::build(model, &tspec).unwrap();
    let i = InferenceLayout::build(model, &ispec).unwrap();
    let cost = CostModel::default();
    let (reused, repeats) =
        plan_steps(model, &t, &i, &cost, &mut |_, _| {}, Reuse::Repeats).unwrap();
    let (analysed, none) =
        plan_steps(model, &t, &i, &cost, &mut |_, _| {}, Reuse::Nothing).unwrap();
    assert_eq!(none, 0, "{case}: repeats found with reuse off");
    // What sourcing starts from: the trainers' single-holder loads after analysis.
    let loads = |reuse| {
        let period = i.engine_period().filter(|p| p.engines > 1);
        let mut p = Planner::new(model, &t, &i, &cost, period).unwrap();
        p.reuse = reuse;
        p.analyse(&mut |_, _| {}).unwrap();
        p.loads
    };
    assert_eq!(
        loads(Reuse::Repeats),
        loads(Reuse::Nothing),
        "{case}: the loads changed when repeats were reused"
    );
    assert!(
        reused.to_bincode() == analysed.to_bincode(),
        "{case}: the table changed when repeats were reused"
    );
    repeats
}

fn moe(width: u32, experts: ExpertForm) -> Model {
    let json = MOE.replace("{I}", &width.to_string());
    Model::from_config_json("moe", &json, experts).unwrap()
}

#[test]
fn reusing_repeated_experts_gives_the_table_analysing_each_would() {
    let per_expert = moe(256, ExpertForm::PerExpert);
    // Experts whose regions all have one holder (no regions of their own), fp8 and bf16, with
    // engines and attention replicas.
    for (train, infer, dtype) in [
        ("ep=2,fsdp=2", "tp=2,ep=4,dp=2", "fp8"),
        ("ep=4,fsdp=2", "tp=2,dp=2", "bf16"),
        ("pp=2,ep=2,fsdp=2", "tp=4,ep=4", "fp8"),
        ("fsdp=4", "tp=1,ep=2", "bf16"),
    ] {
        let repeats = same_table_both_ways(&per_expert, train, infer, dtype);
        assert!(
            repeats > 0,
            "{train} -> {infer} {dtype}: nothing was reused"
        );
    }
}

#[test]
fn reusing_repeats_with_gathers_and_replicas_gives_the_same_table() {
    // 192-wide experts cut by fsdp=4 into 48 rows: fp8 blocks straddle the shards, so the
    // repeated experts have gather regions (copied and sourced on their own).
    let i192 = moe(192, ExpertForm::PerExpert);
    assert!(same_table_both_ways(&i192, "ep=2,fsdp=4", "tp=2,ep=4", "fp8") > 0);
    // 320 rows cut by fsdp=2 at 160: blocks on one shard and one straddling block per expert.
    let i320 = moe(320, ExpertForm::PerExpert);
    assert!(same_table_both_ways(&i320, "ep=2,fsdp=2", "tp=2,ep=4,dp=2", "fp8") > 0);
    // Replicated training (dp): every region has several holders, split by the flow.
    assert!(same_table_both_ways(&i192, "dp=2,ep=2,fsdp=2", "tp=2,dp=2", "bf16") > 0);
    // Stacked experts (one param per layer) and MLA: whatever repeats, the same table.
    let stacked = moe(256, ExpertForm::Stacked);
    same_table_both_ways(&stacked, "ep=2,fsdp=2,experts=stacked", "tp=2,ep=4", "fp8");
    let mla = Model::from_config_json("mla", MLA, ExpertForm::PerExpert).unwrap();
    assert!(same_table_both_ways(&mla, "pp=1,ep=2,fsdp=2", "tp=2,ep=4,dp=2", "fp8") > 0);
}
