//! The `hf` inference format and the `experts=stacked-gate-up` training form against what a
//! real `transformers` model holds: `fixtures/transformers_names.json`, printed by
//! `fixtures/transformers_names.py` from transformers 5.19 (tiny Qwen3, Qwen3-MoE and
//! DeepSeek-V3 configs, bf16 and after `replace_with_fp8_linear`). For each config the training
//! layout's parameters and the hf layout's tensors (tp=1) must have exactly the names, shapes
//! and dtypes of `named_parameters()`; FSDP shards must be the torch.chunk shards FSDP2 gives.

use std::collections::BTreeMap;

use serde_json::Value;
use weightsync_common::DType;
use weightsync_schedules::*;

/// One tensor of the fixture: shape, dtype, and whether transformers holds it as a parameter
/// (else a persistent buffer).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    shape: Vec<u32>,
    dtype: DType,
    parameter: bool,
}

struct Case {
    name: String,
    config: String,
    bf16: BTreeMap<String, Held>,
    fp8: BTreeMap<String, Held>,
}

/// The fixture's cases; tied names (a tied lm_head is the embedding) are left out, as the
/// layouts hold the tensor once.
fn cases() -> Vec<Case> {
    let v: Value = serde_json::from_str(include_str!("fixtures/transformers_names.json")).unwrap();
    assert_eq!(
        v["transformers"], "5.19.0",
        "fixture from another transformers"
    );
    let listing = |x: &Value| -> BTreeMap<String, Held> {
        x.as_array()
            .unwrap()
            .iter()
            .filter(|e| e[3] != "tied")
            .map(|e| {
                let held = Held {
                    shape: e[1]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|d| d.as_u64().unwrap() as u32)
                        .collect(),
                    dtype: e[2].as_str().unwrap().parse().unwrap(),
                    parameter: e[3] == "parameter",
                };
                (e[0].as_str().unwrap().to_string(), held)
            })
            .collect()
    };
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().to_string(),
            config: c["config"].to_string(),
            bf16: listing(&c["bf16"]),
            fp8: listing(&c["fp8"]),
        })
        .collect()
}

fn model(case: &Case) -> Model {
    Model::from_config_json(&case.name, &case.config, ExpertForm::StackedGateUp).unwrap()
}

/// Compares what a layout holds with what transformers holds, naming every difference.
/// Persistent buffers (DeepSeek's `e_score_correction_bias`) are compared by shape: the fixture
/// has them in the `from_config` dtype, while transformers keeps that one in f32 when it loads a
/// checkpoint (`_keep_in_fp32_modules_strict`), as the model here does.
fn same(what: &str, got: &BTreeMap<String, (Vec<u32>, DType)>, want: &BTreeMap<String, Held>) {
    let mut diffs = Vec::new();
    for (name, h) in want {
        match got.get(name) {
            None => diffs.push(format!("missing {name} {:?} {}", h.shape, h.dtype)),
            Some((shape, dtype)) => {
                let dtype_ok = *dtype == h.dtype || (!h.parameter && *dtype == DType::F32);
                if *shape != h.shape || !dtype_ok {
                    diffs.push(format!(
                        "{name}: {shape:?} {dtype}, transformers {:?} {}",
                        h.shape, h.dtype
                    ));
                }
            }
        }
    }
    for name in got.keys().filter(|n| !want.contains_key(*n)) {
        diffs.push(format!("{name} is not a transformers tensor"));
    }
    assert!(diffs.is_empty(), "{what}:\n  {}", diffs.join("\n  "));
}

#[test]
fn training_parameters_are_named_parameters() {
    for case in cases() {
        let m = model(&case);
        let spec: TrainSpec = "fsdp=1,experts=stacked-gate-up".parse().unwrap();
        let layout = TrainingLayout::build(&m, &spec).unwrap();
        let got = layout
            .shards
            .iter()
            .map(|s| {
                let p = &m.params[s.param as usize];
                assert_eq!(
                    s.global,
                    weightsync_schedules::table::TensorBox::full(p.shape)
                );
                (p.name.to_string(), (p.shape.dims().to_vec(), s.dtype))
            })
            .collect();
        same(&format!("{} training", case.name), &got, &case.bf16);
    }
}

/// The hf layout of `case` at `spec`, rank 0, as name -> (shape, dtype).
fn hf_rank0(case: &Case, spec: &str) -> Result<BTreeMap<String, (Vec<u32>, DType)>, PlanError> {
    let layout = InferenceLayout::build(&model(case), &spec.parse()?)?;
    Ok(layout.ranks[0]
        .tensors
        .iter()
        .map(|t| (t.name.clone(), (t.shape.dims().to_vec(), t.dtype)))
        .collect())
}

#[test]
fn hf_inference_tensors_are_named_parameters_bf16_and_fp8() {
    let mut checked = 0;
    for case in cases() {
        let got = hf_rank0(&case, "tp=1,format=hf").unwrap();
        same(&format!("{} hf bf16", case.name), &got, &case.bf16);
        match hf_rank0(&case, "tp=1,format=hf,dtype=fp8") {
            Ok(got) => same(&format!("{} hf fp8", case.name), &got, &case.fp8),
            Err(e) => {
                // 2I = 128: transformers pads gate_up_proj_scale_inv to 2 block rows, one more
                // than the grid; refused by name rather than left unwritten.
                assert_eq!(case.name, "qwen3_moe_i64", "{e}");
                let scales = &case.fp8["model.layers.0.mlp.experts.gate_up_proj_scale_inv"];
                assert_eq!(scales.shape, [4, 2, 1]);
                let msg = e.to_string();
                assert!(
                    msg.contains("model.layers.0.mlp.experts.gate_up_proj")
                        && msg.contains("format hf")
                        && msg.contains("gate_up_proj_scale_inv"),
                    "{msg}"
                );
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 4);
}

#[test]
fn hf_tp_and_ep_ranks_hold_their_slices_of_the_same_tensors() {
    let case = cases()
        .into_iter()
        .find(|c| c.name == "qwen3_moe_i192")
        .unwrap();
    let m = model(&case);
    let layout = InferenceLayout::build(&m, &"tp=2,ep=4,format=hf".parse().unwrap()).unwrap();
    assert_eq!(layout.ranks.len(), 4);
    for r in &layout.ranks {
        let shape = |n: &str| {
            let t = r.tensors.iter().find(|t| t.name == n).unwrap();
            t.shape.dims().to_vec()
        };
        // Embedding whole (transformers does not split it), q heads and kv heads split.
        assert_eq!(shape("model.embed_tokens.weight"), [1024, 128]);
        assert_eq!(shape("model.layers.1.self_attn.q_proj.weight"), [64, 128]);
        assert_eq!(shape("model.layers.1.self_attn.k_proj.weight"), [32, 128]);
        assert_eq!(shape("model.layers.0.mlp.gate_proj.weight"), [128, 128]);
        // One whole expert per ep rank.
        assert_eq!(
            shape("model.layers.1.mlp.experts.gate_up_proj"),
            [1, 384, 128]
        );
        assert_eq!(shape("model.layers.1.mlp.experts.down_proj"), [1, 128, 192]);
        // Every name is a transformers name.
        for t in r.tensors.iter() {
            assert!(case.bf16.contains_key(&t.name), "{}", t.name);
        }
    }
}

#[test]
fn fsdp2_shards_are_torch_chunks_of_named_parameters() {
    // FACTS §2, measured with fully_shard over 3 gloo ranks: [1024,128] -> 342/342/340 rows,
    // [128,128] -> 43/43/42, 4 stacked experts -> 2, 2 and an empty shard.
    let case = cases()
        .into_iter()
        .find(|c| c.name == "qwen3_moe_i192")
        .unwrap();
    let m = model(&case);
    let spec: TrainSpec = "fsdp=3,experts=stacked-gate-up".parse().unwrap();
    let layout = TrainingLayout::build(&m, &spec).unwrap();
    let local = |rank: u32, name: &str| {
        layout
            .shards
            .iter()
            .find(|s| s.rank == rank && &*m.params[s.param as usize].name == name)
            .map(|s| s.global.len[..s.global.ndim as usize].to_vec())
    };
    let rows = |name: &str| {
        (0..3)
            .map(|r| local(r, name).map(|l| l[0]))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        rows("model.embed_tokens.weight"),
        [Some(342), Some(342), Some(340)]
    );
    assert_eq!(
        rows("model.layers.0.self_attn.q_proj.weight"),
        [Some(43), Some(43), Some(42)]
    );
    let gu = "model.layers.1.mlp.experts.gate_up_proj";
    assert_eq!(local(0, gu), Some(vec![2, 384, 128]));
    assert_eq!(local(1, gu), Some(vec![2, 384, 128]));
    assert_eq!(local(2, gu), None, "the empty chunk is no shard");
}

#[test]
fn specs_round_trip_through_their_strings() {
    let s: InferSpec = "tp=2,ep=4,dp=2,format=hf,dtype=fp8".parse().unwrap();
    assert_eq!(s.format, InferFormat::Hf);
    assert_eq!(s.to_string().parse::<InferSpec>().unwrap(), s);
    // The default format leaves the string as it always was.
    let d: InferSpec = "tp=2".parse().unwrap();
    assert_eq!(d.format, InferFormat::Fused);
    assert_eq!(d.to_string(), "tp=2,ep=1,dp=1,dtype=bf16");
    let t: TrainSpec = "fsdp=3,experts=stacked-gate-up".parse().unwrap();
    assert_eq!(t.experts, ExpertForm::StackedGateUp);
    assert_eq!(t.to_string().parse::<TrainSpec>().unwrap(), t);
    let alias: TrainSpec = "fsdp=3,experts=transformers".parse().unwrap();
    assert_eq!(alias, t);
}
