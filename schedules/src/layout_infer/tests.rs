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

/// `(name, box)` of every tensor of `rank`.
fn boxes_of(m: &Model, spec: &str, rank: u32) -> Vec<(String, Option<ParamBox>)> {
    let l = InferenceLayout::build(m, &spec.parse().unwrap()).unwrap();
    let b = l.param_boxes(m, rank).unwrap();
    l.ranks[rank as usize]
        .tensors
        .iter()
        .map(|t| t.name.clone())
        .zip(b)
        .collect()
}

fn box_of<'a>(boxes: &'a [(String, Option<ParamBox>)], name: &str) -> &'a Option<ParamBox> {
    &boxes.iter().find(|(n, _)| n == name).unwrap().1
}

/// `(global dims, offset dims)` of a box.
fn dims(b: &Option<ParamBox>) -> (Vec<u32>, Vec<u32>) {
    let b = b.as_ref().expect("a box");
    let n = b.global.ndim as usize;
    (b.global.dims().to_vec(), b.offset[..n].to_vec())
}

#[test]
fn hf_tp2_boxes_are_the_ranks_slices_of_the_whole_tensors() {
    // Qwen3-8B: H 4096, 32 heads, 8 kv heads, D 128, I 12288, V 151936, lm_head untied.
    let m = Model::preset("qwen3-8b", ExpertForm::PerExpert).unwrap();
    let b = boxes_of(&m, "tp=2,dp=2,format=hf", 3); // engine 1, tp rank 1
    assert!(
        b.iter().all(|(_, x)| x.is_some()),
        "every hf tensor is one box: {b:?}"
    );
    let l = "model.layers.5.";
    let at = |n: &str| dims(box_of(&b, &format!("{l}{n}")));
    assert_eq!(
        at("self_attn.q_proj.weight"),
        (vec![4096, 4096], vec![2048, 0])
    );
    assert_eq!(
        at("self_attn.k_proj.weight"),
        (vec![1024, 4096], vec![512, 0])
    );
    assert_eq!(
        at("self_attn.v_proj.weight"),
        (vec![1024, 4096], vec![512, 0])
    );
    assert_eq!(
        at("self_attn.o_proj.weight"),
        (vec![4096, 4096], vec![0, 2048])
    );
    assert_eq!(at("self_attn.q_norm.weight"), (vec![128], vec![0]));
    assert_eq!(
        at("mlp.gate_proj.weight"),
        (vec![12288, 4096], vec![6144, 0])
    );
    assert_eq!(at("mlp.up_proj.weight"), (vec![12288, 4096], vec![6144, 0]));
    assert_eq!(
        at("mlp.down_proj.weight"),
        (vec![4096, 12288], vec![0, 6144])
    );
    assert_eq!(at("input_layernorm.weight"), (vec![4096], vec![0]));
    // transformers keeps the embedding whole; lm_head is vocab-split (torch.chunk).
    let emb = dims(box_of(&b, "model.embed_tokens.weight"));
    assert_eq!(emb, (vec![151936, 4096], vec![0, 0]));
    let lm = dims(box_of(&b, "lm_head.weight"));
    assert_eq!(lm, (vec![151936, 4096], vec![75968, 0]));
    // Every box's parameter is the tensor's namesake.
    for (n, x) in &b {
        assert_eq!(&*m.params[x.unwrap().param as usize].name, n);
    }
}

#[test]
fn hf_embed_vocab_splits_the_embedding_like_lm_head() {
    // Qwen3-8B at tp=8: V 151936 = 8 x 18992.
    let m = Model::preset("qwen3-8b", ExpertForm::PerExpert).unwrap();
    let whole = boxes_of(&m, "tp=8,format=hf", 3);
    let split = boxes_of(&m, "tp=8,format=hf,embed=vocab", 3);
    let emb = "model.embed_tokens.weight";
    assert_eq!(dims(box_of(&whole, emb)), (vec![151936, 4096], vec![0, 0]));
    assert_eq!(
        dims(box_of(&split, emb)),
        (vec![151936, 4096], vec![3 * 18992, 0])
    );
    let layout = |spec: &str| InferenceLayout::build(&m, &spec.parse().unwrap()).unwrap();
    let l = layout("tp=8,format=hf,embed=vocab");
    let t = l.ranks[3].tensors.iter().find(|t| t.name == emb).unwrap();
    assert_eq!(t.shape.dims(), &[18992, 4096]);
    // Only the embedding changes: every other tensor is the same box in both.
    assert_eq!(whole.len(), split.len());
    for ((n, a), (n2, b)) in whole.iter().zip(&split) {
        assert_eq!(n, n2);
        if n != emb {
            assert_eq!(a, b, "{n}");
        }
    }
    // Each rank receives 1/tp of the embedding instead of all of it.
    let bytes = |spec: &str| -> u64 {
        let l = layout(spec);
        l.ranks
            .iter()
            .flat_map(|r| r.tensors.iter())
            .map(|t| t.len)
            .sum()
    };
    let saved = bytes("tp=8,format=hf") - bytes("tp=8,format=hf,embed=vocab");
    assert_eq!(saved, 7 * 151936 * 4096 * 2);
}

#[test]
fn embed_key_parses_prints_and_is_refused_by_name() {
    let s: InferSpec = "tp=2,format=hf,embed=vocab".parse().unwrap();
    assert_eq!(s.embed, EmbedLayout::Vocab);
    assert_eq!(
        s.to_string(),
        "tp=2,ep=1,dp=1,dtype=bf16,format=hf,embed=vocab"
    );
    assert_eq!(s.to_string().parse::<InferSpec>().unwrap(), s);
    // fused splits the embedding already: one spelling of that layout.
    let f: InferSpec = "tp=2,embed=vocab".parse().unwrap();
    assert_eq!(f, "tp=2".parse().unwrap());
    assert_eq!(f.to_string(), "tp=2,ep=1,dp=1,dtype=bf16");
    let e = "tp=2,format=hf,embed=rows"
        .parse::<InferSpec>()
        .unwrap_err();
    assert!(e.to_string().contains("embed \"rows\""), "{e}");
    let e = "tp=2,format=hf,embedding=vocab"
        .parse::<InferSpec>()
        .unwrap_err();
    assert!(e.to_string().contains("embed, fp8)"), "{e}");
}

#[test]
fn fp8_recipe_key_parses_prints_reaches_the_layout_and_is_refused_by_name() {
    let s: InferSpec = "tp=1,dp=2,format=hf,dtype=fp8,fp8=transformers"
        .parse()
        .unwrap();
    assert_eq!(s.fp8, Fp8Recipe::Transformers);
    assert_eq!(
        s.to_string(),
        "tp=1,ep=1,dp=2,dtype=fp8,format=hf,fp8=transformers"
    );
    assert_eq!(s.to_string().parse::<InferSpec>().unwrap(), s);
    // vLLM's recipe is the default, printed back as nothing (the strings of older jobs).
    let v: InferSpec = "tp=2,dtype=fp8,fp8=vllm".parse().unwrap();
    assert_eq!(v, "tp=2,dtype=fp8".parse().unwrap());
    assert_eq!(v.to_string(), "tp=2,ep=1,dp=1,dtype=fp8");
    let d: InferSpec = "tp=2,dtype=fp8,fp8=DeepGEMM".parse().unwrap();
    assert_eq!(d.fp8, Fp8Recipe::DeepGemm);
    // The layout carries it to the planner.
    let m = Model::preset("kimi-k2", ExpertForm::PerExpert).unwrap();
    let l = InferenceLayout::build(
        &m,
        &"tp=8,ep=32,dtype=fp8,fp8=transformers".parse().unwrap(),
    )
    .unwrap();
    assert_eq!(l.fp8_recipe, Fp8Recipe::Transformers);
    let e = "tp=2,dtype=fp8,fp8=sglang"
        .parse::<InferSpec>()
        .unwrap_err();
    assert!(
        e.to_string().contains("\"sglang\"") && e.to_string().contains("transformers"),
        "{e}"
    );
    // Parsed, then refused once the dtype is settled: a job's `--dtype fp8` comes after.
    let bf16: InferSpec = "tp=2,fp8=transformers".parse().unwrap();
    let e = bf16.check_fp8_recipe().unwrap_err();
    assert!(e.to_string().contains("dtype is bf16"), "{e}");
    let fp8 = InferSpec {
        dtype: InferDType::Fp8,
        ..bf16
    };
    fp8.check_fp8_recipe().unwrap();
}

#[test]
fn fused_kv_replicated_and_fp8_boxes() {
    let m = Model::preset("qwen3-0.6b", ExpertForm::PerExpert).unwrap();
    // Fused: qkv_proj and gate_up_proj are not one box; the unfused tensors are.
    let f = boxes_of(&m, "tp=2", 1);
    let l = "model.layers.0.";
    assert!(box_of(&f, &format!("{l}self_attn.qkv_proj.weight")).is_none());
    assert!(box_of(&f, &format!("{l}mlp.gate_up_proj.weight")).is_none());
    let o = dims(box_of(&f, &format!("{l}self_attn.o_proj.weight")));
    assert_eq!(o, (vec![1024, 2048], vec![0, 1024]));
    // tp=16 > 8 kv heads: tp ranks 6 and 7 both hold kv head 3, whole.
    let h = boxes_of(&m, "tp=16,format=hf", 7);
    let k = dims(box_of(&h, &format!("{l}self_attn.k_proj.weight")));
    assert_eq!(k, (vec![1024, 1024], vec![384, 0]));
    // fp8: the weights are boxes, their block scales are not.
    let q = boxes_of(&m, "tp=2,dtype=fp8,format=hf", 1);
    let w = dims(box_of(&q, &format!("{l}self_attn.q_proj.weight")));
    assert_eq!(w, (vec![2048, 1024], vec![1024, 0]));
    assert!(box_of(&q, &format!("{l}self_attn.q_proj.weight_scale_inv")).is_none());
    let l = InferenceLayout::build(&m, &"tp=2".parse().unwrap()).unwrap();
    assert!(matches!(
        l.param_boxes(&m, 2),
        Err(PlanError::NoSuchRank {
            rank: 2,
            ranks: 2,
            ..
        })
    ));
}

#[test]
fn hf_packed_experts_split_by_tp_are_two_boxes() {
    let m = Model::preset("qwen3-30b-a3b", ExpertForm::StackedGateUp).unwrap();
    let b = boxes_of(&m, "tp=2,format=hf", 1);
    let l = "model.layers.0.mlp.experts.";
    // Per expert the rank's gate rows and its up rows: not one box of [E, 2I, H].
    assert!(box_of(&b, &format!("{l}gate_up_proj")).is_none());
    let down = dims(box_of(&b, &format!("{l}down_proj")));
    assert_eq!(down, (vec![128, 2048, 768], vec![0, 0, 384]));
    // With ep, whole experts: one box.
    let e = boxes_of(&m, "tp=2,ep=2,format=hf", 1);
    let gu = dims(box_of(&e, &format!("{l}gate_up_proj")));
    assert_eq!(gu, (vec![128, 1536, 2048], vec![64, 0, 0]));
}
