"""weightsync under TRL's own GRPOTrainer (``weightsync.trl``): a controller, a vLLM CPU server
with the ``weightsync`` backend, and ``WeightsyncGRPOTrainer`` (TRL's GRPO with its sync
swapped) on a tiny Qwen3 and a tokenizer both written here (no hub), a reward function of the
test's: 3 syncs, i.e. the initial weights and the weights after each of 2 optimizer steps.

- after each sync the server's staged arena equals the trainer's parameters byte for byte, and
  so do vLLM's own parameters (fused ``qkv_proj`` / ``gate_up_proj`` rebuilt from the trainer's;
  a parameter a CPU kernel emptied by packing is counted and skipped), its ``weight_version`` is
  TRL's ``global_step + 1``, and the trainer's weights moved between syncs (GRPO stepped);
- the figures: seconds per ``sync_weights`` call (timed around TRL's call), weightsync's
  server path against TRL's default on CPU (colocate: an in-process vLLM and ``load_weights``;
  TRL's server path needs CUDA for its NCCL group), both in this test;
- bad wiring fails by name when the trainer is built: a model whose shapes or names differ from
  the job's raises naming the tensor, before any step;
- TRL's experimental ``AsyncGRPOTrainer`` (``weightsync.trl_async``) on the same server and job
  (a module fixture: the server starts once for both): TRL's constructor, train-begin callback
  and ``_sync_weight`` with an optimizer step between syncs, 3 syncs byte-exact against the
  trainer, TRL's ``model_version`` told to its rollout worker, a wrong model refused by name
  (TRL's own training step needs CUDA: docs/trl.md says what runs).

Needs TRL (python/scripts/test.sh installs it) and vLLM's CPU build; skipped without them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm")
pytest.importorskip("trl")

from conftest import FIGURES, JOBS, Controller, Procs, start_controller  # noqa: E402
from test_vllm import digest, hf_name_parts, start_server, vllm_env, wait  # noqa: E402

sys.path.insert(0, str(JOBS))
import tiny  # noqa: E402
from train_trl import write_tokenizer  # noqa: E402

TIMEOUT_S = 600
EMPTY = digest(torch.empty(0, dtype=torch.uint8))


def model_folder(tmp_path: Path, name: str = "model", **overrides: Any) -> Path:
    folder = tmp_path / name
    tiny.write_config(str(folder), "dense", **overrides)
    tiny.build(str(folder), seed=100).save_pretrained(str(folder))
    write_tokenizer(str(folder))
    return folder


@dataclass
class SharedServer:
    """One controller (``--train fsdp=1``) and one vLLM CPU server with the weightsync backend
    for the module: GRPO's test and the async trainer's both sync through it, one after the
    other (the async trainer continues the job's versions), so the server starts once."""

    folder: Path
    controller: Controller
    url: str
    procs: Procs


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer]:
    tmp = tmp_path_factory.mktemp("trl-server")
    procs = Procs(tmp)
    try:
        folder = model_folder(tmp)
        c = start_controller(procs, str(folder / "config.json"), "fsdp=1", "tp=1,format=hf")
        yield SharedServer(folder, c, start_server(procs, tmp, folder, c, up_s=600), procs)
    except BaseException:
        print(procs.logs(), file=sys.stderr)
        raise
    finally:
        procs.kill_all()


@pytest.mark.e2e
def test_trl_grpo_syncs_through_weightsync(tmp_path: Path, procs: Procs, shared_server: SharedServer) -> None:
    folder, c, url = shared_server.folder, shared_server.controller, shared_server.url
    out = tmp_path / "out"
    out.mkdir()
    deadline = time.monotonic() + TIMEOUT_S
    tr = procs.start("trl-weightsync", [
        sys.executable, str(JOBS / "train_trl.py"), "--model", str(folder), "--sync", "weightsync", "--url", url,
        "--controller", c.control, "--controller-http", c.http, "--steps", "3", "--out", str(out)], env=c.env())
    wait(procs, tr, deadline)

    previous: dict[str, str] | None = None
    packed = 0
    for v in (1, 2, 3):
        rec = json.loads((out / f"sync_v{v}.json").read_text())
        assert rec["global_step"] == v - 1 and rec["weight_version"] == str(v), rec
        trainer, server = rec["trainer"], rec["server"]
        assert server["arena"] == trainer, f"v{v}: the server's arena differs from the trainer's parameters"
        for n, d in server["params"].items():
            if d == EMPTY:
                packed += 1  # a CPU kernel packed it; the arena and the tokens cover it
                continue
            parts = hf_name_parts(n)
            assert all(p in trainer for p in parts), (v, n)
            if len(parts) == 1:
                assert d == trainer[n], f"v{v}: vLLM's {n} differs from the trainer's"
        if previous is not None:
            moved = [n for n in trainer if trainer[n] != previous[n]]
            assert moved, f"v{v}: no parameter changed since the last sync (GRPO did not step)"
        previous = trainer
    fused = sum(1 for n in server["params"] if len(hf_name_parts(n)) > 1)
    assert fused > 0
    ws = json.loads((out / "sync_seconds_weightsync.json").read_text())

    # TRL's default path, same machine, same run: colocate (an in-process vLLM, load_weights).
    tr = procs.start("trl-colocate", [
        sys.executable, str(JOBS / "train_trl.py"), "--model", str(folder), "--sync", "trl-colocate", "--steps", "3",
        "--out", str(out)], env={**vllm_env(tmp_path), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    wait(procs, tr, time.monotonic() + TIMEOUT_S)
    base = json.loads((out / "sync_seconds_trl-colocate.json").read_text())
    assert len(ws) == len(base) == 3, (ws, base)
    # The first sync includes one-off work on both paths (registration; TRL's first walk).
    ws_s, base_s = sorted(ws[1:])[len(ws[1:]) // 2], sorted(base[1:])[len(base[1:]) // 2]
    FIGURES["TRL GRPO sync_weights, weightsync server vs TRL colocate load_weights (s)"] = {
        "weightsync": [round(x, 4) for x in ws], "trl_colocate": [round(x, 4) for x in base],
        "ratio_after_first": round(ws_s / base_s, 2), "packed_params_skipped": packed}


@pytest.mark.e2e
def test_trl_async_grpo_syncs_through_weightsync(tmp_path: Path, procs: Procs, shared_server: SharedServer) -> None:
    """TRL's experimental AsyncGRPOTrainer (as WeightsyncAsyncGRPOTrainer) on the shared server:
    TRL's own constructor, train-begin callback and ``_sync_weight``; an optimizer step of the
    job's between syncs (TRL's step needs the CUDA FlashAttention-3 kernel: docs/trl.md). Runs
    after GRPO's test on the same job, so its versions continue the server's."""
    folder, c, url = shared_server.folder, shared_server.controller, shared_server.url
    out = tmp_path / "out"
    out.mkdir()
    wrong = model_folder(tmp_path, "wrong", intermediate_size=192)
    tr = procs.start("trl-async", [
        sys.executable, str(JOBS / "train_trl_async.py"), "--model", str(folder), "--url", url,
        "--controller", c.control, "--controller-http", c.http, "--syncs", "3", "--wrong", str(wrong),
        "--out", str(out)], env=c.env())
    wait(procs, tr, time.monotonic() + TIMEOUT_S)

    syncs = json.loads((out / "async_syncs.json").read_text())
    versions = [s["version"] for s in syncs["syncs"]]
    assert len(versions) == 3 and versions == list(range(versions[0], versions[0] + 3)), versions
    assert len(syncs["trl_weight_sync_s"]) == 3  # TRL's own metric: its _sync_weight ran each time
    previous: dict[str, str] | None = None
    for k, v in enumerate(versions, start=1):
        rec = json.loads((out / f"async_v{v}.json").read_text())
        # TRL's bookkeeping: model_version + 1 per sync, told to the rollout worker.
        assert rec["model_version"] == k and rec["told"] == list(range(1, k + 1)), rec
        assert rec["weight_version"] == str(v), rec
        trainer, server = rec["trainer"], rec["server"]
        assert server["arena"] == trainer, f"v{v}: the server's arena differs from the trainer's parameters"
        for n, d in server["params"].items():
            parts = hf_name_parts(n)
            if d != EMPTY and len(parts) == 1:
                assert d == trainer[n], f"v{v}: vLLM's {n} differs from the trainer's"
        if previous is not None:
            assert any(trainer[n] != previous[n] for n in trainer), f"v{v}: no parameter changed since the last sync"
        previous = trainer
    assert all(s["bytes"] > 0 for s in syncs["syncs"]), syncs
    refused = json.loads((out / "async_wrong.json").read_text())
    assert refused["raised"] == "LayoutMismatchError", refused
    assert refused["tensor"] == "model.layers.0.mlp.gate_proj.weight" and refused["tensor"] in refused["message"]
    FIGURES["TRL AsyncGRPO _sync_weight through weightsync (s; TRL's NCCL path needs CUDA)"] = {
        "weightsync": [round(s["seconds"], 4) for s in syncs["syncs"]]}


@pytest.mark.parametrize("wrong, tensor", [
    ({"intermediate_size": 192}, "model.layers.0.mlp.gate_proj.weight"),
    ({"num_hidden_layers": 3}, "model.layers.2."),
])
def test_trl_wrong_model_fails_by_name_before_training(tmp_path: Path, procs: Procs, wrong: dict[str, int],
                                                       tensor: str) -> None:
    import weightsync
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from weightsync.trl import WeightsyncGRPOTrainer
    from train_trl import reward_word_ids

    job = model_folder(tmp_path, "job")
    c = start_controller(procs, str(job / "config.json"), "fsdp=1", "tp=1,format=hf")
    other = model_folder(tmp_path, "other", **wrong)
    model = AutoModelForCausalLM.from_pretrained(str(other), dtype=torch.bfloat16)
    config = GRPOConfig(output_dir=str(tmp_path / "run"), use_vllm=True, vllm_mode="server",
                        vllm_server_base_url="http://127.0.0.1:9", per_device_train_batch_size=4, num_generations=4,
                        max_steps=1, report_to="none", use_cpu=True, bf16=False)
    with pytest.raises(weightsync.RegistrationError) as e:
        WeightsyncGRPOTrainer(model=model, args=config, reward_funcs=reward_word_ids,
                              train_dataset=Dataset.from_dict({"prompt": ["w3 w4"] * 4}),
                              processing_class=AutoTokenizer.from_pretrained(str(other)),
                              weightsync_controller=c.control, weightsync_job_token=c.job_token)
    assert e.value.tensor is not None and e.value.tensor.startswith(tensor), e.value
    assert tensor in str(e.value)
