"""``weightsync.Controller``: a job's controller inside this Python process.

The same Rust service as ``weightsync controller`` (the binary), on a runtime thread of its own:
workers (``weightsync.Trainer`` / ``weightsync.Engine`` in other processes) connect to
:attr:`Controller.control_address`, the training loop or anyone with the API token triggers
syncs over :attr:`Controller.http_url`. Nothing but this package is needed::

    with weightsync.Controller(model="qwen3-0.6b", train="fsdp=4", infer="tp=2,dp=2") as c:
        launch_workers(c.control_address, c.job_token)   # your launcher
        ...
        c.client().sync(step)
"""

from __future__ import annotations

import os
import secrets
from types import TracebackType

from . import _native
from .client import Client

__all__ = ["Controller"]


def _token(given: str | None) -> str:
    return given if given is not None else secrets.token_hex(32)


class Controller:
    """The controller of one job, serving until :meth:`close` (or the end of a ``with`` block).

    Args:
        model: a model preset (``qwen3-0.6b``, ...) or the path of a Hugging Face
            ``config.json``.
        train: the training layout, e.g. ``fsdp=4``.
        infer: the inference layout, e.g. ``tp=2,dp=2`` (``format=hf`` for engines that
            hold the checkpoint's own tensors).
        dtype: the inference dtype, ``bf16`` or ``fp8``.
        http: address of the HTTP API and dashboard; port 0 picks a free port.
        control: address workers connect to; port 0 picks a free port.
        verify: rollouts verify checksums of what landed.
        job_token: the secret workers present (generated if not given).
        api_token: the secret mutating HTTP calls present (generated if not given).
        heartbeat_timeout: seconds a worker may stay silent before its sync fails.
        sync_timeout: seconds a sync may take before it fails.
        history: syncs kept in the controller's history.
        tls_cert, tls_key, tls_ca: serve the control channel and the HTTP API over TLS (all
            three or none; PEM paths): the controller's certificate and key, and the CA that
            signs the workers' client certificates (a worker without one is refused before it
            can prove a secret). The HTTP API is then ``https://`` (:meth:`client` trusts
            ``tls_ca`` for it). None: plain TCP, for loopback and tests (see docs/security.md).

    Raises:
        ControllerError: it cannot start: an address is taken or invalid (``address`` names
            it), the model is unknown, a layout is malformed or does not fit the model.
    """

    job_token: str
    """The secret workers present (``job_token=`` of ``Trainer`` / ``Engine``)."""
    api_token: str
    """The secret mutating HTTP calls present (:meth:`client` uses it)."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        train: str,
        infer: str,
        dtype: str = "bf16",
        *,
        http: str = "127.0.0.1:0",
        control: str = "127.0.0.1:0",
        verify: bool = True,
        job_token: str | None = None,
        api_token: str | None = None,
        heartbeat_timeout: float = 5.0,
        sync_timeout: float = 300.0,
        history: int = 200,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        self.model = os.fspath(model)
        self.train = train
        self.infer = infer
        self.dtype = dtype
        self.job_token = _token(job_token)
        self.api_token = _token(api_token)
        self._core = _native.ControllerCore(
            self.model,
            train,
            infer,
            self.job_token,
            self.api_token,
            dtype=dtype,
            http=http,
            control=control,
            verify=verify,
            heartbeat_timeout=heartbeat_timeout,
            sync_timeout=sync_timeout,
            history=history,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_ca=tls_ca,
        )
        self.tls_ca = None if tls_ca is None else os.fspath(tls_ca)

    @property
    def control_address(self) -> str:
        """The address workers connect to, e.g. ``127.0.0.1:41234`` (the port chosen when 0
        was asked)."""
        return self._core.control_address

    @property
    def http_address(self) -> str:
        """The HTTP API's ``host:port``."""
        return self._core.http_address

    @property
    def http_url(self) -> str:
        """The HTTP API's base URL, e.g. ``http://127.0.0.1:41235`` (dashboard at ``/``;
        ``https://`` with TLS)."""
        return ("https://" if self._core.tls else "http://") + self._core.http_address

    @property
    def trainers(self) -> int:
        """Training ranks the job expects (``Trainer`` ranks ``0..trainers``)."""
        return self._core.trainers

    @property
    def engines(self) -> int:
        """Inference ranks the job expects (``Engine`` ranks ``0..engines``)."""
        return self._core.rollouts

    @property
    def running(self) -> bool:
        """Whether it still serves."""
        return self._core.is_running()

    def client(self, *, timeout: float = 3600.0) -> Client:
        """A :class:`~weightsync.Client` of this controller's HTTP API, with its API token."""
        return Client(self.http_url, self.api_token, timeout=timeout, ca=self.tls_ca)

    def worker_env(self) -> dict[str, str]:
        """The environment a worker process started by the ``weightsync`` CLI needs
        (``WEIGHTSYNC_JOB_TOKEN``), and a training loop's ``WEIGHTSYNC_API_TOKEN``."""
        return {"WEIGHTSYNC_JOB_TOKEN": self.job_token, "WEIGHTSYNC_API_TOKEN": self.api_token}

    def close(self) -> None:
        """Stops serving and joins the controller's thread (workers' connections close).
        Idempotent."""
        self._core.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        # Never the tokens.
        state = "running" if self.running else "closed"
        return (
            f"Controller(model={self.model!r}, train={self.train!r}, infer={self.infer!r}, "
            f"dtype={self.dtype!r}, control={self.control_address!r}, http={self.http_url!r}, {state})"
        )
