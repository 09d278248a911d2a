"""``weightsync.Client``: the controller's HTTP API, for a training loop (or anything else) that
triggers syncs itself instead of pushing from the trainers (``POST /v1/syncs``).

Plain ``urllib``: the API is a few small JSON calls; waiting happens in the socket read, which
releases the GIL and is interrupted by Ctrl-C.
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from .errors import ClientError, FailureKind, SyncFailedError

__all__ = ["Client", "SyncResult", "Failure"]


@dataclass(frozen=True)
class Failure:
    """Why a sync failed: the worker to blame (e.g. ``rollout-1``), the tensor when known, and
    the failure's kind (``checksum``, ``timeout``, ``peer_lost``...)."""

    worker: str
    tensor: str | None
    cause: str
    kind: FailureKind = FailureKind.OTHER

    @staticmethod
    def from_json(f: dict[str, Any]) -> Failure:
        return Failure(str(f["worker"]), f.get("tensor"), str(f["cause"]), FailureKind.parse(f.get("kind")))


@dataclass(frozen=True)
class SyncResult:
    """A sync as the controller reports it. ``state``: pending / running / committed / failed;
    ``stages``: seconds per stage (prepare, write, land, verify, total) that are known."""

    id: int
    version: int
    state: str
    bytes: int
    seconds: float | None
    stages: dict[str, float] = field(default_factory=dict)
    verified: bool | None = None
    failure: Failure | None = None
    created: bool = False

    @staticmethod
    def from_json(body: dict[str, Any]) -> SyncResult:
        stages = {
            k.removesuffix("_ms"): float(v) / 1e3
            for k, v in (body.get("stages") or {}).items()
            if v is not None
        }
        f = body.get("failure")
        return SyncResult(
            id=int(body.get("sync_id", body.get("id", 0))),
            version=int(body["version"]),
            state=str(body["state"]),
            bytes=int(body.get("bytes", 0)),
            seconds=stages.get("total"),
            stages=stages,
            verified=body.get("verified"),
            failure=Failure.from_json(f) if f else None,
            created=bool(body.get("created", False)),
        )


class Client:
    """A client of the controller's HTTP API.

    Args:
        url: the API's base URL, e.g. ``http://127.0.0.1:8080``.
        token: the API token (default ``$WEIGHTSYNC_API_TOKEN``); needed to trigger syncs.
        timeout: seconds a request may take (a waiting sync counts: default one hour).
        ca: for an ``https://`` URL, the CA certificate (PEM path) the controller's certificate
            must chain to (default ``$WEIGHTSYNC_TLS_CA``, else the system's CAs).
        crl: for an ``https://`` URL, a PEM file of revocation lists of that CA (default
            ``$WEIGHTSYNC_TLS_CRL``): a controller certificate it lists is refused.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 3600.0,
        ca: str | os.PathLike[str] | None = None,
        crl: str | os.PathLike[str] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        if "://" not in self.url:
            self.url = "http://" + self.url
        self.token = token if token is not None else os.environ.get("WEIGHTSYNC_API_TOKEN")
        self.timeout = timeout
        self._tls: ssl.SSLContext | None = None
        if self.url.startswith("https://"):
            cafile = os.fspath(ca) if ca is not None else os.environ.get("WEIGHTSYNC_TLS_CA") or None
            self._tls = ssl.create_default_context(cafile=cafile)
            crlfile = os.fspath(crl) if crl is not None else os.environ.get("WEIGHTSYNC_TLS_CRL") or None
            if crlfile is not None:
                # The controller's certificate is refused if the CRL lists it.
                self._tls.load_verify_locations(cafile=crlfile)
                self._tls.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        elif crl is not None:
            raise ValueError(f"crl={os.fspath(crl)!r} given for {self.url}, which is not https://")

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self._tls) as resp:
                return dict(json.loads(resp.read() or b"{}"))
        except urllib.error.HTTPError as e:
            try:
                err = json.loads(e.read()).get("error", {})
            except (ValueError, AttributeError):
                err = {}
            raise ClientError(
                f"{method} {self.url}{path}: HTTP {e.code}: {err.get('message', e.reason)}",
                status=e.code,
                code=str(err.get("code", "")),
            ) from None
        except (urllib.error.URLError, OSError) as e:
            raise ClientError(f"{method} {self.url}{path}: {e}") from None

    def sync(self, version: int, wait: bool = True, *, ready_timeout: float = 0.0) -> SyncResult:
        """Triggers the sync of ``version`` (idempotent: a sync of it already running or done
        is answered). With ``wait``, returns when it ended and raises
        :class:`~weightsync.SyncFailedError` naming the failing worker if it failed.

        ``ready_timeout``: seconds to keep retrying while the controller answers ``not_ready``
        (workers still registering, a plan being computed or not yet accepted by every worker):
        what a training loop wants for its first sync, which may come before the world it
        started alongside is ready. ``0`` (the default) refuses at once.

        Raises:
            ClientError: the API refused (``code``: ``sync_running``, ``stale_version``,
                ``not_ready``, ``unauthorized``, ...); ``not_ready`` only once ``ready_timeout``
                has passed, with the controller's last reason.
        """
        if not ready_timeout >= 0:
            raise ValueError(f"ready_timeout={ready_timeout!r}: expected a non-negative number of seconds")
        deadline = time.monotonic() + ready_timeout
        pause = 0.05
        while True:
            try:
                return self._sync_once(version, wait)
            except ClientError as e:
                left = deadline - time.monotonic()
                if e.code != "not_ready" or left <= 0:
                    raise
                time.sleep(min(pause, left))
                pause = min(pause * 2, 1.0)

    def _sync_once(self, version: int, wait: bool) -> SyncResult:
        path = "/v1/syncs?wait=true" if wait else "/v1/syncs"
        result = SyncResult.from_json(self._request("POST", path, {"version": version}))
        if wait and result.state == "failed":
            f = result.failure
            raise SyncFailedError(
                f"sync of version {version} failed"
                + (f" at {f.worker}" + (f" (tensor {f.tensor})" if f.tensor else "") + f": {f.cause}" if f else ""),
                worker=f.worker if f else None,
                tensor=f.tensor if f else None,
                version=version,
                kind=f.kind if f else FailureKind.OTHER,
                cause=f.cause if f else None,
            )
        return result

    def get(self, sync_id: int) -> SyncResult:
        """One sync by id."""
        return SyncResult.from_json(self._request("GET", f"/v1/syncs/{sync_id}"))

    def of_version(self, version: int) -> SyncResult | None:
        """The newest sync of ``version`` in the controller's history, or None."""
        rows = [r for r in self._request("GET", "/v1/syncs").get("syncs", []) if int(r["version"]) == version]
        if not rows:
            return None
        return self.get(max(int(r["id"]) for r in rows))

    def version(self, version: int, *, until: str = "ended", wait_s: float = 0.0) -> dict[str, Any]:
        """Where ``version`` stands (``GET /v1/versions/{version}``): ``started`` (a sync of a
        version >= it exists), ``ended`` (one committed or failed), ``latest_committed``,
        ``sync`` (the newest attempt of the smallest such version) and ``reached``, after
        waiting up to ``wait_s`` seconds (the controller caps one wait at 60) for ``until``
        (``"started"`` or ``"ended"``). What an inference engine's driver waits on instead of
        polling the engine (``weightsync.vllm_server.VllmServer(controller=...)``)."""
        if until not in ("started", "ended"):
            raise ValueError(f"until={until!r}: expected 'started' or 'ended'")
        if not wait_s >= 0:
            raise ValueError(f"wait_s={wait_s!r}: expected a non-negative number of seconds")
        return self._request("GET", f"/v1/versions/{int(version)}?until={until}&wait_s={float(wait_s)}")

    def healthz(self) -> dict[str, Any]:
        """The controller's health (``/healthz``)."""
        return self._request("GET", "/healthz")
