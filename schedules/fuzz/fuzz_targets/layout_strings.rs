//! Layout strings as typed on a command line or sent in a worker's registration
//! (`pp=2,ep=8,fsdp=16` / `tp=2,dp=2,dtype=fp8`). Input: `<train>\n<infer>`. Parsing must never
//! panic; specs that parse and describe a small world are built into layouts for a tiny model
//! and planned, which must not panic either (errors are fine).
#![no_main]

use libfuzzer_sys::fuzz_target;
use weightsync_schedules::{
    plan, CostModel, ExpertForm, InferSpec, InferenceLayout, Model, TrainSpec, TrainingLayout,
};

/// A two-layer Qwen3 with small dimensions: planning it takes microseconds.
const TINY: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
  "vocab_size": 1024, "tie_word_embeddings": false
}"#;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (train, infer) = text.split_once('\n').unwrap_or((text, ""));
    let train: Result<TrainSpec, _> = train.parse();
    let infer: Result<InferSpec, _> = infer.parse();
    let (Ok(train), Ok(infer)) = (train, infer) else {
        return;
    };
    // Round trip through Display.
    let again: TrainSpec = train
        .to_string()
        .parse()
        .expect("a TrainSpec's Display parses");
    assert_eq!(again.world().ok(), train.world().ok());
    let again: InferSpec = infer
        .to_string()
        .parse()
        .expect("an InferSpec's Display parses");
    assert_eq!(again, infer, "an InferSpec's Display names the same layout");
    let small = train.world().is_ok_and(|w| w <= 64)
        && u64::from(infer.engine_ranks()) * u64::from(infer.dp) <= 64;
    if !small {
        return;
    }
    let Ok(model) = Model::from_config_json("tiny", TINY, ExpertForm::default()) else {
        return;
    };
    let (Ok(t), Ok(i)) = (
        TrainingLayout::build(&model, &train),
        InferenceLayout::build(&model, &infer),
    ) else {
        return;
    };
    let _ = plan(&model, &t, &i, &CostModel::default());
});
