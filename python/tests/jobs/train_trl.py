"""TRL's own GRPOTrainer on a tiny Qwen3 (run by tests/test_trl.py): a few GRPO steps whose
weights reach a vLLM server through weightsync (``--sync weightsync``) or, for the figures,
through TRL's own colocate path (``--sync trl-colocate``: an in-process vLLM and
``load_weights``).

    python train_trl.py --model DIR --sync weightsync --url http://127.0.0.1:P \
        --controller HOST:PORT --controller-http http://HOST:PORT --steps 3 --out OUT

``DIR`` holds the config, a checkpoint and a tokenizer the test wrote (``write_tokenizer``: a
word-level tokenizer built here, no hub). The dataset is a few prompts of those words, the
reward is the mean word id of a completion. After each sync (``--sync weightsync``) this
records to ``OUT/sync_v{V}.json`` the SHA-256 of every trainer parameter at that moment and what
the server says it holds (``VllmServer.digests()``: its parameters and its staged arena), the
server's ``weight_version``, and each ``sync_weights`` call's seconds (``OUT/sync_seconds_{SYNC}.json``, on both paths) and
TRL's logged metrics (``OUT/trl_metrics_{SYNC}.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any

import torch

#: The tokenizer's words: special tokens, then w3 ... w1023 (the tiny model's vocabulary is 1024).
SPECIAL = ["[PAD]", "[EOS]", "[UNK]"]


def write_tokenizer(folder: str, vocab_size: int = 1024) -> None:
    """A word-level tokenizer over ``w3 .. w{vocab_size-1}``, saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")
    fast.save_pretrained(folder)


def reward_word_ids(completions: list[str], **kwargs: Any) -> list[float]:
    """The reward: the mean id of the completion's words / 1000. It differs between the
    completions of a group almost surely (a count of distinct words was often the same for all
    four: zero advantage, a step that moves nothing), so every GRPO step changes the weights."""
    out = []
    for c in completions:
        ids = [int(w[1:]) for w in c.split() if w[1:].isdigit()]
        out.append(sum(ids) / len(ids) / 1000 if ids else 0.0)
    return out


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--sync", choices=["weightsync", "trl-colocate"], required=True)
    ap.add_argument("--url", help="the vLLM server (--sync weightsync)")
    ap.add_argument("--controller", help="the controller's control address (--sync weightsync)")
    ap.add_argument("--controller-http")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    dataset = Dataset.from_dict({"prompt": [" ".join(f"w{(7 * i + j) % 1000 + 3}" for j in range(6)) for i in range(16)]})
    common: dict[str, Any] = dict(
        output_dir=os.path.join(args.out, f"run-{args.sync}"), max_steps=args.steps, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=8, learning_rate=1e-2, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0, use_vllm=True,
    )
    if args.sync == "trl-colocate":
        config = GRPOConfig(vllm_mode="colocate", vllm_max_model_length=128, **common)
        trainer: Any = GRPOTrainer(model=model, args=config, reward_funcs=reward_word_ids,
                                   train_dataset=dataset, processing_class=tokenizer)
    else:
        from weightsync.trl import WeightsyncGRPOTrainer

        url, controller = args.url, args.controller
        config = GRPOConfig(vllm_mode="server", vllm_server_base_url=url, **common)
        trainer = WeightsyncGRPOTrainer(model=model, args=config, reward_funcs=reward_word_ids,
                                        train_dataset=dataset, processing_class=tokenizer,
                                        weightsync_controller=controller,
                                        weightsync_controller_http=args.controller_http)
    seconds = time_each_sync(trainer)  # the sync alone, inside the recording below
    if args.sync == "weightsync":
        record_each_sync(trainer, args.out)
    trainer.train()
    with open(os.path.join(args.out, f"sync_seconds_{args.sync}.json"), "w") as f:
        json.dump(seconds, f)
    with open(os.path.join(args.out, f"trl_metrics_{args.sync}.json"), "w") as f:
        json.dump(trainer.state.log_history, f)
    if args.sync == "weightsync":
        syncs = [{"version": s["version"], "seconds": s["seconds"], "bytes": s["outcome"].bytes}
                 for s in trainer.weightsync.syncs]
        with open(os.path.join(args.out, "weightsync_syncs.json"), "w") as f:
            json.dump(syncs, f)
        trainer.weightsync.close()


def time_each_sync(trainer: Any) -> list[float]:
    """The seconds of each of TRL's ``sync_weights`` calls (the same clock on both paths;
    TRL's own profiler reports only to wandb / mlflow / trackio)."""
    gen = trainer.vllm_generation
    sync = gen.sync_weights
    seconds: list[float] = []

    def timed() -> None:
        t0 = time.perf_counter()
        sync()
        seconds.append(time.perf_counter() - t0)

    gen.sync_weights = timed
    return seconds


def record_each_sync(trainer: Any, out: str) -> None:
    """Test instrumentation: after each of TRL's syncs, what the trainer holds and what the
    server says it holds."""
    gen = trainer.weightsync
    sync = gen.sync_weights

    def recorded() -> None:
        sync()
        v = gen.syncs[-1]["version"]
        rec = {"version": v, "global_step": int(trainer.state.global_step),
               "trainer": {n: digest(p) for n, p in trainer.model.named_parameters()},
               "server": gen.server.digests()[0], "weight_version": gen.server.weight_version()}
        with open(os.path.join(out, f"sync_v{v}.json"), "w") as f:
            json.dump(rec, f)

    gen.sync_weights = recorded


if __name__ == "__main__":
    main()
