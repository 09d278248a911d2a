"""``weightsync.ray``: a weightsync job launched on Ray.

Ray is where RL frameworks (verl, OpenRLHF, NeMo-RL, SkyRL) place their trainers and engines, and
a Ray job has no ``torchrun`` to set ``$RANK`` nor anyone to start a controller by hand. Here the
driver starts the job's controller as a Ray actor (:func:`start`, the same Rust service as
:class:`weightsync.Controller`, in a Ray worker process), and hands the returned :class:`Job`
(picklable) to the actors it places; each actor joins with the rank the launcher gave it::

    job = weightsync.ray.start(model=config, train="fsdp=2", infer="tp=1,dp=2,format=hf")
    trainers = [TrainerActor.remote(job, rank) for rank in range(2)]
    engines = [EngineActor.options(max_restarts=1).remote(job, rank) for rank in range(2)]

    # in TrainerActor.__init__(self, job, rank):
    self.trainer = job.trainer(rank)
    # in EngineActor.__init__(self, job, rank):
    self.engine = job.engine(rank, after_commit=after_commit)

An actor that Ray restarts (``max_restarts``) runs its ``__init__`` again with the same
arguments, so it joins again with the same rank: :meth:`Job.engine` / :meth:`Job.trainer` retry
while the controller still holds the dead process's registration (it lets go when the
connection closes or goes silent for ``heartbeat_timeout``), and the controller re-plans once the
world is complete. Versions pushed meanwhile wait for that plan, so the next version commits
without the training loop doing anything. Actors in another Ray job of the cluster (or a process
that was not given the handle) find the controller by its actor name with :func:`connect`.

Addresses: the controller and each worker bind this node's IP address (``ray.util.
get_node_ip_address()``), so the job spans the cluster's nodes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import ray

from ._hooks import Hook
from .client import Client
from .controller import Controller
from .engine import Engine
from .errors import ConnectError, RegistrationError, SyncError
from .trainer import Trainer

__all__ = ["CONTROLLER_NAME", "Job", "JobAddress", "start", "connect"]

CONTROLLER_NAME = "weightsync-controller"
"""The controller actor's name when :func:`start` is not given one."""


@dataclass(frozen=True)
class JobAddress:
    """Where the job's controller serves and the secrets its workers and callers present."""

    control_address: str
    http_url: str
    job_token: str
    api_token: str
    trainers: int
    engines: int

    def __repr__(self) -> str:  # never the tokens
        return (f"JobAddress(control={self.control_address!r}, http={self.http_url!r}, "
                f"trainers={self.trainers}, engines={self.engines})")


class ControllerActor:
    """The job's controller, held by a Ray actor (``ray.remote(ControllerActor)``; :func:`start`
    creates it). Its methods are what the driver and the workers ask it."""

    def __init__(self, model: str, train: str, infer: str, dtype: str, options: dict[str, Any]) -> None:
        host = _node_ip()
        options = {"control": f"{host}:0", "http": f"{host}:0", **options}
        # A job the controller refuses is said by address() (a task's exception reaches the
        # caller as itself; an __init__'s only as text inside Ray's ActorDiedError).
        self._controller: Controller | None = None
        self._error: SyncError | None = None
        try:
            self._controller = Controller(model, train, infer, dtype, **options)
        except SyncError as e:
            self._error = e

    def address(self) -> JobAddress:
        if self._controller is None:
            assert self._error is not None
            raise self._error
        c = self._controller
        return JobAddress(control_address=c.control_address, http_url=c.http_url,
                          job_token=c.job_token, api_token=c.api_token,
                          trainers=c.trainers, engines=c.engines)

    def running(self) -> bool:
        return self._controller is not None and self._controller.running

    def close(self) -> None:
        if self._controller is not None:
            self._controller.close()


@dataclass(frozen=True)
class Job:
    """A running weightsync job on Ray: its controller actor and address. Picklable: pass it to
    the actors that train and serve (it carries the job's tokens, as their environment would)."""

    actor: Any
    """The controller actor's handle."""
    address: JobAddress

    def trainer(self, rank: int, *, rejoin_timeout: float = 120.0, listen: str | None = None,
                worker_id: str | None = None) -> Trainer:
        """A :class:`weightsync.Trainer` of training rank ``rank`` (the launcher's placement,
        not ``$RANK``), connected to this job's controller.

        Raises:
            RegistrationError / ConnectError: the controller refused it for another reason than
                a registration of the same rank it still holds, or still held it after
                ``rejoin_timeout`` seconds.
        """
        return _rejoin(lambda: Trainer(self.address.control_address, rank, job_token=self.address.job_token,
                                       listen=listen or _listen(), worker_id=worker_id), rejoin_timeout)

    def engine(self, rank: int, *, before_landing: Hook | None = None, after_commit: Hook | None = None,
               rejoin_timeout: float = 120.0, listen: str | None = None,
               worker_id: str | None = None) -> Engine:
        """A :class:`weightsync.Engine` of inference rank ``rank``, connected to this job's
        controller; as :meth:`trainer` for a restarted actor."""
        return _rejoin(lambda: Engine(self.address.control_address, rank, job_token=self.address.job_token,
                                      listen=listen or _listen(), worker_id=worker_id,
                                      before_landing=before_landing, after_commit=after_commit),
                       rejoin_timeout)

    def client(self, *, timeout: float = 3600.0) -> Client:
        """A :class:`weightsync.Client` of the controller's HTTP API, with the API token."""
        return Client(self.address.http_url, self.address.api_token, timeout=timeout)

    def stop(self) -> None:
        """Stops the controller and its actor (idempotent)."""
        try:
            ray.get(self.actor.close.remote())
        except ray.exceptions.RayActorError:
            return
        ray.kill(self.actor)


def start(model: str, train: str, infer: str, dtype: str = "bf16", *, name: str | None = CONTROLLER_NAME,
          namespace: str | None = None, timeout: float = 120.0, **options: Any) -> Job:
    """Starts the job's controller as a Ray actor (``num_cpus=0``; named ``name`` in
    ``namespace`` so :func:`connect` finds it; ``name=None`` for an anonymous one) and returns
    the :class:`Job`. ``options`` are :class:`weightsync.Controller`'s (``verify``,
    ``heartbeat_timeout``, ``sync_timeout``, ...; ``control`` / ``http`` default to this node's
    IP, port 0).

    Raises:
        ControllerError: the controller could not start (the Ray task's cause, unwrapped).
    """
    cls = ray.remote(num_cpus=0, max_restarts=0)(ControllerActor)
    actor = cls.options(name=name, namespace=namespace).remote(str(model), train, infer, dtype, options)
    try:
        address: JobAddress = ray.get(actor.address.remote(), timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        ray.kill(actor)
        cause = e.cause
        raise (cause if isinstance(cause, SyncError) else e) from None
    return Job(actor=actor, address=address)


def connect(name: str = CONTROLLER_NAME, namespace: str | None = None, *, timeout: float = 120.0) -> Job:
    """The :class:`Job` of the controller actor named ``name``, waiting up to ``timeout``
    seconds for it to appear (an actor may start before the driver created it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            actor = ray.get_actor(name, namespace=namespace)
            break
        except ValueError:
            if time.monotonic() > deadline:
                raise ConnectError(f"no weightsync controller actor named {name!r} after {timeout} s") from None
            time.sleep(0.5)
    return Job(actor=actor, address=ray.get(actor.address.remote(), timeout=timeout))


def _node_ip() -> str:
    return str(ray.util.get_node_ip_address())


def _listen() -> str:
    return f"{_node_ip()}:0"


_W = TypeVar("_W", Trainer, Engine)


def _rejoin(join: Callable[[], _W], timeout: float) -> _W:
    """``join()``; while the controller refuses it because it still holds this rank's previous
    registration (a process Ray restarted, whose connection the controller has not yet seen
    close), again every half second up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return join()
        except (RegistrationError, ConnectError) as e:
            if "already registered" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
