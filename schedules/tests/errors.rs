//! Inconsistent input gives an error naming the parameter and the ranks, never a panic.

mod common;

use common::*;
use weightsync_schedules::table::TensorBox;
use weightsync_schedules::*;

fn setup() -> (Model, TrainingLayout, InferenceLayout) {
    let m = model(DENSE, ExpertForm::PerExpert);
    let t = TrainingLayout::build(&m, &"fsdp=2".parse().unwrap()).unwrap();
    let i = InferenceLayout::build(&m, &"tp=2".parse().unwrap()).unwrap();
    (m, t, i)
}

#[test]
fn box_outside_its_tensor_names_param_and_rank() {
    let (m, mut t, i) = setup();
    let s = t.shards.iter_mut().find(|s| s.rank == 1).unwrap();
    s.global.len[0] += 1000;
    let name = m.params[s.param as usize].name.to_string();
    let e = plan(&m, &t, &i, &CostModel::default()).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PlanError::BoxOutsideTensor { .. }), "{msg}");
    assert!(msg.contains(&name) && msg.contains("rank 1"), "{msg}");
}

#[test]
fn uncovered_region_names_param_and_holders() {
    let (m, mut t, i) = setup();
    let q = m
        .params
        .iter()
        .position(|p| &*p.name == "model.layers.1.self_attn.q_proj.weight")
        .unwrap() as u32;
    t.shards.retain(|s| !(s.param == q && s.rank == 1));
    let e = plan(&m, &t, &i, &CostModel::default()).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PlanError::Uncovered { .. }), "{msg}");
    assert!(
        msg.contains("model.layers.1.self_attn.q_proj.weight") && msg.contains("256..512"),
        "{msg}"
    );
    assert!(msg.contains("holding parts: 0"), "{msg}");
}

#[test]
fn tp_not_dividing_heads_is_named() {
    let m = model(DENSE, ExpertForm::PerExpert);
    let e = InferenceLayout::build(&m, &"tp=3".parse().unwrap()).unwrap_err();
    assert!(e.to_string().contains("num_attention_heads"), "{e}");
    let e = TrainingLayout::build(&m, &"tp=4".parse().unwrap()).unwrap_err();
    // 4 q heads divide, 2 kv heads do not.
    assert!(e.to_string().contains("num_key_value_heads"), "{e}");
    let moe = model(MOE, ExpertForm::PerExpert);
    let e = TrainingLayout::build(&moe, &"ep=3".parse().unwrap()).unwrap_err();
    assert!(e.to_string().contains("num_experts"), "{e}");
}

#[test]
fn unknown_family_and_bad_specs() {
    let e = Model::from_config_json("x", r#"{"model_type":"mamba"}"#, ExpertForm::PerExpert)
        .unwrap_err();
    assert!(matches!(e, PlanError::UnknownFamily { .. }) && e.to_string().contains("mamba"));
    let e = "pp=2,fsdp=x".parse::<TrainSpec>().unwrap_err();
    assert!(e.to_string().contains("fsdp"), "{e}");
    let e = "tp=2,ep=3".parse::<InferSpec>().unwrap_err();
    assert!(e.to_string().contains("ep=3"), "{e}");
    let e = Model::from_config_json("x", "not json", ExpertForm::PerExpert).unwrap_err();
    assert!(e.to_string().contains("not JSON"), "{e}");
}

#[test]
fn fp8_shard_off_the_block_grid_is_refused() {
    // MQA kv head of 64 rows split over tp=... is fine; an intermediate of 384 over tp=2
    // (192 rows per rank) is not.
    let json = DENSE.replace("\"intermediate_size\":512", "\"intermediate_size\":384");
    let m = model(&json, ExpertForm::PerExpert);
    let spec = InferSpec {
        tp: 2,
        dtype: InferDType::Fp8,
        ..InferSpec::default()
    };
    let e = InferenceLayout::build(&m, &spec).unwrap_err();
    assert!(matches!(e, PlanError::Fp8Misaligned { .. }), "{e}");
    assert!(
        e.to_string().contains("gate_proj") && e.to_string().contains("rank 0"),
        "{e}"
    );
}

#[test]
fn overlapping_destination_pieces_are_refused() {
    let (m, t, mut i) = setup();
    // Make a piece of rank 1 land on top of its neighbour.
    let k = i
        .pieces
        .iter()
        .position(|p| p.rank == 1 && m.params[p.param as usize].name.ends_with("k_proj.weight"))
        .unwrap();
    i.pieces[k].dst_start[0] = 0;
    let e = plan(&m, &t, &i, &CostModel::default()).unwrap_err();
    assert!(matches!(e, PlanError::DestinationCoverage { .. }), "{e}");
    assert!(e.to_string().contains("inference rank 1"), "{e}");
}

#[test]
fn dtype_disagreement_and_missing_rank() {
    let (m, mut t, i) = setup();
    // The last shard of rank 1 (so widening it overlaps nothing) becomes f32 there only.
    let last = t.shards.iter_mut().filter(|s| s.rank == 1).last().unwrap();
    last.dtype = weightsync_common::DType::F32;
    let e = plan(&m, &t, &i, &CostModel::default()).unwrap_err();
    assert!(matches!(e, PlanError::DtypeMismatch { .. }), "{e}");
    let (m, t, i) = setup();
    let table = plan(&m, &t, &i, &CostModel::default()).unwrap();
    let e = table.slice(9).unwrap_err();
    assert!(e.to_string().contains("rank 9"), "{e}");
    // A shard's box can't name a parameter the model lacks.
    let mut t2 = t.clone();
    t2.shards[0].param = 10_000;
    t2.shards[0].global = TensorBox::new(&[0], &[1]);
    let e = plan(&m, &t2, &i, &CostModel::default()).unwrap_err();
    assert!(e.to_string().contains("10000"), "{e}");
}
