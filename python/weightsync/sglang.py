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

The arena lives in shared memory (``share_memory_()`` before it is registered): SGLang's
``update_weights_from_tensor`` pickles CPU tensors with torch's ``ForkingPickler``
(``MultiprocessingSerializer``), which would otherwise move each tensor's storage into a new
shared block on the first load, leaving weightsync writing the old, freed address. Pickled
shared storage travels as its file descriptor and keeps its address
(``tests/test_sglang.py::test_staged_arena_keeps_its_address_through_sglangs_pickling``).

``engine`` is anything with those methods: ``sglang.Engine`` itself, or a small HTTP adapter
posting to ``/pause_generation``, ``/begin_weight_update``, ``/update_weights_from_tensor``,
``/end_weight_update``, ``/flush_cache``, ``/continue_generation``.

**Direct** (:class:`DirectSync`, job ``format=fused``: SGLang's own parameter names, as vLLM's):
the writes go straight into SGLang's parameters, which live in its scheduler (TP worker)
processes. SGLang runs user code there through a *custom weight loader*: start it with
``--custom-weight-loader weightsync.sglang.land_direct`` (``custom_weight_loader=[...]`` for
``sglang.Engine``), and :class:`DirectSync` calls ``update_weights_from_tensor`` with
``load_format="weightsync.sglang.land_direct"`` and one small control tensor naming what to
do. Inside each TP worker, :func:`land_direct` ``join`` s the job once (a
:class:`weightsync.Engine` of rank ``rank + tp_rank`` registering ``model.named_parameters()``;
parameters a kernel packed or emptied are refused by name) and, per version, ``land`` s it:
holds the landing gate open (generation is paused: SGLang runs the loader between batches,
after ``pause_generation``) and waits until the version committed into the parameters.
SGLang's loader path does not catch exceptions (one would stop its scheduler), so
:func:`land_direct` never raises for a failed sync: it logs, and :class:`DirectSync` learns the
outcome from the controller's HTTP API (:meth:`weightsync.Client.of_version`). A failed sync
leaves SGLang paused (its parameters are half-written) and :meth:`DirectSync.update` raises
naming the cause; the next version that commits resumes it. After a commit:
``end_weight_update`` (post-processing), ``flush_cache``, ``update_weight_version``,
``continue_generation``.

What was run: SGLang has no CPU build on the package registry that shares an environment with
vLLM here, so neither mode ran against a real SGLang. tests/test_sglang.py drives both against a
stand-in with SGLang's method names: the staged logic against a recording stand-in, and direct
landing for real (a controller, two trainers, a torch model with SGLang's fused parameter names
whose parameters :func:`land_direct` registers and into which the versions land), with the
stand-in calling :func:`land_direct` as SGLang's model runner does.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from ._landing import ArenaNotCommitted, LandingGate
from .client import Client
from .engine import Engine
from .errors import RegistrationError, SyncFailedError, TimeoutError

__all__ = ["StagedSync", "DirectSync", "land_direct", "LOADER", "PAUSE_MODES"]

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

        # In shared memory before it is registered: SGLang's update_weights_from_tensor pickles
        # the arena with torch's ForkingPickler, which moves a CPU tensor's storage that is not
        # shared yet into a new shared-memory block and frees the old one; the registered
        # address would then be freed memory from the first load on. A storage already shared
        # is pickled by its file descriptor and stays where it is.
        self.arena = {t.name: torch.empty(t.shape, dtype=getattr(torch, _DTYPES[t.dtype]))
                      for t in self.ws.layout()}
        for t in self.arena.values():
            t.share_memory_()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.ws.register(self.arena, format="hf")
        self._arena_ptrs = {n: t.data_ptr() for n, t in self.arena.items()}
        self.loaded_version: int | None = None

    def update(self, version: int, *, timeout_s: float = 600.0) -> dict[str, Any]:
        """Loads ``version`` (or a newer committed one) into SGLang; returns the timings.

        Raises:
            SyncFailedError: the sync failed (SGLang keeps its last loaded version) or SGLang
                refused the load (then the engine was resumed; its weights are SGLang's to say).
        """
        t, deadline = time.perf_counter(), time.monotonic() + timeout_s
        self.ws.wait_for_version(version, timeout=timeout_s)
        wait_s = time.perf_counter() - t
        e = self.sglang
        try:
            # A newer version landing now (the trainers moved on) is waited for and loaded.
            with self.gate.committed(version, wait_landing=self.ws.wait_for_version, deadline=deadline) as have:
                self._check_arena_in_place()
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


    def _check_arena_in_place(self) -> None:
        """Refuses a load from an arena tensor whose storage moved since it was registered
        (the writes land at the registered address, not in what SGLang would read)."""
        for n, t in self.arena.items():
            if t.data_ptr() != self._arena_ptrs[n]:
                raise RegistrationError(
                    f"{self.ws.worker_id}: the staged arena tensor {n} moved "
                    f"({self._arena_ptrs[n]:#x} -> {t.data_ptr():#x}) after it was registered; "
                    "weightsync writes the registered address", worker=self.ws.worker_id, tensor=n)


#: The custom weight loader SGLang must allow (``--custom-weight-loader``) for :class:`DirectSync`.
LOADER = "weightsync.sglang.land_direct"
#: The name of the control tensor :class:`DirectSync` sends through ``update_weights_from_tensor``.
CONTROL = "__weightsync__"


class _DirectLanding:
    """One TP worker's part of direct landing: its engine and its landing gate."""

    def __init__(self, engine: Engine, gate: LandingGate) -> None:
        self.engine = engine
        self.gate = gate


#: The TP worker's direct landing, keyed by id(model) (one model per SGLang scheduler process).
_LANDINGS: dict[int, _DirectLanding] = {}
_LANDINGS_LOCK = threading.Lock()


def _tp_rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank  # type: ignore[import-not-found]
    except ImportError:
        return 0
    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):  # no model-parallel group: a single worker
        return 0


def land_direct(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang custom weight loader (``--custom-weight-loader weightsync.sglang.land_direct``),
    run by SGLang in each TP worker with its model. ``named_tensors`` holds one control tensor
    (:data:`CONTROL`: UTF-8 JSON) from :class:`DirectSync`:

    - ``{"op": "join", "controller", "rank", "job_token", "landing_wait_s"}``: connect a
      :class:`weightsync.Engine` of rank ``rank + tp_rank`` and register the model's parameters
      (format ``fused``). Raises :class:`weightsync.RegistrationError` for an empty parameter
      (a kernel reads a packed copy; use :class:`StagedSync`): a setup error, before any sync.
    - ``{"op": "land", "version", "timeout_s"}``: hold the landing gate open until ``version``
      (or a newer one) committed into the parameters, the sync failed, or ``timeout_s`` passed.
      Never raises for those (an exception would stop SGLang's scheduler): it logs, and the
      driver asks the controller.
    - ``{"op": "leave"}``: close the engine (before SGLang frees or moves its weights).
    """
    req = _control(named_tensors)
    op = req.get("op")
    key = id(model)
    if op == "join":
        with _LANDINGS_LOCK:
            if key in _LANDINGS:
                return
            rank = int(req["rank"]) + _tp_rank()
            gate = LandingGate(direct=True, landing_wait_s=float(req.get("landing_wait_s", 300.0)))
            engine = Engine(controller=str(req["controller"]), rank=rank, job_token=req.get("job_token"),
                            before_landing=gate.before_landing, after_commit=gate.after_commit)
            try:
                params = dict(model.named_parameters())
                for name, p in params.items():
                    if p.numel() == 0 or p.data_ptr() == 0:
                        raise RegistrationError(
                            f"{engine.worker_id}: direct landing refused: SGLang's parameter {name} is "
                            f"empty (shape {tuple(p.shape)}): its kernel reads a packed copy. Use StagedSync.",
                            worker=engine.worker_id, tensor=name)
                engine.register({n: p.data for n, p in params.items()}, format="fused")
            except BaseException:
                engine.close()
                raise
            _LANDINGS[key] = _DirectLanding(engine, gate)
            log.info(json.dumps({"weightsync": "sglang direct join", "worker": engine.worker_id,
                                 "tensors": len(params)}))
    elif op == "land":
        landing = _LANDINGS.get(key)
        if landing is None:
            log.error(json.dumps({"weightsync": "sglang direct land before join"}))
            return
        version, timeout_s = int(req["version"]), float(req.get("timeout_s", 600.0))
        t0 = time.perf_counter()
        with landing.gate.held():
            try:
                state = landing.engine.wait_for_version(version, timeout=timeout_s)
                log.info(json.dumps({"weightsync": "sglang direct landed", "worker": landing.engine.worker_id,
                                     "version": state.version, "held_s": round(time.perf_counter() - t0, 6)}))
            except (SyncFailedError, TimeoutError) as e:
                log.warning(json.dumps({"weightsync": "sglang direct landing failed; parameters may be "
                                        "half-written, SGLang stays paused", "worker": landing.engine.worker_id,
                                        "version": version, "error": str(e)}))
    elif op == "leave":
        with _LANDINGS_LOCK:
            landing = _LANDINGS.pop(key, None)
        if landing is not None:
            landing.engine.close()
    else:
        log.error(json.dumps({"weightsync": "sglang direct: unknown request", "request": req}))


def _control(named_tensors: list[tuple[str, Any]]) -> dict[str, Any]:
    for name, t in named_tensors:
        if name == CONTROL:
            body = json.loads(bytes(t.detach().to("cpu").contiguous().numpy().tobytes()).decode())
            if not isinstance(body, dict):
                raise ValueError(f"{CONTROL}: expected a JSON object, got {body!r:.100}")
            return body
    raise ValueError(f"{LOADER} called without its control tensor {CONTROL!r} "
                     f"(got {[n for n, _ in named_tensors][:5]})")


class DirectSync:
    """One SGLang engine fed by weightsync straight into its parameters (see the module doc).

    Args:
        engine: ``sglang.Engine`` (started with ``custom_weight_loader=[weightsync.sglang.LOADER]``)
            or an HTTP adapter with the same methods.
        controller: the controller's control address ``host:port`` (the TP workers connect).
        api: the controller's HTTP API (``http://host:port``) and ``api_token``: where this
            driver reads each sync's outcome.
        rank: the inference rank of this engine's TP rank 0 (``dp_rank * tp``).
        pause_mode: ``retract`` (default) or ``abort``.
    """

    def __init__(self, engine: Any, controller: str, api: str, rank: int = 0, *, api_token: str | None = None,
                 pause_mode: str = "retract", job_token: str | None = None, landing_wait_s: float = 300.0) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode {pause_mode!r}: expected one of {PAUSE_MODES}")
        for method in ("pause_generation", "continue_generation", "update_weights_from_tensor", "flush_cache"):
            if not callable(getattr(engine, method, None)):
                raise TypeError(f"engine {type(engine).__name__} has no {method}(): not an SGLang engine")
        self.sglang = engine
        self.pause_mode = pause_mode
        self.client = Client(api, api_token)
        self.loaded_version: int | None = None
        self.paused_by_failure = False
        self._request({"op": "join", "controller": controller, "rank": rank, "job_token": job_token,
                       "landing_wait_s": landing_wait_s})

    def _request(self, body: dict[str, Any]) -> None:
        import torch

        t = torch.frombuffer(bytearray(json.dumps(body).encode()), dtype=torch.uint8)
        out = self.sglang.update_weights_from_tensor(named_tensors=[(CONTROL, t)], load_format=LOADER,
                                                     flush_cache=False)
        if isinstance(out, tuple) and out and out[0] is False:
            raise SyncFailedError(f"SGLang refused {LOADER} ({body.get('op')}): {out[1] if len(out) > 1 else out}",
                                  version=body.get("version"), cause=str(out))

    def update(self, version: int, *, timeout_s: float = 600.0) -> dict[str, Any]:
        """Pauses SGLang, lets ``version`` land into its parameters, then post-processes,
        flushes the cache, sets the weight version and resumes; returns the timings.

        Raises:
            SyncFailedError: the sync failed; SGLang stays paused (its parameters are
                half-written) until a later :meth:`update` commits.
            TimeoutError: the version did not commit in ``timeout_s``; SGLang stays paused.
        """
        e = self.sglang
        t0 = time.perf_counter()
        e.pause_generation(mode=self.pause_mode)
        t1 = time.perf_counter()
        if callable(getattr(e, "begin_weight_update", None)):
            e.begin_weight_update()
        self._request({"op": "land", "version": version, "timeout_s": timeout_s})
        t2 = time.perf_counter()
        result = self.client.of_version(version)
        if result is None or result.state != "committed":
            self.paused_by_failure = True
            f = result.failure if result is not None else None
            if result is not None and result.state == "failed":
                raise SyncFailedError(
                    f"version {version} failed" + (f" at {f.worker}: {f.cause}" if f else "")
                    + f"; SGLang stays paused (parameters half-written) until a later version commits",
                    version=version, worker=f.worker if f else None, tensor=f.tensor if f else None,
                    cause=f.cause if f else None)
            raise TimeoutError(f"version {version} did not commit in {timeout_s} s (controller: "
                               f"{result.state if result else 'no sync of it'}); SGLang stays paused",
                               version=version)
        if callable(getattr(e, "end_weight_update", None)):
            e.end_weight_update()
        e.flush_cache()
        if callable(getattr(e, "update_weight_version", None)):
            e.update_weight_version(str(version))
        t3 = time.perf_counter()
        e.continue_generation()
        t4 = time.perf_counter()
        self.loaded_version, self.paused_by_failure = version, False
        out = {"version": version, "pause_s": t4 - t0, "pause_call_s": t1 - t0, "land_s": t2 - t1,
               "load_s": t3 - t2, "resume_s": t4 - t3}
        log.info(json.dumps({"weightsync": "sglang direct update", **out}))
        return out

    def leave(self) -> None:
        """Before SGLang frees or moves its weights (``release_memory_occupation``): the TP
        workers leave the job. Join again by making a new :class:`DirectSync` after
        ``resume_memory_occupation``."""
        self._request({"op": "leave"})
