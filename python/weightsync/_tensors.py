"""Walking what a caller registers: a module (``named_parameters()``), a mapping or an iterable of
``(name, tensor)`` pairs, where a tensor is a torch tensor or ``DTensor``, a numpy array, a DLPack
producer or any object with the buffer protocol, optionally as ``(tensor, "bf16")`` to
reinterpret same-size elements (a numpy ``uint16`` array holding bf16 bits).

Duck-typed on purpose: this module never imports torch or numpy, so the package works (and
imports fast) in processes that use neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, Union

__all__ = ["TensorSource", "named_tensors", "split_dtype", "is_dtensor", "numel", "current_ptr", "shape_of"]


class _HasNamedParameters(Protocol):
    def named_parameters(self) -> Iterator[tuple[str, Any]]: ...


#: What ``register()`` accepts: a module, a mapping of names to tensors, or ``(name, tensor)`` pairs.
TensorSource = Union[_HasNamedParameters, Mapping[str, Any], Iterable[tuple[str, Any]]]


def named_tensors(source: TensorSource, *, with_buffers: bool = False) -> list[tuple[str, Any]]:
    """The ``(name, tensor)`` pairs of ``source``, names unique. A module gives its
    ``named_parameters()`` (and, with ``with_buffers``, its ``named_buffers()`` after them)."""
    if hasattr(source, "named_parameters"):
        items = list(source.named_parameters())
        if with_buffers and hasattr(source, "named_buffers"):
            items += list(source.named_buffers())
    elif isinstance(source, Mapping):
        items = list(source.items())
    else:
        items = list(source)
    seen: set[str] = set()
    for name, _ in items:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__} {name!r}")
        if name in seen:
            raise ValueError(f"tensor {name} is given twice")
        seen.add(name)
    return items


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
