"""``weightsync.Engine``: one per inference rank, inside the engine's own process.

The engine registers its own parameter tensors as the destinations: the controller routes the
trainers' writes straight into those addresses. Around each landing two hooks run in this
process: ``before_landing(version)`` (stop reading the weights: they are about to change;
nothing lands before it returns) and ``after_commit(version)`` (every write of the version was
counted and verified). A failed sync leaves the engine ``invalid``, with its cause, until a later
version commits.

What only the engine knows (how long it held its requests, its own load, its resume) it reports
with :meth:`Engine.report_stages`, stamped with :meth:`Engine.now_ns`: the controller draws them
as ``pause``, ``load`` and ``resume`` on this engine's lane of the version's sync, on the
dashboard and in the trace.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from . import _native
from ._hooks import Hook
from ._tensors import NameMap, TensorSource, current_ptr, named_tensors, shape_of, split_dtype
from .errors import LayoutMismatchError, RegistrationError, StaleTensorError

__all__ = ["Engine", "EngineState", "TensorInfo", "EngineStage", "Source", "SourceBox"]

State = Literal["idle", "landing", "committed", "invalid"]
Format = Literal["hf", "fused"]
EngineStage = Literal["pause", "load", "resume"]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of this inference rank in the job's inference layout.

    ``global_shape`` and ``offset`` place it in the training parameter (the whole Hugging Face
    tensor) it is cut from, as :class:`weightsync.ShardInfo` places a trainer's shard: the
    parameter's whole shape and where this rank's box starts in it (``shape`` and zeros for a
    tensor the rank holds whole). Both are None for a tensor that is not one box of one
    parameter: a fused tensor (``qkv_proj``, ``gate_up_proj``, ``w13_weight``), an fp8
    block-scale tensor, a packed expert tensor split by tensor parallelism.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    global_shape: tuple[int, ...] | None = None
    offset: tuple[int, ...] | None = None

    @property
    def sharded(self) -> bool:
        """Whether this rank holds only part of the parameter (a box smaller than the whole)."""
        return self.global_shape is not None and self.global_shape != self.shape


@dataclass(frozen=True)
class SourceBox:
    """One part of a :class:`Source`: the box ``offset .. offset + shape`` of the trainers'
    tensor ``tensor``, in that tensor's own dims (the control protocol's ``SourceBox``)."""

    tensor: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Source:
    """What an engine tensor of a declared model is made of (the control protocol's
    ``TensorSource``): ``parts``, boxes of the trainers' tensors, concatenated along ``dim`` of
    the engine tensor, in order.

    A fused ``qkv_proj`` ``[q + 2 kv, H]`` is ``Source(0, [q box, k box, v box])``; a
    tensor-parallel rank's slice of a tensor is one part, its box of the tensor of its name
    (:meth:`box_of`). A part of fewer dims than the tensor leaves leading *stack* dims: the
    parts fill the tensor along ``dim``, then the next index of the stack dims (per-expert gate
    and up boxes filling a stacked ``[E, 2I, H]`` tensor, ``dim`` 1). In every other dim a part
    spans the tensor whole. The engine checks that the parts fill the tensor exactly before it
    registers; the controller checks each part against the trainers' tensors (a part of a
    tensor no trainer holds, a box outside it, a dtype the sides disagree on) and names the
    tensor and both sides before any byte moves (:meth:`Engine.wait_plan` raises it).
    """

    dim: int
    parts: tuple[SourceBox, ...]

    @staticmethod
    def box_of(name: str, global_shape: Sequence[int], offset: Sequence[int],
               shape: Sequence[int]) -> Source | None:
        """The source of a tensor that is the box ``offset .. offset + shape`` of the trainers'
        tensor of the same name (whole shape ``global_shape``): a tensor-parallel rank's
        slice. None when the box is the whole tensor (declared without a source)."""
        if tuple(shape) == tuple(global_shape) and not any(offset):
            return None
        return Source(0, (SourceBox(name, tuple(offset), tuple(shape)),))


def _source_entries(worker: str, sources: Mapping[str, Source | None]
                    ) -> list[tuple[str, int, list[tuple[str, list[int], list[int]]]]]:
    """``sources`` as the native engine takes them, checked for types (ValueError naming the
    tensor): a Source, a dim and every part's offset and shape of non-negative ints, as many
    offsets as dims."""
    out = []
    for name, src in sources.items():
        if src is None:
            continue
        bad = f"{worker}: tensor {name}: source {src!r}"
        if not isinstance(src, Source):
            raise ValueError(f"{bad} is not a weightsync.Source")
        if not isinstance(src.dim, int) or src.dim < 0:
            raise ValueError(f"{bad}: dim is not a non-negative int")
        parts = []
        for i, p in enumerate(src.parts):
            if not isinstance(p, SourceBox):
                raise ValueError(f"{bad}: part {i} is not a weightsync.SourceBox")
            dims = [*p.offset, *p.shape]
            if not all(isinstance(d, int) and d >= 0 for d in dims):
                raise ValueError(f"{bad}: part {i} ({p.tensor}) has an offset or shape that is "
                                 "not non-negative ints")
            if len(p.offset) != len(p.shape):
                raise ValueError(f"{bad}: part {i} ({p.tensor}) has an offset of {len(p.offset)} "
                                 f"dims and a shape of {len(p.shape)}")
            parts.append((p.tensor, list(p.offset), list(p.shape)))
        out.append((name, src.dim, parts))
    return out


@dataclass(frozen=True)
class EngineState:
    """``version``: the last committed version (None before the first); ``state``: idle /
    landing / committed / invalid; ``cause``: why it is invalid; ``run``: the job's run the
    version belongs to (``(run, version)`` never goes back)."""

    version: int | None
    state: State
    cause: str | None
    run: int = 0


def _state(s: _native.State) -> EngineState:
    return EngineState(version=s.version, state=s.state, cause=s.cause, run=s.run)  # type: ignore[arg-type]


def _cuda_devices(tensors: Iterable[Any]) -> set[int]:
    """The CUDA device indices of the torch tensors among ``tensors`` (duck-typed: no torch
    import for CPU tensors)."""
    devices = set()
    for t in tensors:
        device = getattr(t, "device", None)
        if getattr(device, "type", None) == "cuda":
            devices.add(int(getattr(device, "index", None) or 0))
    return devices


def _env_rank() -> int:
    for var in ("WEIGHTSYNC_ENGINE_RANK", "RANK"):
        if var in os.environ:
            return int(os.environ[var])
    raise ValueError("rank not given and neither WEIGHTSYNC_ENGINE_RANK nor RANK is set")


def _format_of(names: list[str]) -> Format | None:
    """The inference format a layout's names suggest (the fused format has qkv_proj /
    gate_up_proj.weight / w13_weight; hf has q_proj and unfused gate/up). Only a guess: some
    architectures' own Hugging Face names are fused (Phi-3's qkv_proj, GLM-4's gate_up_proj),
    so :meth:`Engine.register` trusts it only when the registered names do not match."""
    fused = any(n.endswith(("qkv_proj.weight", "gate_up_proj.weight", "w13_weight")) for n in names)
    hf = any(n.endswith(("q_proj.weight", "gate_proj.weight", "experts.gate_up_proj")) for n in names)
    if fused and not hf:
        return "fused"
    if hf and not fused:
        return "hf"
    return None


class Engine:
    """The weightsync receiver of one inference rank.

    Args:
        controller: the controller's control-channel address, ``host:port``.
        rank: this inference rank (default ``$WEIGHTSYNC_ENGINE_RANK``, else ``$RANK``).
        job_token: the engine role's secret (``Controller.engine_token``; default
            ``$WEIGHTSYNC_ENGINE_TOKEN``, else ``$WEIGHTSYNC_JOB_TOKEN``).
        fabric_token: the fabric's secret (``Controller.fabric_token``; default
            ``$WEIGHTSYNC_FABRIC_TOKEN``, else ``job_token``; needed where each role has its own).
        listen: the fabric's listen address (default ``127.0.0.1:0``). Peers on this machine
            copy large writes straight between the processes' memory (same-host pulls);
            ``WEIGHTSYNC_SAME_HOST=false`` keeps every byte on the sockets.
        worker_id: this worker's name (default ``rollout-{rank}``).
        before_landing, after_commit: hooks (see :meth:`set_hooks`).
        tls_cert, tls_key, tls_ca: TLS to the controller (all three or none): this worker's
            client certificate and key, and the CA the controller's certificate must chain to
            (PEM paths; default ``$WEIGHTSYNC_TLS_CERT``, ``_KEY``, ``_CA``; none: plain TCP).
            With TLS the controller also hands out the fabric's key (docs/security.md).
    """

    def __init__(
        self,
        controller: str,
        rank: int | None = None,
        *,
        job_token: str | None = None,
        listen: str | None = None,
        worker_id: str | None = None,
        before_landing: Hook | None = None,
        after_commit: Hook | None = None,
        fabric_token: str | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        self._core = _native.EngineCore(
            controller, _env_rank() if rank is None else rank, job_token, listen, worker_id,
            fabric_token,
            tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
        )
        self._registered: dict[str, int] = {}
        self._origins: dict[str, Any] = {}
        self._source: Any = None
        self._name_map: NameMap | None = None
        self._before: Hook | None = None
        self._after: Hook | None = None
        self.set_hooks(before_landing=before_landing, after_commit=after_commit)

    @property
    def worker_id(self) -> str:
        """This worker's id, e.g. ``rollout-0``."""
        return self._core.worker_id

    def layout(self) -> list[TensorInfo]:
        """Every tensor this rank must register, as the job plans it."""
        return [
            TensorInfo(
                name=t.name,
                dtype=t.dtype,
                shape=tuple(t.shape),
                global_shape=None if t.global_shape is None else tuple(t.global_shape),
                offset=None if t.offset is None else tuple(t.offset),
            )
            for t in self._core.layout()
        ]

    def set_hooks(self, *, before_landing: Hook | None = None, after_commit: Hook | None = None) -> None:
        """Sets both hooks (None clears one). Each is called with the version, in this process,
        with the GIL taken, on weightsync's thread:

        - ``before_landing(version)``: the engine must stop reading its weights; no byte of the
          version lands before it returns. weightsync also checks here that no registered
          tensor moved.
        - ``after_commit(version)``: called only after every write of the version was counted
          and verified; the weights are the version's until the next ``before_landing``.

        A hook that raises fails the sync, naming this engine and the exception.
        """
        self._before, self._after = before_landing, after_commit
        # Through a weak reference: the native engine holding a bound method would keep this
        # object alive in a cycle the garbage collector cannot see through.
        me = weakref.ref(self)

        def before(version: int) -> None:
            engine = me()
            if engine is not None:
                engine._before_landing(version)

        def after(version: int) -> None:
            engine = me()
            if engine is not None:
                engine._after_commit(version)

        self._core.set_hooks(before, after)

    def _before_landing(self, version: int) -> None:
        self.check_storage()
        if self._before is not None:
            self._before(version)
        # CUDA destinations (a `cuda` build): the engine's queued kernels may still read the
        # weights; the copies of the version to the device must come after them.
        for device in _cuda_devices(self._origins.values()):
            import torch

            torch.cuda.synchronize(device)

    def _after_commit(self, version: int) -> None:
        if self._after is not None:
            self._after(version)

    @property
    def declared(self) -> bool:
        """Whether the job's model is declared by its workers (an architecture the planner does
        not lay out): :meth:`layout` is then empty and :meth:`register` declares every tensor
        this engine holds, whole, which the controller plans from."""
        return self._core.declared

    def wait_plan(self, timeout: float | None = None) -> int:
        """Blocks until the controller planned the world this engine registered in (returns the
        plan id), or raises why it could not: for a declared model, the tensor this engine and
        the trainers disagree on, with both ranks."""
        return self._core.wait_plan(timeout)

    def _register_declared(
        self,
        tensors: TensorSource,
        format: Format | None,
        skip: Iterable[str],
        name_map: NameMap | None,
        sources: Mapping[str, Source | None],
    ) -> dict[str, int]:
        """:meth:`register` for a declared model: every parameter (and, of a module, every
        buffer named ``*_scale_inv``: fp8 scales), with ``skip`` and ``sources``."""
        fused_declared = format == "fused" and any(s is not None for s in sources.values())
        if format not in (None, "hf") and not fused_declared:
            raise LayoutMismatchError(
                f"{self.worker_id}: the job's model is declared: its engines take transformers' "
                f"tensors by name (format=hf), or declare what their fused tensors are made of "
                f"(sources=), this engine registers format={format} without sources",
                worker=self.worker_id, expected="hf", actual=str(format),
            )
        items = named_tensors(tensors, with_buffers=True, name_map=name_map)
        is_module = hasattr(tensors, "named_parameters")
        if is_module:
            params = {n for n, _ in named_tensors(tensors, name_map=name_map)}
            items = [(n, t) for n, t in items if n in params or n.endswith("_scale_inv")]
        entries = [(name, *split_dtype(value)) for name, value in items]
        registered = self._core.declare_and_register(entries, list(skip),
                                                     _source_entries(self.worker_id, sources))
        self._registered = {r.name: r.address for r in registered}
        self._origins = {name: obj for name, obj, _ in entries if name in self._registered}
        self._source = tensors if is_module else None
        self._name_map = name_map
        return dict(self._registered)

    def register(
        self,
        tensors: TensorSource,
        *,
        format: Format | None = None,
        name_map: NameMap | None = None,
        skip: Iterable[str] = (),
        sources: Mapping[str, Source | None] | None = None,
    ) -> dict[str, int]:
        """Registers the engine's own tensors as the destinations, once.

        ``tensors`` is a module (its ``named_parameters()`` and those ``named_buffers()`` the
        layout names, e.g. fp8 ``weight_scale_inv`` when a model keeps them as buffers), a
        mapping or ``(name, tensor)`` pairs. Every tensor of the layout must be there, with the
        planned shape and dtype. Names are handled as :meth:`weightsync.Trainer.register` does:
        wrappers' path components (``_orig_mod``, ``_checkpoint_wrapped_module``,
        ``_fsdp_wrapped_module``, ``module``) are dropped, then ``name_map`` (a mapping, or a
        function returning the job's name or None to leave a tensor out) applies. ``format``
        (``"hf"``: transformers' own names and layout; ``"fused"``: vLLM/SGLang's qkv_proj /
        gate_up_proj) is checked against the job's. Returns the registered address of each
        tensor, by the job's name.

        A job whose model is *declared* (an architecture the planner has no family for) plans
        from what the engines register: every parameter of a module (and its fp8
        ``*_scale_inv`` buffers), whole, and
        ``skip``, the names this engine takes nothing of (a tensor no trainer holds); the
        controller names any tensor the trainers and engines disagree on before a byte moves.

        Raises:
            LayoutMismatchError: a shape or dtype differs from the plan, or the job's format is
                not ``format``.
            RegistrationError: a tensor is missing, extra or unusable (read-only, on a device
                other than the CPU; CUDA tensors are taken only by a wheel built with ``cuda``
                on a machine with a CUDA driver, all of one GPU).

        Torch CUDA tensors (a ``cuda`` wheel) land through page-locked host staging copied to
        the device before the version commits (docs/gpu.md, "Device destinations from Python").

        For a declared model (:attr:`declared`) every tensor given is declared, whole, and the
        controller plans from the declarations; ``skip`` names tensors this engine takes
        nothing of (a buffer no trainer holds, a trainer tensor it does not hold), and
        ``sources`` (by the job's name) what a tensor is made of when it is not the trainers'
        tensor of its name, whole (:class:`Source`): a fused tensor's parts, a
        tensor-parallel rank's box (``tp=N`` jobs: every sharded tensor declares its box, see
        :meth:`Source.box_of`). Sources are only for a declared model (ValueError otherwise:
        the planner lays the job out itself).
        """
        if self._core.declared:
            return self._register_declared(tensors, format, skip, name_map, sources or {})
        if any(s is not None for s in (sources or {}).values()):
            raise ValueError(
                f"{self.worker_id}: sources are declared for a declared model only; this job's "
                "model is one the planner lays out (register the tensors of layout())")
        layout = self.layout()
        names = {t.name for t in layout}
        items = named_tensors(tensors, with_buffers=True, name_map=name_map)
        is_module = hasattr(tensors, "named_parameters")
        if is_module:
            params = {n for n, _ in named_tensors(tensors, name_map=name_map)}
            # Buffers only where the layout names them (not rotary tables and the like).
            items = [(n, t) for n, t in items if n in params or n in names]
        if format is not None:
            job_format = _format_of([t.name for t in layout])
            if job_format is not None and job_format != format and not names <= {n for n, _ in items}:
                raise LayoutMismatchError(
                    f"{self.worker_id}: the job's inference format is {job_format}, this "
                    f"engine registers format={format}",
                    worker=self.worker_id, expected=job_format, actual=format,
                )
        entries = [(name, *split_dtype(value)) for name, value in items]
        for name, obj, _ in entries:
            if name not in names:
                raise RegistrationError(
                    f"{self.worker_id}: tensor {name} ({list(shape_of(obj) or ())}) is not in the "
                    "job's inference layout for this rank",
                    worker=self.worker_id, tensor=name,
                )
        registered = self._core.register(entries)
        self._registered = {r.name: r.address for r in registered}
        self._origins = {name: obj for name, obj, _ in entries}
        self._source = tensors if is_module else None
        self._name_map = name_map
        return dict(self._registered)

    def check_storage(self) -> None:
        """Raises :class:`~weightsync.StaleTensorError` naming the first registered tensor whose
        storage moved since :meth:`register` (writes would land in the old storage)."""
        current = dict(self._origins)
        if self._source is not None:
            current.update(
                {
                    n: p
                    for n, p in named_tensors(self._source, with_buffers=True, name_map=self._name_map)
                    if n in current
                }
            )
        for name, ptr in self._registered.items():
            now = current_ptr(split_dtype(current[name])[0])
            if now is not None and now != ptr:
                raise StaleTensorError(
                    f"{self.worker_id}: tensor {name} moved since register() (was {ptr:#x}, now "
                    f"{now:#x}): weights would land in the old storage",
                    worker=self.worker_id, tensor=name,
                )

    def status(self) -> EngineState:
        """Version, state and cause, read together."""
        return _state(self._core.state())

    @property
    def version(self) -> int | None:
        """The last committed version (None before the first)."""
        return self.status().version

    @property
    def run(self) -> int:
        """The job's run the last committed version belongs to."""
        return self.status().run

    @property
    def state(self) -> State:
        """``idle``, ``landing``, ``committed`` or ``invalid``."""
        return self.status().state

    @property
    def cause(self) -> str | None:
        """Why the engine is ``invalid`` (None otherwise)."""
        return self.status().cause

    def wait_for_version(self, version: int, timeout: float | None = None) -> EngineState:
        """Blocks (GIL released, Ctrl-C honoured) until a version >= ``version`` committed.

        Raises:
            SyncFailedError: the sync of ``version`` failed on this engine (``worker`` names
                the worker that failed it, this engine when its own hook raised; ``kind`` says
                what kind of failure it was).
            TimeoutError: ``timeout`` seconds passed first.
        """
        return _state(self._core.wait_for_version(version, timeout))

    def now_ns(self) -> int:
        """Nanoseconds on this engine's clock: monotonic, zero when the engine connected. Stamp
        the spans of :meth:`report_stages` with it."""
        return self._core.now_ns()

    def report_stages(self, version: int, spans: Iterable[tuple[EngineStage, int, int]]) -> None:
        """Reports this engine's own stages of ``version``, so the dashboard's timeline and the
        trace show them on this engine's lane of the version's sync, beside its landing.

        ``spans`` are ``(stage, start_ns, end_ns)`` with ``stage`` one of ``"pause"`` (the
        engine served no requests), ``"load"`` (its own loading path: load_weights,
        post-processing) and ``"resume"`` (finishing the update, resetting the prefix cache),
        and times from :meth:`now_ns`. Call it once they are known, usually after
        :meth:`wait_for_version` returned or in ``after_commit``; it does not wait for the
        controller. weightsync moves the spans to the sync's time base (a pause that began before
        this engine was told of the version is drawn from the sync's start). The controller
        drops, and logs, a report for a version whose sync failed.

        Raises:
            ValueError: naming the span: a stage other than those three, a negative time, a span
                that ends before it starts, in the future or before this engine was told to
                prepare ``version``, a version this engine was never told to prepare (or too
                many versions ago), or more than 64 spans.
            ClosedError: the engine was closed.
        """
        items: list[tuple[str, int, int]] = []
        for i, span in enumerate(spans):
            try:
                stage, start_ns, end_ns = span
            except (TypeError, ValueError):
                raise ValueError(
                    f"{self.worker_id}: spans[{i}] is {span!r}, not (stage, start_ns, end_ns)"
                ) from None
            items.append((stage, start_ns, end_ns))
        self._core.report_stages(version, items)

    def close(self) -> None:
        """Leaves the job (idempotent)."""
        self._core.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
