"""``weightsync.verl``: verl's checkpoint engine ``"weightsync"``.

verl moves weights from its actor (trainer) workers to its rollout replicas through a checkpoint
engine (``verl/checkpoint_engine/``): ``CheckpointEngineManager.update_weights`` asks every
actor worker to ``send_weights`` a generator of *gathered* full tensors, bucketed through one
NCCL group built per sync, and every rollout worker to ``receive_weights`` them and hand them to
the inference server. This backend keeps verl's manager and hooks and replaces the transport:
each actor rank pushes its *own registered shards* (FSDP2 ``DTensor`` local shards, nothing
gathered: the generator verl passes is closed unconsumed), the controller's plan writes them
straight into the engines' registered tensors, and the rollout side waits for the commit. No
process group is built or torn down per sync (``prepare`` / ``build_topology`` /
``init_process_group`` / ``finalize`` have nothing to do); the job's controller is the Ray
actor :func:`weightsync.ray.start` created, found by its name.

What a verl user changes (verl's own config keys)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.namespace=<ray namespace>

plus, in the actor worker once its model is built, the registration of its shards
(``self.checkpoint_engine.register_trainer(module)``), and on the engines the weightsync
engine (``weightsync.vllm``'s worker extension for vLLM, ``job.engine(rank)`` for a
transformers model). ``docs/verl.md`` has the details and the versions tested.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

import weightsync.ray as ws_ray

from ._tensors import NameMap, TensorSource
from .errors import RegistrationError, SyncFailedError, TimeoutError
from .trainer import Trainer

__all__ = ["BACKEND", "WeightsyncCheckpointEngine"]

BACKEND = "weightsync"
"""The name the backend is registered under (``checkpoint_engine.backend``)."""

_POLL_S = 30.0


@CheckpointEngineRegistry.register(BACKEND)
class WeightsyncCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """verl's checkpoint engine over weightsync, one per actor or rollout worker.

    Args (verl passes the first two; ``engine_kwargs.weightsync`` the rest):
        bucket_size: verl's bucket size; unused (nothing is bucketed: the plan moves each
            shard whole).
        is_master: whether this is actor rank 0; unused.
        controller: the controller actor's name (:func:`weightsync.ray.start`'s ``name``).
        namespace: its Ray namespace.
        timeout: seconds one sync may take before ``send_weights`` / ``receive_weights`` raise.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, *, controller: str = ws_ray.CONTROLLER_NAME,
                 namespace: str | None = None, timeout: float = 600.0) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.controller = controller
        self.namespace = namespace
        self.timeout = timeout
        self._job: ws_ray.Job | None = None
        self._trainer: Trainer | None = None
        self._last_version = 0
        self.last_seconds: float | None = None
        """Seconds the last sync took, as this worker saw it."""

    @property
    def job(self) -> ws_ray.Job:
        """The weightsync job (its controller actor, found by name on first use)."""
        if self._job is None:
            self._job = ws_ray.connect(self.controller, namespace=self.namespace, timeout=self.timeout)
        return self._job

    def register_trainer(self, model: TensorSource, *, rank: int | None = None,
                         name_map: NameMap | None = None) -> Trainer:
        """Registers this actor rank's parameters (an FSDP2 module: its local shards) with the
        job, once, before the first sync. ``rank``: the training rank (default: this process's
        ``torch.distributed`` rank, which verl's worker group assigned).

        Raises:
            LayoutMismatchError / RegistrationError: a parameter's name, shape or placement
                differs from the job's (names it).
        """
        if self._trainer is not None:
            raise RegistrationError(f"{self._trainer.worker_id}: register_trainer() was called already",
                                    worker=self._trainer.worker_id)
        if rank is None:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RegistrationError("register_trainer(): rank not given and torch.distributed is not initialized")
            rank = dist.get_rank()
        trainer = self.job.trainer(rank)
        try:
            trainer.register(model, name_map=name_map)
        except BaseException:
            trainer.close()
            raise
        self._trainer = trainer
        return trainer

    # The per-sync topology of verl's NCCL backends: nothing to build, the controller's plan is
    # in force for the job's life.
    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    def _next_version(self, global_steps: int | None) -> int:
        """The weightsync version of this sync: ``global_steps`` where it is newer than the last
        one, else the last + 1 (the actor and rollout sides see the same calls, so they agree)."""
        self._last_version = max(self._last_version + 1, int(global_steps or 0))
        return self._last_version

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Pushes this rank's registered shards as the next version and waits for the commit.
        ``weights`` (verl's generator of gathered tensors) is closed without being read.

        Raises:
            RegistrationError: :meth:`register_trainer` was not called in this worker.
            SyncFailedError: the sync failed (names the worker and the tensor).
        """
        close = getattr(weights, "close", None) or getattr(weights, "aclose", None)
        if close is not None:
            closed = close()
            if asyncio.iscoroutine(closed):
                await closed
        trainer = self._trainer
        if trainer is None:
            raise RegistrationError(
                "the weightsync checkpoint engine pushes the registered shards: call "
                "checkpoint_engine.register_trainer(model) in the actor worker once its model is built")
        version = self._next_version(global_steps)
        t0 = time.perf_counter()
        outcome = await asyncio.to_thread(lambda: trainer.push(version).wait(timeout=self.timeout))
        self.last_seconds = time.perf_counter() - t0
        return {"weightsync/version": float(outcome.version), "weightsync/bytes": float(outcome.bytes),
                "weightsync/seconds": outcome.seconds}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, Any]]:
        """Waits until the next version committed on every engine, then yields nothing: the
        engines' own tensors already hold it (there is nothing for the server adapter to load).

        Raises:
            SyncFailedError: the controller ended that version's sync as failed.
            TimeoutError: it did not end within ``timeout`` seconds.
        """
        version = self._next_version(global_steps)
        t0 = time.perf_counter()
        await asyncio.to_thread(self._wait_committed, version)
        self.last_seconds = time.perf_counter() - t0
        return
        yield  # an async generator, as verl's server adapters iterate it

    def _wait_committed(self, version: int) -> None:
        client = self.job.client(timeout=_POLL_S + 30)
        deadline = time.monotonic() + self.timeout
        while True:
            answer = client.version(version, until="ended", wait_s=min(_POLL_S, max(0.0, deadline - time.monotonic())))
            committed = answer.get("latest_committed")
            if committed is not None and int(committed) >= version:
                return
            sync = answer.get("sync") or {}
            if answer.get("reached") and sync.get("state") == "failed":
                failure = sync.get("failure") or {}
                raise SyncFailedError(
                    f"weightsync: the sync of version {version} failed: {failure.get('cause', sync)}",
                    worker=failure.get("worker"), tensor=failure.get("tensor"), version=version,
                    cause=failure.get("cause"), kind=str(failure.get("kind") or "other"))
            if time.monotonic() >= deadline:
                raise TimeoutError(f"weightsync: version {version} did not commit in {self.timeout} s "
                                   f"(latest committed {committed!r})", version=version)
