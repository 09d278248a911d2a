"""TRL's experimental async GRPO trainer (``AsyncGRPOTrainer``, as
``weightsync.trl_async.WeightsyncAsyncGRPOTrainer``) syncing a tiny Qwen3 to a vLLM server
through weightsync (run by tests/test_trl.py):

    python train_trl_async.py --model DIR --url http://127.0.0.1:P --controller HOST:PORT \
        --controller-http http://HOST:PORT --syncs 3 --wrong OTHER_DIR --out OUT

What of TRL runs, and what cannot on CPU (docs/trl.md): the trainer is TRL's own, built by its
own constructor, and its syncs are TRL's own ``_sync_weight`` (the cold sync through TRL's
``_TrainBeginCallback.on_train_begin``, then the call TRL's ``StepIntervalCallback`` makes after
an optimizer step). Its training step cannot run here: the model's attention is TRL's
``tree_fa3`` (the FlashAttention-3 kernel from the Hub's ``kernels-community/flash-attn3``, CUDA
only), so between syncs this script takes an optimizer step of its own on the same model
(plain SDPA attention, a log-sum-exp loss of the logits). Its rollout worker is a recorder
(TRL's ``RolloutWorkerProtocol``, which the trainer takes as ``rollout_worker=``): TRL's
worker generates through the server's chat routes in a spawned process, which the test's
tokenizer-less server does not serve. TRL's constructor asks CUDA for the device's name
(``get_peak_flops_per_device``, for MFU metrics): that probe answers None here, as TRL's
does for a device it does not know.

After each sync this records to ``OUT/async_v{V}.json`` the SHA-256 of every trainer parameter,
what the server holds (``VllmServer.digests()``), its ``weight_version``, TRL's
``model_version`` and what the rollout worker was told; ``OUT/async_syncs.json``: each sync's
seconds and bytes and TRL's ``perf/weight_sync_s``. Then ``--wrong``: a model whose layout is
not the job's is refused when the trainer is built (``OUT/async_wrong.json``: the error).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import sys
from typing import Any

import torch


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class RecordingRolloutWorker:
    """TRL's ``RolloutWorkerProtocol``: records what the trainer tells it."""

    def __init__(self) -> None:
        self.rollout_buffer: queue.Queue[Any] = queue.Queue()
        self.metrics_queue: queue.Queue[Any] = queue.Queue()
        self.versions: list[int] = []
        self.started = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        pass


def build(args: argparse.Namespace, model: str, worker: RecordingRolloutWorker) -> Any:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from weightsync.trl_async import WeightsyncAsyncGRPOTrainer

    config = AsyncGRPOConfig(output_dir=os.path.join(args.out, "run-async"), max_steps=args.syncs,
                             per_device_train_batch_size=4, num_generations=4, report_to="none", use_cpu=True,
                             bf16=False, dtype="bfloat16", vllm_server_base_url=args.url, save_strategy="no")
    reward = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731  # never called: no rollouts here
    dataset = Dataset.from_dict({"prompt": ["w3 w4 w5"] * 8})
    tokenizer = AutoTokenizer.from_pretrained(model)
    trainer = WeightsyncAsyncGRPOTrainer(
        model=model, args=config, reward_funcs=reward, train_dataset=dataset, processing_class=tokenizer,
        rollout_worker=worker,  # the test's recorder (TRL's own worker needs a server with a tokenizer)
        weightsync_controller=args.controller, weightsync_controller_http=args.controller_http)
    return trainer


def optimizer_step(model: Any, opt: torch.optim.Optimizer, step: int) -> None:
    """One SGD step on the model with SDPA attention (TRL's tree_fa3 needs CUDA)."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        ids = torch.tensor([[(7 * step + j) % 1000 + 3 for j in range(8)]])
        hidden = model.model(input_ids=ids).last_hidden_state
        loss = (hidden @ model.lm_head.weight.T).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    finally:
        model.config._attn_implementation = impl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--controller-http")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--wrong", help="a model folder whose layout is not the job's")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import trl.experimental.async_grpo.async_grpo_trainer as agt

    # TRL's CUDA-only device probe (MFU metrics): None, as TRL answers for a device it does not know.
    agt.get_peak_flops_per_device = lambda accelerator, dtype: None

    worker = RecordingRolloutWorker()
    trainer = build(args, args.model, worker)
    model = trainer.accelerator.unwrap_model(trainer.model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    begin = next(cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "_TrainBeginCallback")
    sync_callback = next(cb for cb in trainer.callback_handler.callbacks
                         if type(cb).__name__ == "StepIntervalCallback" and cb.fn == trainer._sync_weight)

    def record() -> None:
        s = trainer.syncs[-1]
        srv = trainer.weight_transfer.server
        rec = {"version": s["version"], "model_version": trainer.model_version, "told": list(worker.versions),
               "trainer": {n: digest(p) for n, p in model.named_parameters()}, "server": srv.digests()[0],
               "weight_version": srv.weight_version()}
        with open(os.path.join(args.out, f"async_v{s['version']}.json"), "w") as f:
            json.dump(rec, f)

    # TRL's train begin: joins the server to the job, the cold sync, starts the rollout worker.
    begin.on_train_begin(trainer.args, trainer.state, trainer.control)
    assert worker.started
    record()
    for step in range(1, args.syncs):
        optimizer_step(model, opt, step)
        trainer.state.global_step = step
        sync_callback.on_step_end(trainer.args, trainer.state, trainer.control)  # TRL's periodic sync
        record()
    syncs = [{"version": s["version"], "seconds": s["seconds"], "bytes": s["outcome"].bytes} for s in trainer.syncs]
    with open(os.path.join(args.out, "async_syncs.json"), "w") as f:
        json.dump({"syncs": syncs, "trl_weight_sync_s": trainer._metrics["train"]["perf/weight_sync_s"]}, f)
    trainer.close()

    if args.wrong:
        import weightsync

        try:
            build(args, args.wrong, RecordingRolloutWorker())
            wrong: dict[str, Any] = {"raised": None}
        except (weightsync.RegistrationError, weightsync.LayoutMismatchError) as e:
            wrong = {"raised": type(e).__name__, "tensor": e.tensor, "message": str(e)}
        with open(os.path.join(args.out, "async_wrong.json"), "w") as f:
            json.dump(wrong, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
