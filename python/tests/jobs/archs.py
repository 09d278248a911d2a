"""Tiny random models of architectures weightsync has no family for (issue 36), each written as a
``config.json`` the way ``save_pretrained`` writes it, built by transformers 5.19 from the config
alone (no downloads): what ``tests/test_architectures.py`` syncs from FSDP2 to ``format=hf``
engines.

Every model has hidden size 64, 2 layers and 4 attention heads over 2 KV heads; the vocabulary
(1000, 1001 or 777 rows) is not a multiple of 64, and under 3 FSDP ranks every 64-row
projection splits 22/22/20 (2 ranks: an odd vocabulary splits unevenly). Each entry says what
is new about it for the planner: tensors no known family has.

Tried and left out (transformers 5.19): ``internlm2`` (remote code only: no config class);
``qwen2_vl`` and ``gemma3`` (multimodal) are not ``AutoModelForCausalLM`` models: they build as
``AutoModelForImageTextToText`` (``tiny.build`` picks it), Qwen2-VL is the vision-language
model here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

TEXT = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, max_position_embeddings=256, vocab_size=1000, tie_word_embeddings=False,
    eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


@dataclass(frozen=True)
class Arch:
    """One architecture: its ``model_type``, the config's own keys, the FSDP ranks to train it
    on, and what it brings that the seven known families lack."""

    model_type: str
    extra: dict[str, Any] = field(default_factory=dict)
    nproc: int = 3
    new: str = ""


ARCHS: dict[str, Arch] = {a.model_type: a for a in [
    Arch("gemma3_text", dict(head_dim=16, sliding_window=32), 3,
         "q_norm/k_norm per head, pre/post feed-forward norms, sliding and global layers, "
         "scaled embedding"),
    Arch("phi3", dict(vocab_size=1001), 2,
         "qkv_proj and gate_up_proj fused in its own Hugging Face names; odd vocabulary over 2 ranks"),
    Arch("glm4", dict(head_dim=16), 3,
         "q/k/v biases, fused gate_up_proj, post-self-attn and post-mlp norms, partial rotary"),
    Arch("olmo2", {}, 3, "q_norm/k_norm over the whole projection, no input layernorm"),
    Arch("granite", dict(vocab_size=777), 2,
         "embedding/residual/logit multipliers; odd vocabulary over 2 ranks"),
    Arch("gpt_oss", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                         layer_types=["sliding_attention", "full_attention"],
                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0,
                                          "original_max_position_embeddings": 128,
                                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}), 3,
         "attention sinks, router with bias, packed experts [E, H, 2I] with biases "
         "(4 experts over 3 ranks: 2, 2 and an empty shard)"),
    Arch("qwen2_vl", {}, 3,
         "a vision tower (5-D patch embedding, fused qkv with bias, merger) beside the language "
         "model; trained on an image and text"),
]}

#: Qwen2-VL: the image token and one 2x2-patch image (merged 2x2: one token).
IMAGE_TOKEN, VISION_START, VISION_END = 999, 997, 996


def write_config(folder: str, model_type: str, **overrides: Any) -> str:
    """Writes ``folder/config.json`` for ``model_type`` (a key of :data:`ARCHS`), with
    ``overrides`` of its text config's keys (e.g. the sizes vLLM's CPU attention takes); returns
    its path."""
    import torch
    from transformers import AutoConfig, Qwen2VLConfig

    arch = ARCHS[model_type]
    if model_type == "qwen2_vl":
        text = {**TEXT, **overrides, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
        text.pop("tie_word_embeddings")
        cfg: Any = Qwen2VLConfig(
            text_config=text,
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                               patch_size=14, spatial_merge_size=2, in_chans=3, temporal_patch_size=2),
            image_token_id=IMAGE_TOKEN, video_token_id=998, vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END, tie_word_embeddings=False,
        )
    else:
        cfg = AutoConfig.for_model(model_type, **{**TEXT, **arch.extra, **overrides})
    cfg.dtype = torch.bfloat16
    os.makedirs(folder, exist_ok=True)
    cfg.save_pretrained(folder)
    return os.path.join(folder, "config.json")


def batch_kwargs(model: Any, g: Any) -> dict[str, Any]:
    """One training batch for ``model`` from generator ``g`` (the same on every rank): random
    tokens, and for a vision-language model an image in the middle of each sequence, so the
    vision tower trains too."""
    import torch

    vocab = model.config.get_text_config().vocab_size
    if model.config.model_type != "qwen2_vl":
        ids = torch.randint(0, vocab - 4, (2, 32), generator=g)
        return dict(input_ids=ids, labels=ids)
    ids = torch.randint(0, vocab - 4, (2, 32), generator=g)
    ids[:, 10:13] = torch.tensor([VISION_START, IMAGE_TOKEN, VISION_END])
    pixels = torch.randn(2 * 4, 3 * 2 * 14 * 14, generator=g).to(torch.bfloat16)
    return dict(input_ids=ids, labels=ids, pixel_values=pixels,
                image_grid_thw=torch.tensor([[1, 2, 2], [1, 2, 2]]),
                mm_token_type_ids=(ids == IMAGE_TOKEN).long())
