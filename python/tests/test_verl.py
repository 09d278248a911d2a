"""``weightsync.verl``: verl's own ``CheckpointEngineManager`` (verl 0.9.1) drives the
``"weightsync"`` checkpoint engine on a Ray local cluster (CPU): 2 FSDP2 actor workers push
their shards, 2 rollout workers (verl's ``CheckpointEngineWorker`` with a transformers engine)
receive; 3 versions land byte for byte equal to the trainers' ``full_tensor()``, and verl's
generator of gathered tensors is never read.

verl is installed without its dependencies (test.sh: verl 0.9.1 pins transformers<5.11, this
suite runs transformers 5.19) plus the few modules ``verl.checkpoint_engine`` imports; the
manager, the registry, verl's ``RayWorkerGroup`` dispatch and the rollout worker's
``update_weights`` are verl's code. Its actor worker (``ActorRolloutRefWorker``) and rollout
replicas (vLLM / SGLang servers) are not: they need verl's full dependency set and a GPU
server, so ``jobs/verl_actors.py`` stands in for them (see docs/verl.md)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed (test.sh installs it)")

import weightsync  # noqa: E402
import weightsync.ray  # noqa: E402

from conftest import FIGURES, JOBS, free_port  # noqa: E402
from test_ray import NAMESPACE, assert_lands, ray_cluster, write_config  # noqa: E402

sys.path.insert(0, str(JOBS))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with ray_cluster(tmp_path_factory):
        yield


def test_verl_manager_drives_the_weightsync_backend(cluster: None, tmp_path: Path) -> None:
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig

    import verl_actors
    import weightsync.verl

    assert CheckpointEngineRegistry.get("weightsync") is weightsync.verl.WeightsyncCheckpointEngine
    model, config_json = write_config(tmp_path / "model")
    job = weightsync.ray.start(model=config_json, train="fsdp=2", infer="tp=1,dp=2,format=hf", namespace=NAMESPACE)
    # What a verl user sets (actor_rollout_ref.rollout.checkpoint_engine.*).
    config = CheckpointEngineConfig(backend="weightsync", custom_backend_module="weightsync.verl",
                                    engine_kwargs={"weightsync": {"namespace": NAMESPACE}})
    actor_cls = ray.remote(num_cpus=1)(verl_actors.VerlActor)
    rollout_cls = ray.remote(num_cpus=1)(verl_actors.VerlRollout)
    rendezvous = f"127.0.0.1:{free_port()}"
    actors = [actor_cls.remote(r, 2, rendezvous, model, config) for r in range(2)]
    rollouts = [rollout_cls.remote(r, model, config) for r in range(2)]
    try:
        actor_wg = RayWorkerGroup(worker_handles=actors, ray_cls_with_init=RayClassWithInitArgs(cls=actor_cls))
        manager = CheckpointEngineManager(config, actor_wg, [verl_actors.Replica([w]) for w in rollouts])
        seconds = []
        for v in (1, 2, 3):
            ray.get([a.train_step.remote() for a in actors], timeout=300)
            t0 = time.monotonic()
            metrics = manager.update_weights(global_steps=v)
            seconds.append(time.monotonic() - t0)
            assert metrics["weightsync/version"] == v, metrics
            full = ray.get([a.full.remote() for a in actors], timeout=120)[0]
            landed = ray.get([r.tensors.remote() for r in rollouts], timeout=120)
            assert [version for version, _ in landed] == [v, v], landed
            assert_lands(full, [tensors for _, tensors in landed], v)
        # Nothing was gathered for the sync, nothing went through the server adapter: the shards
        # were written into the engines' own tensors.
        assert ray.get([a.gathered_tensors.remote() for a in actors]) == [0, 0]
        assert ray.get([r.loaded_by_adapter.remote() for r in rollouts]) == [0, 0]
        FIGURES["verl_update_weights_seconds"] = [round(s, 3) for s in seconds]
    finally:
        for a in [*actors, *rollouts]:
            ray.kill(a, no_restart=True)
        job.stop()
