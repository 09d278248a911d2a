"""Hook types shared by the engine and its docs."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Hook"]

#: A hook: called with the version, in the engine's process, with the GIL taken. Raising fails
#: the sync, naming this engine and the exception.
Hook = Callable[[int], object]
