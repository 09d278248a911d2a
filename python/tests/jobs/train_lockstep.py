"""The FSDP2 trainer of jobs/train_fsdp.py in lockstep with a vLLM engine (run by
tests/test_vllm.py): after each step's push and record it waits for the engine's
``OUT/vllm_r{r}_v{step}.done`` of every engine ``r`` before training on, as an on-policy RL loop waits for its rollouts.

    torchrun --nproc-per-node 2 train_lockstep.py --model DIR --controller HOST:PORT --steps 3 --out OUT

``--first-step N`` starts at step N: a trainer restarted after a crash rejoins the job (same
ranks) and pushes from there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import archs  # noqa: E402
import tiny  # noqa: E402
from train_fsdp import record  # noqa: E402

import weightsync  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--steps", type=int, default=3, help="the last step")
    ap.add_argument("--first-step", type=int, default=1,
                    help="a restarted trainer's first step (it trains from the initial weights)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--wait-s", type=float, default=600)
    ap.add_argument("--engines", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model = tiny.build(args.model, seed=0)
    mesh = init_device_mesh("cpu", (world,))
    for block in tiny.blocks(model):  # decoder layers (and a vision tower's blocks)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1234)
    if dist.get_rank() == 1:  # for the engine that kills a trainer mid-sync
        with open(os.path.join(args.out, "trainer_r1.pid"), "w") as f:
            f.write(str(os.getpid()))
    trainer = weightsync.Trainer(controller=args.controller)
    trainer.register(model)
    for step in range(args.first_step, args.steps + 1):
        if model.config.model_type in archs.ARCHS:
            inputs = archs.batch_kwargs(model, g)
        else:
            batch = torch.randint(0, model.config.vocab_size, (2, 32), generator=g)
            inputs = dict(input_ids=batch, labels=batch)
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        outcome = trainer.push(step).wait()
        record(model, args.out, step, outcome)
        done = [os.path.join(args.out, f"vllm_r{r}_v{step}.done") for r in range(args.engines)]
        deadline = time.monotonic() + args.wait_s
        while not all(os.path.exists(d) for d in done):
            if time.monotonic() > deadline:
                raise SystemExit(f"engine did not finish version {step} in {args.wait_s} s")
            time.sleep(0.05)
        dist.barrier()
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
