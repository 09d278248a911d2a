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
  the job's raises naming the tensor, before any step.

Needs TRL (python/scripts/test.sh installs it) and vLLM's CPU build; skipped without them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm")
pytest.importorskip("trl")

from conftest import FIGURES, JOBS, Procs, start_controller  # noqa: E402
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


@pytest.mark.e2e
def test_trl_grpo_syncs_through_weightsync(tmp_path: Path, procs: Procs) -> None:
    folder = model_folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    c = start_controller(procs, str(folder / "config.json"), "fsdp=1", "tp=1,format=hf")
    url = start_server(procs, tmp_path, folder, c, up_s=600)
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
    procs.kill_all()
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
