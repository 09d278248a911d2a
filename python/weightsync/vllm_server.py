"""``weightsync.vllm_server.VllmServer``: the ``weightsync`` backend of a vLLM *server*
(``vllm serve`` / ``python -m vllm.entrypoints.openai.api_server``) driven over its HTTP routes,
from the training loop's process or an orchestrator, which need not have vLLM installed.

The server runs with ``VLLM_SERVER_DEV_MODE=1`` (vLLM exposes the weight-transfer routes and
``/collective_rpc`` only then), ``--weight-transfer-config '{"backend": "weightsync"}'`` and
``--worker-extension-cls weightsync.vllm.WorkerExtension`` (which loads the backend inside the
spawned EngineCore)::

    srv = VllmServer("http://10.0.0.2:8000", controller="http://10.0.0.1:8080")
    srv.init(controller="10.0.0.1:7070", mode="staged")   # once: registers the arena
    ...                                                    # trainers push step N
    timings = srv.update(N)                                # the same four phases as offline

:meth:`VllmServer.update` does what :func:`weightsync.vllm.update` does for an offline ``LLM``,
through the four routes (``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, then ``/reset_prefix_cache``): it first waits until the version is
whole in the workers' arenas (staged), so the engine keeps serving meanwhile and is held only
for the load. Given the controller's HTTP API (``VllmServer(url, controller=...)``), that wait is
a long poll of the controller and the workers are asked (``weightsync_ready`` through
``/collective_rpc``) once before and once after it; without it they are polled, and a server
with one worker process then keeps that process spinning on its message queue between polls.

Plain ``urllib`` (as :class:`weightsync.Client`): a few small JSON calls.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from ._update import drive
from .client import Client
from .errors import ClientError, SyncFailedError, TimeoutError

__all__ = ["VllmServer"]


class VllmServer:
    """One vLLM server's ``weightsync`` backend. ``url``: the server's base URL;
    ``controller``: the controller's HTTP API (its URL, or a :class:`weightsync.Client`), which
    :meth:`update` then long-polls while the trainers write instead of polling the server's
    workers (recommended: see :func:`weightsync._update.drive`); ``request_timeout_s``: how
    long one HTTP call may take (``update_weights`` waits for the load, so keep it above a
    load's time)."""

    def __init__(self, url: str, *, controller: Client | str | None = None,
                 request_timeout_s: float = 600.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url {url!r}: expected http://host:port")
        self.url = url.rstrip("/")
        self.controller = Client(controller) if isinstance(controller, str) else controller
        self.request_timeout_s = request_timeout_s

    # ---- HTTP -------------------------------------------------------------------------------

    def _call(self, method: str, route: str, body: dict[str, Any] | None = None,
              timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + route, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.request_timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise ClientError(f"vLLM {method} {route}: HTTP {e.code}: {detail}", status=e.code) from None
        except (urllib.error.URLError, OSError) as e:
            raise ClientError(f"vLLM {method} {route} at {self.url}: {e}") from None
        return json.loads(raw) if raw else None

    def _rpc(self, method: str, *args: str) -> list[Any]:
        out = self._call("POST", "/collective_rpc", {"method": method, "args": list(args)})
        if not isinstance(out, dict) or "results" not in out:
            raise ClientError(f"vLLM /collective_rpc {method}: unexpected answer {out!r:.200}")
        return list(out["results"])

    # ---- the backend ------------------------------------------------------------------------

    def init(self, controller: str, *, mode: str = "staged", rank: int | None = None,
             job_token: str | None = None, **init_info: Any) -> None:
        """``/init_weight_transfer_engine``: each worker of the server joins the job at
        ``controller`` (see :class:`weightsync.vllm.WeightsyncInitInfo` for the fields)."""
        info: dict[str, Any] = {"controller": controller, "mode": mode, **init_info}
        if rank is not None:
            info["rank"] = rank
        if job_token is not None:
            info["job_token"] = job_token
        self._call("POST", "/init_weight_transfer_engine", {"init_info": info})

    def ready(self, version: int, wait_s: float = 0.0) -> list[dict[str, Any]]:
        """Each worker's ``weightsync_ready(version, wait_s)`` (see
        :class:`weightsync.vllm.WorkerExtension`): with ``wait_s`` > 0 each worker waits up to
        that long for the answer to become yes."""
        return self._rpc("weightsync_ready", str(int(version)), str(float(wait_s)))

    def status(self) -> list[dict[str, Any]]:
        """Each worker's backend status (mode, loaded version, engine state, per-sync timings)."""
        return self._rpc("weightsync_status")

    def digests(self) -> list[dict[str, dict[str, str]]]:
        """Each worker's SHA-256 of its parameters and arena tensors."""
        return self._rpc("weightsync_digests")

    def weight_version(self) -> str | None:
        out = self._call("GET", "/weight_info")
        return None if out is None else out.get("weight_version")

    def update(self, version: int, *, timeout_s: float = 600.0, reset_prefix_cache: bool = True,
               poll_s: float = 0.01, worker_wait_s: float = 0.5) -> dict[str, Any]:
        """Brings the server to ``version`` (or a newer committed one); returns the timings
        (driver side plus each worker's), as :func:`weightsync.vllm.update`.

        Raises:
            TimeoutError: the version did not reach every worker in ``timeout_s`` (the server
                keeps serving its last version).
            SyncFailedError: the sync failed (staged: nothing was loaded, the server keeps
                serving its last version).
        """
        return drive(_ServerCalls(self), version, timeout_s=timeout_s, reset_prefix_cache=reset_prefix_cache,
                     poll_s=poll_s, worker_wait_s=worker_wait_s, controller=self.controller)

    def shutdown(self) -> None:
        """``/shutdown_weight_transfer_engine``: each worker leaves the job."""
        self._call("POST", "/shutdown_weight_transfer_engine", {})


class _ServerCalls:
    """:class:`weightsync._update.UpdateCalls` over a server's HTTP routes."""

    def __init__(self, srv: VllmServer) -> None:
        self.srv = srv
        self.where = srv.url

    def ready(self, version: int, wait_s: float) -> list[dict[str, Any]]:
        return self.srv.ready(version, wait_s)

    def start(self) -> None:
        self.srv._call("POST", "/start_weight_update", {})

    def update(self, version: int, timeout_s: float) -> None:
        try:
            self.srv._call("POST", "/update_weights", {"update_info": {"version": version, "timeout_s": timeout_s}})
        except ClientError as e:
            # vLLM ended the session; the workers' status says why.
            st = self.srv.status()
            causes = [f"{s.get('worker')}: {s.get('state')} ({s.get('cause')})" for s in st]
            raise SyncFailedError(
                f"{self.where}: update to version {version} failed ({e}); workers: {causes}; it keeps "
                f"serving {self.srv.weight_version()!r}", version=version,
                cause="; ".join(str(s.get("cause")) for s in st)) from None

    def finish(self, version: int) -> None:
        self.srv._call("POST", "/finish_weight_update", {"weight_version": str(version)})

    def reset_prefix_cache(self, deadline: float) -> None:
        # Retried: the reset fails while a running request holds blocks.
        while not self.srv._call("POST", "/reset_prefix_cache").get("success", False):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.where}: the prefix cache could not be reset (requests kept "
                                   "holding blocks)")
            time.sleep(0.01)

    def resumed(self) -> None:
        self.srv._rpc("weightsync_resumed")  # the resume span, to the controller's timeline

    def status(self) -> list[dict[str, Any]]:
        return self.srv.status()

    def weight_version(self) -> str | None:
        return self.srv.weight_version()
