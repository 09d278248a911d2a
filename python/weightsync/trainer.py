"""``weightsync.Trainer``: one per training rank, in the training process.

The trainer learns the job (model, training and inference layouts) from the controller,
registers the rank's own parameter memory in place (FSDP2 ``DTensor`` local shards, plain
tensors, numpy arrays: no copy into an arena), and after each optimizer step declares with
:meth:`Trainer.push` that the tensors hold a version. The controller starts the sync once every
training rank pushed it; :meth:`PushHandle.wait` returns its figures or raises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from . import _native
from ._nvrtc import name_wheel_nvrtc
from ._tensors import (
    NameMap,
    TensorSource,
    current_ptr,
    is_dtensor,
    named_tensors,
    numel,
    shape_of,
    split_dtype,
)
from .errors import LayoutMismatchError, RegistrationError, StaleTensorError

__all__ = ["Trainer", "PushHandle", "SyncOutcome", "ShardInfo"]


@dataclass(frozen=True)
class ShardInfo:
    """One shard this rank holds in the job's training layout."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SyncOutcome:
    """A committed sync, as one trainer saw it.

    ``bytes`` = ``staged_bytes`` (cast, quantised, fused or sliced through the staging arena) +
    ``direct_bytes`` (written by the fabric straight from the registered tensors: nobody else
    copied them). ``stages`` maps each pipeline stage to its seconds. ``path`` names how the
    bytes reached the engines: ``payloads`` (the fabric's sockets), ``process_vm_readv`` (a
    same-host engine copied them out of this process), ``shared_memory`` (a same-host engine the
    kernel refuses ptrace access copied them out of memory this process shared by descriptor),
    ``mixed``; ``path_bytes`` counts the bytes of each.
    """

    version: int
    bytes: int
    staged_bytes: int
    direct_bytes: int
    seconds: float
    stages: dict[str, float] = field(default_factory=dict)
    superseded: str | None = None
    """Why the version never synced, when it did not: a newer version (or a newer run) was
    pushed before it started. Not an error: the engines get the newer one."""
    path: str | None = None
    path_bytes: dict[str, int] = field(default_factory=dict)


class PushHandle:
    """The sync of one pushed version. :meth:`wait` may be called again after a timeout."""

    def __init__(self, core: _native.PushCore) -> None:
        self._core = core

    @property
    def version(self) -> int:
        """The version pushed."""
        return self._core.version

    def wait(self, timeout: float | None = None) -> SyncOutcome:
        """Blocks until the sync commits (returns its figures), is superseded (returns an
        outcome whose ``superseded`` says why: a newer version was pushed first) or fails
        (raises :class:`~weightsync.SyncFailedError` naming the failing worker and the failure's
        ``kind``, e.g. ``"checksum"``; ``"modified"`` names a tensor written during the sync).
        The GIL is released meanwhile and Ctrl-C interrupts. ``timeout`` in seconds raises
        :class:`~weightsync.TimeoutError`; the sync goes on, and **the registered tensors must
        not change until it ends**: the next :meth:`Trainer.push` is refused until then, and a
        write during the sync fails it (kind ``"modified"``). If the controller is lost while
        the sync is in flight, this raises (kind ``"peer_lost"``) rather than hanging."""
        o = self._core.wait(timeout)
        return SyncOutcome(
            version=o.version,
            bytes=o.bytes,
            staged_bytes=o.staged_bytes,
            direct_bytes=o.direct_bytes,
            seconds=o.seconds,
            stages=dict(o.stages),
            superseded=o.superseded,
            path=o.path,
            path_bytes=dict(o.path_bytes),
        )


def _shard_offset(t: Any) -> tuple[int, ...]:
    """Where a ``DTensor``'s local shard starts in the whole tensor: torch's own answer where it
    gives one, else torch.chunk of dim 0 over each mesh dim that shards dim 0."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(int(o) for o in offset)
    except Exception:  # an older or newer torch without it
        pass
    shape = tuple(t.shape)
    start, n = 0, shape[0]
    for i, p in enumerate(t.placements):
        if callable(getattr(p, "is_shard", None)) and p.is_shard(0):
            k, c = t.device_mesh.size(i), t.device_mesh.get_local_rank(i)
            chunk = -(-n // k)
            s = min(c * chunk, n)
            start, n = start + s, min(s + chunk, n) - s
    return (start,) + (0,) * (len(shape) - 1)


def _env_rank() -> int:
    for var in ("RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    raise ValueError("rank not given and neither RANK nor SLURM_PROCID is set")


class Trainer:
    """The weightsync trainer of one training rank.

    Args:
        controller: the controller's control-channel address, ``host:port``.
        rank: this training rank (default: ``$RANK``, as torchrun sets it).
        job_token: the trainer role's secret (``Controller.trainer_token``; default:
            ``$WEIGHTSYNC_TRAINER_TOKEN``, else ``$WEIGHTSYNC_JOB_TOKEN``).
        fabric_token: the fabric's secret (``Controller.fabric_token``; default:
            ``$WEIGHTSYNC_FABRIC_TOKEN``, else ``job_token``; needed where each role has its own).
        listen: the fabric's listen address (default ``127.0.0.1:0``). Peers on this machine
            copy large writes straight between the processes' memory (same-host pulls);
            ``WEIGHTSYNC_SAME_HOST=false`` keeps every byte on the sockets.
        worker_id: this worker's name (default ``trainer-{rank}``).
        run: the job's run this trainer's versions belong to (default 0). A job restarted from
            a checkpoint older than the last committed version declares a newer run (here or
            with :meth:`begin_run`), after which its versions may restart below the last
            committed one; without it, such pushes fail as ``stale``.
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
        run: int = 0,
        fabric_token: str | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        self._core = _native.TrainerCore(
            controller, _env_rank() if rank is None else rank, job_token, listen, worker_id, run,
            fabric_token,
            tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
        )
        self._registered: dict[str, int] = {}
        # The registered tensors by name, for the check that none was written during a sync.
        self._tensors: dict[str, Any] = {}
        self._origins: dict[str, Any] = {}
        self._source: Any = None
        self._name_map: NameMap | None = None
        self._cuda_devices: set[int] = set()

    @property
    def worker_id(self) -> str:
        """This worker's id, e.g. ``trainer-0``."""
        return self._core.worker_id

    def layout(self) -> list[ShardInfo]:
        """The shards this rank must register (empty shards are not listed)."""
        return [
            ShardInfo(
                name=s.name,
                dtype=s.dtype,
                global_shape=tuple(s.global_shape),
                offset=tuple(s.offset),
                shape=tuple(s.shape),
            )
            for s in self._core.layout()
        ]

    def register(self, tensors: TensorSource, *, name_map: NameMap | None = None) -> dict[str, int]:
        """Registers this rank's parameters in place, once.

        ``tensors`` is a module (its ``named_parameters()``), a mapping of names to tensors, or
        ``(name, tensor)`` pairs; names are the job's parameter names (transformers'
        ``named_parameters()``). A module is registered as it is: the path components that
        ``torch.compile`` (``_orig_mod``), activation checkpointing
        (``_checkpoint_wrapped_module``), FSDP1 (``_fsdp_wrapped_module``) and DDP-style
        wrappers (``module``) insert are dropped wherever they appear in a name; ``name_map``
        (a mapping, or a function returning the job's name or None to leave a tensor out)
        then turns a framework's own names into the job's. The returned addresses are keyed by
        the job's names. A ``DTensor``'s local shard is registered, after checking that
        it is sharded on dim 0 and that its global and local shapes are the layout's; empty
        shards (FSDP2 gives them shape ``(0, ...)``) are skipped. Returns the registered address
        of each tensor.

        The tensors may be torch CUDA tensors, all on one GPU, where the extension was built with
        the ``cuda`` feature: the sync then reads them by DMA and prepares casts and fp8 on that
        GPU, and :meth:`push` synchronises the GPU first. A build without it refuses them by name
        (:class:`RegistrationError`), as it refuses CPU and CUDA tensors mixed.

        A job whose model is *declared* (an architecture the planner has no family for: the
        controller plans it from what the workers register) has no layout to check against:
        each shard is declared with its box instead, the whole parameter's shape and where the
        shard starts in it (a ``DTensor``'s ``Shard(0)`` chunk; a plain tensor is whole), and
        the controller checks them against every other rank's and every engine's.

        Raises:
            LayoutMismatchError: a shape, dtype or placement differs from the layout (names the
                parameter, the expected and the actual shard).
            RegistrationError: a tensor is missing or not in the layout, or unusable.
        """
        if self._core.declared:
            return self._register_declared(tensors, name_map)
        layout = {s.name: s for s in self.layout()}
        entries: list[tuple[str, object, str | None]] = []
        origins: dict[str, Any] = {}
        for name, value in named_tensors(tensors, name_map=name_map):
            obj, dtype = split_dtype(value)
            self._check_placement(name, obj, layout.get(name))
            if numel(obj) == 0:
                if name in layout:
                    raise LayoutMismatchError(
                        f"{self.worker_id}: tensor {name}: this rank's shard is empty, the "
                        f"layout expects shape {list(layout[name].shape)}",
                        worker=self.worker_id, tensor=name,
                        expected=str(list(layout[name].shape)), actual="empty",
                    )
                continue
            entries.append((name, obj.to_local() if is_dtensor(obj) else obj, dtype))
            origins[name] = obj
        name_wheel_nvrtc(any(_on_cuda(obj) for _n, obj, _d in entries))
        registered = self._core.register(entries)
        self._tensors = {name: obj for name, obj, _dtype in entries}
        self._registered = {r.name: r.address for r in registered}
        self._cuda_devices = {
            int(getattr(getattr(obj, "device", None), "index", None) or 0)
            for _name, obj, _dtype in entries
            if getattr(getattr(obj, "device", None), "type", None) == "cuda"
        }
        self._origins = origins
        self._source = tensors if hasattr(tensors, "named_parameters") else None
        self._name_map = name_map
        return dict(self._registered)

    @property
    def declared(self) -> bool:
        """Whether the job's model is declared by its workers: an architecture the planner does
        not lay out (a ``config.json`` of another ``model_type``, or ``model="declared"``). Then
        :meth:`layout` is empty and :meth:`register` declares what this rank holds: every
        parameter's local shard with its place in the whole parameter, which the controller
        plans from once every worker registered."""
        return self._core.declared

    def wait_plan(self, timeout: float | None = None) -> int:
        """Blocks until the controller planned the world this rank registered in (returns the
        plan id), or raises why it could not: for a declared model, the tensor the trainers and
        engines disagree on, with both ranks. Needs every worker registered."""
        return self._core.wait_plan(timeout)

    def _register_declared(self, tensors: TensorSource, name_map: NameMap | None) -> dict[str, int]:
        """:meth:`register` for a declared model: each tensor's local shard and its box (a
        ``DTensor`` sharded on dim 0: its local shard at its global offset; any other tensor:
        whole). Empty shards are not declared."""
        entries: list[tuple[str, object, str | None]] = []
        boxes: list[tuple[list[int], list[int]]] = []
        origins: dict[str, Any] = {}
        for name, value in named_tensors(tensors, name_map=name_map):
            obj, dtype = split_dtype(value)
            self._check_placement(name, obj, None)
            if numel(obj) == 0:
                continue
            if is_dtensor(obj):
                local = obj.to_local()
                global_shape = list(shape_of(obj) or ())
                offset = list(_shard_offset(obj))
                entries.append((name, local, dtype))
            else:
                global_shape = list(shape_of(obj) or ())
                offset = [0] * len(global_shape)
                entries.append((name, obj, dtype))
            boxes.append((global_shape, offset))
            origins[name] = obj
        name_wheel_nvrtc(any(_on_cuda(obj) for _n, obj, _d in entries))
        registered = self._core.declare_and_register(entries, boxes)
        self._tensors = {name: obj for name, obj, _dtype in entries}
        self._registered = {r.name: r.address for r in registered}
        self._origins = origins
        self._source = tensors if hasattr(tensors, "named_parameters") else None
        self._name_map = name_map
        return dict(self._registered)

    def _check_placement(self, name: str, t: Any, shard: ShardInfo | None) -> None:
        if not is_dtensor(t):
            return
        shard0 = [callable(getattr(p, "is_shard", None)) and p.is_shard(0) for p in t.placements]
        replicate = [callable(getattr(p, "is_replicate", None)) and p.is_replicate() for p in t.placements]
        if not any(shard0) or not all(s or r for s, r in zip(shard0, replicate)):
            placements = tuple(repr(p) for p in t.placements)
            raise LayoutMismatchError(
                f"{self.worker_id}: tensor {name}: placements {placements}: weightsync's FSDP "
                "layout shards dim 0 (torch.chunk semantics), i.e. Shard(dim=0)",
                worker=self.worker_id, tensor=name, expected="(Shard(dim=0),)", actual=str(placements),
            )
        if shard is None:
            return
        global_shape = shape_of(t)
        local_shape = shape_of(t.to_local())
        if global_shape != shard.global_shape or (local_shape != shard.shape and numel(t) != 0):
            raise LayoutMismatchError(
                f"{self.worker_id}: tensor {name}: global shape {list(global_shape or ())}, local "
                f"shard {list(local_shape or ())}; the layout expects global "
                f"{list(shard.global_shape)}, shard {list(shard.shape)} at {list(shard.offset)}",
                worker=self.worker_id, tensor=name,
                expected=f"{list(shard.shape)} of {list(shard.global_shape)}",
                actual=f"{list(local_shape or ())} of {list(global_shape or ())}",
            )

    def check_storage(self) -> None:
        """Raises :class:`~weightsync.StaleTensorError` naming the first registered tensor whose
        storage moved since :meth:`register` (or, for a registered module, whose parameter was
        replaced): weightsync would read its old bytes. :meth:`push` calls it. Registration is
        once per Trainer: update parameters in place (optimizers do), or start a new Trainer."""
        if not self._registered:
            raise RegistrationError(f"{self.worker_id}: register() first", worker=self.worker_id)
        current = dict(self._origins)
        if self._source is not None:
            current.update(
                {n: p for n, p in named_tensors(self._source, name_map=self._name_map) if n in current}
            )
        for name, ptr in self._registered.items():
            now = current_ptr(split_dtype(current[name])[0])
            if now is not None and now != ptr:
                raise StaleTensorError(
                    f"{self.worker_id}: tensor {name} moved since register() (was {ptr:#x}, now "
                    f"{now:#x}); its registered bytes are stale. Copy new values into the registered "
                    "tensor (param.data.copy_(...)) instead of re-assigning it, or close this "
                    "Trainer and register the tensors with a new one",
                    worker=self.worker_id, tensor=name,
                )

    @property
    def run(self) -> int:
        """The job's run this trainer's versions belong to."""
        return self._core.run

    def begin_run(self, run: int) -> None:
        """This trainer's versions belong to ``run`` (larger than the current one) from now on:
        a job restarted from a checkpoint declares a new run, after which its versions may
        restart below the last committed one. The controller begins the run with the first
        push of it (or ``POST /v1/runs``); pushes of older runs end superseded."""
        self._core.begin_run(run)

    def _write_check(self) -> Any:
        """A check that names the first registered tensor written since now (torch counts
        in-place writes in ``tensor._version``: an optimizer step bumps it), or None when no
        registered tensor keeps such a counter (numpy arrays)."""
        tensors = {n: t for n, t in self._tensors.items() if hasattr(t, "_version")}
        if not tensors:
            return None
        seen = {n: int(t._version) for n, t in tensors.items()}

        def written() -> str | None:
            for name, t in tensors.items():
                if int(t._version) != seen[name]:
                    return name
            return None

        return written

    def push(self, version: int) -> PushHandle:
        """Declares that the registered tensors hold ``version`` and stay put until its sync
        ends (do not step the optimizer before :meth:`PushHandle.wait` returns: a write during
        the sync fails it naming the tensor, kind ``"modified"``). The sync starts once every
        training rank pushed ``version``; a newer version pushed by every rank before it started
        supersedes it. Raises :class:`~weightsync.PushRefusedError` while the previous push's
        sync is still running here."""
        self.check_storage()
        if self._cuda_devices:
            # The optimizer's kernels may still be running on torch's streams; the sync reads
            # the tensors on its own streams, so everything queued must have finished first.
            import torch

            for device in sorted(self._cuda_devices):
                torch.cuda.synchronize(device)
        return PushHandle(self._core.push(version, self._write_check()))

    def close(self) -> None:
        """Leaves the job (idempotent)."""
        self._core.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _on_cuda(obj: object) -> bool:
    """Whether ``obj`` is a torch CUDA tensor (duck-typed: no torch import)."""
    return getattr(getattr(obj, "device", None), "type", None) == "cuda"
