"""The engine-update driver (``weightsync._update.drive``) waiting on the controller instead of
the engine's workers: with scripted workers and controller answers (what it asks, and how
often), and ``Client.version``, the long poll it uses, against a real controller."""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import Procs, start_controller

from weightsync import Client
from weightsync._update import drive
from weightsync.errors import TimeoutError


class Workers:
    """Scripted ``UpdateCalls``: each worker says ready once ``ready_after`` answers were given
    (or once ``flag["ready"]`` is set); every call is logged."""

    where = "test engine"

    def __init__(self, n: int, mode: str, ready_after: int | None = None,
                 first_loads: list[int] | None = None) -> None:
        self.n, self.mode, self.ready_after = n, mode, ready_after
        self.flag = {"ready": False}
        self.log: list[tuple[str, Any]] = []
        # What each worker loads on the first update (a newer version may have committed into
        # some arenas meanwhile); later updates load the version asked for.
        self.first_loads = first_loads
        self.loaded: list[int | None] = [None] * n

    def ready(self, version: int, wait_s: float) -> list[dict[str, Any]]:
        self.log.append(("ready", wait_s))
        asked = sum(1 for k, _ in self.log if k == "ready")
        ok = self.flag["ready"] or (self.ready_after is not None and asked > self.ready_after)
        return [{"ready": ok, "state": "idle", "cause": None, "mode": self.mode}] * self.n

    def start(self) -> None:
        self.log.append(("start", None))

    def update(self, version: int, timeout_s: float) -> None:
        self.log.append(("update", version))
        first = self.first_loads if sum(1 for k, _ in self.log if k == "update") == 1 else None
        self.loaded = [max(first[i] if first else version, v or 0) for i, v in enumerate(self.loaded)]

    def finish(self, version: int) -> None:
        self.log.append(("finish", version))

    def reset_prefix_cache(self, deadline: float) -> None:
        self.log.append(("reset", None))

    def resumed(self) -> None:
        self.log.append(("resumed", None))

    def status(self) -> list[dict[str, Any]]:
        sync = {"pause_s": 0.01, "land_s": 0.02, "load_s": 0.01}
        return [{"syncs": [sync], "loaded_version": v} for v in self.loaded]

    def weight_version(self) -> str | None:
        return "0"

    def ready_calls(self) -> list[float]:
        return [w for k, w in self.log if k == "ready"]


class Controller:
    """Scripted ``VersionSource``: says ``reached`` at the ``reach_at``-th long poll and then
    makes the workers ready (the news reaching them); logs what it was asked."""

    def __init__(self, workers: Workers, reach_at: int | None) -> None:
        self.workers, self.reach_at = workers, reach_at
        self.asked: list[tuple[int, str, float]] = []

    def version(self, version: int, *, until: str = "ended", wait_s: float = 0.0) -> dict[str, Any]:
        self.asked.append((version, until, wait_s))
        reached = self.reach_at is not None and len(self.asked) >= self.reach_at
        if reached:
            self.workers.flag["ready"] = True
        else:
            time.sleep(min(wait_s, 0.05))
        return {"version": version, "reached": reached, "started": reached, "ended": reached,
                "latest_committed": 3, "sync": {"version": version, "state": "running",
                                                "waiting_on": ["rollout-0"]}}


@pytest.mark.parametrize("workers,mode,until", [(1, "staged", "ended"), (2, "staged", "ended"),
                                                (2, "direct", "started")])
def test_the_workers_are_asked_once_before_and_once_after_the_controller(workers: int, mode: str,
                                                                           until: str) -> None:
    w = Workers(workers, mode)
    c = Controller(w, reach_at=3)
    out = drive(w, 4, timeout_s=60, reset_prefix_cache=True, poll_s=0.01, worker_wait_s=0.5, controller=c)
    # Once at once, once after the controller's answer, waiting inside the workers for its news.
    assert w.ready_calls() == [0.0, 0.5], w.log
    assert out["ready_polls"] == 2
    assert [a[1] for a in c.asked] == [until] * 3, c.asked
    assert all(0 < a[2] <= 30 for a in c.asked), c.asked
    assert [k for k, _ in w.log[2:]] == ["start", "update", "finish", "reset", "resumed"], w.log


def test_workers_that_loaded_different_versions_are_brought_to_one_and_it_is_reported() -> None:
    # Asked for 4, tensor-parallel worker 1 found 5 committed in its arena already: the engine
    # would serve a mix. Worker 0 is updated again to 5, and the engine reports 5, not 4.
    w = Workers(2, "staged", ready_after=0, first_loads=[4, 5])
    out = drive(w, 4, timeout_s=60, reset_prefix_cache=False, poll_s=0.01)
    assert [e for e in w.log if e[0] in ("update", "finish")] == [("update", 4), ("update", 5), ("finish", 5)]
    assert out["loaded_version"] == 5 and out["updates"] == 2 and w.loaded == [5, 5]


def test_an_engine_that_loaded_a_newer_version_reports_that_one() -> None:
    w = Workers(1, "staged", ready_after=0, first_loads=[6])
    out = drive(w, 4, timeout_s=60, reset_prefix_cache=False, poll_s=0.01)
    assert ("finish", 6) in w.log and ("finish", 4) not in w.log and out["loaded_version"] == 6


def test_ready_at_once_asks_the_controller_nothing() -> None:
    w = Workers(1, "staged", ready_after=0)
    c = Controller(w, reach_at=1)
    out = drive(w, 4, timeout_s=60, reset_prefix_cache=False, poll_s=0.01, controller=c)
    assert c.asked == [] and out["ready_polls"] == 1


def test_a_version_that_never_comes_times_out_with_the_controllers_view() -> None:
    w = Workers(1, "staged")
    c = Controller(w, reach_at=None)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        drive(w, 9, timeout_s=0.3, reset_prefix_cache=True, poll_s=0.01, controller=c)
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "no sync of a version >= 9 has ended" in msg and "'running'" in msg and "rollout-0" in msg, msg
    assert w.ready_calls() == [0.0], "the workers were asked only once"
    assert not any(k == "start" for k, _ in w.log)


def test_without_the_controller_the_workers_are_polled() -> None:
    w = Workers(1, "staged", ready_after=4)
    out = drive(w, 4, timeout_s=60, reset_prefix_cache=False, poll_s=0.001)
    assert out["ready_polls"] == 5 and w.ready_calls() == [0.0] * 5


def test_client_version_long_polls_a_real_controller(procs: Procs) -> None:
    c = start_controller(procs, "qwen3-0.6b", "fsdp=2", "tp=1")
    client = Client(c.http)
    now = client.version(1)
    assert now["version"] == 1 and now["started"] is False and now["reached"] is False, now
    assert now["sync"] is None and now["latest_committed"] is None, now
    t0 = time.monotonic()
    waited = client.version(1, until="started", wait_s=0.3)
    assert time.monotonic() - t0 >= 0.3 and waited["reached"] is False, waited
    with pytest.raises(ValueError, match="until='soon'"):
        client.version(1, until="soon")
    with pytest.raises(ValueError, match="wait_s"):
        client.version(1, wait_s=-1)
