"""An inference engine process with weightsync in it (run by the end-to-end tests):

    python engine_hf.py --model DIR --controller HOST:PORT --rank R --versions 1 2 3 --out OUT

A transformers model of ``DIR/config.json`` (bf16, or ``--fp8``: FP8Linear with 128x128 block
scales) whose own parameters are registered as the destinations (``format=hf``). After each
committed version the ``after_commit`` hook writes the engine's tensors and its greedy tokens to
``OUT/engine{R}_v{V}.pt``; a failed version writes the engine's state to
``OUT/engine{R}_failed_v{V}.json``. ``--ep-rank/--ep-size`` (MoE with ep on the engine): the rank
holds only its experts, registered as a slice of transformers' stacked expert tensors.
``--die-at V``: the process kills itself (SIGKILL) when version V starts landing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

import weightsync  # noqa: E402


def engine_tensors(model: Any, ep_rank: int, ep_size: int) -> Any:
    """The model itself, or with ep: its tensors with each stacked expert tensor cut to this
    rank's experts (a contiguous slice along dim 0, registered in place)."""
    if ep_size == 1:
        return model
    out = {}
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            per = p.shape[0] // ep_size
            p = p.detach()[ep_rank * per:(ep_rank + 1) * per]
        out[name] = p
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--versions", type=int, nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--ep-rank", type=int, default=0)
    ap.add_argument("--ep-size", type=int, default=1)
    ap.add_argument("--die-at", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = (tiny.build_fp8 if args.fp8 else tiny.build)(args.model, seed=100 + args.rank).eval()
    tensors = engine_tensors(model, args.ep_rank, args.ep_size)
    generate = not args.fp8 and args.ep_size == 1  # fp8 kernels do not run on CPU; ep holds part

    def before_landing(version: int) -> None:
        if version == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def after_commit(version: int) -> None:
        named = tensors.items() if isinstance(tensors, dict) else tensors.named_parameters()
        snapshot = {n: t.detach().clone() for n, t in named}
        tokens = tiny.greedy(model) if generate else None
        torch.save({"params": snapshot, "tokens": tokens},
                   os.path.join(args.out, f"engine{args.rank}_v{version}.pt"))

    engine = weightsync.Engine(controller=args.controller, rank=args.rank,
                               before_landing=before_landing, after_commit=after_commit)
    engine.register(tensors, format="hf")
    print(f"{engine.worker_id}: registered", flush=True)
    for version in args.versions:
        try:
            engine.wait_for_version(version, timeout=600)
        except weightsync.SyncFailedError as e:
            print(e.worker, engine.state, engine.cause)  # e.g. rollout-1 invalid ...
            with open(os.path.join(args.out, f"engine{args.rank}_failed_v{version}.json"), "w") as f:
                json.dump({"state": engine.state, "version": engine.version, "cause": engine.cause,
                           "error_worker": e.worker, "message": str(e)}, f)
    engine.close()


if __name__ == "__main__":
    main()
