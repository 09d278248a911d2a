"""Engines of a declared model that say what their tensors are made of (``weightsync.Source``),
from Python without torch: a ``config.json`` of an architecture the planner does not know
(``gemma3_text``), two trainers holding Hugging Face tensors whole, and one ``tp=2`` engine
whose two ranks hold, as vLLM does, a fused ``qkv_proj`` of their q, k and v rows, a fused
``gate_up_proj`` of their gate and up rows, their columns of ``o_proj`` (a box of the tensor
of its name) and the norm whole. The controller plans from those declarations alone and every
engine tensor lands equal to the trainers' parts, concatenated. A source that cannot fill its
tensor is refused by ``register`` naming it; a part no trainer holds and a dtype the sides
disagree on fail the plan naming the tensor, before any byte moves. Seconds each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import weightsync
from weightsync import Source, SourceBox

from conftest import Controller, Procs, start_controller
from test_embedded import full_value, in_threads

np = pytest.importorskip("numpy")

CONFIG = {"model_type": "gemma3_text", "hidden_size": 16, "num_hidden_layers": 1}
A, M = "model.layers.0.self_attn.", "model.layers.0.mlp."
# The trainers' tensors (trainer 0 the attention, trainer 1 the rest), whole.
TENSORS = {
    A + "q_proj.weight": (8, 16),
    A + "k_proj.weight": (4, 16),
    A + "v_proj.weight": (4, 16),
    A + "o_proj.weight": (16, 8),
    M + "gate_proj.weight": (12, 16),
    M + "up_proj.weight": (12, 16),
    "model.layers.0.input_layernorm.weight": (16,),
}
TRAINER_0 = [n for n in TENSORS if n.startswith(A)]


def rows(name: str, rank: int) -> SourceBox:
    """Tensor-parallel rank ``rank`` of 2's rows of ``name``."""
    r, c = TENSORS[name]
    return SourceBox(name, (rank * r // 2, 0), (r // 2, c))


def engine_rank(rank: int) -> tuple[dict[str, Any], dict[str, Source | None], dict[str, Any]]:
    """Rank ``rank``'s tensors, their sources, and what each must hold at a version (a function
    of the full tensors)."""
    o = TENSORS[A + "o_proj.weight"]
    sources = {
        A + "qkv_proj.weight": Source(0, tuple(rows(A + p, rank) for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight"))),
        M + "gate_up_proj.weight": Source(0, (rows(M + "gate_proj.weight", rank), rows(M + "up_proj.weight", rank))),
        A + "o_proj.weight": Source.box_of(A + "o_proj.weight", o, (0, rank * o[1] // 2), (o[0], o[1] // 2)),
        "model.layers.0.input_layernorm.weight": None,
    }
    def cut(full: dict[str, Any], b: SourceBox) -> Any:
        return full[b.tensor][tuple(slice(s, s + n) for s, n in zip(b.offset, b.shape))]

    def want(full: dict[str, Any]) -> dict[str, Any]:
        return {n: full[n] if s is None else np.concatenate([cut(full, b) for b in s.parts], axis=s.dim)
                for n, s in sources.items()}
    shapes = {n: a.shape for n, a in want({n: np.zeros(s, np.uint16) for n, s in TENSORS.items()}).items()}
    return {n: np.zeros(s, np.uint16) for n, s in shapes.items()}, sources, want


def controller(tmp_path: Path, procs: Procs) -> Controller:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    return start_controller(procs, str(cfg), "fsdp=2", "tp=2,format=hf")


def join(c: Controller, change: Any = None):  # noqa: ANN201 - test helper
    """Two trainers and the engine's two ranks registered; ``change(rank, dst, sources)`` may
    alter a rank's declarations first."""
    tok = c.job_token
    engines = [weightsync.Engine(c.control, r, job_token=tok) for r in range(2)]
    trainers = [weightsync.Trainer(c.control, r, job_token=tok) for r in range(2)]
    src = [{n: np.zeros(TENSORS[n], np.uint16) for n in TENSORS if (n in TRAINER_0) == (r == 0)} for r in range(2)]
    ranks = [engine_rank(r) for r in range(2)]
    if change is not None:
        for r, (dst, sources, _) in enumerate(ranks):
            change(r, dst, sources)
    in_threads(
        [lambda e=e, d=d, s=s: e.register({n: (a, "bf16") if a.dtype == np.uint16 else a for n, a in d.items()},
                                          format="hf", sources=s)
         for e, (d, s, _) in zip(engines, ranks)]
        + [lambda t=t, s=s: t.register({n: (a, "bf16") for n, a in s.items()}) for t, s in zip(trainers, src)]
    )
    return engines, trainers, src, ranks


def close(*workers: Any) -> None:
    for w in workers:
        w.close()


def test_fused_and_tensor_parallel_sources_land_their_parts(tmp_path: Path, procs: Procs) -> None:
    engines, trainers, src, ranks = join(controller(tmp_path, procs))
    try:
        for w in [*engines, *trainers]:
            w.wait_plan(timeout=30)
        for v in (1, 2):
            full = {n: full_value(n, s, v) for n, s in TENSORS.items()}
            for s in src:
                for n, a in s.items():
                    a[...] = full[n]
            in_threads([lambda t=t: t.push(v).wait(timeout=60) for t in trainers])
            for e, (dst, _, want) in zip(engines, ranks):
                assert e.wait_for_version(v, timeout=30).version == v
                for n, a in want(full).items():
                    assert np.array_equal(dst[n], a), f"{e.worker_id} v{v}: {n}"
    finally:
        close(*trainers, *engines)


def test_a_source_that_cannot_fill_its_tensor_is_refused_by_register(tmp_path: Path, procs: Procs) -> None:
    c = controller(tmp_path, procs)
    e = weightsync.Engine(c.control, 0, job_token=c.job_token)
    try:
        dst, sources, _ = engine_rank(0)
        # q and k rows only: 6 of qkv_proj's 8 rows.
        qkv = A + "qkv_proj.weight"
        sources[qkv] = Source(0, sources[qkv].parts[:2])  # type: ignore[union-attr]
        with pytest.raises(weightsync.RegistrationError, match=r"tensor model\.layers\.0\.self_attn\.qkv_proj\.weight.*stop short") as err:
            e.register({n: (a, "bf16") for n, a in dst.items()}, sources=sources)
        assert "fill 6 of its 8 along dim 0" in str(err.value)
        # Whole tensors only cannot be a tp=2 rank's.
        with pytest.raises(weightsync.RegistrationError, match="tp=2"):
            e.register({"model.layers.0.input_layernorm.weight": (dst["model.layers.0.input_layernorm.weight"], "bf16")})
        with pytest.raises(ValueError, match=r"tensor x: source .*offset of 1 dims and a shape of 2"):
            e.register({}, sources={"x": Source(0, (SourceBox("y", (0,), (1, 2)),))})
    finally:
        close(e)


def _unknown_part(rank: int, dst: dict[str, Any], sources: dict[str, Any]) -> None:
    gu = M + "gate_up_proj.weight"
    sources[gu] = Source(0, (sources[gu].parts[0], SourceBox(M + "upp_proj.weight", (rank * 6, 0), (6, 16))))


def _f32_norm(rank: int, dst: dict[str, Any], sources: dict[str, Any]) -> None:
    dst["model.layers.0.input_layernorm.weight"] = np.zeros(16, np.float32)


@pytest.mark.parametrize(("change", "said"), [
    (_unknown_part, r"gate_up_proj\.weight.*upp_proj\.weight"),
    (_f32_norm, r"input_layernorm\.weight.*f32.*bf16"),
])
def test_a_part_no_trainer_holds_or_a_dtype_mismatch_fails_the_plan_by_name(
        tmp_path: Path, procs: Procs, change: Any, said: str) -> None:
    engines, trainers, _src, ranks = join(controller(tmp_path, procs), change)
    try:
        with pytest.raises(weightsync.SyncError, match=said):
            trainers[0].wait_plan(timeout=30)
        assert all(not a.any() for dst, _, _ in ranks for a in dst.values())
    finally:
        close(*trainers, *engines)
