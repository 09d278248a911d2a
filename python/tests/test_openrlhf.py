"""``weightsync.openrlhf`` against the real weightsync path (a controller, an engine process
holding a transformers model registered with ``weightsync.Engine``): OpenRLHF itself does not
import on CPU (docs/openrlhf.md says what fails), so each policy rank is a process
(``jobs/train_openrlhf.py``, as OpenRLHF runs one Ray actor per rank) holding a replica of a
tiny Qwen3 behind an object shaped as OpenRLHF's ``ActorPPOTrainer`` is read by
:func:`weightsync.openrlhf.install` (``.actor.model.module``), as ZeRO-1/2 holds them
(``--train dp=2``). Each round both ranks take the same SGD step and call their trainer's
``broadcast_to_vllm()`` as OpenRLHF's ``PPOTrainer`` does:

- after each of 3 syncs the engine's tensors equal the trainer's byte for byte, the trainer's
  weights moved between syncs, and both ranks pushed (the planner split the reads among the
  replicas: each rank's outcome counts bytes);
- bad wiring fails by name at ``install``: a shape not the job's, a name not the job's, a ZeRO-3
  partitioned parameter;
- the engine side (``weightsync.openrlhf_engine``): OpenRLHF's own ``RolloutRayActor`` class
  (OpenRLHF 0.11.2, installed without its dependencies: its engine module imports on CPU),
  subclassed by ``rollout_actor_class`` and built by OpenRLHF's constructor with
  ``create_vllm_engines``' engine arguments, receives 3 versions from a policy rank through
  ``weightsync_init`` / ``weightsync_update``: after each, its ``weight_version`` is the version
  asked for or a newer one the policy already pushed, and vLLM's loaded parameters equal that
  version of the trainer's byte for byte (fused ones against the trainer's parts concatenated);
  OpenRLHF's ``generate`` serves, and after the last its
  staged arena equals the trainer's (skipped where OpenRLHF is not installed).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import JOBS, Procs, start_controller  # noqa: E402

sys.path.insert(0, str(JOBS))
import tiny  # noqa: E402

TIMEOUT_S = 300
ENGINE_TIMEOUT_S = 600  # a vLLM CPU engine's start: 2.5 minutes on a loaded 2-core host


def model_folder(tmp_path: Path, name: str = "model", **overrides: Any) -> Path:
    folder = tmp_path / name
    tiny.write_config(str(folder), "dense", **overrides)
    return folder


def actor_trainer(model: Any) -> Any:
    """An object read as OpenRLHF's ``ActorPPOTrainer`` is: ``actor.model`` is DeepSpeed's
    engine, whose ``module`` is the Hugging Face model; ``broadcast_to_vllm`` is OpenRLHF's."""
    def openrlhf_broadcast() -> None:
        raise AssertionError("OpenRLHF's own broadcast_to_vllm ran: install() did not replace it")

    return SimpleNamespace(actor=SimpleNamespace(model=SimpleNamespace(module=model)),
                           broadcast_to_vllm=openrlhf_broadcast)


@pytest.mark.e2e
def test_openrlhf_broadcast_to_vllm_through_weightsync(tmp_path: Path, procs: Procs) -> None:
    folder = model_folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    c = start_controller(procs, str(folder / "config.json"), "dp=2", "tp=1,format=hf")
    engine = procs.start("engine0", [sys.executable, str(JOBS / "engine_hf.py"), "--rank", "0", "--model", str(folder),
                                     "--controller", c.control, "--versions", "1", "2", "3", "--out", str(out)],
                         env=c.env())
    ranks = [procs.start(f"policy{r}", [sys.executable, str(JOBS / "train_openrlhf.py"), "--model", str(folder),
                                        "--controller", c.control, "--rank", str(r), "--steps", "3", "--out", str(out)],
                         env=c.env()) for r in (0, 1)]
    deadline = time.monotonic() + TIMEOUT_S
    for p in [*ranks, engine]:
        try:
            rc = p.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{p.name} still running after {TIMEOUT_S} s\n{procs.logs()}")
        assert rc == 0, f"{p.name} exited with {rc}\n{procs.logs()}"

    previous: dict[str, Any] | None = None
    for v in (1, 2, 3):
        recs = [torch.load(out / f"trainer_r{r}_v{v}.pt") for r in (0, 1)]
        assert [r["version"] for r in recs] == [v, v]
        # Both ranks pushed a share: the planner split the reads among the replicas.
        assert all(r["bytes"] > 0 for r in recs), f"v{v}: a rank moved nothing: {[r['bytes'] for r in recs]}"
        full = recs[0]["params"]
        assert all(torch.equal(full[n], recs[1]["params"][n]) for n in full), f"v{v}: the replicas differ"
        got = torch.load(out / f"engine0_v{v}.pt")["params"]
        assert sorted(got) == sorted(full)
        for n, t in full.items():
            assert torch.equal(got[n].view(torch.uint8), t.contiguous().view(torch.uint8)), f"v{v}: {n} differs"
        if previous is not None:
            assert any(not torch.equal(previous[n], full[n]) for n in full), f"v{v}: nothing moved"
        previous = full


@pytest.mark.parametrize("case", ["shape", "name", "zero3"])
def test_openrlhf_bad_wiring_fails_by_name_at_install(tmp_path: Path, procs: Procs, case: str) -> None:
    import weightsync
    from weightsync.openrlhf import WeightsyncSettings, install

    job = model_folder(tmp_path, "job")
    c = start_controller(procs, str(job / "config.json"), "dp=1", "tp=1,format=hf")
    if case == "shape":
        model = tiny.build(str(model_folder(tmp_path, "other", intermediate_size=192)), seed=7)
        want, error = "model.layers.0.mlp.gate_proj.weight", weightsync.LayoutMismatchError
    elif case == "name":
        model = tiny.build(str(job), seed=7)
        model.model.extra = torch.nn.Linear(2, 2, bias=False).to(torch.bfloat16)
        want, error = "model.extra.weight", weightsync.RegistrationError
    else:
        model = tiny.build(str(job), seed=7)
        p = model.model.layers[1].self_attn.q_proj.weight
        p.ds_shape = p.shape  # as DeepSpeed ZeRO-3 marks the parameters it partitioned
        want, error = "model.layers.1.self_attn.q_proj.weight", weightsync.RegistrationError
    trainer = actor_trainer(model)
    original = trainer.broadcast_to_vllm
    settings = WeightsyncSettings(controller=c.control, job_token=c.job_token)
    with pytest.raises(error) as e:
        install(trainer, settings, rank=0)
    assert e.value.tensor == want and want in str(e.value), e.value
    assert trainer.broadcast_to_vllm is original  # nothing swapped: OpenRLHF's own path stands


def sha(t: Any) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.e2e
def test_openrlhf_rollout_actor_receives_through_weightsync(tmp_path: Path, procs: Procs) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("openrlhf")
    folder = model_folder(tmp_path)
    tiny.build(str(folder), seed=100).save_pretrained(str(folder))  # the engine's initial checkpoint
    out = tmp_path / "out"
    out.mkdir()
    c = start_controller(procs, str(folder / "config.json"), "dp=1", "tp=1,format=hf")
    from test_vllm import vllm_env

    env = {**c.env(), **vllm_env(tmp_path), "PYTHONSAFEPATH": "1"}
    engine = procs.start("openrlhf-engine", [
        sys.executable, str(JOBS / "engine_openrlhf.py"), "--model", str(folder), "--controller", c.control,
        "--controller-http", c.http, "--versions", "1", "2", "3", "--out", str(out)], env=env)
    policy = procs.start("policy0", [sys.executable, str(JOBS / "train_openrlhf.py"), "--model", str(folder),
                                     "--controller", c.control, "--rank", "0", "--steps", "3", "--out", str(out)],
                         env=c.env())
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    for p in (policy, engine):
        try:
            rc = p.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{p.name} still running after {ENGINE_TIMEOUT_S} s\n{procs.logs()}")
        assert rc == 0, f"{p.name} exited with {rc}\n{procs.logs()}"

    from test_vllm import hf_name_parts

    empty = sha(torch.empty(0, dtype=torch.uint8))
    previous: dict[str, str] | None = None
    for v in (1, 2, 3):
        rec = json.loads((out / f"orl_engine_v{v}.json").read_text())
        # The policy pushes without waiting for this engine: asked for v, it may already hold a
        # newer version, and then it says so (an engine never reports a version it does not hold).
        held = int(rec["weight_version"])
        assert v <= held <= 3 and rec["loaded_version"] == held, (v, rec["weight_version"], rec["loaded_version"])
        params = torch.load(out / f"trainer_r0_v{held}.pt")["params"]
        full = {n: sha(t) for n, t in params.items()}
        # vLLM's loaded parameters are that version: fused ones (qkv_proj, gate_up_proj) are the
        # trainer's parts concatenated (tp=1); one a CPU kernel emptied by packing is skipped.
        loaded = [n for n, d in rec["digests"]["params"].items() if d != empty]
        assert loaded, rec["digests"]["params"]
        for n in loaded:
            parts = hf_name_parts(n)
            want = sha(torch.cat([params[p] for p in parts])) if len(parts) > 1 else full[n]
            assert rec["digests"]["params"][n] == want, f"v{v}: vLLM's {n} differs from the trainer's v{held}"
        assert len(rec["tokens"]) == 8  # OpenRLHF's generate served with these weights
    for v in (1, 2, 3):  # each step changed the trainer's weights
        now = {n: sha(t) for n, t in torch.load(out / f"trainer_r0_v{v}.pt")["params"].items()}
        if previous is not None:
            assert any(previous[n] != now[n] for n in now), f"v{v}: nothing moved"
        previous = now
    # The staged arena after the last version: byte for byte the trainer's (earlier versions'
    # arenas may already hold the next one: the policy pushes without waiting for this engine).
    assert rec["digests"]["arena"] == full, "the engine's arena differs from the trainer's last version"
