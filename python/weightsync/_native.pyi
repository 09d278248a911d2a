"""Stubs of the native module (Rust, PyO3). Use the public classes of :mod:`weightsync`."""

from collections.abc import Callable, Sequence

POLL_SECONDS: float

Entry = tuple[str, object, str | None]
Registered = tuple[str, int, int, str]
Outcome = tuple[int, int, int, int, float, list[tuple[str, float]]]
State = tuple[int | None, str, str | None]

def cli_main(argv: Sequence[str], program: Sequence[str] | None = None) -> int: ...

class ControllerCore:
    def __init__(
        self,
        model: str,
        train: str,
        infer: str,
        job_token: str,
        api_token: str,
        dtype: str = "bf16",
        http: str = "127.0.0.1:0",
        control: str = "127.0.0.1:0",
        verify: bool = True,
        heartbeat_timeout: float = 5.0,
        sync_timeout: float = 300.0,
        history: int = 200,
    ) -> None: ...
    @property
    def control_address(self) -> str: ...
    @property
    def http_address(self) -> str: ...
    @property
    def trainers(self) -> int: ...
    @property
    def rollouts(self) -> int: ...
    def is_running(self) -> bool: ...
    def close(self) -> None: ...

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
    def layout(
        self,
    ) -> list[tuple[str, str, list[int], list[int] | None, list[int] | None]]: ...
    def set_hooks(
        self,
        before_landing: Callable[[int], object] | None = None,
        after_commit: Callable[[int], object] | None = None,
    ) -> None: ...
    def register(self, tensors: Sequence[Entry]) -> list[Registered]: ...
    def state(self) -> State: ...
    def wait_for_version(self, version: int, timeout: float | None = None) -> State: ...
    def now_ns(self) -> int: ...
    def report_stages(self, version: int, spans: Sequence[tuple[str, int, int]]) -> None: ...
    def close(self) -> None: ...
