"""weightsync.sglang.StagedSync's logic, and ONLY its logic: SGLang has no CPU build that runs
beside vLLM here, so both SGLang and the weightsync engine are recording stand-ins below. What
this checks: the order of SGLang's calls around a load (pause -> begin -> load from the arena ->
end -> flush -> version -> continue), that a failed or incomplete sync never calls SGLang's
loader, that generation is resumed when SGLang's load raises, and that ``in_place`` pausing is
refused. It does not show that SGLang accepts these calls (not run against a real SGLang)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from weightsync import SyncFailedError  # noqa: E402
from weightsync.engine import EngineState, TensorInfo  # noqa: E402
from weightsync.sglang import StagedSync  # noqa: E402


class FakeWeightsync:
    """Stands in for weightsync.Engine: a two-tensor layout; the test drives the hooks."""

    worker_id = "rollout-0"

    def __init__(self) -> None:
        self.before: Any = None
        self.after: Any = None
        self.registered: dict[str, Any] = {}
        self.failed: set[int] = set()

    def layout(self) -> list[TensorInfo]:
        return [TensorInfo("model.norm.weight", "bf16", (4,)), TensorInfo("lm_head.weight", "f32", (2, 4))]

    def set_hooks(self, *, before_landing: Any = None, after_commit: Any = None) -> None:
        self.before, self.after = before_landing, after_commit

    def register(self, tensors: dict[str, Any], *, format: str | None = None) -> dict[str, int]:
        assert format == "hf"
        self.registered = tensors
        return {n: t.data_ptr() for n, t in tensors.items()}

    def land(self, version: int, value: float, commit: bool = True) -> None:
        self.before(version)
        for t in self.registered.values():
            t.fill_(value)
        if commit:
            self.after(version)
        else:
            self.failed.add(version)

    def wait_for_version(self, version: int, timeout: float | None = None) -> EngineState:
        if version in self.failed:
            raise SyncFailedError(f"v{version} failed", version=version, worker="trainer-1", cause="killed")
        return EngineState(version, "committed", None)


class RecordingSGLang:
    def __init__(self, fail_load: bool = False) -> None:
        self.calls: list[Any] = []
        self.fail_load = fail_load

    def pause_generation(self, mode: str) -> None:
        self.calls.append(("pause", mode))

    def continue_generation(self) -> None:
        self.calls.append("continue")

    def begin_weight_update(self) -> None:
        self.calls.append("begin")

    def end_weight_update(self) -> None:
        self.calls.append("end")

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]], flush_cache: bool = True) -> None:
        if self.fail_load:
            raise RuntimeError("load refused")
        self.calls.append(("load", {n: float(t.float().mean()) for n, t in named_tensors}))

    def flush_cache(self) -> None:
        self.calls.append("flush")

    def update_weight_version(self, v: str) -> None:
        self.calls.append(("version", v))


def test_a_committed_version_is_loaded_between_pause_and_continue() -> None:
    ws, sg = FakeWeightsync(), RecordingSGLang()
    sync = StagedSync(sg, weightsync_engine=ws)
    ws.land(1, 3.0)
    out = sync.update(1)
    assert sg.calls == [("pause", "retract"), "begin",
                        ("load", {"model.norm.weight": 3.0, "lm_head.weight": 3.0}),
                        "end", "flush", ("version", "1"), "continue"]
    assert out["version"] == 1 and sync.loaded_version == 1 and out["load_s"] >= 0


def test_a_failed_sync_never_reaches_sglang() -> None:
    ws, sg = FakeWeightsync(), RecordingSGLang()
    sync = StagedSync(sg, weightsync_engine=ws, pause_mode="abort")
    ws.land(1, 1.0)
    sync.update(1)
    sg.calls.clear()
    ws.land(2, 9.0, commit=False)  # half-written, then the trainer died
    with pytest.raises(SyncFailedError):
        sync.update(2)
    assert sg.calls == [] and sync.loaded_version == 1
    # An old version cannot be re-read from a dirty arena either.
    with pytest.raises(SyncFailedError, match="no whole version"):
        sync.update(1)
    assert sg.calls == []
    ws.land(3, 4.0)
    assert sync.update(3)["version"] == 3
    assert sg.calls[0] == ("pause", "abort")


def test_generation_resumes_when_sglang_refuses_the_load() -> None:
    ws, sg = FakeWeightsync(), RecordingSGLang(fail_load=True)
    sync = StagedSync(sg, weightsync_engine=ws)
    ws.land(1, 1.0)
    with pytest.raises(RuntimeError, match="load refused"):
        sync.update(1)
    assert sg.calls[-1] == "continue" and sync.loaded_version is None


def test_in_place_pause_is_refused() -> None:
    with pytest.raises(ValueError, match="in_place"):
        StagedSync(RecordingSGLang(), weightsync_engine=FakeWeightsync(), pause_mode="in_place")
