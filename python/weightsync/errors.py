"""The exceptions of weightsync. Every one is a :class:`SyncError` and names, where there is one,
the worker (``trainer-0``, ``rollout-1``) and the tensor (a parameter name) it is about, as
attributes as well as in the message."""

from __future__ import annotations

__all__ = [
    "SyncError",
    "ConnectError",
    "RegistrationError",
    "LayoutMismatchError",
    "StaleTensorError",
    "SyncFailedError",
    "TimeoutError",
    "ClosedError",
    "ClientError",
    "ControllerError",
]


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
    ``cause`` says why."""

    cause: str | None

    def __init__(self, message: str, *, cause: str | None = None, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.cause = cause


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
