//! Fused and tensor-parallel engines declare what each tensor is made of (boxes of the trainers'
//! tensors concatenated along a dim), and the planner plans from that alone:
//! - the known families' serving layouts (vLLM's fused `qkv_proj`, `gate_up_proj`,
//!   `w13_weight`, each tensor-parallel rank's slice; Qwen3 at tp=2, Kimi-K2's production
//!   inference side at tp=8, ep=32, fp8), declared as their engines would
//!   ([`declared::engine_declarations`]), plan the config path's table byte for byte;
//! - per-expert trainer tensors stacked into one engine tensor per layer (a transformers-style
//!   `gate_up_proj` `[E, 2I, H]`), planned from declarations and executed by the reference
//!   executor: every byte where the stacking puts it;
//! - parts that do not fit (a box outside its tensor, a shape or dtype the sides disagree on,
//!   overlapping or gapped concatenations) are refused naming the tensor and both sides.

mod common;

use common::*;
use weightsync_common::DType;
use weightsync_common::protocol::{SourceBox, TensorMeta, TensorSource, WorldSpec};
use weightsync_schedules::declared::{self, EngineDeclaration};
use weightsync_schedules::job::{self, Job};

fn world(model: &str, train: &str, infer: &str, dtype: DType) -> WorldSpec {
    WorldSpec {
        model: model.into(),
        train: train.into(),
        infer: infer.into(),
        dtype,
        verify: true,
    }
}

/// Plans `w` (a declared model) from trainer declarations `t` and engine 0's ranks'
/// declarations `e`, every engine declaring what engine 0 does (by reference, as the
/// controller's registrations would be equal).
fn plan_declared(
    w: &WorldSpec,
    t: &[Vec<TensorMeta>],
    e: &[Vec<TensorMeta>],
    skip: &[String],
) -> Result<Job, String> {
    let (_, ranks) = job::declared_world(w).map_err(|e| e.to_string())?;
    let tr: Vec<&[TensorMeta]> = t.iter().map(Vec::as_slice).collect();
    let en: Vec<EngineDeclaration> = (0..ranks as usize)
        .map(|i| EngineDeclaration {
            tensors: &e[i % e.len()],
            skip,
        })
        .collect();
    job::plan_declared_job(w, &tr, &en).map_err(|e| e.to_string())
}

/// The config path's job and the one planned from the declarations its workers would send:
/// the tables must be equal once encoded.
fn same_table(model: &str, train: &str, infer: &str, dtype: DType) -> Job {
    let known = world(model, train, infer, dtype);
    let from_config = job::plan_job(&known, None).unwrap();
    let l = &from_config.layouts;
    let t = declared::trainer_declarations(&l.model, &l.train);
    let e = declared::engine_declarations(&l.model, &l.infer);
    // Fused tensors declare their parts; a tensor-parallel rank its boxes.
    assert!(
        e.iter().flatten().any(|m| m.source.is_some()),
        "{model} {infer}: no tensor declares a source"
    );
    let declared_as = world(&format!("declared:{model}"), train, infer, dtype);
    let declared = plan_declared(&declared_as, &t, &e, &[]).unwrap();
    assert_eq!(declared.table.num_params, from_config.table.num_params);
    assert!(
        declared.table.to_bincode() == from_config.table.to_bincode(),
        "{model} {train} / {infer} {dtype}: the declared table differs from the config's"
    );
    declared
}

#[test]
fn qwen3_fused_tensor_parallel_declared_plans_the_same_table() {
    // vLLM's layout (format=fused): qkv_proj and gate_up_proj fused, each tp rank its slice,
    // the embedding and lm_head split by vocab; two engines of two ranks.
    let j = same_table("qwen3-0.6b", "fsdp=4", "tp=2,dp=2", DType::BF16);
    assert_eq!(j.table.rollouts.len(), 4);
    // And fp8: every fused part on its own 128x128 blocks, scales in the same places.
    same_table("qwen3-0.6b", "dp=2,fsdp=2", "tp=2", DType::F8E4M3);
    // transformers' layout split by tensor parallelism (format=hf, tp=2): boxes, not fusion.
    same_table("qwen3-0.6b", "fsdp=3", "tp=2,format=hf", DType::BF16);
}

/// Kimi-K2's production inference side: tp=8, ep=32 (data-parallel MLA attention, 12 routed
/// experts per rank in w13_weight / w2_weight), fp8, on two engines of 32 ranks, from
/// transformers' stacked experts (975 tensors: quick in a debug build). The 10,240-GPU job
/// itself, 8,192 trainers of per-expert tensors into 64 such engines, plans the same table
/// from declarations in the timing of `declared_same_table.rs` (`same_table` there).
#[test]
fn kimi_k2_production_inference_side_declared_plans_the_same_table() {
    let train = "pp=2,ep=4,fsdp=2,experts=transformers";
    let j = same_table("kimi-k2", train, "tp=8,ep=32,dp=2", DType::F8E4M3);
    assert_eq!(j.table.rollouts.len(), 64);
}

/// Per-expert trainer tensors into transformers' stacked experts (`experts=per-expert`, the
/// default, into `format=hf`): refused before as an engine tensor no trainer holds; now the
/// engine declares each stacked tensor made of the experts' tensors.
#[test]
fn qwen3_moe_per_expert_into_stacked_experts_plans_the_same_table() {
    let j = same_table("qwen3-30b-a3b", "ep=4,fsdp=2", "format=hf", DType::BF16);
    let r = j.table.rollout(0).unwrap();
    assert!(
        r.tensors
            .iter()
            .any(|t| t.name == "model.layers.0.mlp.experts.gate_up_proj")
    );
}

const E: u64 = 3;
const I: u64 = 4;
const H: u64 = 6;

/// A tiny MoE layer's trainer tensors: per-expert gate, up, down, and q, k, v.
fn tiny_params() -> Vec<(String, Vec<u64>)> {
    let mut v = vec![
        ("model.layers.0.self_attn.q_proj.weight".into(), vec![8, H]),
        ("model.layers.0.self_attn.k_proj.weight".into(), vec![4, H]),
        ("model.layers.0.self_attn.v_proj.weight".into(), vec![4, H]),
    ];
    for e in 0..E {
        for (p, s) in [("gate", [I, H]), ("up", [I, H]), ("down", [H, I])] {
            v.push((
                format!("model.layers.0.mlp.experts.{e}.{p}_proj.weight"),
                s.to_vec(),
            ));
        }
    }
    v
}

fn part(tensor: &str, offset: &[u64], shape: &[u64]) -> SourceBox {
    SourceBox {
        tensor: tensor.into(),
        offset: offset.to_vec(),
        shape: shape.to_vec(),
    }
}

fn made_of(name: &str, shape: Vec<u64>, dim: u32, parts: Vec<SourceBox>) -> TensorMeta {
    TensorMeta {
        source: Some(TensorSource { dim, parts }),
        ..TensorMeta::whole(name, shape, DType::BF16)
    }
}

/// Tp rank `t` of 2: a fused qkv of its q, k and v rows, and every expert's gate and up rows
/// of its half stacked into `[E, I, H]` (gate rows, then up rows, per expert), its half of the
/// down columns into `[E, H, I/2]`.
fn tiny_engine(t: u64) -> Vec<TensorMeta> {
    let exp = |e: u64, p: &str| format!("model.layers.0.mlp.experts.{e}.{p}_proj.weight");
    let attn = |p: &str| format!("model.layers.0.self_attn.{p}_proj.weight");
    let il = I / 2;
    let mut gate_up = Vec::new();
    let mut down = Vec::new();
    for e in 0..E {
        gate_up.push(part(&exp(e, "gate"), &[t * il, 0], &[il, H]));
        gate_up.push(part(&exp(e, "up"), &[t * il, 0], &[il, H]));
        down.push(part(&exp(e, "down"), &[0, t * il], &[H, il]));
    }
    vec![
        made_of(
            "model.layers.0.self_attn.qkv_proj.weight",
            vec![8, H],
            0,
            vec![
                part(&attn("q"), &[t * 4, 0], &[4, H]),
                part(&attn("k"), &[t * 2, 0], &[2, H]),
                part(&attn("v"), &[t * 2, 0], &[2, H]),
            ],
        ),
        made_of(
            "model.layers.0.mlp.experts.gate_up_proj",
            vec![E, 2 * il, H],
            1,
            gate_up,
        ),
        made_of(
            "model.layers.0.mlp.experts.down_proj",
            vec![E, H, il],
            1,
            down,
        ),
    ]
}

fn tiny_trainers(of: u32) -> Vec<Vec<TensorMeta>> {
    (0..of)
        .map(|r| {
            tiny_params()
                .into_iter()
                .filter_map(|(name, g)| {
                    let (s, n) =
                        weightsync_schedules::layout_train::torch_chunk(g[0] as u32, of, r);
                    (n > 0).then(|| TensorMeta {
                        name,
                        shape: vec![u64::from(n), g[1]],
                        dtype: DType::BF16,
                        bytes: u64::from(n) * g[1] * 2,
                        global_shape: g.clone(),
                        offset: vec![u64::from(s), 0],
                        source: None,
                    })
                })
                .collect()
        })
        .collect()
}

#[test]
fn stacked_experts_from_per_expert_tensors_land_where_stacked() {
    let w = world("declared:tiny-moe", "fsdp=3", "tp=2,dp=2", DType::BF16);
    let engine = [tiny_engine(0), tiny_engine(1)];
    let job = plan_declared(&w, &tiny_trainers(3), &engine, &[]).unwrap();
    let model = &job.layouts.model;
    let full = random_model(model, 11);
    let landed = execute(&job.table, model, &full);
    check_coverage(&job.table, &landed);
    let param = |name: &str| {
        let i = model.params.iter().position(|p| *p.name == *name).unwrap();
        (&full[i], model.params[i].shape)
    };
    // Element (r, c) of a trainer tensor, as bytes.
    let at = |name: &str, r: u64, c: u64| {
        let (bytes, s) = param(name);
        let i = ((r * u64::from(s.dims[1]) + c) * 2) as usize;
        [bytes[i], bytes[i + 1]]
    };
    let il = I / 2;
    let mut checked = 0;
    for (rank, plan) in rollouts(&job.table).iter().enumerate() {
        let t = rank as u64 % 2;
        let arena = &landed.arenas[rank];
        let tensor = |name: &str| {
            let d = plan.tensors.iter().find(|d| d.name == name).unwrap();
            &arena[d.offset as usize..(d.offset + d.len) as usize]
        };
        let elem = |bytes: &[u8], i: u64| [bytes[2 * i as usize], bytes[2 * i as usize + 1]];
        let qkv = tensor("model.layers.0.self_attn.qkv_proj.weight");
        for row in 0..8 {
            let (p, r) = match row {
                0..4 => ("q", t * 4 + row),
                4..6 => ("k", t * 2 + row - 4),
                _ => ("v", t * 2 + row - 6),
            };
            for c in 0..H {
                let want = at(&format!("model.layers.0.self_attn.{p}_proj.weight"), r, c);
                assert_eq!(elem(qkv, row * H + c), want, "rank {rank} qkv ({row}, {c})");
                checked += 1;
            }
        }
        let gate_up = tensor("model.layers.0.mlp.experts.gate_up_proj");
        let down = tensor("model.layers.0.mlp.experts.down_proj");
        for e in 0..E {
            for row in 0..2 * il {
                let (p, r) = if row < il {
                    ("gate", t * il + row)
                } else {
                    ("up", t * il + row - il)
                };
                let name = format!("model.layers.0.mlp.experts.{e}.{p}_proj.weight");
                for c in 0..H {
                    let i = (e * 2 * il + row) * H + c;
                    assert_eq!(elem(gate_up, i), at(&name, r, c), "rank {rank} gate_up");
                    checked += 1;
                }
            }
            let name = format!("model.layers.0.mlp.experts.{e}.down_proj.weight");
            for row in 0..H {
                for c in 0..il {
                    let i = (e * H + row) * il + c;
                    assert_eq!(
                        elem(down, i),
                        at(&name, row, t * il + c),
                        "rank {rank} down"
                    );
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 4 * (8 * H + E * 2 * il * H + E * H * il));
}

/// Plans the tiny job with rank 1's declarations changed by `f`; the error's text.
fn refused(f: impl FnOnce(&mut Vec<TensorMeta>)) -> String {
    let w = world("declared:tiny-moe", "fsdp=3", "tp=2", DType::BF16);
    let mut one = tiny_engine(1);
    f(&mut one);
    let engine = [tiny_engine(0), one];
    plan_declared(&w, &tiny_trainers(3), &engine, &[]).unwrap_err()
}

fn parts(e: &mut [TensorMeta], i: usize) -> &mut Vec<SourceBox> {
    &mut e[i].source.as_mut().unwrap().parts
}

#[test]
fn parts_that_do_not_fit_are_refused_by_name() {
    let qkv = "tensor model.layers.0.self_attn.qkv_proj.weight: inference rank 1";
    // A box outside the trainer tensor: k has 4 rows.
    let s = refused(|e| parts(e, 0)[1].offset = vec![3, 0]);
    assert!(
        s.contains(qkv)
            && s.contains("model.layers.0.self_attn.k_proj.weight [3..5, 0..6]")
            && s.contains("outside the model.layers.0.self_attn.k_proj.weight of shape [4, 6]")
            && s.contains("trainer rank 0"),
        "{s}"
    );
    // A part no trainer holds.
    let s = refused(|e| parts(e, 0)[2].tensor = "model.layers.0.self_attn.w_proj.weight".into());
    assert!(
        s.contains(qkv) && s.contains("no trainer holds model.layers.0.self_attn.w_proj.weight"),
        "{s}"
    );
    // A shape the sides disagree on: a part narrower than the tensor in a dim it spans.
    let s = refused(|e| parts(e, 0)[0].shape = vec![4, 5]);
    assert!(
        s.contains(qkv)
            && s.contains("declares shape [8, 6]")
            && s.contains("part 0, model.layers.0.self_attn.q_proj.weight")
            && s.contains("holds model.layers.0.self_attn.q_proj.weight of shape [8, 6]")
            && s.contains("spans 5 in dim 1, where the tensor is 6"),
        "{s}"
    );
    // Overlapping: q's box grown by a row runs into k's place, and v's past the end.
    let s = refused(|e| {
        let q = &mut parts(e, 0)[0];
        q.offset = vec![3, 0];
        q.shape = vec![5, H];
    });
    assert!(
        s.contains(qkv)
            && s.contains("part 2, model.layers.0.self_attn.v_proj.weight")
            && s.contains("trainer rank")
            && s.contains(
                "runs to 9 along dim 0, past the tensor's 8: it overlaps the tensor's end"
            ),
        "{s}"
    );
    let s = refused(|e| {
        let p = parts(e, 1);
        p[0].shape = vec![3, H];
        p[0].offset = vec![1, 0];
    });
    assert!(
        s.contains("tensor model.layers.0.mlp.experts.gate_up_proj: inference rank 1")
            && s.contains("part 1, model.layers.0.mlp.experts.0.up_proj.weight")
            && s.contains("overlaps the next stacked slice's place"),
        "{s}"
    );
    // Gapped: the last expert's up rows missing.
    let s = refused(|e| {
        parts(e, 1).pop();
    });
    assert!(
        s.contains("tensor model.layers.0.mlp.experts.gate_up_proj: inference rank 1")
            && s.contains("its 5 parts concatenated along dim 1 (the last model.layers.0.mlp.experts.2.gate_proj.weight")
            && s.contains("fill 60 of its 72 elements: nothing fills [2..3, 2..4, 0..6]"),
        "{s}"
    );
    // A dtype the sides disagree on (f16 is neither the trainers' bf16 nor a cast to bf16).
    let s = refused(|e| e[0].dtype = DType::F16);
    assert!(
        s.contains(qkv) && s.contains("declares f16") && s.contains("holds bf16"),
        "{s}"
    );
    // A concatenation dim the parts do not span; parts of unlike dims.
    let s = refused(|e| e[2].source.as_mut().unwrap().dim = 0);
    assert!(
        s.contains("concatenated along dim 0, which is not one of the dims 1..3"),
        "{s}"
    );
    // A trainer tensor no rank of an engine takes: every rank drops expert 2's down.
    let w = world("declared:tiny-moe", "fsdp=3", "tp=2", DType::BF16);
    let drop = |t: u64| {
        let mut e = tiny_engine(t);
        let d = parts(&mut e, 2);
        d.pop();
        e[2].shape = vec![E - 1, H, I / 2];
        e
    };
    let s = plan_declared(&w, &tiny_trainers(3), &[drop(0), drop(1)], &[]).unwrap_err();
    assert!(
        s.contains("tensor model.layers.0.mlp.experts.2.down_proj.weight: trainer rank 0 holds it")
            && s.contains("no rank of engine 0 (inference ranks 0..=1)"),
        "{s}"
    );
}
