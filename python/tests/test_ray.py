"""``weightsync.ray`` on a real Ray local cluster (CPU, capped: 4 logical CPUs, a small object
store, no dashboard): the controller as a Ray actor started from the job's description, 2 FSDP2
trainer actors (gloo) and 2 transformers engine actors, ranks given by the placement. Three
versions land byte for byte equal to the trainers' ``full_tensor()``; then an engine actor is
killed with ``ray.kill(no_restart=False)``, Ray restarts it, it rejoins by itself and the next
version lands byte-exact on both engines. And a trainer whose parameter names differ from the
job's is refused before its first step, naming the tensor. Torch start-up in each actor
dominates its time (minutes on a loaded 2-core machine)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import weightsync  # noqa: E402
import weightsync.ray  # noqa: E402

from conftest import FIGURES, JOBS, free_port  # noqa: E402

NAMESPACE = "weightsync-test"


@contextlib.contextmanager
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A Ray local cluster for one test module, capped: 4 logical CPUs, a 100 MiB object store,
    no dashboard.

    Workers inherit the driver's environment when ray.init starts the local cluster: jobs/ on
    their path (the actors' modules), one torch thread each. Ray also puts the driver's current
    directory on the workers' path: pytest runs in python/, whose weightsync/ source folder (no
    native module) would shadow the installed package, so ray.init runs from elsewhere."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "OMP_NUM_THREADS")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(JOBS), saved["PYTHONPATH"]) if p)
    os.environ["OMP_NUM_THREADS"] = "1"
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray-driver"))
    try:
        # Ray gives its raylet a fixed 30 s to register; a loaded machine can miss it.
        for attempt in range(3):
            try:
                ray.init(num_cpus=4, object_store_memory=100 * 1024**2, include_dashboard=False,
                         namespace=NAMESPACE, log_to_driver=True, configure_logging=False)
                break
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
                ray.shutdown()
                if "timed out during startup" not in str(e) or attempt == 2:
                    raise
    finally:
        os.chdir(cwd)
    try:
        yield
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with ray_cluster(tmp_path_factory):
        yield


def write_config(folder: Path) -> tuple[str, str]:
    """The tiny dense Qwen3's folder (what the actors build from) and its config.json (the
    job's model)."""
    import sys

    sys.path.insert(0, str(JOBS))
    import tiny

    return str(folder), tiny.write_config(str(folder), "dense")


def actors() -> tuple[Any, Any]:
    import ray_actors

    trainer = ray.remote(num_cpus=1)(ray_actors.FsdpTrainer)
    # max_task_retries: a call in flight when the actor dies is run again on its restarted self.
    engine = ray.remote(num_cpus=1, max_restarts=1, max_task_retries=1)(ray_actors.HfEngine)
    return trainer, engine


def as_bytes(t: Any) -> Any:
    return t.contiguous().view(torch.uint8)


def assert_lands(full: dict[str, Any], engines: list[dict[str, Any]], version: int) -> None:
    for r, got in enumerate(engines):
        assert set(got) == set(full), f"engine {r} v{version}: names differ"
        for name, want in full.items():
            g = got[name]
            assert (g.dtype, tuple(g.shape)) == (want.dtype, tuple(want.shape)), f"engine {r} v{version}: {name}"
            assert torch.equal(as_bytes(g), as_bytes(want)), f"engine {r} v{version}: {name}: bytes differ"


def wait_dead(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"engine process {pid} still alive {timeout} s after ray.kill")


def test_controller_actor_fsdp2_trainers_engine_restart(cluster: None, tmp_path: Path) -> None:
    model, config = write_config(tmp_path / "model")
    job = weightsync.ray.start(model=config, train="fsdp=2", infer="tp=1,dp=2,format=hf", namespace=NAMESPACE)
    Trainer, Engine = actors()
    rendezvous = f"127.0.0.1:{free_port()}"
    trainers = [Trainer.remote(job, r, 2, rendezvous, model) for r in range(2)]
    engines = [Engine.remote(r, model, NAMESPACE) for r in range(2)]
    try:
        seconds = []
        for v in (1, 2, 3):
            t0 = time.monotonic()
            full = ray.get([t.step.remote(v) for t in trainers], timeout=300)[0]
            seconds.append(time.monotonic() - t0)
            assert_lands(full, ray.get([e.tensors_at.remote(v) for e in engines], timeout=120), v)

        # Ray restarts the killed engine (max_restarts=1): its __init__ runs again, connects by
        # the controller's actor name and registers rank 1 again; the push of version 4 waits
        # for the re-planned world and lands on both engines.
        pid = ray.get(engines[1].pid.remote())
        ray.kill(engines[1], no_restart=False)
        wait_dead(pid)
        pushed = [t.step.remote(4) for t in trainers]
        landed = [e.tensors_at.remote(4) for e in engines]
        full = ray.get(pushed, timeout=300)[0]
        assert_lands(full, ray.get(landed, timeout=300), 4)
        assert ray.get(engines[1].pid.remote()) != pid, "engine 1 was not restarted"
        FIGURES["ray_seconds_per_step"] = [round(s, 3) for s in seconds]
        ray.get([t.close.remote() for t in trainers], timeout=60)
    finally:
        for a in [*trainers, *engines]:
            ray.kill(a, no_restart=True)
        job.stop()


def test_framework_names_that_differ_are_refused_by_name(cluster: None, tmp_path: Path) -> None:
    model, config = write_config(tmp_path / "model")
    job = weightsync.ray.start(model=config, train="fsdp=1", infer="tp=1,dp=1,format=hf", name="weightsync-names",
                               namespace=NAMESPACE)
    Trainer, _ = actors()
    # A framework that keeps its own prefix on one tensor (say "policy." from a wrapper the
    # adapter's name map does not know).
    wrong = "policy.model.layers.0.self_attn.q_proj.weight"
    trainer = Trainer.remote(job, 0, 1, f"127.0.0.1:{free_port()}", model,
                             {"model.layers.0.self_attn.q_proj.weight": wrong})
    try:
        # The actor's __init__ (the registration, before any step) fails; Ray says why.
        with pytest.raises(ray.exceptions.RayActorError) as e:
            ray.get(trainer.step.remote(1), timeout=300)
        said = str(e.value)
        assert "creation task" in said and "RegistrationError" in said, said
        assert '"model.layers.0.self_attn.q_proj.weight"' in said and "has no registered tensor" in said, said
    finally:
        ray.kill(trainer, no_restart=True)
        job.stop()


def test_a_job_the_controller_refuses_raises_its_error(cluster: None) -> None:
    with pytest.raises(weightsync.ControllerError, match="unknown model"):
        weightsync.ray.start(model="no-such-model", train="fsdp=2", infer="tp=1,dp=2", name="weightsync-refused",
                             namespace=NAMESPACE)
