"""weightsync inside vLLM: a ``WeightTransferEngine`` backend named ``"weightsync"`` and a
``worker_extension_cls`` (:class:`WorkerExtension`) for versions without that API.

Import this module in the engine process before the model loads (naming it as the
``worker_extension_cls`` module does that, also inside a spawned EngineCore)::

    llm = LLM(model=..., weight_transfer_config={"backend": "weightsync"},
              worker_extension_cls="weightsync.vllm.WorkerExtension")
    llm.init_weight_transfer_engine({"init_info": {"controller": "10.0.0.1:7070", "mode": "staged"}})
    ...
    timings = weightsync.vllm.update(llm, step)   # after the trainers pushed `step`

A vLLM *server* is driven the same way over its HTTP routes by
:class:`weightsync.vllm_server.VllmServer` (no vLLM needed in the caller).

Each vLLM worker process holds one :class:`weightsync.Engine`: its inference rank is the
worker's global rank ``dp_index * world_size + rank`` by default, or ``init_info["rank"]`` (the
inference rank of the engine's first worker) plus the worker's rank within the engine.

Why the load happens inside ``update_weights`` and not in the ``after_commit`` hook: the hook
runs on weightsync's thread, while vLLM's forward passes run on the engine-core thread; vLLM
calls ``update_weights`` (and every ``collective_rpc``) on the engine-core thread between
steps, so a load there never races a forward pass, in-process or in a spawned EngineCore. The
hook only records that the arena holds a whole, verified version.

Two landing modes (``init_info["mode"]``):

- ``staged`` (default; job ``format=hf``): the writes land in an arena of tensors with the
  Hugging Face names and shapes the model's loader takes, registered once, while vLLM keeps
  serving. ``update_weights(version)`` waits until a version >= ``version`` committed into
  the arena, then runs vLLM's own loading path from views of the arena
  (``initialize_layerwise_reload`` -> ``load_weights`` -> ``finalize_layerwise_reload``), so
  any kernel format (packed oneDNN weights, fp8 scale layouts, repacks) comes out right. The
  engine is paused only for that load. A failed sync never reaches the model: the arena is
  marked dirty from the first write, ``update_weights`` raises, vLLM keeps serving its last
  loaded version. Where CUDA is present the arena is page-locked host memory
  (``pin_memory``), so the loader's copies to the GPU are DMA from pinned pages rather than
  pageable copies staged by the driver (:func:`staged_arena`). With tensor parallelism (``tensor_parallel_size=N``, job
  ``--infer tp=N,format=hf``) each worker's arena holds only its rank's box of each tensor, and
  at load each sharded tensor reaches vLLM's loader as a whole-shaped tensor holding only that
  box, which is all the loader reads; at init each box is checked against the one vLLM's
  loader narrows to, and a mismatch is refused naming the tensor (``weightsync._vllm_shards``).
  ``format=hf`` keeps the embedding whole on every rank, as transformers does; vLLM splits it
  by vocabulary rows, so give the job ``embed=vocab`` (``--infer tp=N,format=hf,embed=vocab``)
  and each rank receives only its rows (a hint is logged at init when it would). For a
  *declared* model (an architecture the planner has no family for: the controller plans from
  what the workers declare) the arena is the checkpoint's tensors, whole, by the names of the
  safetensors files vLLM loaded (``weightsync._checkpoint``), declared to the controller;
  ``init_info["skip"]`` names checkpoint tensors no trainer holds. With tensor parallelism
  (job ``--infer tp=N,format=hf``) each worker's arena holds, of each tensor, the box vLLM's
  loader reads on it (``weightsync._vllm_shards.declared_layout``), declared as that box of
  the trainers' tensor, so the controller plans each rank's part without knowing the family.
  In direct mode a declared model's parameters are declared as what they are made of
  (``qkv_proj`` of its q, k and v boxes, ``gate_up_proj`` of its gate and up boxes, any other
  its box of the tensor of its name: ``declared_direct_sources``); the job names
  ``format=fused``.
- ``direct`` (job ``format=fused``, vLLM's own parameter names): the writes go straight into
  vLLM's parameters. Only when those are what the kernels read: a parameter emptied by
  kernel packing (``numel() == 0``, e.g. the CPU backend's oneDNN handles on AVX-512 hosts) is
  refused at init. The engine is paused from before the first write to the commit: the
  ``before_landing`` hook waits until ``update_weights`` holds the engine-core thread. With
  tensor parallelism (job ``--infer tp=N,format=fused``) each worker registers its own shards
  (``qkv_proj`` its q, k and v heads, ``o_proj`` its columns, ...) and receives exactly them;
  a parameter whose shape is not the planner's for that rank (e.g. a padded vocabulary) is
  refused at registration, naming it.

After the load: :func:`update` resets the prefix cache (stale KV of the old weights would
otherwise be served: ``finish_weight_update`` does not reset it) and sets ``weight_version``.
The pause, the load and the resume are also stages on this engine's lane of the sync on the
controller's dashboard and trace (``Engine.report_stages``).
Timings of each sync (pause, land, load, resume) come back from :func:`update` and are logged
as one JSON line on the ``weightsync.vllm`` logger.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from ._checkpoint import CheckpointTensor, checkpoint_folder, checkpoint_tensors
from ._landing import ArenaNotCommitted, LandingGate
from ._update import drive
from .client import Client
from ._vllm_shards import check_boxes, declared_direct_sources, declared_layout, loader_items
from .engine import Engine, EngineStage, Source, TensorInfo
from .errors import ClosedError, RegistrationError, SyncFailedError, TimeoutError

__all__ = ["BACKEND", "WeightsyncInitInfo", "WeightsyncUpdateInfo", "WeightsyncTransferEngine",
           "WorkerExtension", "update", "sleep", "wake_up", "torch_dtype"]

BACKEND = "weightsync"
log = logging.getLogger("weightsync.vllm")

_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
           "f8_e4m3": torch.float8_e4m3fn}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout dtype name (``bf16``, ``f16``, ``f32``, ``f8_e4m3``)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} of the job's layout has no torch dtype here") from None


def staged_arena(layout: list[TensorInfo], pin: bool | None = None) -> dict[str, torch.Tensor]:
    """The staged mode's arena: one host tensor per layout entry. Page-locked (``pin_memory``)
    where CUDA is present (``pin=None`` asks torch), so vLLM's loader copies it to the GPU by
    DMA straight from the pinned pages, not through the driver's pageable path (a staging copy
    per chunk); such copies may also run ``non_blocking``. weightsync registers host memory of
    either kind the same way."""
    if pin is None:
        pin = torch.cuda.is_available()
    return {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype), pin_memory=pin) for t in layout}


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """``controller``: the controller's control address ``host:port``; ``mode``: ``staged`` or
    ``direct``; ``rank``: the inference rank of the engine's first worker (each worker adds its
    rank within the engine; default: the worker's global rank);
    ``job_token`` / ``listen`` / ``worker_id`` as for :class:`weightsync.Engine`;
    ``landing_wait_s``: how long a direct-mode landing waits for ``update_weights`` to pause
    the engine before it fails the sync; ``skip``: for a declared model (an architecture the
    planner has no family for), checkpoint tensors this engine takes nothing of (none of the
    trainers holds them), as :meth:`weightsync.Engine.register`'s ``skip``."""

    controller: str = ""
    mode: str = "staged"
    rank: int | None = None
    job_token: str | None = None
    listen: str | None = None
    worker_id: str | None = None
    landing_wait_s: float = 300.0
    skip: list[str] = field(default_factory=list)


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """``version``: load this version (or a newer committed one); ``timeout_s``: how long to wait
    for it to commit."""

    version: int = 0
    timeout_s: float = 600.0


@dataclass
class _Sync:
    """One sync's timings on this worker, in seconds."""

    version: int
    mode: str
    land_s: float | None = None  # first byte allowed in (before_landing returned) -> commit
    wait_s: float = 0.0          # update_weights waiting for the commit
    load_s: float = 0.0          # staged: init + load_weights + finalize
    load_parts_s: dict[str, float] = field(default_factory=dict)
    pause_s: float = 0.0         # engine-core thread held by update_weights (no forward passes)
    loaded_version: int | None = None
    # The same spans on the engine's clock (Engine.now_ns), for the controller's timeline.
    pause_ns: tuple[int, int] | None = None
    load_ns: tuple[int, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()
                if not k.endswith("_ns")}


class WeightsyncTransferEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """The ``weightsync`` backend: one :class:`weightsync.Engine` per vLLM worker."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine: Engine | None = None
        self.mode = "staged"
        self.arena: dict[str, torch.Tensor] = {}
        # Staged, tp > 1: the arena tensors that hold only this rank's box (by name).
        self.sharded: dict[str, TensorInfo] = {}
        self.gate = LandingGate(direct=False)
        self.loaded_version: int | None = None
        self.syncs: list[_Sync] = []
        self._init_info: WeightsyncInitInfo | None = None
        self.epochs = 0  # registrations so far (1 + rejoins after a wake-up)

    # ---- the four phases -------------------------------------------------------------------

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        if self.engine is not None:
            raise RuntimeError(f"{self.engine.worker_id}: the weightsync engine is already initialised")
        if not init_info.controller:
            raise ValueError("init_info.controller (the controller's host:port) is required")
        if init_info.mode not in ("staged", "direct"):
            raise ValueError(f"init_info.mode {init_info.mode!r}: expected 'staged' or 'direct'")
        self.mode = init_info.mode
        self.gate = LandingGate(direct=self.mode == "direct", landing_wait_s=float(init_info.landing_wait_s))
        pc = self.parallel_config
        if init_info.rank is None:
            rank = pc.data_parallel_index * pc.world_size + pc.rank
        else:
            rank = init_info.rank + pc.rank
        engine = Engine(controller=init_info.controller, rank=rank, job_token=init_info.job_token,
                        listen=init_info.listen, worker_id=init_info.worker_id,
                        before_landing=self.gate.before_landing, after_commit=self.gate.after_commit)
        try:
            if self.mode == "staged" and engine.declared:
                # No planned layout: declare the checkpoint's tensors by the checkpoint's names,
                # each as the box vLLM's loader reads of it on this worker (whole at tp=1),
                # a sharded one as a source of one part: that box of the trainers' tensor.
                layout = declared_layout(self.model, self._checkpoint_layout(), pc.tensor_parallel_size)
                self.arena = {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype)) for t in layout}
                sources = {t.name: Source.box_of(t.name, t.global_shape or t.shape, t.offset or (), t.shape)
                           for t in layout}
                engine.register(self.arena, format="hf", skip=init_info.skip, sources=sources)
                self.sharded = {t.name: t for t in layout if t.sharded}
            elif self.mode == "staged":
                layout = engine.layout()
                sharded = check_boxes(self.model, layout, engine.worker_id, pc.tensor_parallel_size)
                _hint_whole_embedding(layout, engine.worker_id, pc.tensor_parallel_size)
                self.arena = staged_arena(layout)
                engine.register(self.arena, format="hf")
                self.sharded = {t.name: t for t in sharded}
            elif engine.declared:
                # vLLM's own parameters, each declared as what it is made of: a fused one as
                # its Hugging Face parts' boxes, any other as its box of the tensor of its name.
                params = self._direct_params(engine.worker_id)
                checkpoint = {t.name: tuple(t.shape) for t in self._checkpoint_layout()}
                try:
                    sources = declared_direct_sources(
                        self.model, {n: tuple(p.shape) for n, p in params.items()}, checkpoint)
                except LookupError as e:
                    raise RegistrationError(f"{engine.worker_id}: direct landing of a declared model "
                                            f"refused: {e}", worker=engine.worker_id,
                                            tensor=str(e).split(":")[0]) from None
                engine.register(params, format="fused", skip=init_info.skip, sources=sources)
            else:
                engine.register(self._direct_params(engine.worker_id), format="fused")
        except BaseException:
            engine.close()
            raise
        self.engine = engine
        self._init_info = init_info
        self.epochs += 1
        log.info(json.dumps({"weightsync": "init", "worker": engine.worker_id, "mode": self.mode,
                             "registration": self.epochs, "tp": pc.tensor_parallel_size,
                             "tensors": len(self.arena) if self.mode == "staged" else None,
                             "sharded": len(self.sharded) if self.mode == "staged" else None}))

    def _checkpoint_layout(self) -> list[CheckpointTensor]:
        """A declared model's arena: the tensors of the checkpoint vLLM loaded (its
        safetensors headers), floating-point ones in the dtype vLLM serves."""
        mc = self.model_config
        served = next((n for n, d in _DTYPES.items() if d == mc.dtype), None)
        if served is None:
            raise ValueError(f"vLLM serves dtype {mc.dtype}, which weightsync does not move")
        folder = checkpoint_folder(mc.model, getattr(mc, "revision", None))
        return checkpoint_tensors(folder, served)

    # ---- sleep / wake ---------------------------------------------------------------------

    def leave(self) -> None:
        """Before vLLM sleeps: leave the job and free the arena. Sleep frees or moves the
        memory weightsync registered (the weights, and the arena, which must not keep GPU
        memory the trainer wants back), so this worker's regions are withdrawn first: the
        controller sees it leave (a running sync fails naming it; no sync starts until it
        rejoins) and no write can reach memory registered before the sleep."""
        engine = self._require_engine()
        engine.close()
        self.engine = None
        self.arena = {}
        self.sharded = {}
        self.gate = LandingGate(direct=self.mode == "direct", landing_wait_s=self.gate.landing_wait_s)
        log.info(json.dumps({"weightsync": "left for sleep", "worker": engine.worker_id}))

    def rejoin(self) -> bool:
        """After vLLM woke up: register the memory as it is now (a new arena; in direct mode
        the parameters wherever the wake-up put them) under the same init info. The controller
        re-plans the job (a new table epoch) before the next sync. Returns False (and does
        nothing) when this worker had not left (a level-0 sleep keeps the weights in place)."""
        if self._init_info is None:
            raise RuntimeError("weightsync: rejoin before init_weight_transfer_engine")
        if self.engine is not None:
            return False
        self.init_transfer_engine(self._init_info)
        return True

    def start_weight_update(self) -> None:
        self._require_engine()

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        engine = self._require_engine()
        sync = _Sync(version=update_info.version, mode=self.mode)
        t_enter, n_enter = time.perf_counter(), engine.now_ns()
        try:
            if self.mode == "staged":
                t = time.perf_counter()
                engine.wait_for_version(update_info.version, timeout=update_info.timeout_s)
                sync.wait_s = time.perf_counter() - t
                self._load_arena(sync, update_info.version, time.monotonic() + update_info.timeout_s)
            else:
                # This thread is vLLM's engine-core thread: while it waits here no forward pass
                # runs, so the direct writes may land (the gate lets before_landing through).
                with self.gate.held():
                    t = time.perf_counter()
                    sync.loaded_version = self._wait_direct(engine, update_info)
                    sync.wait_s = time.perf_counter() - t
                self.loaded_version = sync.loaded_version
        finally:
            sync.pause_s = time.perf_counter() - t_enter
            sync.pause_ns = (n_enter, engine.now_ns())
            sync.land_s = self.gate.land_s.get(sync.loaded_version or -1)
            self.syncs.append(sync)
        log.info(json.dumps({"weightsync": "sync", "worker": engine.worker_id, **sync.as_dict()}))
        spans: list[tuple[EngineStage, int, int]] = [("pause", *sync.pause_ns)]
        if sync.load_ns is not None:
            spans.append(("load", *sync.load_ns))
        self._report(sync.loaded_version, spans)

    def resumed(self) -> None:
        """The engine serves again (``finish_weight_update`` and the prefix-cache reset are
        done): reports the resume span, from the end of the pause until now."""
        engine, last = self._require_engine(), self.syncs[-1] if self.syncs else None
        if last is None or last.pause_ns is None or last.loaded_version is None:
            return
        self._report(last.loaded_version, [("resume", last.pause_ns[1], engine.now_ns())])

    def _report(self, version: int | None, spans: list[tuple[EngineStage, int, int]]) -> None:
        """Sends this worker's stages of ``version`` to the controller's timeline. Never fails
        the sync: a refused report is logged."""
        if version is None or self.engine is None:
            return
        try:
            self.engine.report_stages(version, spans)
        except (ValueError, ClosedError) as e:
            log.warning(json.dumps({"weightsync": "stage report refused", "worker": self.engine.worker_id,
                                    "version": version, "error": str(e)}))

    def _wait_direct(self, engine: Engine, update_info: WeightsyncUpdateInfo) -> int:
        """Waits for ``version`` (or newer) to commit into the live parameters. A sync that
        fails part-way leaves them half-written: the engine stays held (paused) and waits for
        a later version until ``timeout_s`` runs out, then raises naming the cause."""
        deadline = time.monotonic() + update_info.timeout_s
        want, failure = update_info.version, None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncFailedError(
                    f"{engine.worker_id}: direct landing: no version >= {update_info.version} "
                    f"committed in {update_info.timeout_s} s"
                    + (f"; the parameters are half-written by a failed sync ({failure})" if failure else ""),
                    version=update_info.version, worker=engine.worker_id,
                    cause=failure or "timeout")
            try:
                state = engine.wait_for_version(want, timeout=left)
                assert state.version is not None
                return state.version
            except SyncFailedError as e:
                failure = f"{e.worker}: {e.cause}"
                log.warning(json.dumps({"weightsync": "direct sync failed, engine stays paused",
                                        "worker": engine.worker_id, "version": want, "cause": failure}))
                want = max(want, (e.version or want)) + 1
                time.sleep(0.05)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # No device synchronisation: everything here is host memory and already done.
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        self._require_engine()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # ---- staged ---------------------------------------------------------------------------

    def _load_arena(self, sync: _Sync, version: int, deadline: float) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        engine = self._require_engine()
        try:
            # Keeps the next version's writes out of the arena while vLLM reads it; a newer
            # version landing now is waited for and loaded instead.
            with self.gate.committed(version, wait_landing=engine.wait_for_version, deadline=deadline) as have:
                t0, n0 = time.perf_counter(), engine.now_ns()
                initialize_layerwise_reload(self.model)
                t1 = time.perf_counter()
                # tp > 1: sharded tensors go in whole-shaped, holding only this rank's box.
                whole_s = [0.0]
                items = loader_items(self.arena, self.sharded, whole_s) if self.sharded else iter(self.arena.items())
                self.model.load_weights(items)  # type: ignore[operator]
                t2 = time.perf_counter()
                finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]
                t3, n3 = time.perf_counter(), engine.now_ns()
        except ArenaNotCommitted as e:
            raise SyncFailedError(f"{engine.worker_id}: {e}; vLLM keeps serving version {self.loaded_version}",
                                  version=version, worker=engine.worker_id, cause=str(e)) from None
        sync.load_parts_s = {"init": t1 - t0, "load_weights": t2 - t1, "finalize": t3 - t2}
        if self.sharded:
            sync.load_parts_s["whole_shaped"] = whole_s[0]  # part of load_weights
        sync.load_s = t3 - t0
        sync.load_ns = (n0, n3)
        sync.loaded_version = have
        self.loaded_version = have

    # ---- direct ---------------------------------------------------------------------------

    def _direct_params(self, worker: str) -> dict[str, torch.Tensor]:
        params = dict(self.model.named_parameters())
        for name, p in params.items():
            if p.numel() == 0 or p.data_ptr() == 0:
                raise RegistrationError(
                    f"{worker}: direct landing refused: vLLM's parameter {name} is empty "
                    f"(shape {tuple(p.shape)}): its kernel reads a packed copy made at load time "
                    "(e.g. the CPU backend's oneDNN weights), so bytes written into the parameter "
                    "would be ignored. Use mode='staged' (loads through vLLM's own loader).",
                    worker=worker, tensor=name,
                )
        return {n: p.data for n, p in params.items()}

    def _require_engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("weightsync: call init_weight_transfer_engine first")
        return self.engine

    def status(self) -> dict[str, Any]:
        e = self.engine
        st = e.status() if e is not None else None
        return {"worker": e.worker_id if e else None, "mode": self.mode, "registrations": self.epochs,
                "tp": self.parallel_config.tensor_parallel_size, "sharded": sorted(self.sharded),
                "loaded_version": self.loaded_version, "arena_version": self.gate.arena_version,
                "engine_version": st.version if st else None, "state": st.state if st else None,
                "cause": st.cause if st else None,
                "syncs": [s.as_dict() for s in self.syncs]}


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, WeightsyncTransferEngine)


class WorkerExtension:
    """``worker_extension_cls``: methods callable by name through ``collective_rpc``.

    Importing this module registers the backend in the worker; the methods read the backend's
    state and the live parameters (for checks), and ``weightsync_reload_from_arena`` drives the
    same staged load on vLLM versions without the weight-transfer API."""

    def _ws_engine(self) -> WeightsyncTransferEngine:
        eng = getattr(self, "weight_transfer_engine", None)
        if not isinstance(eng, WeightsyncTransferEngine):
            raise RuntimeError("weight_transfer_config.backend is not 'weightsync'")
        return eng

    def weightsync_status(self) -> dict[str, Any]:
        return self._ws_engine().status()

    def weightsync_ready(self, version: int | str, wait_s: float | str = 0.0) -> dict[str, Any]:
        """May ``update_weights(version)`` start without holding the engine waiting? Yes when
        a whole version >= ``version`` is in the arena (staged) or its landing waits for the
        engine (direct), when the engine already committed one, or when the sync of a version
        >= ``version`` failed (``update_weights`` will raise at once). An older failure does not
        count: after a failed sync the engine waits for the next version while it serves
        (``version`` may come as a string: vLLM's HTTP ``/collective_rpc`` passes only strings).

        Returns at once with ``wait_s == 0``; else sleeps (in steps of 5 ms, holding this
        worker's engine-core thread) until the answer is yes or ``wait_s`` passed."""
        version = int(version)
        deadline = time.monotonic() + float(wait_s)
        eng = self._ws_engine()
        engine, gate = eng._require_engine(), eng.gate
        while True:
            have, waiting = gate.arena_version, gate.waiting
            ready = (have is not None and have >= version) or (waiting is not None and waiting >= version)
            if not ready:
                try:
                    engine.wait_for_version(version, timeout=0)
                    ready = True
                except SyncFailedError:
                    ready = True
                except TimeoutError:
                    pass
            if ready or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        st = engine.status()
        return {"ready": ready, "state": st.state, "cause": st.cause, "mode": eng.mode}

    def weightsync_digests(self) -> dict[str, dict[str, str]]:
        """SHA-256 of the bytes of every parameter vLLM holds and of every arena tensor
        (``{"params": {name: hex}, "arena": {name: hex}}``): what vLLM's HTTP
        ``/collective_rpc`` can return (JSON), for checks from another process. An empty
        (kernel-packed) parameter digests to the empty string."""
        import hashlib

        def digest(t: torch.Tensor) -> str:
            if t.numel() == 0:
                return ""
            return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()

        model = self.model_runner.model  # type: ignore[attr-defined]
        return {"params": {n: digest(p) for n, p in model.named_parameters()},
                "arena": {n: digest(t) for n, t in self._ws_engine().arena.items()}}

    def weightsync_resumed(self) -> None:
        self._ws_engine().resumed()

    def weightsync_leave(self) -> None:
        self._ws_engine().leave()

    def weightsync_rejoin(self) -> bool:
        return self._ws_engine().rejoin()

    def weightsync_params(self) -> dict[str, torch.Tensor]:
        """A copy of every parameter vLLM holds (empty ones stay empty)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def weightsync_arena(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self._ws_engine().arena.items()}

    def weightsync_layout(self) -> list[dict[str, Any]]:
        """This worker's tensors in the job's layout (name, dtype, shape, and the box in the
        whole tensor: ``global_shape``, ``offset``), as JSON-able dicts."""
        engine = self._ws_engine()._require_engine()
        return [dataclasses.asdict(t) for t in engine.layout()]


def update(llm: Any, version: int, *, timeout_s: float = 600.0, reset_prefix_cache: bool = True,
           poll_s: float = 0.005, worker_wait_s: float = 0.5,
           controller: Client | str | None = None) -> dict[str, Any]:
    """Brings an offline ``vllm.LLM`` to ``version`` (or a newer committed one) through the
    weight-transfer API, resets its prefix cache and sets its ``weight_version``; returns the
    timings (driver side plus each worker's).

    It first polls the workers (a quick ``collective_rpc`` every ``poll_s``) until the version
    is whole in every arena (staged) or its landing waits for the engine (direct), so vLLM
    serves while the trainers write and is held only for the load (staged) or the landing
    (direct).

    With several worker processes (tensor parallelism: vLLM's multiprocess executor) each poll
    waits in the workers instead, up to ``worker_wait_s``, asleep: those workers busy-wait on
    their message queue for a second after every message, so a poll every few milliseconds
    would keep each of them spinning a CPU at 100% for as long as the trainers take (on a
    shared 2-core host it starved a 2-rank trainer: no step in 10 minutes). Nothing is
    served meanwhile that would otherwise be: an offline ``LLM`` serves only inside its own
    ``generate`` calls.

    Given the controller's HTTP API (``controller``: its URL or a :class:`weightsync.Client`),
    the wait is a long poll there instead and the workers are asked once before and once
    after it."""
    if isinstance(controller, str):
        controller = Client(controller)
    return drive(_OfflineCalls(llm), version, timeout_s=timeout_s, reset_prefix_cache=reset_prefix_cache,
                 poll_s=poll_s, worker_wait_s=worker_wait_s, controller=controller)


class _OfflineCalls:
    """:class:`weightsync._update.UpdateCalls` over an offline ``vllm.LLM``."""

    where = "vLLM"

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def ready(self, version: int, wait_s: float) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc("weightsync_ready", args=(version, wait_s)))

    def start(self) -> None:
        self.llm.start_weight_update()

    def update(self, version: int, timeout_s: float) -> None:
        # Raises when the sync failed (vLLM ended the session; staged: nothing was loaded).
        self.llm.update_weights({"update_info": {"version": version, "timeout_s": timeout_s}})

    def finish(self, version: int) -> None:
        self.llm.finish_weight_update(weight_version=str(version))

    def reset_prefix_cache(self, deadline: float) -> None:
        self.llm.reset_prefix_cache()

    def resumed(self) -> None:
        self.llm.collective_rpc("weightsync_resumed")

    def status(self) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc("weightsync_status"))

    def weight_version(self) -> str | None:
        v = self.llm.get_weight_version()
        return None if v is None else str(v)


def sleep(llm: Any, level: int = 1, mode: str = "abort") -> None:
    """``llm.sleep(level, mode)`` for an engine in a weightsync job. Levels 1 and 2 free or
    move the weights: its workers leave the job first (see
    :meth:`WeightsyncTransferEngine.leave`) and syncs wait until it is back. Level 0 only
    pauses scheduling: the workers stay registered."""
    if level >= 1:
        llm.collective_rpc("weightsync_leave")
    llm.sleep(level=level, mode=mode)


def wake_up(llm: Any, tags: list[str] | None = None) -> None:
    """``llm.wake_up(tags)``, then its workers register their memory as it is now and rejoin
    the job (the controller re-plans). With ``tags`` (a partial wake-up), weightsync rejoins on
    the call that brings the weights back (``"weights"`` in ``tags``)."""
    llm.wake_up(tags=tags)
    if tags is None or "weights" in tags:
        llm.collective_rpc("weightsync_rejoin")


def _hint_whole_embedding(layout: list[TensorInfo], worker: str, tp: int) -> None:
    """With tp > 1, says when the job sends this rank the whole embedding although vLLM reads
    only its vocabulary rows (the job's ``embed=vocab`` sends only those)."""
    emb = next((t for t in layout if t.name == "model.embed_tokens.weight"), None)
    if tp > 1 and emb is not None and not emb.sharded:
        log.info(json.dumps({"weightsync": "hint", "worker": worker, "tensor": emb.name, "tp": tp,
                             "shape": list(emb.shape),
                             "hint": "the embedding arrives whole on every tp rank and vLLM reads 1/tp "
                                     "of it: embed=vocab in the job's --infer sends each rank only its rows"}))
