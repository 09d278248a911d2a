"""The engine side of ``weightsync.openrlhf``: OpenRLHF's vLLM Ray actor (``RolloutRayActor`` in
``openrlhf/trainer/ray/vllm_engine.py``) receiving weights through weightsync instead of its
worker extension's NCCL broadcast.

OpenRLHF's engine receives through ``WorkerWrap`` (``vllm_worker_wrap.py``, its
``worker_extension_cls``): ``init_process_group`` joins the NCCL group the policy's rank 0
opens, and ``update_weight(name, dtype, shape)``, called once per parameter, receives that one
tensor into a fresh CUDA buffer and ``load_weights`` it; the actor forwards both through
``self.llm.collective_rpc`` (``self.llm``: vLLM's ``AsyncLLMEngine``). Here the actor's engine
runs weightsync's vLLM backend instead (``weight_transfer_config={"backend": "weightsync"}``,
``worker_extension_cls="weightsync.vllm.WorkerExtension"``): its workers register their memory
with the job once (:meth:`WeightsyncRolloutMethods.weightsync_init`) and the policy's rank 0
brings each engine to a version (:meth:`WeightsyncRolloutMethods.weightsync_update`: the bytes
land in the staged arena while the engine keeps generating, then one load). What a user
changes, where OpenRLHF builds its engines::

    import openrlhf.trainer.ray.vllm_engine as ve
    from weightsync.openrlhf_engine import rollout_actor_class, engine_updater

    ve.RolloutRayActor = rollout_actor_class(ve.RolloutRayActor)  # before create_vllm_engines(...)
    engines = ve.create_vllm_engines(...)
    ray.get([e.weightsync_init.remote(controller, rank=i * tp) for i, e in enumerate(engines)])
    # the policy ranks: weightsync.openrlhf.install(..., update_engines=engine_updater(engines))

:func:`rollout_actor_class` subclasses OpenRLHF's own actor class (``create_vllm_engines``
builds whatever ``vllm_engine.RolloutRayActor`` names): the engine arguments OpenRLHF passes
are kept, only the worker extension and the weight-transfer backend are weightsync's. Generation
(``generate``, ``generate_responses``), sleep and wake-up stay OpenRLHF's.

The methods are ``async`` as the actor's are (an async Ray actor: one event loop). The update
runs weightsync's driver (:func:`weightsync._update.drive`) on a thread, each engine call going
back to the actor's loop, so generation requests keep being served while the version lands.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from ._update import drive
from .client import Client

__all__ = ["ENGINE_KWARGS", "WeightsyncRolloutMethods", "rollout_actor_class", "engine_updater"]

#: The engine arguments that make an OpenRLHF engine receive through weightsync (in place of
#: ``worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"``).
ENGINE_KWARGS: dict[str, Any] = {"worker_extension_cls": "weightsync.vllm.WorkerExtension",
                                 "weight_transfer_config": {"backend": "weightsync"}}


class _AsyncEngineCalls:
    """:class:`weightsync._update.UpdateCalls` over vLLM's ``AsyncLLMEngine``, called from a
    thread: each call runs on the actor's event loop."""

    where = "vLLM (OpenRLHF RolloutRayActor)"

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.llm = llm
        self.loop = loop

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def ready(self, version: int, wait_s: float) -> list[dict[str, Any]]:
        return list(self._run(self.llm.collective_rpc("weightsync_ready", args=(version, wait_s))))

    def start(self) -> None:
        self._run(self.llm.start_weight_update())

    def update(self, version: int, timeout_s: float) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        # Raises when the sync failed (staged: nothing was loaded).
        self._run(self.llm.update_weights(
            WeightTransferUpdateRequest(update_info={"version": version, "timeout_s": timeout_s})))

    def finish(self, version: int) -> None:
        self._run(self.llm.finish_weight_update(weight_version=str(version)))

    def reset_prefix_cache(self, deadline: float) -> None:
        self._run(self.llm.reset_prefix_cache())

    def resumed(self) -> None:
        self._run(self.llm.collective_rpc("weightsync_resumed"))

    def status(self) -> list[dict[str, Any]]:
        return list(self._run(self.llm.collective_rpc("weightsync_status")))

    def weight_version(self) -> str | None:
        v = self._run(self.llm.get_weight_version())
        return None if v is None else str(v)


class WeightsyncRolloutMethods:
    """The weightsync methods of an OpenRLHF ``RolloutRayActor`` (whose ``self.llm`` is vLLM's
    ``AsyncLLMEngine`` built with :data:`ENGINE_KWARGS`); mixed in by
    :func:`rollout_actor_class`, or into any class holding such an engine as ``llm``."""

    llm: Any

    async def weightsync_init(self, controller: str, *, rank: int = 0, job_token: str | None = None,
                              mode: str = "staged", **init_info: Any) -> None:
        """The engine's workers join the job at ``controller`` (``host:port``) as inference
        ranks ``rank ..`` (engine ``i`` of tensor-parallel size ``tp``: ``i * tp``), with the
        job's token (default: ``$WEIGHTSYNC_JOB_TOKEN`` in the engine's workers)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info: dict[str, Any] = {"controller": controller, "mode": mode, "rank": int(rank), **init_info}
        if job_token is not None:
            info["job_token"] = job_token
        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def weightsync_update(self, version: int, timeout_s: float = 600.0,
                                controller_http: str | None = None) -> dict[str, Any]:
        """Brings the engine to ``version`` (or a newer committed one): waits while it serves
        until the version is whole in its arena (a long poll of the controller's HTTP API when
        ``controller_http`` is given), loads it, resets the prefix cache, sets the engine's
        ``weight_version``. Returns the timings. Raises ``weightsync.TimeoutError`` /
        ``SyncFailedError`` (the engine keeps serving its last version)."""
        calls = _AsyncEngineCalls(self.llm, asyncio.get_running_loop())
        controller = Client(controller_http) if controller_http else None
        return await asyncio.to_thread(drive, calls, int(version), timeout_s=timeout_s, reset_prefix_cache=True,
                                       poll_s=0.005, worker_wait_s=0.5, controller=controller)

    async def weightsync_status(self) -> list[dict[str, Any]]:
        """Each worker's backend status (its loaded version, per-sync timings)."""
        return list(await self.llm.collective_rpc("weightsync_status"))

    async def weightsync_digests(self) -> list[dict[str, dict[str, str]]]:
        """Each worker's SHA-256 of its parameters and arena tensors (for checks)."""
        return list(await self.llm.collective_rpc("weightsync_digests"))


def _original_class(actor_cls: Any) -> type:
    """The class a ``@ray.remote`` decorated (Ray's actor class keeps it behind a subclass of
    its own); a plain class as it is."""
    meta = getattr(actor_cls, "__ray_metadata__", None)
    if meta is None:
        if not isinstance(actor_cls, type):
            raise TypeError(f"weightsync.openrlhf_engine: expected OpenRLHF's RolloutRayActor, got {actor_cls!r}")
        return actor_cls
    original: type = meta.modified_class.__mro__[1]
    return original


def rollout_actor_class(rollout_ray_actor: Any, *, remote: bool = True) -> Any:
    """OpenRLHF's ``RolloutRayActor`` (the ``@ray.remote`` class, or its plain class) with the
    weightsync methods, its engine built with :data:`ENGINE_KWARGS` in place of OpenRLHF's
    worker extension. Returns a Ray actor class (``remote=False``: the plain class, which
    ``ray.remote`` accepts, and which runs without Ray where OpenRLHF's constructor does)."""
    base = _original_class(rollout_ray_actor)
    init: Any = getattr(base, "__init__", None)  # noqa: B009  # (mypy: __init__ of a class object)
    if init is None or not inspect.iscoroutinefunction(init):
        raise TypeError(f"weightsync.openrlhf_engine: {base.__qualname__}.__init__ is not async; "
                        "expected OpenRLHF 0.11's RolloutRayActor (it builds vLLM's AsyncLLMEngine)")

    async def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        ext = kwargs.get("worker_extension_cls")
        if ext not in (None, ENGINE_KWARGS["worker_extension_cls"]) and not str(ext).startswith("openrlhf."):
            raise ValueError(f"weightsync.openrlhf_engine: worker_extension_cls={ext!r}: the engine's extension "
                             f"is {ENGINE_KWARGS['worker_extension_cls']}")
        await init(self, *args, **{**kwargs, **ENGINE_KWARGS})

    cls = type("WeightsyncRolloutRayActor", (WeightsyncRolloutMethods, base),
               {"__init__": __init__, "__module__": __name__,
                "__doc__": f"OpenRLHF's {base.__qualname__} receiving weights through weightsync."})
    if not remote:
        return cls
    import ray

    return ray.remote(cls)


def engine_updater(engines: list[Any], *, timeout_s: float = 600.0,
                   controller_http: str | None = None) -> Callable[[int], list[dict[str, Any]]]:
    """``update_engines`` for :func:`weightsync.openrlhf.install` on the policy's rank 0: brings
    every engine actor (handles of :func:`rollout_actor_class`'s actors) to the version, in
    parallel; returns each engine's timings."""
    import ray

    def update(version: int) -> list[dict[str, Any]]:
        return list(ray.get([e.weightsync_update.remote(version, timeout_s, controller_http) for e in engines]))

    return update
