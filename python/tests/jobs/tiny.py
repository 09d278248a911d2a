"""Tiny random Qwen3 / Qwen3-MoE models for the end-to-end tests: configs written to a folder
(``config.json``, as ``save_pretrained`` writes it: what the controller's ``--model`` reads),
models built the same way on the trainer and the engines (``from_config(dtype=bf16)``: never
``.to(bf16)``, which also casts the rotary tables and changes the tokens), greedy generation,
and the fp8 engine (transformers' FP8Linear, 128x128 blocks)."""

from __future__ import annotations

import os
from typing import Any

import torch

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def write_config(folder: str, kind: str, **overrides: Any) -> str:
    """Writes ``folder/config.json`` for ``kind`` (dense | moe | moe-fp8), with ``overrides`` of
    its keys (the config class derives what follows from them, e.g. ``layer_types`` from
    ``num_hidden_layers``); returns its path."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    if kind == "dense":
        cfg: Any = Qwen3Config(**{"intermediate_size": 256, "head_dim": 32, **common, **overrides})
    elif kind == "moe":
        cfg = Qwen3MoeConfig(**{
            "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 4,
            "num_experts_per_tok": 2, "norm_topk_prob": True, **common, **overrides,
        })
    else:
        raise ValueError(kind)
    cfg.dtype = torch.bfloat16
    os.makedirs(folder, exist_ok=True)
    cfg.save_pretrained(folder)
    return os.path.join(folder, "config.json")


def build(folder: str, seed: int, dtype: Any = None) -> Any:
    """The model of ``folder/config.json`` in bf16 (or ``dtype``: f32 master weights), random
    init from ``seed``: a causal LM, or for a vision-language config (Qwen2-VL) the
    image-text-to-text model, which generates text the same way."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    torch.manual_seed(seed)
    cfg = AutoConfig.from_pretrained(folder)
    auto = AutoModelForCausalLM if cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModelForImageTextToText
    return auto.from_config(cfg, dtype=dtype or torch.bfloat16)


def blocks(model: Any) -> list[Any]:
    """The repeated blocks of a model, each one FSDP2 unit: the members of every ModuleList
    (decoder layers; a vision tower's blocks)."""
    return [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]


def build_fp8(folder: str, seed: int) -> Any:
    """The engine's fp8 model: transformers' FP8Linear (e4m3 weights + f32 ``weight_scale_inv``
    per 128x128 block) in every linear but lm_head; the new fp8 tensors are allocated empty (the
    sync fills them)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    model = build(folder, seed)
    qc = FineGrainedFP8Config(weight_block_size=[128, 128], modules_to_not_convert=["lm_head"])
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], quantization_config=qc)
    for mod in model.modules():
        for pn, p in list(mod.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(mod, pn, torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=False))
    return model


@torch.no_grad()
def greedy(model: Any, n: int = 16) -> list[int]:
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
    return [int(t) for t in out[0, len(PROMPT):].tolist()]
