"""The exceptions of weightsync. Every one is a :class:`SyncError` and names, where there is one,
the worker (``trainer-0``, ``rollout-1``) and the tensor (a parameter name) it is about, as
attributes as well as in the message; a :class:`SyncFailedError` also says the failure's
:class:`FailureKind`."""

from __future__ import annotations

import enum

__all__ = [
    "FailureKind",
    "SyncError",
    "ConnectError",
    "RegistrationError",
    "LayoutMismatchError",
    "StaleTensorError",
    "SyncFailedError",
    "PushRefusedError",
    "TimeoutError",
    "ClosedError",
    "ClientError",
    "ControllerError",
]


class FailureKind(str, enum.Enum):
    """What kind of failure ended a sync (a ``str``: ``kind == "checksum"`` holds).

    The controller keeps it with the failure (``GET /v1/syncs/{id}`` says it as ``kind``) and
    every worker of the sync hears it, so a training loop can decide by it without parsing a
    message: retry after a ``TIMEOUT`` or a ``PEER_LOST``, stop on a ``CHECKSUM``."""

    CHECKSUM = "checksum"
    """What landed differs from what the trainer prepared."""
    TIMEOUT = "timeout"
    """Writes that did not land, or a worker that did not answer, in time."""
    FABRIC = "fabric"
    """A fabric operation failed: a refused write, a lane that broke, a peer not reachable."""
    LAYOUT = "layout"
    """The plan, the job or the registered tensors disagree with the layout."""
    SOURCE = "source"
    """A trainer's source does not hold what the plan reads."""
    CANCELLED = "cancelled"
    """The sync was cancelled (aborted) before this part finished."""
    PEER_LOST = "peer_lost"
    """A worker of the sync left or fell silent."""
    HOOK = "hook"
    """An engine's own hook (``before_landing``, ``after_commit``) raised."""
    SUPERSEDED = "superseded"
    """Not a failure: a newer version (or run) was pushed before this one started. A trainer's
    ``PushHandle.wait()`` returns an outcome whose ``superseded`` says why."""
    STALE = "stale"
    """The version is not newer than the last committed one of the job's run (a trainer
    restarted from an older checkpoint): declare a new run (``Trainer.begin_run``)."""
    MODIFIED = "modified"
    """A registered tensor was written while its sync read it (an optimizer step during the
    sync); ``tensor`` names it. The next push syncs again."""
    OTHER = "other"
    """Anything else."""

    @classmethod
    def parse(cls, name: object) -> FailureKind:
        """The kind named ``name``; ``OTHER`` for a name this version does not know (a newer
        controller's)."""
        try:
            return cls(name)
        except ValueError:
            return cls.OTHER

    def __str__(self) -> str:
        return self.value


class SyncError(Exception):
    """Base of every weightsync error.

    Attributes:
        worker: the worker the error is about (for a failed sync: the one that failed), or None.
        tensor: the tensor (parameter name) it is about, or None.
        version: the weight version it is about, or None.
    """

    worker: str | None
    tensor: str | None
    version: int | None

    def __init__(
        self,
        message: str,
        *,
        worker: str | None = None,
        tensor: str | None = None,
        version: int | None = None,
        **details: object,
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.tensor = tensor
        self.version = version
        for k, v in details.items():
            setattr(self, k, v)


class ConnectError(SyncError):
    """The controller could not be reached, refused the job token, or the job it describes
    cannot be used by this worker."""


class RegistrationError(SyncError):
    """``register()`` refused the tensors: a missing, extra, empty, non-contiguous or foreign
    tensor (``tensor`` names it), or a second registration."""


class LayoutMismatchError(RegistrationError):
    """A tensor's shape, dtype or placement differs from the job's layout.

    Attributes:
        expected: what the layout says (e.g. ``bf16 [512, 128]``).
        actual: what the tensor is.
    """

    expected: str | None
    actual: str | None

    def __init__(
        self,
        message: str,
        *,
        expected: str | None = None,
        actual: str | None = None,
        **kw: object,
    ) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.expected = expected
        self.actual = actual


class StaleTensorError(SyncError):
    """A registered tensor's storage moved since ``register()`` (e.g. ``p.data = ...``): its
    bytes would be stale. Update parameters in place (``p.data.copy_(...)``, as optimizers do),
    or register the tensors with a new Trainer / Engine (registration is once per object)."""


class SyncFailedError(SyncError):
    """The sync of ``version`` failed: ``worker`` is the worker that failed (e.g. ``rollout-1``),
    ``kind`` what kind of failure it was (a :class:`FailureKind`, e.g. ``"checksum"``),
    ``tensor`` the tensor to blame when one is, ``cause`` says why."""

    kind: FailureKind
    cause: str | None

    def __init__(
        self,
        message: str,
        *,
        kind: FailureKind | str = FailureKind.OTHER,
        cause: str | None = None,
        **kw: object,
    ) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.kind = FailureKind.parse(kind)
        self.cause = cause


class PushRefusedError(SyncError):
    """``Trainer.push`` while the sync of this trainer's previous push is still reading its
    tensors: wait for it (``PushHandle.wait()``) first. ``version`` is the refused version,
    ``running`` the one whose sync runs."""

    running: int | None

    def __init__(self, message: str, *, running: int | None = None, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.running = running


class TimeoutError(SyncError):  # noqa: A001 - weightsync.TimeoutError, by design
    """A wait ran out of time. The sync may still finish: waiting again is allowed."""


class ClosedError(SyncError):
    """The trainer or engine was closed (or its connection to the controller ended)."""


class ClientError(SyncError):
    """The controller's HTTP API refused a request.

    Attributes:
        status: the HTTP status (0 when no answer came).
        code: the API's error code (``sync_running``, ``stale_version``, ``unauthorized``, ...).
    """

    status: int
    code: str

    def __init__(self, message: str, *, status: int = 0, code: str = "", **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.status = status
        self.code = code


class ControllerError(SyncError):
    """``weightsync.Controller`` could not start: an address taken or invalid (``address``
    names it), an unknown model, a layout that is malformed or does not fit the model.

    Attributes:
        address: the address that could not be bound, or None.
    """

    address: str | None

    def __init__(self, message: str, *, address: str | None = None, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.address = address
