"""A training job as an RL framework runs one, with weightsync in it (run by the end-to-end tests):

    torchrun --nproc-per-node 2 train_fsdp.py --model DIR --controller HOST:PORT --steps 3 --out OUT

A transformers model (``DIR/config.json``, random init, bf16) under FSDP2 ``fully_shard`` on
CPU/gloo, AdamW on random tokens; after each optimizer step the new weights are pushed to the
engines (``--trigger push``: every rank pushes and waits; ``--trigger http``: rank 0 asks the
controller over HTTP with ``weightsync.Client``). After each sync every rank writes its outcome
(``OUT/outcome_r{rank}_v{step}.json``) and rank 0 the gathered full parameters and greedy tokens
(``OUT/trainer_v{step}.pt``) for the test to compare with the engines'. ``--expect-failure-at V``:
the sync of V must fail (an engine is killed); the error is recorded and training goes on.
``--weights-dtype f32``: the parameters are f32 and FSDP2 runs under mixed precision
(``MixedPrecisionPolicy(param_dtype=bf16)``), so the shards weightsync reads stay f32 (the job's
training layout says ``dtype=f32``) and the engines, in bf16 or fp8, are cast or quantised from
them.
``--lrs 1e-6 1e-6 1e-5``: AdamW's learning rate of each step (the last one for the steps after;
default 1e-2), e.g. RL learning rates for the delta-sync test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import archs  # noqa: E402
import tiny  # noqa: E402

import weightsync  # noqa: E402


def record(model: torch.nn.Module, out: str, step: int, outcome: weightsync.SyncOutcome | None) -> None:
    rank = dist.get_rank()
    if outcome is not None:
        with open(os.path.join(out, f"outcome_r{rank}_v{step}.json"), "w") as f:
            json.dump({"version": outcome.version, "bytes": outcome.bytes,
                       "staged_bytes": outcome.staged_bytes, "direct_bytes": outcome.direct_bytes,
                       "seconds": outcome.seconds, "stages": outcome.stages}, f)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective
    model.eval()
    tokens = tiny.greedy(model)  # collective on an FSDP2 model
    model.train()
    if rank == 0:
        torch.save({"params": full, "tokens": tokens}, os.path.join(out, f"trainer_v{step}.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--trigger", choices=["push", "http"], default="push")
    ap.add_argument("--http", default=None)
    ap.add_argument("--expect-failure-at", type=int, default=None)
    ap.add_argument("--weights-dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-2])
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    # The same seed on every rank: identical before sharding.
    if args.weights_dtype == "f32":
        model = tiny.build(args.model, seed=0, dtype=torch.float32)
        shard = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    else:
        model, shard = tiny.build(args.model, seed=0), {}
    mesh = init_device_mesh("cpu", (world,))
    for block in tiny.blocks(model):  # decoder layers (and a vision tower's blocks)
        fully_shard(block, mesh=mesh, **shard)
    fully_shard(model, mesh=mesh, **shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lrs[0])
    g = torch.Generator().manual_seed(1234)  # the same tokens on every rank
    vocab = model.config.get_text_config().vocab_size

    trainer = weightsync.Trainer(controller=args.controller)  # rank from $RANK
    trainer.register(model)
    client = weightsync.Client(args.http) if args.trigger == "http" and rank == 0 else None
    for step in range(1, args.steps + 1):
        if model.config.model_type in archs.ARCHS:
            inputs = archs.batch_kwargs(model, g)
        else:
            batch = torch.randint(0, vocab, (2, 32), generator=g)
            inputs = dict(input_ids=batch, labels=batch)
        model(**inputs).loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = args.lrs[min(step, len(args.lrs)) - 1]
        optimizer.step()
        optimizer.zero_grad()
        outcome = None
        try:
            if args.trigger == "http":
                # Every rank's optimizer step must be over before the sync reads the shards
                # (push says so per rank; an outside trigger needs the barrier).
                dist.barrier()
                if client is not None:
                    # The first step may come before every worker accepted the plan.
                    client.sync(step, ready_timeout=120)
                dist.barrier()
            elif args.expect_failure_at is not None and step > args.expect_failure_at:
                outcome = sync_with_retry(trainer, step)  # an engine may still be restarting
            else:
                outcome = trainer.push(step).wait()
        except weightsync.SyncFailedError as e:
            if step != args.expect_failure_at:
                raise
            with open(os.path.join(args.out, f"failure_r{rank}_v{step}.json"), "w") as f:
                json.dump({"worker": e.worker, "version": e.version, "cause": e.cause,
                           "message": str(e), "type": type(e).__name__}, f)
            dist.barrier()
            continue
        record(model, args.out, step, outcome)
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


def sync_with_retry(trainer: weightsync.Trainer, step: int) -> weightsync.SyncOutcome:
    """push(step).wait(); a push refused while the world is incomplete (an engine restarting)
    is retried for up to 120 s."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return trainer.push(step).wait(timeout=300)
        except weightsync.SyncFailedError:
            raise
        except weightsync.SyncError as e:
            if time.monotonic() > deadline:
                raise
            print(f"trainer-{dist.get_rank()}: push({step}) refused, retrying: {e}", flush=True)
            time.sleep(1)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        err = traceback.format_exc()
        print(err, file=sys.stderr, flush=True)
        out = sys.argv[sys.argv.index("--out") + 1]
        with open(os.path.join(out, f"error_r{os.environ.get('RANK', '?')}.txt"), "w") as f:
            f.write(err)
        raise
