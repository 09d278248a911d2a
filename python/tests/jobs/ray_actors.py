"""The training and serving actors of the Ray test (``tests/test_ray.py``), as an RL framework
places them: plain classes the test wraps with ``ray.remote``; they live in a module of their own
so Ray's workers import them by name (``jobs/`` is on their ``PYTHONPATH``).

``FsdpTrainer``: one rank of a transformers model under FSDP2 ``fully_shard`` (CPU/gloo, rank and
world from the launcher, not the environment), registered with ``job.trainer(rank)``; each
``step(v)`` is an AdamW step on random tokens, a push of ``v`` and, from rank 0, the gathered
``full_tensor()`` of every parameter. ``HfEngine``: a transformers model of the same config
(another seed) whose own parameters are the destinations (``format=hf``), joined through the
controller's actor name (:func:`weightsync.ray.connect`)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

import weightsync  # noqa: E402
import weightsync.ray  # noqa: E402


class FsdpTrainer:
    def __init__(self, job: weightsync.ray.Job, rank: int, world: int, rendezvous: str, config_dir: str,
                 rename: dict[str, str] | None = None) -> None:
        self.setup(rank, world, rendezvous, config_dir)
        self.trainer = job.trainer(rank)
        # A framework whose names differ from the job's (``rename``) is refused here, before
        # the first step, naming the tensor.
        params = {(rename or {}).get(n, n): p for n, p in self.model.named_parameters()}
        self.trainer.register(params)

    def setup(self, rank: int, world: int, rendezvous: str, config_dir: str) -> None:
        """The gloo group (rank and world from the launcher), the model under FSDP2, AdamW."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        self.rank = rank
        dist.init_process_group("gloo", init_method=f"tcp://{rendezvous}", rank=rank, world_size=world)
        self.model = tiny.build(config_dir, seed=0)  # the same seed on every rank
        mesh = init_device_mesh("cpu", (world,))
        for block in tiny.blocks(self.model):
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.tokens = torch.Generator().manual_seed(1234)

    def train_step(self) -> None:
        """One AdamW step on random tokens (collective)."""
        vocab = self.model.config.vocab_size
        batch = torch.randint(0, vocab, (2, 16), generator=self.tokens)
        self.model(input_ids=batch, labels=batch).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def full(self) -> dict[str, Any] | None:
        """(collective) The full parameters: rank 0 returns them, the others None."""
        full = {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}
        return full if self.rank == 0 else None

    def step(self, version: int) -> dict[str, Any] | None:
        """One optimizer step, its push, then the full parameters (rank 0)."""
        self.train_step()
        outcome = self.trainer.push(version).wait(timeout=120)
        assert outcome.version == version, outcome
        return self.full()

    def close(self) -> None:
        import torch.distributed as dist

        self.trainer.close()
        dist.destroy_process_group()


class HfEngine:
    def __init__(self, rank: int, config_dir: str, namespace: str) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.model = tiny.build(config_dir, seed=100 + rank).eval()
        job = weightsync.ray.connect(namespace=namespace)
        self.engine = job.engine(rank)
        self.engine.register(self.model, format="hf")

    def pid(self) -> int:
        return os.getpid()

    def tensors_at(self, version: int) -> dict[str, Any]:
        """Waits for ``version`` to commit here; returns a copy of every parameter."""
        st = self.engine.wait_for_version(version, timeout=120)
        assert (st.version, st.state) == (version, "committed"), st
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}
