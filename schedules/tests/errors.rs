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
fn worlds_past_a_million_ranks_are_refused_before_anything_is_allocated() {
    // fsdp=4294967295 used to abort allocating 34 GB for the per-rank lists.
    for spec in ["fsdp=4294967295", "pp=1024,fsdp=1025", "pp=65536,dp=65536"] {
        let e = spec.parse::<TrainSpec>().unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("1048576 ranks") && msg.contains("pp * dp * ep * fsdp * tp"),
            "{spec}: {msg}"
        );
    }
    assert_eq!(
        "pp=1024,fsdp=1024"
            .parse::<TrainSpec>()
            .unwrap()
            .world()
            .unwrap(),
        1 << 20
    );
    let e = "tp=65536,dp=65536".parse::<InferSpec>().unwrap_err();
    assert!(
        e.to_string()
            .contains("max(tp, ep) * dp = 4294967296 inference ranks"),
        "{e}"
    );
    assert!("tp=8,ep=64,dp=16384".parse::<InferSpec>().is_ok());
    // A spec that parses but whose layout would not fit: refused by its piece count.
    let m = Model::preset("qwen3-0.6b", ExpertForm::PerExpert).unwrap();
    let Err(e) = InferenceLayout::build(&m, &"tp=1,dp=1048576".parse().unwrap()) else {
        panic!("a layout of 1048576 engines of 310 pieces was built");
    };
    assert!(
        e.to_string().contains("pieces per engine times dp=1048576"),
        "{e}"
    );
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

#[test]
fn layout_errors_name_the_tensor_and_the_format() {
    let m = model(DENSE, ExpertForm::PerExpert);
    for (spec, tensor, format) in [
        (
            "tp=3,format=hf",
            "model.layers.0.self_attn.q_proj.weight",
            "format hf",
        ),
        (
            "tp=3",
            "model.layers.0.self_attn.qkv_proj.weight",
            "format fused",
        ),
    ] {
        let e = InferenceLayout::build(&m, &spec.parse().unwrap()).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(tensor) && msg.contains(format) && msg.contains("num_attention_heads"),
            "{msg}"
        );
    }
    let moe = model(MOE, ExpertForm::StackedGateUp);
    let e = InferenceLayout::build(&moe, &"ep=3,format=hf".parse().unwrap()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("model.layers.1.mlp.experts.gate_up_proj") && msg.contains("num_experts"),
        "{msg}"
    );
    let e = "tp=2,format=gguf".parse::<InferSpec>().unwrap_err();
    assert!(
        e.to_string().contains("gguf") && e.to_string().contains("hf"),
        "{e}"
    );
}

#[test]
fn fp8_gate_up_blocks_the_format_cannot_hold_are_refused_by_name() {
    let fp8 = |s: &str| InferSpec {
        dtype: InferDType::Fp8,
        ..s.parse().unwrap()
    };
    // hf: one [2I, H] grid per expert; I = 192 from separate gate and up tensors would put
    // gate and up rows of two training tensors in one block.
    for form in [ExpertForm::PerExpert, ExpertForm::Stacked] {
        let m = model(MOE_I192, form);
        let e = InferenceLayout::build(&m, &fp8("ep=2,format=hf")).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, PlanError::BadSpec { .. }), "{msg}");
        assert!(
            msg.contains("model.layers.1.mlp.experts.gate_up_proj")
                && msg.contains("format hf")
                && msg.contains("experts=stacked-gate-up"),
            "{msg}"
        );
    }
    // ... and so would the tp halves of the packed tensor (96 gate rows, 96 up rows).
    let packed = model(MOE_I192, ExpertForm::StackedGateUp);
    let e = InferenceLayout::build(&packed, &fp8("tp=2,format=hf")).unwrap_err();
    assert!(e.to_string().contains("tp=2 halves"), "{e}");
    // fused: engines keep gate and up on separate grids, which the packed I = 192 tensor mixes.
    let e = InferenceLayout::build(&packed, &fp8("ep=2")).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("model.layers.1.mlp.experts.w13_weight")
            && msg.contains("format fused")
            && msg.contains("format=hf"),
        "{msg}"
    );
    // bf16 has no blocks: every one of them plans.
    for spec in ["ep=2,format=hf", "tp=2,format=hf", "ep=2"] {
        InferenceLayout::build(&packed, &spec.parse().unwrap()).unwrap();
    }
}

#[test]
fn packed_experts_refuse_training_tp() {
    let m = model(MOE, ExpertForm::StackedGateUp);
    let e =
        TrainingLayout::build(&m, &"tp=2,experts=stacked-gate-up".parse().unwrap()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("model.layers.1.mlp.experts.gate_up_proj") && msg.contains("tp=2"),
        "{msg}"
    );
    // The spec's form must be the model's.
    let e = TrainingLayout::build(&m, &"fsdp=2".parse().unwrap()).unwrap_err();
    assert!(e.to_string().contains("experts=stacked-gate-up"), "{e}");
}
