"""weightsync for SGLang: staged syncs driven through SGLang's documented weight-update
interfaces.

    import sglang as sgl
    engine = sgl.Engine(model_path=...)                      # or an HTTP adapter, see below
    sync = weightsync.sglang.StagedSync(engine, controller="10.0.0.1:7070", rank=0)
    ...
    timings = sync.update(step)          # after the trainers pushed `step`

How it works: the writes of a version land in an arena (the job's ``format=hf`` layout, the
Hugging Face names SGLang's ``load_weights`` takes), registered once with
:class:`weightsync.Engine` in this process, while SGLang keeps serving. :meth:`StagedSync.update`
waits until a whole, verified version >= ``version`` is in the arena, then, holding the arena
(no next-version write lands meanwhile):

1. ``pause_generation(mode=pause_mode)`` (``retract`` by default: running requests go back to
   the queue and recompute their KV later; ``abort`` returns them; ``in_place`` is refused: it
   keeps the running requests' KV of the old weights, and SGLang then cannot flush the cache);
2. ``begin_weight_update()`` when the engine has it (SGLang >= PR #28001: restores in-place
   packed weights to a loadable state);
3. ``update_weights_from_tensor(named_tensors=arena)``: SGLang's own loader (so packing and
   quantisation come out as the engine needs them);
4. ``end_weight_update()`` when present (quant finalize / post-load);
5. ``flush_cache()`` (no stale KV of the old weights), ``update_weight_version(str(version))``
   when present;
6. ``continue_generation()``, also when a step above failed.

A failed sync never reaches SGLang: the arena is dirty from the first write of a version and
``update`` raises; SGLang keeps serving its last loaded version.

Only the staged mode: writing straight into SGLang's parameters needs code inside its
scheduler process (where the model's memory is), which this driver-side hook is not.
``engine`` is anything with those methods: ``sglang.Engine`` itself, or a small HTTP adapter
posting to ``/pause_generation``, ``/begin_weight_update``, ``/update_weights_from_tensor``,
``/end_weight_update``, ``/flush_cache``, ``/continue_generation``.

What was run: SGLang has no CPU build on the package registry that shares an environment with
vLLM here, so this hook ran only against a recording stand-in in tests/test_sglang.py (a unit
test of the call order and the failure paths), never against a real SGLang.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ._landing import ArenaNotCommitted, LandingGate
from .engine import Engine
from .errors import SyncFailedError

__all__ = ["StagedSync", "PAUSE_MODES"]

log = logging.getLogger("weightsync.sglang")

#: SGLang's ``/pause_generation`` modes this hook accepts (``in_place`` is refused: see above).
PAUSE_MODES = ("retract", "abort")

_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f8_e4m3": "float8_e4m3fn"}


class StagedSync:
    """One SGLang engine (tp=1) fed by weightsync through a staged arena.

    Args:
        engine: the SGLang engine (``sglang.Engine`` or an HTTP adapter with the same methods).
        controller, rank, job_token, listen, worker_id: as for :class:`weightsync.Engine`.
        pause_mode: ``retract`` (default) or ``abort``.
        weightsync_engine: an already connected :class:`weightsync.Engine` to use instead of
            connecting one (its hooks are replaced).
    """

    def __init__(self, engine: Any, controller: str | None = None, rank: int = 0, *,
                 pause_mode: str = "retract", job_token: str | None = None, listen: str | None = None,
                 worker_id: str | None = None, weightsync_engine: Any = None) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"pause_mode {pause_mode!r}: expected one of {PAUSE_MODES} ('in_place' keeps the "
                "running requests' KV of the old weights and SGLang cannot flush its cache then)")
        for method in ("pause_generation", "continue_generation", "update_weights_from_tensor", "flush_cache"):
            if not callable(getattr(engine, method, None)):
                raise TypeError(f"engine {type(engine).__name__} has no {method}(): not an SGLang engine")
        self.sglang = engine
        self.pause_mode = pause_mode
        self.gate = LandingGate(direct=False)
        if weightsync_engine is None:
            if controller is None:
                raise ValueError("controller (host:port) is required")
            weightsync_engine = Engine(controller=controller, rank=rank, job_token=job_token,
                                       listen=listen, worker_id=worker_id)
        self.ws = weightsync_engine
        self.ws.set_hooks(before_landing=self.gate.before_landing, after_commit=self.gate.after_commit)
        import torch

        self.arena = {t.name: torch.empty(t.shape, dtype=getattr(torch, _DTYPES[t.dtype]))
                      for t in self.ws.layout()}
        self.ws.register(self.arena, format="hf")
        self.loaded_version: int | None = None

    def update(self, version: int, *, timeout_s: float = 600.0) -> dict[str, Any]:
        """Loads ``version`` (or a newer committed one) into SGLang; returns the timings.

        Raises:
            SyncFailedError: the sync failed (SGLang keeps its last loaded version) or SGLang
                refused the load (then the engine was resumed; its weights are SGLang's to say).
        """
        t = time.perf_counter()
        self.ws.wait_for_version(version, timeout=timeout_s)
        wait_s = time.perf_counter() - t
        e = self.sglang
        try:
            with self.gate.committed(version) as have:
                t0 = time.perf_counter()
                e.pause_generation(mode=self.pause_mode)
                t1 = time.perf_counter()
                try:
                    if callable(getattr(e, "begin_weight_update", None)):
                        e.begin_weight_update()
                    e.update_weights_from_tensor(named_tensors=list(self.arena.items()), flush_cache=False)
                    if callable(getattr(e, "end_weight_update", None)):
                        e.end_weight_update()
                    e.flush_cache()
                    if callable(getattr(e, "update_weight_version", None)):
                        e.update_weight_version(str(have))
                    t2 = time.perf_counter()
                finally:
                    e.continue_generation()
                t3 = time.perf_counter()
        except ArenaNotCommitted as err:
            raise SyncFailedError(f"{self.ws.worker_id}: {err}; SGLang keeps version {self.loaded_version}",
                                  version=version, worker=self.ws.worker_id, cause=str(err)) from None
        self.loaded_version = have
        out = {"version": have, "wait_s": wait_s, "land_s": self.gate.land_s.get(have), "pause_s": t3 - t0,
               "pause_call_s": t1 - t0, "load_s": t2 - t1, "resume_s": t3 - t2}
        log.info(json.dumps({"weightsync": "sglang update", **out}))
        return out
