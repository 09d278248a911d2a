"""A declared model from Python, without torch: a ``config.json`` of an architecture the
planner does not know (``gemma3_text``), two trainers and two engines in this process, numpy
arrays registered in place. The trainers hold whole tensors (trainer 0 some, trainer 1 the
rest), the engines every tensor and a buffer they skip; the controller plans from what they
declare and every engine tensor equals the trainers'. An engine that declares a wrong shape gets
the plan's failure naming the tensor and both ranks. Seconds each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import weightsync

from conftest import Controller, Procs, start_controller
from test_embedded import full_value, in_threads

np = pytest.importorskip("numpy")

CONFIG = {"model_type": "gemma3_text", "hidden_size": 16, "num_hidden_layers": 2}

# name -> shape; trainer 0 holds the first three, trainer 1 the rest.
TENSORS = {
    "model.embed_tokens.weight": (101, 16),
    "model.layers.0.self_attn.q_proj.bias": (7,),
    "model.layers.0.mlp.experts.gate_up_proj": (3, 10, 16),
    "model.layers.1.pre_feedforward_layernorm.weight": (16,),
    "model.vision_tower.patch_embedding.weight": (4, 3, 2, 2),
}


def controller(tmp_path: Path, procs: Procs) -> Controller:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    return start_controller(procs, str(cfg), "fsdp=2", "dp=2,format=hf")


def join(c: Controller, wrong_shape: bool = False):  # noqa: ANN201 - test helper
    tok = c.job_token
    engines = [weightsync.Engine(c.control, r, job_token=tok) for r in range(2)]
    trainers = [weightsync.Trainer(c.control, r, job_token=tok) for r in range(2)]
    assert all(w.declared for w in [*engines, *trainers])
    assert trainers[0].layout() == [] and engines[0].layout() == []
    names = list(TENSORS)
    src = [{n: np.zeros(TENSORS[n], np.uint16) for n in part} for part in (names[:3], names[3:])]
    dst = []
    for r in range(2):
        d = {n: np.zeros(s, np.uint16) for n, s in TENSORS.items()}
        if wrong_shape and r == 1:
            d["model.embed_tokens.weight"] = np.zeros((102, 16), np.uint16)
        dst.append(d)
    buffers = [np.zeros(8, np.float32) for _ in range(2)]
    in_threads(
        [lambda e=e, d=d, b=b: e.register({**{n: (a, "bf16") for n, a in d.items()},
                                           "model.rotary_emb.inv_freq": b},
                                          format="hf", skip=["model.rotary_emb.inv_freq"])
         for e, d, b in zip(engines, dst, buffers)]
        + [lambda t=t, s=s: t.register({n: (a, "bf16") for n, a in s.items()}) for t, s in zip(trainers, src)]
    )
    return engines, trainers, src, dst


def test_a_declared_model_lands_every_tensor(tmp_path: Path, procs: Procs) -> None:
    engines, trainers, src, dst = join(controller(tmp_path, procs))
    try:
        for w in [*engines, *trainers]:
            w.wait_plan(timeout=30)
        for v in (1, 2):
            for s in src:
                for n, a in s.items():
                    a[...] = full_value(n, TENSORS[n], v)
            in_threads([lambda t=t: t.push(v).wait(timeout=60) for t in trainers])
            for e, d in zip(engines, dst):
                assert e.wait_for_version(v, timeout=30).version == v
                for n, a in d.items():
                    assert np.array_equal(a, full_value(n, TENSORS[n], v)), f"{e.worker_id} v{v}: {n}"
    finally:
        for w in [*trainers, *engines]:
            w.close()


def test_a_disagreement_is_named_before_any_byte_moves(tmp_path: Path, procs: Procs) -> None:
    engines, trainers, _src, dst = join(controller(tmp_path, procs), wrong_shape=True)
    try:
        with pytest.raises(weightsync.SyncError) as e:
            trainers[0].wait_plan(timeout=30)
        msg = str(e.value)
        assert "tensor model.embed_tokens.weight" in msg, msg
        assert "inference rank 1 declares shape [102, 16]" in msg, msg
        assert "trainer rank 0 holds a tensor of shape [101, 16]" in msg, msg
        assert all(not a.any() for a in dst[0].values())
    finally:
        for w in [*trainers, *engines]:
            w.close()
