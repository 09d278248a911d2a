"""fp8 as each engine would load it (issue 36): transformers' own ``Fp8Quantize`` (what
``from_pretrained`` with ``FineGrainedFP8Config`` writes) against the reference's
``transformers`` recipe, bit for bit on random bf16 weights; how often it differs from vLLM's
recipe; and a job that names ``fp8=transformers`` (FSDP2 -> two transformers fp8 engines) whose
engines hold, bit for bit, what ``Fp8Quantize`` makes from the trainer's weights."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import FIGURES, JOBS, Procs  # noqa: E402
from test_e2e import compare, outcomes, run_job  # noqa: E402

sys.path.insert(0, str(JOBS))
from fp8_reference import quantize_blocks  # noqa: E402


def transformers_quantize(w: object) -> tuple[object, object]:
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    cfg = FineGrainedFP8Config(weight_block_size=[128, 128])
    out = Fp8Quantize(types.SimpleNamespace(quantization_config=cfg)).convert({"w.weight": w})
    return out["w.weight"], out["w.weight_scale_inv"]


def as_bytes(t: object) -> object:
    return t.contiguous().view(torch.uint8)  # type: ignore[attr-defined]


def test_reference_recipe_is_transformers_fp8quantize_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(36)
    w = torch.randn(1024, 20 * 128, generator=g).to(torch.bfloat16)  # 8 x 20 = 160 blocks
    w[:128, :128] = 0  # an all-zero block: scale 1.0 in transformers, 1e-4/448 in vLLM's
    w[128:256, 128:256] *= 1e-6  # a block below vLLM's 1e-4 amax floor
    q_t, s_t = transformers_quantize(w)
    q_r, s_r = quantize_blocks(w, "transformers")
    assert torch.equal(as_bytes(q_t), as_bytes(q_r)), int((as_bytes(q_t) != as_bytes(q_r)).sum())
    assert torch.equal(as_bytes(s_t), as_bytes(s_r))
    assert float(s_t[0, 0]) == 1.0
    # vLLM's recipe: the same values, scales one ulp apart in many blocks.
    q_v, s_v = quantize_blocks(w, "a")
    differ = int((as_bytes(s_v).view(torch.int32) != as_bytes(s_t).view(torch.int32)).sum())
    values = int((as_bytes(q_v) != as_bytes(q_t)).sum())
    FIGURES["fp8 recipes, 160 random bf16 blocks"] = {"scales differing vllm vs transformers": differ,
                                                      "values differing": values}
    assert differ > 0 and values > 0


@pytest.mark.e2e
def test_job_naming_the_transformers_recipe(tmp_path: Path, procs: Procs) -> None:
    out = run_job(tmp_path, procs, kind="dense", train="fsdp=2", nproc=2,
                  infer="tp=1,dp=2,format=hf,fp8=transformers", dtype="fp8",
                  engines={0: (0, 1), 1: (0, 1)}, steps=2)
    compare(out, [1, 2], {0: (0, 1), 1: (0, 1)}, fp8=True, tokens=False, recipe="transformers")
    # And that reference is transformers' own quantiser, bit for bit, on the trainer's weights.
    params = torch.load(out / "trainer_v2.pt")["params"]
    engine = torch.load(out / "engine0_v2.pt")["params"]
    name = "model.layers.0.mlp.down_proj.weight"
    q, s = transformers_quantize(params[name])
    assert torch.equal(as_bytes(engine[name]), as_bytes(q))
    assert torch.equal(as_bytes(engine[name[: -len("weight")] + "weight_scale_inv"]), as_bytes(s))
    FIGURES["dense fsdp=2 -> hf fp8=transformers dp=2"] = outcomes(out, [1, 2])
