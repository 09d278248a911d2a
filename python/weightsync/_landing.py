"""When an inference engine may read what weightsync wrote: the state shared by the engine
integrations (:mod:`weightsync.vllm`, :mod:`weightsync.sglang`).

The ``before_landing`` / ``after_commit`` hooks of :class:`weightsync.Engine` run on
weightsync's thread; the engine loads or resumes on its own thread. :class:`LandingGate` sits
between the two so that an engine never reads a half-written version:

- **staged**: the destination is an arena the engine does not serve from. It is *dirty* from
  the first write of a version (``before_landing``) until that version commits
  (``after_commit``: every write counted and verified). :meth:`committed` hands the engine the
  arena only when it holds a whole version >= the one asked for, and keeps the next version's
  writes out while the engine loads from it (``before_landing`` waits for the load to end).
- **direct**: the destination is the memory the engine serves from, so no byte may land while
  the engine runs: ``before_landing`` waits until the engine is held in :meth:`held` (its
  forward passes stopped), up to ``landing_wait_s``, else the sync fails before any write.

Pure Python, no torch: unit-tested without an engine (tests/test_landing.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["LandingGate", "ArenaNotCommitted", "EngineNotHeld"]


class ArenaNotCommitted(RuntimeError):
    """The arena holds no whole version >= the one asked for (a newer one is landing, or the
    last sync failed part-way)."""


class EngineNotHeld(RuntimeError):
    """Direct landing: the engine was not held (paused) within ``landing_wait_s``."""


class LandingGate:
    """See the module doc. ``direct``: landing waits for :meth:`held`."""

    def __init__(self, *, direct: bool, landing_wait_s: float = 300.0) -> None:
        self.direct = direct
        self.landing_wait_s = landing_wait_s
        self._cv = threading.Condition()
        self._arena_version: int | None = None
        self._landing: int | None = None
        self._held = 0
        self._waiting: int | None = None
        self._reading = False
        self._land_t0: dict[int, float] = {}
        self.land_s: dict[int, float] = {}

    @property
    def arena_version(self) -> int | None:
        """The whole, verified version the destination holds (None while one is landing)."""
        with self._cv:
            return self._arena_version

    @property
    def landing(self) -> int | None:
        """The version being written now, if any."""
        with self._cv:
            return self._landing

    @property
    def waiting(self) -> int | None:
        """Direct: the version whose landing waits for the engine to be held, if any."""
        with self._cv:
            return self._waiting

    # ---- hooks (weightsync's thread) ------------------------------------------------------

    def before_landing(self, version: int) -> None:
        with self._cv:
            if self.direct:
                self._waiting = version
                ok = self._cv.wait_for(lambda: self._held > 0, self.landing_wait_s)
                self._waiting = None
                if not ok:
                    raise EngineNotHeld(
                        f"direct landing of version {version}: the engine was not paused within "
                        f"{self.landing_wait_s} s (its update call must be waiting for this version)")
            else:
                self._cv.wait_for(lambda: not self._reading)
            self._arena_version = None  # dirty from the first write on
            self._landing = version
            self._land_t0[version] = time.perf_counter()

    def after_commit(self, version: int) -> None:
        with self._cv:
            self._arena_version = version
            self._landing = None
            t0 = self._land_t0.pop(version, None)
            if t0 is not None:
                self.land_s[version] = time.perf_counter() - t0
            self._cv.notify_all()

    # ---- the engine's thread --------------------------------------------------------------

    @contextmanager
    def committed(self, version: int, *, wait_landing: Callable[[int, float], object] | None = None,
                  deadline: float = 0.0) -> Iterator[int]:
        """Staged: yields the arena's version (>= ``version``) and keeps writes out meanwhile.

        With ``wait_landing`` (the engine's ``wait_for_version(v, timeout)``, which raises when
        the sync of ``v`` fails), a version >= ``version`` landing now is waited for until
        ``deadline`` (``time.monotonic()``) and then yielded: the trainers do not wait for an
        engine that is behind, so the next version may start landing between the moment the
        arena held ``version`` and the load.

        Raises:
            ArenaNotCommitted: the arena holds no whole version >= ``version`` (and none such is
                landing, or it did not commit by ``deadline``).
        """
        while True:
            with self._cv:
                have, landing = self._arena_version, self._landing
                if have is not None and have >= version:
                    self._reading = True
                    break
                left = deadline - time.monotonic()
                if wait_landing is None or landing is None or landing < version or left <= 0:
                    raise ArenaNotCommitted(
                        f"the arena holds no whole version >= {version} (holds "
                        f"{f'version {landing} landing now' if have is None else have})")
            wait_landing(landing, left)
            with self._cv:  # the commit hook may run a moment after the engine heard of it
                self._cv.wait_for(lambda: self._landing != landing, max(0.0, min(1.0, deadline - time.monotonic())))
        try:
            yield have
        finally:
            with self._cv:
                self._reading = False
                self._cv.notify_all()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Direct: the engine's forward passes are stopped inside this block; landing may go on."""
        with self._cv:
            self._held += 1
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                self._held -= 1
