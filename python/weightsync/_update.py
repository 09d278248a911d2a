"""The driver's side of one vLLM weight update, shared by the offline ``LLM``
(:func:`weightsync.vllm.update`) and the HTTP server (:meth:`weightsync.vllm_server.VllmServer.update`):
the same four phases over two transports.

1. wait until every worker's ``weightsync_ready(version)`` says yes: the version is whole in
   its arena (staged) or its landing waits for the engine (direct), so vLLM serves while the
   trainers write. Given the controller (its HTTP API), the wait is a long poll there
   (``GET /v1/versions/{v}``) and the workers are asked once before and once after it: each
   question to a worker is a message through the engine, which holds its loop (a waiting
   poll) or leaves the worker process spinning on its message queue (vLLM's workers
   busy-wait a second after every message). Without it, the workers are polled;
2. ``start_weight_update`` -> ``update_weights`` (the worker's pause: the load, or the landing;
   again for workers behind, until every worker holds the same version:
   :func:`load_one_version`) -> ``finish_weight_update(weight_version)`` with the version the
   engine now holds (``version`` or a newer one that committed meanwhile);
3. reset the prefix cache (stale KV of the old weights would be served otherwise);
4. ``weightsync_resumed`` (the resume span goes to the controller's timeline) and the timings.

No vLLM import here: the server's driver need not have vLLM installed.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Protocol

from .errors import TimeoutError

log = logging.getLogger("weightsync.vllm")

#: Longest pause between two polls of the workers (they start ``poll_s`` apart and back off).
MAX_POLL_S = 0.2


class UpdateCalls(Protocol):
    """One transport's calls; ``where`` names the engine in errors."""

    where: str

    def ready(self, version: int, wait_s: float) -> list[dict[str, Any]]: ...
    def start(self) -> None: ...
    def update(self, version: int, timeout_s: float) -> None: ...
    def finish(self, version: int) -> None: ...
    def reset_prefix_cache(self, deadline: float) -> None: ...
    def resumed(self) -> None: ...
    def status(self) -> list[dict[str, Any]]: ...
    def weight_version(self) -> str | None: ...


class VersionSource(Protocol):
    """Where a version stands, from the controller (:meth:`weightsync.Client.version`)."""

    def version(self, version: int, *, until: str = "ended", wait_s: float = 0.0) -> dict[str, Any]: ...


#: Longest single long poll of the controller (it caps one at 60 s itself).
MAX_LONG_POLL_S = 30.0


def wait_on_controller(controller: VersionSource, version: int, first: list[dict[str, Any]],
                       deadline: float, where: str) -> dict[str, Any]:
    """Long-polls the controller until the sync of ``version`` (or a newer one) reached what
    the workers' first answers (``first``, with their ``mode``) need before they can say yes:
    ``ended`` for staged workers (the version is whole in every arena when the controller
    commits it, or it failed), ``started`` when every worker lands directly (their landing
    waits for the engine once the sync exists). Returns the controller's last answer.

    Raises:
        TimeoutError: ``deadline`` (``time.monotonic()``) passed first.
    """
    until = "started" if first and all(r.get("mode") == "direct" for r in first) else "ended"
    while True:
        left = deadline - time.monotonic()
        answer = controller.version(version, until=until, wait_s=max(0.0, min(MAX_LONG_POLL_S, left)))
        if answer.get("reached"):
            return answer
        if time.monotonic() >= deadline:
            sync = answer.get("sync") or {}
            raise TimeoutError(
                f"version {version} did not reach every worker of {where} in time: by the controller, "
                f"no sync of a version >= {version} has {until} (latest committed "
                f"{answer.get('latest_committed')!r}; sync of version {sync.get('version')!r}: "
                f"{sync.get('state')!r}, waiting on {sync.get('waiting_on')!r})",
                version=version)


def load_one_version(calls: UpdateCalls, version: int, deadline: float) -> tuple[int, int]:
    """Runs ``update_weights`` until every worker of the engine holds the same version (>=
    ``version``); returns it and how many updates that took.

    A worker loads the newest whole version its arena holds, so when the trainers commit the
    next version while the engine loads (they do not wait for engines that are behind), one
    tensor-parallel worker may load ``version`` and another the next one. The engine would then
    serve a mix: the workers behind are updated again to the newest version any of them loaded
    (it is in their arenas, or landing), until all agree. The version the engine then reports
    (``finish_weight_update``) is the one it holds, never merely the one asked for.

    Raises:
        TimeoutError: the workers did not agree by ``deadline``.
        SyncFailedError: (from ``calls.update``) a sync failed.
    """
    want, updates = version, 0
    while True:
        calls.update(want, max(1.0, deadline - time.monotonic()))
        updates += 1
        reported = [s.get("loaded_version") for s in calls.status()]
        loaded = [int(v) for v in reported if v is not None]
        if not loaded or len(loaded) < len(reported):
            raise RuntimeError(f"{calls.where}: after update_weights({want}) a worker reports no loaded "
                               f"version ({reported})")
        if len(set(loaded)) == 1:
            held = loaded[0]
            if held < version:
                raise RuntimeError(f"{calls.where}: update_weights({want}) left the workers at version "
                                   f"{held}, older than {version}")
            return held, updates
        want = max(loaded)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{calls.where}: its workers hold different versions {loaded} and did not "
                               f"agree on {want} in time", version=version)
        log.info(json.dumps({"weightsync": "workers loaded different versions", "where": calls.where,
                             "loaded": loaded, "updating_to": want}))


def drive(calls: UpdateCalls, version: int, *, timeout_s: float, reset_prefix_cache: bool,
          poll_s: float, worker_wait_s: float = 0.0,
          controller: VersionSource | None = None) -> dict[str, Any]:
    """Runs the update (see the module doc); returns the driver's timings and each worker's
    (``ready_polls``: how many times the workers were asked whether they were ready).

    With ``controller``, the workers are asked once, then the controller is long-polled
    (:func:`wait_on_controller`), then the workers are asked again, waiting inside them up to
    ``worker_wait_s`` for the news the controller already has. Without it (or if that last
    answer is still no), polls start ``poll_s`` apart and back off to :data:`MAX_POLL_S`; with
    more than one worker, each poll after the first waits inside the workers for up to
    ``worker_wait_s`` (asleep) instead of polling every ``poll_s``: vLLM's worker processes
    busy-wait on their message queue for a while after every message, so quick polls would keep
    every worker spinning a CPU for as long as the trainers take.

    Raises:
        TimeoutError: the version did not reach every worker in ``timeout_s`` (the engine keeps
            serving its last version).
        SyncFailedError: (from ``calls.update``) the sync failed.
    """
    tw = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    wait_s = 0.0
    sleep_s = poll_s
    polls = 0
    while True:
        states = calls.ready(version, wait_s)
        polls += 1
        if states and all(r["ready"] for r in states):
            break
        if controller is not None and polls == 1:
            wait_on_controller(controller, version, states, deadline, calls.where)
            # The workers hear the controller's news a moment later: wait for it inside them
            # (asleep, answered as soon as it comes), however many they are.
            wait_s = max(0.0, min(worker_wait_s, deadline - time.monotonic()))
            continue
        if len(states) > 1:
            wait_s = max(0.0, min(worker_wait_s, deadline - time.monotonic()))
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"version {version} did not reach every worker of {calls.where} in {timeout_s} s (worker "
                f"states {[(r['state'], r['cause']) for r in states]}); it keeps serving "
                f"{calls.weight_version()!r}", version=version)
        if wait_s == 0:
            time.sleep(sleep_s)
            # Back off while the trainers take long: each poll is a round trip through the
            # engine (an HTTP request and an engine-core message for a server), and on a busy
            # host a poll every few milliseconds takes CPU from the very trainers being waited for.
            sleep_s = min(2 * sleep_s, max(poll_s, MAX_POLL_S))
    t0 = time.perf_counter()
    calls.start()
    t1 = time.perf_counter()
    held, updates = load_one_version(calls, version, deadline)
    t2 = time.perf_counter()
    calls.finish(held)
    t3 = time.perf_counter()
    if reset_prefix_cache:
        calls.reset_prefix_cache(deadline)
    t4 = time.perf_counter()
    calls.resumed()
    workers = [s["syncs"][-1] for s in calls.status()]
    out = {"version": version, "loaded_version": held, "updates": updates, "ready_wait_s": t0 - tw,
           "start_s": t1 - t0, "update_s": t2 - t1,
           "finish_s": t3 - t2, "reset_prefix_cache_s": t4 - t3, "resume_s": t4 - t2, "workers": workers,
           "ready_polls": polls,
           "pause_s": max(w["pause_s"] for w in workers),
           "land_s": max((w["land_s"] or 0.0) for w in workers),
           "load_s": max(w["load_s"] for w in workers)}
    log.info(json.dumps({"weightsync": "update", "where": calls.where,
                         **{k: v for k, v in out.items() if k != "workers"}}))
    return out
