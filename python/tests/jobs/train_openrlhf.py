"""One OpenRLHF policy rank whose ``broadcast_to_vllm`` goes through ``weightsync.openrlhf``
(run by tests/test_openrlhf.py, one process per rank as OpenRLHF runs one Ray actor per rank):

    python train_openrlhf.py --model DIR --controller HOST:PORT --rank R --steps 3 --out OUT

OpenRLHF itself does not import on CPU (docs/openrlhf.md), so ``PolicyActor`` holds what
OpenRLHF's ``PolicyModelActor`` holds where the adapter reads it: ``self.trainer`` shaped as
``ActorPPOTrainer`` (``trainer.actor.model.module`` is the Hugging Face model, as DeepSpeed's
engine holds it), a replica of a tiny Qwen3 as ZeRO-1/2 keeps on every rank. Each round is an
SGD step (the same batch on every rank, so the replicas stay equal) and the call OpenRLHF's
``PPOTrainer`` makes, ``broadcast_to_vllm()``; after each, ``OUT/trainer_r{R}_v{V}.pt`` holds the
rank's parameters and the sync's outcome.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

import weightsync.openrlhf as wo  # noqa: E402


def openrlhf_broadcast() -> None:
    raise AssertionError("OpenRLHF's own broadcast_to_vllm ran: install() did not replace it")


class PolicyActor:
    """What the adapter touches of OpenRLHF's ``PolicyModelActor``."""

    def __init__(self, model_dir: str, controller: str, rank: int) -> None:
        self.model = tiny.build(model_dir, seed=7)  # the same initial weights on every replica
        self.trainer = SimpleNamespace(actor=SimpleNamespace(model=SimpleNamespace(module=self.model)),
                                       broadcast_to_vllm=openrlhf_broadcast)
        self.weightsync = wo.install(self.trainer, wo.WeightsyncSettings(controller=controller), rank=rank)

    def fit(self, step: int) -> None:
        """One optimizer step, the same on every replica."""
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 1024, (2, 16), generator=g)
        opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)

    actor = PolicyActor(args.model, args.controller, args.rank)
    for v in range(1, args.steps + 1):
        if v > 1:
            actor.fit(v)
        actor.trainer.broadcast_to_vllm()  # as OpenRLHF's PPOTrainer calls it, on every rank
        outcome = actor.weightsync.syncs[-1]["outcome"]
        params: dict[str, Any] = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
        torch.save({"params": params, "version": actor.weightsync.syncs[-1]["version"], "bytes": outcome.bytes},
                   os.path.join(args.out, f"trainer_r{args.rank}_v{v}.pt"))
    actor.weightsync.close()


if __name__ == "__main__":
    main()
