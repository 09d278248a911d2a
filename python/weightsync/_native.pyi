"""Stubs of the native module (Rust, PyO3). Use the public classes of :mod:`weightsync`."""

from collections.abc import Callable, Sequence

POLL_SECONDS: float

Entry = tuple[str, object, str | None]
Registered = tuple[str, int, int, str]
Outcome = tuple[int, int, int, int, float, list[tuple[str, float]]]
State = tuple[int | None, str, str | None]

def tensor_info(
    obj: object, dtype: str | None = None, writable: bool = False
) -> tuple[int, int, str, list[int], str]: ...

class TrainerCore:
    def __init__(
        self,
        controller: str,
        rank: int,
        job_token: str | None = None,
        listen: str | None = None,
        worker_id: str | None = None,
    ) -> None: ...
    @property
    def worker_id(self) -> str: ...
    def layout(self) -> list[tuple[str, str, list[int], list[int], list[int]]]: ...
    def register(self, tensors: Sequence[Entry]) -> list[Registered]: ...
    def push(self, version: int) -> PushCore: ...
    def close(self) -> None: ...

class PushCore:
    @property
    def version(self) -> int: ...
    def wait(self, timeout: float | None = None) -> Outcome: ...

class EngineCore:
    def __init__(
        self,
        controller: str,
        rank: int,
        job_token: str | None = None,
        listen: str | None = None,
        worker_id: str | None = None,
    ) -> None: ...
    @property
    def worker_id(self) -> str: ...
    def layout(self) -> list[tuple[str, str, list[int]]]: ...
    def set_hooks(
        self,
        before_landing: Callable[[int], object] | None = None,
        after_commit: Callable[[int], object] | None = None,
    ) -> None: ...
    def register(self, tensors: Sequence[Entry]) -> list[Registered]: ...
    def state(self) -> State: ...
    def wait_for_version(self, version: int, timeout: float | None = None) -> State: ...
    def close(self) -> None: ...
