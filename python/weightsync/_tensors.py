"""Walking what a caller registers: a module (``named_parameters()``), a mapping or an iterable of
``(name, tensor)`` pairs, where a tensor is a torch tensor or ``DTensor``, a numpy array, a DLPack
producer or any object with the buffer protocol, optionally as ``(tensor, "bf16")`` to
reinterpret same-size elements (a numpy ``uint16`` array holding bf16 bits).

Names are the job's parameter names (transformers' ``named_parameters()``). A module registered
as it is may carry wrappers' path components in its names: ``_orig_mod`` (``torch.compile``),
``_checkpoint_wrapped_module`` (activation checkpointing), ``_fsdp_wrapped_module`` (FSDP1),
``module`` (DDP and other ``self.module`` wrappers). They are dropped wherever they appear, so
``_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight`` registers as
``model.layers.0.mlp.up_proj.weight``; a framework whose own names differ still passes a
``name_map`` (a mapping, or a function returning the job's name, or None to leave the tensor
out), applied after the wrappers are dropped.

Duck-typed on purpose: this module never imports torch or numpy, so the package works (and
imports fast) in processes that use neither.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, Union

__all__ = [
    "TensorSource", "NameMap", "WRAPPER_COMPONENTS", "named_tensors", "job_name", "split_dtype",
    "is_dtensor", "numel", "current_ptr", "shape_of",
]


class _HasNamedParameters(Protocol):
    def named_parameters(self) -> Iterator[tuple[str, Any]]: ...


#: What ``register()`` accepts: a module, a mapping of names to tensors, or ``(name, tensor)`` pairs.
TensorSource = Union[_HasNamedParameters, Mapping[str, Any], Iterable[tuple[str, Any]]]

#: A framework's names to the job's: a mapping (names it lacks pass unchanged) or a function
#: (returning the job's name, or None to leave the tensor out).
NameMap = Union[Mapping[str, str], Callable[[str], Union[str, None]]]

#: Path components that wrappers insert into parameter names, dropped wherever they appear.
WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module"})


def job_name(name: str, name_map: NameMap | None = None) -> str | None:
    """The job's name of a tensor registered as ``name``: the wrappers' components dropped,
    then ``name_map`` applied (None: the map leaves the tensor out)."""
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {type(name).__name__} {name!r}")
    parts = name.split(".")
    stripped = ".".join(p for p in parts if p not in WRAPPER_COMPONENTS)
    if not stripped:
        raise ValueError(f"tensor name {name!r} is only wrapper components")
    if name_map is None:
        return stripped
    mapped: str | None
    if isinstance(name_map, Mapping):
        mapped = name_map.get(stripped, stripped)
    elif callable(name_map):
        mapped = name_map(stripped)
    else:
        raise TypeError(f"name_map must be a mapping or a callable, got {type(name_map).__name__}")
    if mapped is not None and not isinstance(mapped, str):
        raise TypeError(f"name_map gave {type(mapped).__name__} {mapped!r} for {stripped}, not a str or None")
    return mapped


def named_tensors(
    source: TensorSource, *, with_buffers: bool = False, name_map: NameMap | None = None
) -> list[tuple[str, Any]]:
    """The ``(name, tensor)`` pairs of ``source`` under the job's names (see :func:`job_name`;
    tensors the map leaves out are dropped), names unique. A module gives its
    ``named_parameters()`` (and, with ``with_buffers``, its ``named_buffers()`` after them)."""
    if hasattr(source, "named_parameters"):
        items = list(source.named_parameters())
        if with_buffers and hasattr(source, "named_buffers"):
            items += list(source.named_buffers())
    elif isinstance(source, Mapping):
        items = list(source.items())
    else:
        items = list(source)
    seen: dict[str, str] = {}
    out: list[tuple[str, Any]] = []
    for name, value in items:
        renamed = job_name(name, name_map)
        if renamed is None:
            continue
        if renamed in seen:
            if seen[renamed] == name:
                raise ValueError(f"tensor {name} is given twice")
            raise ValueError(f"tensors {seen[renamed]} and {name} are both named {renamed} in the job")
        seen[renamed] = name
        out.append((renamed, value))
    return out


def split_dtype(value: Any) -> tuple[Any, str | None]:
    """``(tensor, "bf16")`` -> ``(tensor, "bf16")``; a bare tensor -> ``(tensor, None)``."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
        return value[0], value[1]
    return value, None


def is_dtensor(t: Any) -> bool:
    """A torch ``DTensor`` (duck-typed: ``to_local`` and ``placements``)."""
    return hasattr(t, "to_local") and hasattr(t, "placements")


def numel(t: Any) -> int:
    """Number of elements of a tensor-like (a ``DTensor``: of its local shard)."""
    if is_dtensor(t):
        t = t.to_local()
    if hasattr(t, "numel") and callable(t.numel):
        return int(t.numel())
    if hasattr(t, "size") and isinstance(t.size, int):  # numpy
        return int(t.size)
    return memoryview(t).nbytes


def shape_of(t: Any) -> tuple[int, ...] | None:
    """The shape of a tensor-like, when it has one."""
    shape = getattr(t, "shape", None)
    return None if shape is None else tuple(int(d) for d in shape)


def current_ptr(t: Any) -> int | None:
    """Where a tensor's bytes are now (a ``DTensor``: its local shard's); None when the object
    cannot move them (a buffer exporter holds them while weightsync holds its export)."""
    if is_dtensor(t):
        t = t.to_local()
    if hasattr(t, "data_ptr") and hasattr(t, "untyped_storage"):
        return int(t.data_ptr())
    iface = getattr(t, "__array_interface__", None)
    if isinstance(iface, dict):
        return int(iface["data"][0])
    return None
