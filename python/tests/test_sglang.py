"""weightsync.sglang against stand-ins: SGLang has no CPU build that runs beside vLLM here, so
none of this shows that a real SGLang accepts these calls.

- StagedSync's logic, and only its logic (SGLang and the weightsync engine are recording
  stand-ins): the order of SGLang's calls around a load (pause -> begin -> load from the arena
  -> end -> flush -> version -> continue), that a failed or incomplete sync never calls SGLang's
  loader, that generation is resumed when SGLang's load raises, that ``in_place`` pausing is
  refused.
- DirectSync for real on weightsync's side: a controller, two numpy trainers, and a torch model
  with SGLang's fused Qwen3 parameter names whose parameters ``land_direct`` registers (called
  by the stand-in as SGLang's model runner calls a custom weight loader); every version lands in
  place, byte for byte; a version that does not commit leaves SGLang paused until one does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from weightsync import SyncFailedError  # noqa: E402
from weightsync.engine import EngineState, TensorInfo  # noqa: E402
from weightsync.sglang import StagedSync  # noqa: E402

from conftest import Procs, start_controller  # noqa: E402
from test_embedded import full_value, np  # noqa: E402


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
    # An old version cannot be re-read from a dirty arena either: the load waits on the version
    # landing there, and fails with that sync's failure.
    with pytest.raises(SyncFailedError, match="v2 failed"):
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


# ---- direct landing: a real controller and real trainers, SGLang a stand-in ----------------

CONFIG = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 320,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def sglang_qwen3(cfg: dict[str, Any]) -> Any:
    """A torch module with SGLang's (and vLLM's) fused Qwen3 parameter names and shapes, bf16."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg["vocab_size"], h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.qkv_proj.weight": (q + 2 * kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_up_proj.weight": (2 * i, h), p + "mlp.down_proj.weight": (h, i),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    model = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = model
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16),
                                                        requires_grad=False))
    return model


class SGLangStandIn(RecordingSGLang):
    """SGLang's weight-update methods; ``update_weights_from_tensor`` with a custom
    ``load_format`` runs the loader with the model, as SGLang's model runner does (only loaders
    listed in ``custom_weight_loader``)."""

    def __init__(self, model: Any, custom_weight_loader: list[str]) -> None:
        super().__init__()
        self.model = model
        self.custom_weight_loader = custom_weight_loader

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]], load_format: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        import importlib

        assert load_format in self.custom_weight_loader, load_format
        module, fn = load_format.rsplit(".", 1)
        getattr(importlib.import_module(module), fn)(self.model, named_tensors)
        self.calls.append(("loader", json.loads(bytes(named_tensors[0][1].numpy().tobytes()))["op"]))
        return True, "Success"


def fused_expected(full: dict[str, Any], name: str) -> Any:
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if fused in name:
            return np.concatenate([full[name.replace(fused, p)] for p in parts], axis=0)
    return full[name]


@pytest.mark.e2e
def test_direct_landing_writes_into_the_models_parameters(tmp_path: Path, procs: Procs) -> None:
    import weightsync
    from weightsync.sglang import LOADER, DirectSync

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    c = start_controller(procs, str(cfg), "fsdp=2", "tp=1,dp=1,format=fused")
    model = sglang_qwen3(CONFIG)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    sg = SGLangStandIn(model, custom_weight_loader=[LOADER])
    sync = DirectSync(sg, controller=c.control, api=c.http, api_token=c.api_token, job_token=c.job_token)
    trainers = [weightsync.Trainer(c.control, r, job_token=c.job_token) for r in range(2)]
    try:
        shards = [{s.name: s for s in t.layout()} for t in trainers]
        src = [{n: np.zeros(s.shape, np.uint16) for n, s in sh.items()} for sh in shards]
        for t, s in zip(trainers, src):
            t.register({n: (a, "bf16") for n, a in s.items()})

        def push(v: int) -> dict[str, Any]:
            full: dict[str, Any] = {}
            for sh, s in zip(shards, src):
                for name, info in sh.items():
                    full.setdefault(name, full_value(name, info.global_shape, v))
                    s[name][...] = full[name][tuple(slice(o, o + n) for o, n in zip(info.offset, info.shape))]
            for t in trainers:
                t.push(v)  # the sync starts once both pushed; it lands when SGLang is paused
            return full

        for v in (1, 2):
            full = push(v)
            sg.calls.clear()
            out = sync.update(v, timeout_s=60)
            assert sg.calls == [("pause", "retract"), "begin", ("loader", "land"), "end", "flush",
                                ("version", str(v)), "continue"], sg.calls
            for n, p in model.named_parameters():
                got = p.data.view(torch.int16).numpy().view(np.uint16)
                assert np.array_equal(got, fused_expected(full, n)), f"v{v}: {n} differs"
                assert p.data_ptr() == ptrs[n], f"{n} moved: the writes must land in place"
            assert out["version"] == v and sync.loaded_version == v
        # Nobody pushes version 3: the landing times out, the controller has no committed sync
        # of it, and SGLang stays paused.
        sg.calls.clear()
        with pytest.raises(weightsync.TimeoutError, match="stays paused"):
            sync.update(3, timeout_s=1.5)
        assert "continue" not in sg.calls and sync.paused_by_failure
        # Version 3 pushed: the next update commits it and resumes.
        full = push(3)
        sg.calls.clear()
        sync.update(3, timeout_s=60)
        assert sg.calls[-1] == "continue" and not sync.paused_by_failure
        n = "model.layers.1.mlp.gate_up_proj.weight"
        got = dict(model.named_parameters())[n].data.view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got, fused_expected(full, n))
    finally:
        sync.leave()
        for t in trainers:
            t.close()


def test_direct_landing_refuses_an_empty_parameter(tmp_path: Path, procs: Procs) -> None:
    import weightsync
    from weightsync.sglang import LOADER, DirectSync

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    c = start_controller(procs, str(cfg), "fsdp=2", "tp=1,dp=1,format=fused")
    model = sglang_qwen3(CONFIG)
    model.lm_head.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(weightsync.RegistrationError, match="lm_head.weight is empty") as e:
        DirectSync(SGLangStandIn(model, [LOADER]), controller=c.control, api=c.http, job_token=c.job_token)
    assert e.value.tensor == "lm_head.weight"


# ---- staged landing through SGLang's own pickling ------------------------------------------


def sglang_scheduler_reads(payload: bytes) -> dict[str, bytes]:
    """What an SGLang scheduler process does with ``update_weights_from_tensor``'s payload:
    ``MultiprocessingSerializer.deserialize`` (``ForkingPickler.loads``), then reads the tensors.
    Runs in a spawned child, as SGLang's scheduler is another process."""
    import torch.multiprocessing  # noqa: F401 - registers torch's reducers
    from multiprocessing.reduction import ForkingPickler

    named = ForkingPickler.loads(payload)
    return {n: bytes(t.view(torch.int16).numpy().tobytes()) for n, t in named}


class PicklingSGLang(RecordingSGLang):
    """``update_weights_from_tensor`` as SGLang's ``Engine`` runs it: the named tensors
    serialized with ``MultiprocessingSerializer.serialize`` (torch's ``ForkingPickler``, which
    shares a CPU tensor's storage, moving it unless it is shared already) once per TP rank, and
    read by the scheduler in another process."""

    def __init__(self, pool: Any) -> None:
        super().__init__()
        self.pool = pool
        self.loaded: list[dict[str, bytes]] = []

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]], flush_cache: bool = True) -> None:
        import io

        import torch.multiprocessing  # noqa: F401 - registers torch's reducers
        from multiprocessing.reduction import ForkingPickler

        buf = io.BytesIO()
        ForkingPickler(buf).dump(named_tensors)  # MultiprocessingSerializer.serialize
        self.loaded.append(self.pool.apply(sglang_scheduler_reads, (buf.getvalue(),)))
        self.calls.append("load")


@pytest.mark.e2e
def test_staged_arena_keeps_its_address_through_sglangs_pickling(tmp_path: Path, procs: Procs) -> None:
    import multiprocessing

    import weightsync

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    c = start_controller(procs, str(cfg), "fsdp=2", "tp=1,dp=1,format=hf")
    trainers = [weightsync.Trainer(c.control, r, job_token=c.job_token) for r in range(2)]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        sg = PicklingSGLang(pool)
        sync = StagedSync(sg, controller=c.control, job_token=c.job_token)
        try:
            ptrs = {n: t.data_ptr() for n, t in sync.arena.items()}
            assert all(t.is_shared() for t in sync.arena.values())
            shards = [{s.name: s for s in t.layout()} for t in trainers]
            src = [{n: np.zeros(s.shape, np.uint16) for n, s in sh.items()} for sh in shards]
            for t, s in zip(trainers, src):
                t.register({n: (a, "bf16") for n, a in s.items()})
            for v in (1, 2, 3):
                full: dict[str, Any] = {}
                for sh, s in zip(shards, src):
                    for name, info in sh.items():
                        full.setdefault(name, full_value(name, info.global_shape, v))
                        s[name][...] = full[name][tuple(slice(o, o + n) for o, n in zip(info.offset, info.shape))]
                for t in trainers:
                    t.push(v)
                assert sync.update(v, timeout_s=60)["version"] == v
                seen = sg.loaded[-1]
                assert set(seen) == set(full)
                for n, want in full.items():
                    assert seen[n] == want.tobytes(), f"v{v}: SGLang's scheduler read stale {n}"
                # Pickling did not move the arena: the next version lands where SGLang reads.
                assert {n: t.data_ptr() for n, t in sync.arena.items()} == ptrs
        finally:
            sync.ws.close()
            for t in trainers:
                t.close()


def test_staged_sync_refuses_an_arena_that_moved() -> None:
    ws, sg = FakeWeightsync(), RecordingSGLang()
    sync = StagedSync(sg, weightsync_engine=ws)
    name = "lm_head.weight"
    sync.arena[name] = sync.arena[name].clone()  # what pickling an unshared storage amounts to
    ws.land(1, 2.0)
    from weightsync import RegistrationError

    with pytest.raises(RegistrationError, match="lm_head.weight moved"):
        sync.update(1)
    assert sg.calls == []
