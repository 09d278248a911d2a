//! Presets: the public `config.json` values (the fields the planner reads) of the models RL
//! teams train most, so `--model kimi-k2` works without a download. Any other model is read
//! from its own config.json through the same parser ([`crate::model::Model::from_config_json`]).

/// `(preset name, config.json text)`.
pub const PRESETS: &[(&str, &str)] = &[
    ("qwen3-0.6b", QWEN3_0_6B),
    ("qwen3-8b", QWEN3_8B),
    ("qwen3-30b-a3b", QWEN3_30B_A3B),
    ("qwen3-235b-a22b", QWEN3_235B_A22B),
    ("deepseek-v3", DEEPSEEK_V3),
    ("kimi-k2", KIMI_K2),
];

/// The config.json of a preset (name matched case-insensitively).
pub fn preset_config(name: &str) -> Option<&'static str> {
    let want = name.to_ascii_lowercase();
    PRESETS.iter().find(|(n, _)| *n == want).map(|(_, c)| *c)
}

/// Qwen/Qwen3-0.6B.
pub const QWEN3_0_6B: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
  "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
  "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
  "vocab_size": 151936, "tie_word_embeddings": true, "attention_bias": false,
  "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000
}"#;

/// Qwen/Qwen3-8B.
pub const QWEN3_8B: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
  "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
  "vocab_size": 151936, "tie_word_embeddings": false, "attention_bias": false,
  "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000
}"#;

/// Qwen/Qwen3-30B-A3B.
pub const QWEN3_30B_A3B: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
  "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
  "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
  "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
  "norm_topk_prob": true, "vocab_size": 151936, "tie_word_embeddings": false,
  "attention_bias": false, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000
}"#;

/// Qwen/Qwen3-235B-A22B.
pub const QWEN3_235B_A22B: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
  "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
  "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
  "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
  "norm_topk_prob": true, "vocab_size": 151936, "tie_word_embeddings": false,
  "attention_bias": false, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000
}"#;

/// deepseek-ai/DeepSeek-V3 (the MTP layer, `num_nextn_predict_layers`, is not synced).
pub const DEEPSEEK_V3: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
  "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
  "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
  "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
  "first_k_dense_replace": 3, "moe_layer_freq": 1, "topk_method": "noaux_tc",
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": false,
  "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-06,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
}"#;

/// moonshotai/Kimi-K2-Instruct.
pub const KIMI_K2: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "torch_dtype": "bfloat16",
  "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
  "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
  "n_shared_experts": 1, "n_routed_experts": 384, "num_experts_per_tok": 8,
  "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "noaux_tc",
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
  "v_head_dim": 128, "vocab_size": 163840, "tie_word_embeddings": false,
  "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-06,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
}"#;
