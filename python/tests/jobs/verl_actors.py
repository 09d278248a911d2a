"""The verl side of ``tests/test_verl.py``: verl's actor and rollout workers as far as they run
on CPU, around the ``"weightsync"`` checkpoint engine.

``VerlActor``: one FSDP2 rank (gloo) that builds its checkpoint engine and answers verl's
``CheckpointEngineManager`` as verl's ``ActorRolloutRefWorker`` does (the same
``@register``-ed ``update_weights`` / ``execute_checkpoint_engine``, the same
``CheckpointEngineRegistry.new(backend, is_master=..., bucket_size=..., **engine_kwargs)``),
except that its model is a tiny transformers model instead of verl's engine.
``update_weights`` hands the backend a generator of gathered tensors, as verl's
``get_per_tensor_param`` does; it counts what is read from it.

``VerlRollout``: verl's own ``CheckpointEngineWorker`` (its ``update_weights`` and
``execute_checkpoint_engine`` as verl ships them) whose ``__init__`` builds the backend the way
verl's does, with a transformers model as the inference engine (registered with weightsync,
``format=hf``) and a server adapter that loads whatever ``receive_weights`` yields into it.

``Replica``: the parts of verl's ``RolloutReplica`` the manager calls (there is no server to
pause: the engine is the actor's model).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ray_actors  # noqa: E402
import tiny  # noqa: E402

from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker  # noqa: E402
from verl.single_controller.base import Worker  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402
from verl.utils.import_utils import import_external_libs  # noqa: E402
from verl.workers.config import CheckpointEngineConfig  # noqa: E402

import weightsync.ray  # noqa: E402


def checkpoint_engine(config: CheckpointEngineConfig, **verl_args: Any) -> Any:
    """The backend, built as verl's workers build it."""
    import_external_libs(config.custom_backend_module or None)
    return CheckpointEngineRegistry.new(config.backend, bucket_size=config.update_weights_bucket_megabytes << 20,
                                        **verl_args, **config.engine_kwargs.get(config.backend, {}))


class VerlActor(Worker):  # type: ignore[misc]
    def __init__(self, rank: int, world: int, rendezvous: str, config_dir: str,
                 config: CheckpointEngineConfig) -> None:
        # Not Worker.__init__: it reads verl's environment, which its own worker group sets.
        self.fsdp = ray_actors.FsdpTrainer.__new__(ray_actors.FsdpTrainer)
        self.fsdp.setup(rank, world, rendezvous, config_dir)
        self.checkpoint_engine = checkpoint_engine(config, is_master=torch.distributed.get_rank() == 0)
        # The one line verl's actor worker gains: its shards are the source.
        self.checkpoint_engine.register_trainer(self.fsdp.model)
        self.gathered = 0

    def train_step(self) -> None:
        self.fsdp.train_step()

    def full(self) -> dict[str, Any] | None:
        return self.fsdp.full()

    def gathered_tensors(self) -> int:
        return self.gathered

    def _per_tensor_param(self) -> Any:
        for name, p in self.fsdp.model.named_parameters():
            self.gathered += 1
            yield name, p.full_tensor()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        # verl's ActorRolloutRefWorker.update_weights for a checkpoint-engine backend.
        metrics = await self.checkpoint_engine.send_weights(self._per_tensor_param(), global_steps=global_steps)
        return metrics or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class TransformersAdapter:
    """A server adapter over a transformers model: loads what it is given by name."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.loaded = 0

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        params = dict(self.model.named_parameters())
        async for name, tensor in weights:
            with torch.no_grad():
                params[name].copy_(tensor)
            self.loaded += 1


class VerlRollout(CheckpointEngineWorker):  # type: ignore[misc]
    def __init__(self, rank: int, config_dir: str, config: CheckpointEngineConfig) -> None:
        # CheckpointEngineWorker.__init__ builds its backend the same way, then verl's server
        # adapter for rollout.name and a gloo group of the replica (a vLLM/SGLang server).
        torch.set_num_threads(1)
        self.model = tiny.build(config_dir, seed=100 + rank).eval()
        self.checkpoint_engine = checkpoint_engine(config)
        self.server_adapter = TransformersAdapter(self.model)
        namespace = config.engine_kwargs[config.backend].get("namespace")
        self.engine = weightsync.ray.connect(namespace=namespace).engine(rank)
        self.engine.register(self.model, format="hf")

    def loaded_by_adapter(self) -> int:
        return int(self.server_adapter.loaded)

    def tensors(self) -> tuple[int | None, dict[str, Any]]:
        return self.engine.version, {n: p.detach().clone() for n, p in self.model.named_parameters()}


class Replica:
    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None
