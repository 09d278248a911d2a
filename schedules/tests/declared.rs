//! A declared model's plan moves the right bytes: odd tensors (a 1-D bias, an odd-sized
//! embedding, a 3-D stacked tensor, a 4-D convolution, an f32 norm cast to bf16) sharded
//! unevenly by FSDP2 over three trainers (one holds no rows of some), planned from the workers'
//! declarations alone and executed by the reference executor: every byte of both engines is the
//! whole tensor's, written once.

mod common;

use common::*;
use weightsync_common::DType;
use weightsync_common::protocol::{TensorMeta, WorldSpec};
use weightsync_schedules::declared::EngineDeclaration;
use weightsync_schedules::job;
use weightsync_schedules::layout_train::torch_chunk;

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
    ("model.layers.1.mlp.router.weight", &[5, 16], DType::F32),
    ("lm_head.weight", &[2, 16], DType::BF16),
];

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

#[test]
fn a_declared_plan_lands_every_tensor_whole() {
    let world = WorldSpec {
        model: "declared:odd".into(),
        train: "fsdp=3".into(),
        infer: "dp=2,format=hf".into(),
        dtype: DType::BF16,
        verify: true,
    };
    let trainers: Vec<Vec<TensorMeta>> = (0..3)
        .map(|r| ODD.iter().map(|(n, g, d)| chunk(n, *d, g, r, 3)).collect())
        .collect();
    // The engines take the router in f32 (the trainers' own dtype: a copy) and the f32 norm in
    // bf16 (a cast); both skip a buffer of their own.
    let engine = |router: DType| -> Vec<TensorMeta> {
        let mut e: Vec<TensorMeta> = ODD
            .iter()
            .map(|(n, g, _)| {
                let d = if n.contains("router") {
                    router
                } else {
                    DType::BF16
                };
                TensorMeta::whole(*n, g.to_vec(), d)
            })
            .collect();
        e.insert(
            2,
            TensorMeta::whole("model.rotary_emb.inv_freq", vec![4], DType::F32),
        );
        e
    };
    let engines = [engine(DType::F32), engine(DType::F32)];
    let skip = vec!["model.rotary_emb.inv_freq".to_string()];
    let t: Vec<&[TensorMeta]> = trainers.iter().map(Vec::as_slice).collect();
    let e: Vec<EngineDeclaration> = engines
        .iter()
        .map(|x| EngineDeclaration {
            tensors: x,
            skip: &skip,
        })
        .collect();
    let job = job::plan_declared_job(&world, &t, &e).unwrap();
    let model = &job.layouts.model;
    let full = random_model(model, 7);
    let landed = execute(&job.table, model, &full);
    check_coverage(&job.table, &landed);
    let mut checked = 0;
    for (r, plan) in rollouts(&job.table).iter().enumerate() {
        assert_eq!(
            plan.tensors.len(),
            ODD.len(),
            "the skipped tensor is not laid out"
        );
        for t in &plan.tensors {
            let pid = model.params.iter().position(|p| *p.name == t.name).unwrap();
            let src = &full[pid];
            let want: Vec<u8> = match (model.params[pid].dtype, t.dtype) {
                (a, b) if a == b => src.clone(),
                (DType::F32, DType::BF16) => src
                    .chunks_exact(4)
                    .flat_map(|c| {
                        f32_to_bf16(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
                    })
                    .collect(),
                other => panic!("unexpected {other:?}"),
            };
            let got = &landed.arenas[r][t.offset as usize..(t.offset + t.len) as usize];
            assert!(got == want.as_slice(), "rank {r} tensor {}", t.name);
            checked += 1;
        }
    }
    assert_eq!(checked, 2 * ODD.len());
}
