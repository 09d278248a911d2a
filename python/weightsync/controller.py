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
        job_token: the secret workers present (generated if not given), where a role has no
            secret of its own.
        api_token: the secret mutating HTTP calls present (generated if not given).
        trainer_token, engine_token: one secret per worker role (default: ``job_token``; with
            ``role_secrets=True``, generated). A worker proves its role's secret, so an engine's
            secret cannot register a trainer (nor the other way round).
        read_token: when given, the read-only views (``/v1/...``, ``/metrics``, the
            dashboard) need it or the API token; otherwise they are open.
        fabric_token: the secret trainers and engines authenticate their fabric lanes with,
            shared by both roles (default: ``job_token`` while both roles share it, else
            generated). Give it to every worker (``fabric_token=`` of ``Trainer`` / ``Engine``).
        role_secrets: generate a distinct trainer, engine and fabric secret (those not given).
        Secrets are never printed (``repr`` leaves them out); see ``docs/security.md``.
        heartbeat_timeout: seconds a worker may stay silent before its sync fails.
        sync_timeout: seconds a sync may take before it fails.
        history: syncs kept in the controller's history.
        tls_cert, tls_key, tls_ca: serve the control channel and the HTTP API over TLS (all
            three or none; PEM paths): the controller's certificate and key, and the CA that
            signs the workers' client certificates (a worker without one is refused before it
            can prove a secret). The HTTP API is then ``https://`` (:meth:`client` trusts
            ``tls_ca`` for it). None: plain TCP, for loopback and tests (see docs/security.md).
        tls_crl: with TLS, a PEM file of certificate revocation lists of ``tls_ca``: a worker
            certificate it lists is refused in the handshake (every certificate of a worker's
            chain below the CA is checked, and one whose issuer has no CRL in the file is
            refused). Read once, at start.
        delta: delta syncs (engines get only what changed since the version they hold):
            ``"auto"`` (offered while a measured delta sync beats the last full one, probed
            again every 16 full syncs), ``"on"`` (always, where an engine can take one) or
            ``"off"`` (every sync full: trainers keep no bases, engines register no inbox).
            See docs/delta.md for what each costs.

    Raises:
        ValueError: ``delta`` is none of ``auto``, ``on``, ``off`` (the message names it).
        ControllerError: it cannot start: an address is taken or invalid (``address`` names
            it), the model is unknown, a layout is malformed or does not fit the model.
    """

    job_token: str
    """The secret workers present (``job_token=`` of ``Trainer`` / ``Engine``)."""
    api_token: str
    """The secret mutating HTTP calls present (:meth:`client` uses it)."""
    trainer_token: str
    """The secret trainers present (``job_token=`` of ``Trainer``)."""
    engine_token: str
    """The secret engines present (``job_token=`` of ``Engine``)."""
    fabric_token: str
    """The fabric's secret, for every worker (``fabric_token=`` of ``Trainer`` / ``Engine``)."""
    read_token: str | None
    """The read-only views' secret, or None when they are open."""
    delta: str
    """The delta mode it was started with: ``auto``, ``on`` or ``off``."""

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
        trainer_token: str | None = None,
        engine_token: str | None = None,
        read_token: str | None = None,
        fabric_token: str | None = None,
        role_secrets: bool = False,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_crl: str | os.PathLike[str] | None = None,
        delta: str = "auto",
    ) -> None:
        self.model = os.fspath(model)
        self.train = train
        self.infer = infer
        self.dtype = dtype
        self.job_token = _token(job_token)
        self.api_token = _token(api_token)

        def role(given: str | None) -> str:
            if given is not None:
                return given
            return _token(None) if role_secrets else self.job_token

        self.trainer_token = role(trainer_token)
        self.engine_token = role(engine_token)
        if fabric_token is None:
            shared = self.trainer_token == self.engine_token == self.job_token
            fabric_token = self.job_token if shared else _token(None)
        self.fabric_token = fabric_token
        self.read_token = read_token
        for name in ("trainer_token", "engine_token", "fabric_token", "read_token"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must not be empty")
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
            trainer_token=self.trainer_token,
            engine_token=self.engine_token,
            read_token=self.read_token,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_ca=tls_ca,
            tls_crl=tls_crl,
            delta=delta,
        )
        self.delta = self._core.delta
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

    def worker_env(self, role: str | None = None) -> dict[str, str]:
        """The environment a worker process started by the ``weightsync`` CLI needs, and a
        training loop's ``WEIGHTSYNC_API_TOKEN``. Without ``role``: the job token
        (``WEIGHTSYNC_JOB_TOKEN``). With ``role`` (``"trainer"`` or ``"engine"``): only that
        role's secret (``WEIGHTSYNC_TRAINER_TOKEN`` / ``WEIGHTSYNC_ENGINE_TOKEN``) and the
        fabric's (``WEIGHTSYNC_FABRIC_TOKEN``), so an engine host never holds a trainer's (nor the
        API token, which a trainer's environment gets)."""
        if role is None:
            return {"WEIGHTSYNC_JOB_TOKEN": self.job_token, "WEIGHTSYNC_API_TOKEN": self.api_token}
        env = {
            self._role_variable(role): self.worker_token(role),
            "WEIGHTSYNC_FABRIC_TOKEN": self.fabric_token,
        }
        if role == "trainer":  # the training loop triggers syncs; an engine host never may
            env["WEIGHTSYNC_API_TOKEN"] = self.api_token
        return env

    def worker_token(self, role: str) -> str:
        """The secret a worker of ``role`` (``"trainer"`` or ``"engine"``) presents."""
        self._role_variable(role)
        return self.trainer_token if role == "trainer" else self.engine_token

    @staticmethod
    def _role_variable(role: str) -> str:
        if role not in ("trainer", "engine"):
            raise ValueError(f"role must be 'trainer' or 'engine', got {role!r}")
        return f"WEIGHTSYNC_{role.upper()}_TOKEN"

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
            f"dtype={self.dtype!r}, delta={self.delta!r}, control={self.control_address!r}, "
            f"http={self.http_url!r}, {state})"
        )
