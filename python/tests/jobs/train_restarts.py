"""A training job that torchrun restarts after a rank is ``kill -9``ed (run by
``test_trainer_restarts.py``):

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 2 \\
        train_restarts.py --controller HOST:PORT --http URL --out OUT --final 7 --kill-at 0:3 --kill-at 1:4

Two ranks on CPU/gloo, each holding its FSDP shard (``Trainer.layout()``) of every parameter as
a torch bf16 tensor registered with ``weightsync.Trainer``. Version ``V``'s weights are a pure
function of ``V`` (:func:`full_value`), so every incarnation torchrun starts writes exactly the
same bytes for ``V``, and the test knows them without the job. Each incarnation resumes from the
controller's last committed version (``/healthz``) and goes on to ``--final``.

One rank is slow in its optimizer step (rank 1 in even incarnations, rank 0 in odd ones): it
writes the first half of its tensors, sleeps, then writes the rest, so for a while its tensors
hold half of one version and half of another. At ``--kill-at G:V`` (incarnation G, as torchrun
counts restarts, version V) the slow rank, half-updated, writes its pid to
``OUT/midstep_gG_vV.json`` and waits to be killed; the other rank has pushed V meanwhile. The
next incarnation's slow rank is the other one, so the version the killed group left pushed by
one rank is pushed again at once by the new fast rank while the new slow rank is mid-step: a
controller that counted the dead rank's push would sync half-updated tensors.

Files: ``OUT/incarnation_gG_rR.json`` (pid, first version), ``OUT/pushed_gG_rR_vV.json`` once
rank R pushed V, ``OUT/outcome_gG_rR_vV.json`` once its sync ended.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any

import numpy as np


def full_value(name: str, shape: tuple[int, ...], version: int) -> Any:
    """The whole parameter ``name`` at ``version``: bf16 bit patterns of finite numbers, as
    uint16 (the same function as ``test_embedded.full_value``)."""
    seed = int.from_bytes(hashlib.blake2b(f"{name}/{version}".encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 0x3F80, size=shape, dtype=np.uint16)


def digest(name: str, shape: tuple[int, ...], version: int) -> str:
    """SHA-256 of the whole parameter's bytes at ``version``: what an engine holding it whole
    must hold once ``version`` committed."""
    return hashlib.sha256(full_value(name, shape, version).tobytes()).hexdigest()


def write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)  # the test polls for these files: never half-written


def main() -> None:
    import torch
    import torch.distributed as dist

    import weightsync

    ap = argparse.ArgumentParser()
    ap.add_argument("--controller", required=True)
    ap.add_argument("--http", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--final", type=int, required=True)
    ap.add_argument("--slow-s", type=float, default=0.3)
    ap.add_argument("--kill-at", action="append", default=[], help="G:V")
    args = ap.parse_args()
    kill_at = {tuple(int(x) for x in k.split(":")) for k in args.kill_at}
    torch.set_num_threads(1)
    incarnation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"incarnation {incarnation}, rank {os.environ['RANK']} (pid {os.getpid()}): starting", flush=True)
    # A file store of this incarnation's own: gloo's rendezvous in the store torchrun's agent
    # keeps hangs in a restarted group here (torch 2.13, --standalone).
    store = os.path.join(args.out, f"gloo_store_g{incarnation}")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    slow_rank = 1 if incarnation % 2 == 0 else 0

    trainer = weightsync.Trainer(controller=args.controller)  # rank from $RANK
    shards = {s.name: s for s in trainer.layout()}
    tensors = {n: torch.zeros(tuple(s.shape), dtype=torch.bfloat16) for n, s in shards.items()}
    trainer.register(tensors)
    names = sorted(tensors)

    # Resume after the last committed version, as rank 0 reads it from the controller.
    latest: list[Any] = [None]
    if rank == 0:
        committed = weightsync.Client(args.http).healthz().get("latest_committed")
        latest[0] = 0 if committed is None else int(committed["version"])
    dist.broadcast_object_list(latest, src=0)
    first = latest[0] + 1
    print(f"incarnation {incarnation}, rank {rank}: resuming at version {first}", flush=True)
    write_json(os.path.join(args.out, f"incarnation_g{incarnation}_r{rank}.json"),
               {"pid": os.getpid(), "first": first})

    def write(name: str, version: int) -> None:
        s = shards[name]
        box = tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape))
        full = full_value(name, tuple(s.global_shape), version)
        with torch.no_grad():
            tensors[name].copy_(torch.from_numpy(np.ascontiguousarray(full[box])).view(torch.bfloat16))

    for version in range(first, args.final + 1):
        # The optimizer step: the slow rank is half-updated for a while.
        half = len(names) // 2 if rank == slow_rank else len(names)
        for name in names[:half]:
            write(name, version)
        if rank == slow_rank:
            if (incarnation, version) in kill_at:
                write_json(os.path.join(args.out, f"midstep_g{incarnation}_v{version}.json"), {"pid": os.getpid()})
                time.sleep(120)
                raise RuntimeError(f"incarnation {incarnation}: not killed at version {version}")
            time.sleep(args.slow_s)
        for name in names[half:]:
            write(name, version)
        handle = push(trainer, version)
        write_json(os.path.join(args.out, f"pushed_g{incarnation}_r{rank}_v{version}.json"), {})
        outcome = handle.wait(timeout=120)
        write_json(os.path.join(args.out, f"outcome_g{incarnation}_r{rank}_v{version}.json"),
                   {"version": outcome.version, "bytes": outcome.bytes, "superseded": outcome.superseded})
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


def push(trainer: Any, version: int) -> Any:
    """``trainer.push(version)``; a push refused while the world is incomplete (this
    incarnation's other rank not registered yet) is retried for up to 60 s."""
    import weightsync

    deadline = time.monotonic() + 60
    while True:
        try:
            return trainer.push(version)
        except weightsync.SyncError as e:
            if time.monotonic() > deadline:
                raise
            print(f"trainer: push({version}) refused, retrying: {e}", flush=True)
            time.sleep(0.2)


if __name__ == "__main__":
    main()
