"""The landing gate shared by the engine integrations (weightsync._landing): when an engine may
read what weightsync wrote. Threads play weightsync's hook thread and the engine's thread; no
engine, controller or torch is involved (the real engines are exercised by test_vllm.py)."""

from __future__ import annotations

import threading
import time

import pytest

from weightsync._landing import ArenaNotCommitted, EngineNotHeld, LandingGate


def test_staged_arena_is_readable_only_when_a_whole_version_committed() -> None:
    gate = LandingGate(direct=False)
    with pytest.raises(ArenaNotCommitted):
        with gate.committed(1):
            pass
    gate.before_landing(1)
    with pytest.raises(ArenaNotCommitted, match="landing now"):
        with gate.committed(1):
            pass
    gate.after_commit(1)
    with gate.committed(1) as v:
        assert v == 1
    assert gate.land_s[1] >= 0
    # A newer committed version satisfies an older request; an older one does not.
    gate.before_landing(2)
    gate.after_commit(2)
    with gate.committed(1) as v:
        assert v == 2
    with pytest.raises(ArenaNotCommitted):
        with gate.committed(3):
            pass


def test_staged_failed_sync_leaves_the_arena_dirty_until_a_later_commit() -> None:
    gate = LandingGate(direct=False)
    gate.before_landing(1)
    gate.after_commit(1)
    gate.before_landing(2)  # version 2 fails part-way: no after_commit
    assert gate.arena_version is None and gate.landing == 2
    with pytest.raises(ArenaNotCommitted):
        with gate.committed(1):  # even the old version is no longer whole in the arena
            pass
    gate.before_landing(3)
    gate.after_commit(3)
    with gate.committed(2) as v:
        assert v == 3


def test_staged_next_landing_waits_for_the_load_to_end() -> None:
    gate = LandingGate(direct=False)
    gate.before_landing(1)
    gate.after_commit(1)
    started = threading.Event()
    landed_at: list[float] = []

    def land() -> None:
        started.set()
        gate.before_landing(2)
        landed_at.append(time.monotonic())

    with gate.committed(1):
        t = threading.Thread(target=land)
        t.start()
        started.wait()
        time.sleep(0.2)
        assert not landed_at, "version 2 started landing while the engine read version 1"
        released = time.monotonic()
    t.join(5)
    assert landed_at and landed_at[0] >= released


class Failed(Exception):
    """What the engine's ``wait_for_version`` raises for a failed sync, in these tests."""


def test_staged_load_asked_for_an_older_version_waits_for_the_one_landing() -> None:
    # Version 1 was whole when the engine asked; version 2 started landing before the load.
    gate = LandingGate(direct=False)
    gate.before_landing(1)
    gate.after_commit(1)
    gate.before_landing(2)
    waited: list[int] = []

    def wait_for_version(v: int, timeout: float) -> None:
        waited.append(v)
        time.sleep(0.05)
        gate.after_commit(v)  # the sync of v commits (the hook runs on weightsync's thread)

    with gate.committed(1, wait_landing=wait_for_version, deadline=time.monotonic() + 5) as v:
        assert v == 2, "the engine loads the version that landed, and says so"
    assert waited == [2]
    # Without a way to wait it is refused, naming the version landing.
    gate.before_landing(3)
    with pytest.raises(ArenaNotCommitted, match="version 3 landing now"):
        with gate.committed(1):
            pass


def test_staged_load_waiting_on_a_landing_that_fails_raises_its_failure() -> None:
    gate = LandingGate(direct=False)
    gate.before_landing(1)
    gate.after_commit(1)
    gate.before_landing(2)

    def wait_for_version(v: int, timeout: float) -> None:
        raise Failed(f"sync of version {v} failed")

    with pytest.raises(Failed, match="version 2 failed"):
        with gate.committed(1, wait_landing=wait_for_version, deadline=time.monotonic() + 5):
            pass
    # A landing older than what is asked for is not waited for.
    with pytest.raises(ArenaNotCommitted):
        with gate.committed(3, wait_landing=wait_for_version, deadline=time.monotonic() + 5):
            pass


def test_direct_landing_waits_until_the_engine_is_held() -> None:
    gate = LandingGate(direct=True, landing_wait_s=5)
    landed = threading.Event()

    def land() -> None:
        gate.before_landing(1)
        landed.set()

    t = threading.Thread(target=land)
    t.start()
    time.sleep(0.2)
    assert not landed.is_set(), "direct writes began while the engine was serving"
    with gate.held():
        assert landed.wait(5)
        gate.after_commit(1)
    t.join(5)
    assert gate.arena_version == 1


def test_direct_landing_fails_when_the_engine_is_never_held() -> None:
    gate = LandingGate(direct=True, landing_wait_s=0.1)
    with pytest.raises(EngineNotHeld, match="version 7"):
        gate.before_landing(7)
    assert gate.landing is None  # nothing was let in
