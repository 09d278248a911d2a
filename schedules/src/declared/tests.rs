//! Declared models: the model and layouts from declarations, and every refusal naming the
//! tensor and both sides. (That a plan of one moves the right bytes is `tests/declared.rs`.)

use weightsync_common::DType;
use weightsync_common::protocol::{TensorMeta, WorldSpec};

use super::*;
use crate::job;
use crate::layout_train::torch_chunk;

/// Trainer rank `rank`'s FSDP2 box of `name` (torch.chunk of dim 0 over `of` ranks).
fn chunk(name: &str, dtype: DType, global: &[u64], rank: u32, of: u32) -> TensorMeta {
    let (s, n) = torch_chunk(global[0] as u32, of, rank);
    let mut shape = global.to_vec();
    shape[0] = n as u64;
    let mut offset = vec![0; global.len()];
    offset[0] = s as u64;
    TensorMeta {
        name: name.into(),
        bytes: shape.iter().product::<u64>() * dtype.size() as u64,
        shape,
        dtype,
        global_shape: global.to_vec(),
        offset,
        source: None,
    }
}

/// A box of `name` at `offset` of shape `shape`.
fn boxed(name: &str, global: &[u64], offset: &[u64], shape: &[u64]) -> TensorMeta {
    TensorMeta {
        name: name.into(),
        shape: shape.to_vec(),
        dtype: DType::BF16,
        bytes: 0,
        global_shape: global.to_vec(),
        offset: offset.to_vec(),
        source: None,
    }
}

/// The odd tensors the tests plan: a 1-D bias, an embedding of an odd vocabulary, a 3-D
/// stacked tensor, a 4-D convolution, and an f32 norm.
const ODD: &[(&str, &[u64], DType)] = &[
    ("model.embed_tokens.weight", &[101, 16], DType::BF16),
    (
        "model.visual.patch_embed.proj.weight",
        &[4, 3, 2, 2],
        DType::BF16,
    ),
    ("model.layers.0.self_attn.q_proj.bias", &[7], DType::BF16),
    (
        "model.layers.0.mlp.experts.gate_up_proj",
        &[3, 10, 8],
        DType::BF16,
    ),
    ("model.layers.1.input_layernorm.weight", &[16], DType::F32),
    ("model.norm.weight", &[16], DType::BF16),
];

fn trainers(of: u32) -> Vec<Vec<TensorMeta>> {
    (0..of)
        .map(|r| ODD.iter().map(|(n, g, d)| chunk(n, *d, g, r, of)).collect())
        .collect()
}

/// Every ODD tensor whole, in bf16.
fn engine() -> Vec<TensorMeta> {
    ODD.iter()
        .map(|(n, g, _)| TensorMeta::whole(*n, g.to_vec(), DType::BF16))
        .collect()
}

fn world(infer: &str, dtype: DType) -> WorldSpec {
    WorldSpec {
        model: "declared:odd".into(),
        train: "fsdp=3".into(),
        infer: infer.into(),
        dtype,
        verify: true,
    }
}

/// Plans `t` against `e` (one engine declaration each) with `skip`.
fn plan_with(
    w: &WorldSpec,
    t: &[Vec<TensorMeta>],
    e: &[Vec<TensorMeta>],
    skip: &[String],
) -> Result<job::Job, String> {
    let tr: Vec<&[TensorMeta]> = t.iter().map(Vec::as_slice).collect();
    let en: Vec<EngineDeclaration> = e
        .iter()
        .map(|x| EngineDeclaration { tensors: x, skip })
        .collect();
    job::plan_declared_job(w, &tr, &en).map_err(|e| e.to_string())
}

#[test]
fn odd_tensors_make_a_model_and_a_plan() {
    let w = world("dp=2,format=hf", DType::BF16);
    let job = plan_with(&w, &trainers(3), &[engine(), engine()], &[]).unwrap();
    let m = &job.layouts.model;
    assert!(m.is_declared());
    assert_eq!(m.params.len(), ODD.len());
    // The 4-D convolution is [4, 3, 4]; trainer 2's chunk of its 4 rows is empty.
    assert_eq!(m.params[1].shape, Shape::new(&[4, 3, 4]));
    assert!(
        !job.layouts
            .train
            .shards
            .iter()
            .any(|s| s.rank == 2 && s.param == 1)
    );
    // Groups: embed and the unnumbered vision tensor before block 0, blocks 0 and 1, head.
    let groups: Vec<u16> = m.params.iter().map(|p| m.mesh_group(p.role)).collect();
    assert_eq!(groups, [0, 0, 1, 1, 2, 3]);
    assert_eq!(m.mesh_group_name(3), "head");
    assert_eq!(job.table.rollouts.len(), 2);
    // Both engines are laid out alike: one layout stored.
    assert_eq!(job.table.rollout_layouts.len(), 1);
    // What an engine computes from its own declarations is what the table gives it.
    let own = job::declared_rollout_layout(&w, 1, &engine(), &[]).unwrap();
    assert!(job::same_rollout_layout(
        &own,
        &job.table.rollout(1).unwrap()
    ));
}

#[test]
fn shard_boxes_must_tile_their_tensor() {
    let g = [10u64, 4];
    let overlap = [
        vec![boxed("w", &g, &[0, 0], &[6, 4])],
        vec![boxed("w", &g, &[5, 0], &[5, 4])],
    ];
    let e = from_trainers("m", &[&overlap[0], &overlap[1]]).unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("tensor w") && s.contains("trainer rank 0") && s.contains("trainer rank 1"),
        "{s}"
    );
    assert!(s.contains("overlap"), "{s}");
    let gap = [
        vec![boxed("w", &g, &[0, 0], &[4, 4])],
        vec![boxed("w", &g, &[6, 0], &[4, 4])],
    ];
    let s = from_trainers("m", &[&gap[0], &gap[1]])
        .unwrap_err()
        .to_string();
    assert!(
        s.contains("no trainer holds [4..6, 0..4]") || s.contains("[4"),
        "{s}"
    );
    assert!(s.contains("32 of its 40"), "{s}");
    // Replicas hold the same box; a tp-style grid of boxes tiles too.
    let grid = [
        vec![
            boxed("w", &g, &[0, 0], &[5, 2]),
            boxed("v", &[3], &[0], &[3]),
        ],
        vec![
            boxed("w", &g, &[0, 2], &[5, 2]),
            boxed("v", &[3], &[0], &[3]),
        ],
        vec![boxed("w", &g, &[5, 0], &[5, 4])],
    ];
    let (m, t) = from_trainers("m", &[&grid[0], &grid[1], &grid[2]]).unwrap();
    assert_eq!(m.params.len(), 2);
    assert_eq!(t.shards.len(), 5);
    // Two ranks disagreeing on the whole shape or dtype are named.
    let mut other = boxed("w", &[10, 5], &[5, 0], &[5, 5]);
    let s = from_trainers("m", &[&grid[0], std::slice::from_ref(&other)])
        .unwrap_err()
        .to_string();
    assert!(
        s.contains("global shape [10, 4]") && s.contains("[10, 5]"),
        "{s}"
    );
    other = boxed("w", &g, &[5, 0], &[5, 4]);
    other.dtype = DType::F32;
    let s = from_trainers("m", &[&grid[0], std::slice::from_ref(&other)])
        .unwrap_err()
        .to_string();
    assert!(
        s.contains("dtype bf16") && s.contains("trainer rank 1 f32"),
        "{s}"
    );
    // A box outside its tensor, a name twice on one rank.
    let out = [boxed("w", &g, &[8, 0], &[4, 4])];
    let s = from_trainers("m", &[&out]).unwrap_err().to_string();
    assert!(
        s.contains("tensor w: trainer rank 0") && s.contains("outside"),
        "{s}"
    );
    let twice = [boxed("v", &[3], &[0], &[3]), boxed("v", &[3], &[0], &[3])];
    let s = from_trainers("m", &[&twice]).unwrap_err().to_string();
    assert!(s.contains("declares it twice"), "{s}");
}

#[test]
fn engines_and_trainers_that_disagree_are_named() {
    let w = world("dp=2,format=hf", DType::BF16);
    let t = trainers(3);
    // A tensor the engine declares that no trainer holds: refused, or skipped when listed.
    let mut extra = engine();
    extra.push(TensorMeta::whole(
        "model.rotary_emb.inv_freq",
        vec![8],
        DType::F32,
    ));
    let s = plan_with(&w, &t, &[engine(), extra.clone()], &[]).unwrap_err();
    assert!(
        s.contains("tensor model.rotary_emb.inv_freq: inference rank 1 declares it")
            && s.contains("no trainer holds it"),
        "{s}"
    );
    let skip = vec!["model.rotary_emb.inv_freq".to_string()];
    plan_with(&w, &t, &[engine(), extra], &skip).unwrap();
    // A trainer tensor an engine does not take: refused, unless skipped.
    let mut fewer = engine();
    fewer.retain(|m| m.name != "model.norm.weight");
    let s = plan_with(&w, &t, &[fewer.clone(), engine()], &[]).unwrap_err();
    assert!(
        s.contains("tensor model.norm.weight: trainer rank 0 holds it")
            && s.contains("inference rank 0 neither declares it nor skips it"),
        "{s}"
    );
    plan_with(&w, &t, &[fewer, engine()], &["model.norm.weight".into()]).unwrap();
    // Shapes and dtypes: both sides named.
    let mut wrong = engine();
    wrong[0].shape = vec![102, 16];
    let s = plan_with(&w, &t, &[engine(), wrong], &[]).unwrap_err();
    assert!(
        s.contains("tensor model.embed_tokens.weight: inference rank 1 declares shape [102, 16]")
            && s.contains("trainer rank 0 holds a tensor of shape [101, 16]"),
        "{s}"
    );
    let mut f16 = engine();
    f16[2].dtype = DType::F16;
    let s = plan_with(&w, &t, &[f16, engine()], &[]).unwrap_err();
    assert!(
        s.contains("tensor model.layers.0.self_attn.q_proj.bias: inference rank 0 declares f16")
            && s.contains("trainer rank 0 holds bf16"),
        "{s}"
    );
    // The f32 norm may land as f32 (the trainers' own) as well as bf16, in one dtype on
    // every engine.
    let mut kept = engine();
    kept[4].dtype = DType::F32;
    plan_with(&w, &t, &[kept.clone(), kept.clone()], &[]).unwrap();
    let s = plan_with(&w, &t, &[kept, engine()], &[]).unwrap_err();
    assert!(
        s.contains("inference rank 0 declares f32, inference rank 1 bf16"),
        "{s}"
    );
}

#[test]
fn layouts_a_declared_model_cannot_have_are_refused() {
    let t = trainers(3);
    for (infer, why) in [
        ("tp=2,format=hf", "which dim"),
        ("dp=2", "format=hf"),
        ("ep=2,format=hf", "tp=1, ep=1"),
    ] {
        let s = plan_with(&world(infer, DType::BF16), &t, &[engine()], &[]).unwrap_err();
        assert!(s.contains(why), "{infer}: {s}");
    }
    let s = plan_with(&world("dp=2,format=hf", DType::BF16), &t, &[engine()], &[]).unwrap_err();
    assert!(
        s.contains("2 inference ranks, but 3 trainers and 1 engines"),
        "{s}"
    );
    // Layouts from strings are refused for a declared model, and known ones are not declared.
    let w = world("format=hf", DType::BF16);
    let e = job::layouts(&w, None).unwrap_err().to_string();
    assert!(e.contains("declared model"), "{e}");
    let gemma = r#"{"model_type":"gemma3_text","hidden_size":64}"#;
    let by_config = WorldSpec {
        model: "/m/config.json".into(),
        ..w.clone()
    };
    assert!(job::is_declared(&by_config, Some(gemma)));
    assert!(!job::is_declared(
        &by_config,
        Some(r#"{"model_type":"qwen3"}"#)
    ));
    assert!(!job::is_declared(&by_config, Some("{")));
    let preset = WorldSpec {
        model: "qwen3-0.6b".into(),
        ..w
    };
    assert!(!job::is_declared(&preset, None));
}

#[test]
fn fp8_engine_tensors_need_their_scales() {
    let w = world("format=hf", DType::F8E4M3);
    let t = trainers(3);
    let t = [t[0].clone(), t[1].clone(), t[2].clone()];
    let q = |e: &mut Vec<TensorMeta>, name: &str, scale: Vec<u64>| {
        let i = e.iter().position(|m| m.name == name).unwrap();
        e[i].dtype = DType::F8E4M3;
        e.insert(
            i + 1,
            TensorMeta::whole(format!("{name}_scale_inv"), scale, DType::F32),
        );
    };
    let mut e = engine();
    q(&mut e, "model.embed_tokens.weight", vec![1, 1]);
    q(
        &mut e,
        "model.layers.0.mlp.experts.gate_up_proj",
        vec![3, 1, 1],
    );
    let job = plan_with(&w, &t, &[e.clone()], &[]).unwrap();
    let r = job.table.rollout(0).unwrap();
    let dt: Vec<(&str, DType)> = r.tensors.iter().map(|t| (&*t.name, t.dtype)).collect();
    assert!(dt.contains(&("model.embed_tokens.weight_scale_inv", DType::F32)));
    let mut wrong = e.clone();
    wrong[1].shape = vec![2, 1];
    let s = plan_with(&w, &t, &[wrong], &[]).unwrap_err();
    assert!(s.contains("need f32 [1, 1]"), "{s}");
    let mut none = e.clone();
    none.remove(1);
    let s = plan_with(&w, &t, &[none], &[]).unwrap_err();
    assert!(
        s.contains("declares no model.embed_tokens.weight_scale_inv"),
        "{s}"
    );
    let s = plan_with(&world("format=hf", DType::BF16), &t, &[e], &[]).unwrap_err();
    assert!(s.contains("this job is bf16"), "{s}");
}

#[test]
fn logical_shapes_merge_trailing_dims() {
    assert_eq!(logical_shape(&[]).unwrap(), Shape::new(&[1]));
    assert_eq!(
        logical_shape(&[2, 3, 4, 5, 6]).unwrap(),
        Shape::new(&[2, 3, 120])
    );
    assert!(logical_shape(&[1 << 33]).is_err());
    // A box of a 4-D tensor must hold its trailing dims whole.
    let cut = [boxed("c", &[4, 3, 2, 2], &[0, 0, 1, 0], &[4, 3, 1, 2])];
    let s = from_trainers("m", &[&cut]).unwrap_err().to_string();
    assert!(s.contains("trailing dims whole"), "{s}");
}
