"""weightsync in OpenRLHF: ``ActorPPOTrainer.broadcast_to_vllm`` through weightsync instead of
OpenRLHF's NCCL broadcast (or CUDA IPC).

OpenRLHF's ``broadcast_to_vllm`` runs on every policy rank (a Ray actor each): it walks the
parameters one by one, gathers each under ZeRO-3 (``deepspeed.zero.GatheredParameters``), and
rank 0 broadcasts it over an NCCL group to every vLLM engine, one tensor at a time, each engine
loading it (``load_weights``) as it arrives (about 80 s for 70B, OpenRLHF#647). Here every rank
registers the memory it holds once and pushes it as a version (:meth:`weightsync.Trainer.push`):
with ZeRO-1/2 each rank holds the whole model, the job says ``--train dp=N`` and the planner
splits the reads among the replicas, so no rank sends the whole model and nothing is gathered;
rank 0 then brings the engines to that version (``update_engines``) and every rank waits for
the commit. What an OpenRLHF user changes, once the policy actor built its trainer (in
``PolicyModelActor.init_model_from_pretrained``, after ``self.trainer = ActorPPOTrainer(...)``)::

    self.weightsync = weightsync.openrlhf.install(self.trainer, WeightsyncSettings(controller=...),
                                                  update_engines=...)

after which OpenRLHF's own ``self.trainer.broadcast_to_vllm()`` (called by ``PPOTrainer`` after
each ``fit``) is weightsync's :class:`WeightsyncBroadcast`. The engines run weightsync's vLLM
backend (``weight_transfer_config={"backend": "weightsync"}``,
``worker_extension_cls="weightsync.vllm.WorkerExtension"``, see ``weightsync.vllm``) instead of
``openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap``; ``update_engines(version)`` is called on
rank 0 only and brings them to ``version`` (``weightsync.vllm.update(llm, version)`` for an
engine in reach; for OpenRLHF's Ray engine actors, a remote method on each that runs it);
``None`` when the engines follow the controller by themselves (they land every committed
version).

Bad wiring fails when :func:`install` runs, before any step: a parameter whose name is not the
job's, a job tensor the model lacks, a shape or dtype differing from the job's layout
(:func:`weightsync._adapter.check_model_against_job`), or a ZeRO-3 partitioned parameter
(DeepSpeed's flat partitions are not a layout weightsync registers), each naming the tensor.

Versions: the number of syncs so far, from 1 (OpenRLHF syncs after each ``fit``; a version
holds the weights after that many training rounds), or the ``version`` passed.

Why the module imports neither OpenRLHF nor Ray: OpenRLHF 0.11.2's ``ppo_actor`` module imports
DeepSpeed, Ray and flash-attn-dependent code at its top and calls CUDA in
``broadcast_to_vllm`` (see docs/openrlhf.md); the adapter only reads the trainer's
``actor.model.module`` (DeepSpeed's engine holds the Hugging Face model there) and replaces the
instance's ``broadcast_to_vllm``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ._adapter import WeightsyncSettings, check_model_against_job, refuse_zero3
from .trainer import SyncOutcome, Trainer

__all__ = ["WeightsyncSettings", "WeightsyncBroadcast", "install", "refuse_zero3"]


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))


class WeightsyncBroadcast:
    """``broadcast_to_vllm`` through weightsync for one training rank: callable with no
    argument as OpenRLHF calls it. Built by :func:`install` (or directly, with the model).

    ``model``: the module whose parameters the job moves (OpenRLHF: ``actor.model.module``).
    ``rank``: the training rank (default: ``torch.distributed``'s, else ``$RANK``).
    ``update_engines``: called on rank 0 with each version once this rank pushed it; it brings
    the engines to it. ``syncs``: each sync's version, seconds and
    :class:`~weightsync.SyncOutcome`."""

    def __init__(self, model: Any, settings: WeightsyncSettings, *, rank: int | None = None,
                 update_engines: Callable[[int], Any] | None = None) -> None:
        self.model = model
        self.settings = settings
        self.rank = _rank() if rank is None else rank
        self.update_engines = update_engines
        self.syncs: list[dict[str, Any]] = []
        self._registered = False
        self._last_version = 0
        trainer = Trainer(settings.controller, rank=self.rank, job_token=settings.job_token)
        try:
            refuse_zero3(model, trainer.worker_id)
            check_model_against_job(trainer, model)
        except BaseException:
            trainer.close()
            raise
        self.trainer = trainer

    def __call__(self, version: int | None = None) -> SyncOutcome:
        """One sync: registers at the first (the model's memory in place), pushes ``version``
        (default: the next), brings the engines to it on rank 0, waits for the commit."""
        v = self._last_version + 1 if version is None else version
        if v <= self._last_version:
            raise ValueError(f"weightsync.openrlhf: version {v} after {self._last_version}: versions must grow")
        t0 = time.perf_counter()
        if not self._registered:
            self.trainer.register(self.model)
            self._registered = True
        handle = self.trainer.push(v)
        engines: Any = None
        if self.rank == 0 and self.update_engines is not None:
            engines = self.update_engines(v)
        outcome = handle.wait(self.settings.timeout_s)
        self._last_version = v
        self.syncs.append({"version": v, "seconds": time.perf_counter() - t0, "outcome": outcome, "engines": engines})
        return outcome

    def close(self) -> None:
        """Leaves the job (idempotent)."""
        self.trainer.close()


def install(actor_trainer: Any, settings: WeightsyncSettings, *, rank: int | None = None,
            update_engines: Callable[[int], Any] | None = None) -> WeightsyncBroadcast:
    """Makes ``actor_trainer.broadcast_to_vllm`` (an OpenRLHF ``ActorPPOTrainer``, on every
    policy rank) sync through weightsync; returns the :class:`WeightsyncBroadcast` now in its
    place. Checks the model against the job first: raises naming the tensor when it differs."""
    actor = getattr(actor_trainer, "actor", None)
    engine = getattr(actor, "model", None)
    model = getattr(engine, "module", engine)  # DeepSpeed's engine holds the HF model as .module
    if model is None or not callable(getattr(model, "named_parameters", None)):
        raise TypeError("weightsync.openrlhf.install: expected OpenRLHF's ActorPPOTrainer (its .actor.model.module "
                        f"is the model), got {type(actor_trainer).__name__}")
    sync = WeightsyncBroadcast(model, settings, rank=rank, update_engines=update_engines)
    actor_trainer.broadcast_to_vllm = sync
    return sync

