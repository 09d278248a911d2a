"""weightsync: move fresh model weights from training ranks to inference engines.

In every training rank::

    trainer = weightsync.Trainer(controller="10.0.0.1:7070")   # rank from $RANK
    trainer.register(model)                                    # FSDP2 shards, in place
    ...
    optimizer.step()
    trainer.push(step).wait()

In every inference rank, inside the engine's process::

    engine = weightsync.Engine(controller="10.0.0.1:7070", rank=r,
                               before_landing=pause, after_commit=resume)
    engine.register(model, format="hf")                        # the engine's own tensors

Or trigger syncs over HTTP: ``weightsync.Client(url, token).sync(step)``.

The job's controller runs in any Python process (the same Rust service as the ``weightsync``
binary, which the wheel also installs as a console script)::

    with weightsync.Controller(model="qwen3-0.6b", train="fsdp=4", infer="tp=2,dp=2") as c:
        ...   # workers connect to c.control_address with c.job_token
        c.client().sync(step)

Errors are :class:`SyncError` subclasses naming the worker and the tensor. Every wait releases
the GIL and Ctrl-C interrupts it. torch is never imported by this package.
"""

from __future__ import annotations

from .client import Client, Failure, SyncResult
from .controller import Controller
from .engine import Engine, EngineStage, EngineState, Source, SourceBox, TensorInfo
from .errors import (
    ClientError,
    ClosedError,
    ConnectError,
    FailureKind,
    ControllerError,
    LayoutMismatchError,
    PushRefusedError,
    RegistrationError,
    StaleTensorError,
    SyncError,
    SyncFailedError,
    TimeoutError,
)
from .trainer import PushHandle, ShardInfo, SyncOutcome, Trainer

__version__ = "0.1.0"

__all__ = [
    "Trainer",
    "PushHandle",
    "SyncOutcome",
    "ShardInfo",
    "Engine",
    "EngineState",
    "EngineStage",
    "Source",
    "SourceBox",
    "TensorInfo",
    "Client",
    "SyncResult",
    "Controller",
    "Failure",
    "FailureKind",
    "SyncError",
    "ConnectError",
    "RegistrationError",
    "LayoutMismatchError",
    "PushRefusedError",
    "StaleTensorError",
    "SyncFailedError",
    "TimeoutError",
    "ClosedError",
    "ClientError",
    "ControllerError",
]
