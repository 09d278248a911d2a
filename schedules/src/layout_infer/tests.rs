//! Engine shapes of known models, checked against what the engines hold.

use super::*;
use weightsync_common::DType;

use crate::model::ExpertForm;
use crate::table::Shape;

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
