"""The package against a real controller, without torch: two trainers and two engines in this
one process (each with its own runtime, waits release the GIL), numpy arrays registered in place
on both sides; and what the package refuses, by name. Seconds each."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import weightsync

from conftest import Controller, Procs, start_controller

np = pytest.importorskip("numpy")

# A small dense Qwen3 whose rows 2 FSDP ranks split evenly and 3 unevenly.
CONFIG = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 320,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def controller(tmp_path: Path, procs: Procs, train: str = "fsdp=2", infer: str = "tp=1,dp=2,format=hf") -> Controller:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    return start_controller(procs, str(cfg), train, infer)


def full_value(name: str, shape: tuple[int, ...], version: int) -> Any:
    """The parameter `name` at `version`: bf16 bit patterns of finite numbers, as uint16."""
    seed = int.from_bytes(hashlib.blake2b(f"{name}/{version}".encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 0x3F80, size=shape, dtype=np.uint16)


def in_threads(fns: list[Callable[[], Any]], timeout: float = 120) -> list[Any]:
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a call did not return"
    for e in errors:
        if e is not None:
            raise e
    return results


class Job:
    """Two numpy trainers (fsdp=2) and two numpy engines (hf, dp=2) in this process."""

    def __init__(self, c: Controller, fail_hook_at: int | None = None) -> None:
        tok = c.job_token
        self.calls: list[tuple[str, str, int]] = []
        self.engines = [weightsync.Engine(c.control, r, job_token=tok) for r in range(2)]
        for e in self.engines:
            e.set_hooks(before_landing=self._hook("before", e.worker_id, fail_hook_at),
                        after_commit=self._hook("after", e.worker_id, None))
        self.trainers = [weightsync.Trainer(c.control, r, job_token=tok) for r in range(2)]
        self.dst = [{t.name: np.zeros(t.shape, np.uint16) for t in e.layout()} for e in self.engines]
        self.shards = [{s.name: s for s in t.layout()} for t in self.trainers]
        self.src = [{n: np.zeros(s.shape, np.uint16) for n, s in sh.items()} for sh in self.shards]
        in_threads(
            [lambda e=e, d=d: e.register({n: (a, "bf16") for n, a in d.items()}, format="hf")
             for e, d in zip(self.engines, self.dst)]
            + [lambda t=t, s=s: t.register({n: (a, "bf16") for n, a in s.items()})
               for t, s in zip(self.trainers, self.src)]
        )

    def _hook(self, kind: str, worker: str, fail_at: int | None) -> Callable[[int], None]:
        def hook(version: int) -> None:
            self.calls.append((kind, worker, version))
            if version == fail_at and worker == "rollout-1":
                raise RuntimeError(f"engine refuses version {version}")
        return hook

    def step(self, version: int) -> dict[str, Any]:
        """The trainers' tensors take `version`'s values in place; returns the full tensors."""
        full = {}
        for shards, src in zip(self.shards, self.src):
            for name, s in shards.items():
                full.setdefault(name, full_value(name, s.global_shape, version))
                box = tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape))
                src[name][...] = full[name][box]
        return full

    def push(self, version: int) -> list[weightsync.SyncOutcome]:
        return in_threads([lambda t=t: t.push(version).wait(timeout=60) for t in self.trainers])

    def close(self) -> None:
        for w in [*self.trainers, *self.engines]:
            w.close()


def test_two_trainers_two_engines_numpy(tmp_path: Path, procs: Procs) -> None:
    job = Job(controller(tmp_path, procs))
    try:
        for v in (1, 2, 3):
            full = job.step(v)
            outcomes = job.push(v)
            for e, dst in zip(job.engines, job.dst):
                # The trainers' push ends on the controller's commit; each engine learns it on
                # its own connection a moment later.
                assert e.wait_for_version(v, timeout=30).version == v
                assert (e.version, e.state, e.cause) == (v, "committed", None)
                for name, a in dst.items():
                    assert np.array_equal(a, full[name]), f"{e.worker_id} v{v}: {name} differs"
            # bf16 -> bf16: nothing goes through staging; rows are written straight from the
            # registered arrays (bytes also counts the small boxes the planner gathers first,
            # written from the gather arena).
            assert all(o.version == v and o.bytes >= o.direct_bytes > 0 for o in outcomes), outcomes
            assert sum(o.staged_bytes for o in outcomes) == 0, outcomes
        for w in ("rollout-0", "rollout-1"):
            mine = [(k, v) for k, who, v in job.calls if who == w]
            assert mine == [("before", 1), ("after", 1), ("before", 2), ("after", 2), ("before", 3), ("after", 3)]
    finally:
        job.close()


@pytest.mark.parametrize("delta", [None, "off"])
def test_the_in_process_controller_syncs_under_its_default_delta_mode_and_off(
        tmp_path: Path, delta: str | None) -> None:
    """``weightsync.Controller`` by default (``auto``: the first sync full, the second a probe)
    and with ``delta="off"`` (every sync full): byte-exact either way, each sync saying why."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    kw = {} if delta is None else {"delta": delta}
    with weightsync.Controller(str(cfg), "fsdp=2", "tp=1,dp=2,format=hf", **kw) as c:
        assert c.delta == (delta or "auto")
        job = Job(SimpleNamespace(control=c.control_address, job_token=c.job_token))  # type: ignore[arg-type]
        try:
            for v in (1, 2):
                full = job.step(v)
                job.push(v)
                for e, dst in zip(job.engines, job.dst):
                    assert e.wait_for_version(v, timeout=30).version == v
                    for name, a in dst.items():
                        assert np.array_equal(a, full[name]), f"{e.worker_id} v{v}: {name} differs"
        finally:
            job.close()
        with urllib.request.urlopen(c.http_url + "/v1/syncs", timeout=10) as r:
            syncs = {s["version"]: s for s in json.loads(r.read())["syncs"]}
        why = [syncs[v]["delta_policy"] for v in (1, 2)]
    if delta == "off":
        assert why == ["off", "off"], why
    else:
        assert why[0] == "auto: full (nothing committed in this run yet)", why
        assert why[1].startswith("auto: probe (full "), why


def settled(e: weightsync.Engine, timeout: float = 10) -> weightsync.EngineState:
    """The engine's state once the abort reached it (its own connection may lag the trainers')."""
    deadline = time.monotonic() + timeout
    while (st := e.status()).state == "landing" and time.monotonic() < deadline:
        time.sleep(0.05)
    return st


def test_failing_hook_names_the_engine(tmp_path: Path, procs: Procs) -> None:
    job = Job(controller(tmp_path, procs), fail_hook_at=2)
    try:
        job.step(1)
        job.push(1)
        job.step(2)
        with pytest.raises(weightsync.SyncFailedError) as e:
            job.push(2)
        assert e.value.worker == "rollout-1" and e.value.version == 2, e.value
        assert "engine refuses version 2" in str(e.value)
        assert e.value.kind is weightsync.FailureKind.HOOK, e.value
        states = {x.worker_id: settled(x) for x in job.engines}
        assert states["rollout-1"].state == "invalid" and states["rollout-1"].version == 1
        assert "engine refuses" in (states["rollout-1"].cause or "")
        assert states["rollout-0"].state in ("invalid", "committed") and states["rollout-0"].version == 1
        with pytest.raises(weightsync.SyncFailedError) as e:
            job.engines[1].wait_for_version(2, timeout=10)
        assert (e.value.worker, e.value.kind) == ("rollout-1", "hook"), e.value
        full = job.step(3)
        job.push(3)
        for e, dst in zip(job.engines, job.dst):
            assert e.wait_for_version(3, timeout=30).version == 3
            assert (e.version, e.state) == (3, "committed")
            assert all(np.array_equal(a, full[n]) for n, a in dst.items())
    finally:
        job.close()


def test_a_checksum_mismatch_reaches_python_as_its_kind(tmp_path: Path, procs: Procs) -> None:
    """rollout-1 registers, as its layer-1 q_proj, the very array rollout-0 registered as its
    layer-0 q_proj (each engine refuses overlaps among its own tensors, not with another
    process's). Both land there, so after the first sync that memory holds one layer's values
    (or a mix): the other rollout's verification finds bytes that differ from the trainers'
    checksums, and the failure reaches every waiter as ``kind == "checksum"``, naming that
    rollout and its tensor."""
    c = controller(tmp_path, procs)
    tok = c.job_token
    engines = [weightsync.Engine(c.control, r, job_token=tok) for r in range(2)]
    trainers = [weightsync.Trainer(c.control, r, job_token=tok) for r in range(2)]
    try:
        dst = [{t.name: np.zeros(t.shape, np.uint16) for t in e.layout()} for e in engines]
        l0 = next(n for n in dst[0] if "layers.0." in n and n.endswith("q_proj.weight"))
        l1 = l0.replace("layers.0.", "layers.1.")
        assert dst[1][l1].shape == dst[0][l0].shape
        dst[1][l1] = dst[0][l0]
        shards = [{s.name: s for s in t.layout()} for t in trainers]
        src = [{n: np.zeros(s.shape, np.uint16) for n, s in sh.items()} for sh in shards]
        full: dict[str, Any] = {}
        for sh, sr in zip(shards, src):
            for name, s in sh.items():
                full.setdefault(name, full_value(name, s.global_shape, 1))
                sr[name][...] = full[name][tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape))]
        assert not np.array_equal(full[l0], full[l1])
        in_threads(
            [lambda e=e, d=d: e.register({n: (a, "bf16") for n, a in d.items()}, format="hf")
             for e, d in zip(engines, dst)]
            + [lambda t=t, s=s: t.register({n: (a, "bf16") for n, a in s.items()}) for t, s in zip(trainers, src)]
        )

        def failure(call: Callable[[], Any]) -> weightsync.SyncFailedError:
            with pytest.raises(weightsync.SyncFailedError) as e:
                call()
            return e.value

        pushes = [t.push(1) for t in trainers]
        errors = in_threads([lambda p=p: failure(lambda: p.wait(timeout=60)) for p in pushes])
        errors += in_threads([lambda e=e: failure(lambda: e.wait_for_version(1, timeout=60)) for e in engines])
        blamed = {"rollout-0": l0, "rollout-1": l1}
        for err in errors:
            assert err.kind is weightsync.FailureKind.CHECKSUM and err.kind == "checksum", err
            assert err.worker in blamed and err.version == 1, err
            assert err.tensor is not None and blamed[err.worker] in err.tensor, err
            assert "checksum mismatch" in (err.cause or ""), err
        assert len({(e.worker, e.tensor) for e in errors}) == 1, "every waiter hears the same failure"
        # The controller keeps the kind beside the text.
        sync = weightsync.Client(c.http, c.api_token).of_version(1)
        assert sync is not None and sync.state == "failed" and sync.failure is not None
        assert sync.failure.kind is weightsync.FailureKind.CHECKSUM, sync.failure
        assert sync.failure.worker == errors[0].worker, sync.failure
    finally:
        for w in [*trainers, *engines]:
            w.close()


def test_registration_errors_name_the_tensor(tmp_path: Path, procs: Procs) -> None:
    c = controller(tmp_path, procs)
    t = weightsync.Trainer(c.control, 0, job_token=c.job_token)
    shards = t.layout()
    good = {s.name: (np.zeros(s.shape, np.uint16), "bf16") for s in shards}
    victim = shards[1]
    bad_shape = dict(good)
    bad_shape[victim.name] = (np.zeros((victim.shape[0] + 1, *victim.shape[1:]), np.uint16), "bf16")
    with pytest.raises(weightsync.LayoutMismatchError) as e:
        t.register(bad_shape)
    assert e.value.tensor == victim.name and victim.name in str(e.value), e.value
    missing = {k: v for k, v in good.items() if k != victim.name}
    with pytest.raises(weightsync.RegistrationError, match=victim.name.replace(".", r"\.")):
        t.register(missing)
    with pytest.raises(weightsync.RegistrationError, match="model.layers.9.nothing"):
        t.register({**good, "model.layers.9.nothing": (np.zeros(4, np.uint16), "bf16")})
    with pytest.raises(weightsync.RegistrationError, match=r"(?s)tensor model\..*f32"):
        t.register({k: np.zeros(s.shape, np.float32) for k, s in ((s.name, s) for s in shards)})
    t.close()
    e2 = weightsync.Engine(c.control, 0, job_token=c.job_token)
    with pytest.raises(weightsync.LayoutMismatchError, match="fused"):
        e2.register({}, format="fused")
    e2.close()


class FakeCudaTensor:
    """What the native module reads of a torch CUDA tensor (no GPU here): duck-typed, never
    dereferenced, since registration refuses it before any copy."""

    class _Device:
        type = "cuda"
        index = 0

    class _Storage:
        def __init__(self, nbytes: int) -> None:
            self._nbytes = nbytes

        def data_ptr(self) -> int:
            return 0x7F00_0000_0000

        def nbytes(self) -> int:
            return self._nbytes

    dtype = "torch.bfloat16"
    device = _Device()

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def numel(self) -> int:
        return int(np.prod(self.shape))

    def element_size(self) -> int:
        return 2

    def data_ptr(self) -> int:
        return 0x7F00_0000_0000

    def untyped_storage(self) -> FakeCudaTensor._Storage:
        return FakeCudaTensor._Storage(self.numel() * 2)

    def is_contiguous(self) -> bool:
        return True


def test_cuda_tensors_go_through_the_same_register_call(tmp_path: Path, procs: Procs) -> None:
    from weightsync import _native

    info = _native.tensor_info(FakeCudaTensor((4, 8)))
    assert (info.dtype, info.shape, info.kind) == ("bf16", [4, 8], "torch-cuda"), info
    with pytest.raises(ValueError, match=r"CUDA tensor \(on cuda:0\) as a destination"):
        _native.tensor_info(FakeCudaTensor((4, 8)), None, True)
    c = controller(tmp_path, procs)
    t = weightsync.Trainer(c.control, 0, job_token=c.job_token)
    shards = t.layout()
    mixed = {s.name: (np.zeros(s.shape, np.uint16), "bf16") for s in shards}
    mixed[shards[0].name] = FakeCudaTensor(tuple(shards[0].shape))
    with pytest.raises(weightsync.RegistrationError, match="one device") as e:
        t.register(mixed)
    assert e.value.tensor == shards[0].name
    on_gpu = {s.name: FakeCudaTensor(tuple(s.shape)) for s in shards}
    with pytest.raises(weightsync.RegistrationError) as e:
        t.register(on_gpu)
    # A build without `cuda` says so; one with it opens the GPU and, without a driver here,
    # names the missing driver library. Either way the tensor is named.
    assert "no CUDA support" in str(e.value) or "libcuda" in str(e.value), e.value
    assert e.value.tensor in on_gpu or e.value.tensor is None, e.value
    t.close()


class FakeCudaArray:
    """A ``__cuda_array_interface__`` producer (numba, cupy) that is not a torch tensor."""

    __cuda_array_interface__ = {"shape": (4, 8), "typestr": "<f2", "data": (0x7F00_0000_0000, False),
                                "version": 3}


def test_engine_cuda_destinations_are_refused_by_name(tmp_path: Path, procs: Procs) -> None:
    """What this machine can show of CUDA destinations (no GPU, no CUDA tensor can be made):
    duck-typed CUDA tensors as an engine's destinations are refused before any byte moves, the
    error naming the tensor and why (this build has no `cuda`; a `cuda` build: this machine has
    no CUDA driver). Not shown here: a real torch CUDA tensor landing in a `cuda` build's wheel
    (the GPU check's `engine` step runs that path from Rust)."""
    torch = pytest.importorskip("torch")
    from weightsync import _native

    for obj in (FakeCudaTensor((4, 8)), FakeCudaArray()):
        with pytest.raises(ValueError, match="CUDA tensor .*as a destination") as e:
            _native.tensor_info(obj, None, True)
        assert "no CUDA support" in str(e.value), e.value
    c = controller(tmp_path, procs)
    e = weightsync.Engine(c.control, 0, job_token=c.job_token)
    try:
        layout = e.layout()
        dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
        tensors = {t.name: torch.zeros(t.shape, dtype=dt[t.dtype]) for t in layout}
        first = layout[0].name
        tensors[first] = FakeCudaTensor(tuple(layout[0].shape))
        with pytest.raises(weightsync.RegistrationError, match="on cuda:0") as err:
            e.register(tensors)
        assert err.value.tensor == first and first in str(err.value), err.value
        assert "no CUDA support" in str(err.value), err.value
        # meta tensors (shape without memory) are refused by their device too.
        tensors[first] = torch.empty(tuple(layout[0].shape), dtype=torch.bfloat16, device="meta")
        with pytest.raises(weightsync.RegistrationError, match="meta"):
            e.register(tensors)
    finally:
        e.close()


def test_moved_tensor_is_refused_by_name(tmp_path: Path, procs: Procs) -> None:
    torch = pytest.importorskip("torch")
    c = controller(tmp_path, procs)
    t = weightsync.Trainer(c.control, 0, job_token=c.job_token)
    params = {s.name: torch.nn.Parameter(torch.zeros(s.shape, dtype=torch.bfloat16)) for s in t.layout()}
    t.register(params)
    victim = sorted(params)[3]
    params[victim].data = params[victim].data.clone()  # re-assigned: new storage
    with pytest.raises(weightsync.StaleTensorError) as e:
        t.push(1)
    assert e.value.tensor == victim and victim in str(e.value)
    t.close()


def test_wait_releases_the_gil_and_ctrl_c_interrupts(tmp_path: Path, procs: Procs) -> None:
    c = controller(tmp_path, procs)
    # The child installs Python's own SIGINT handler: a process started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then leaves it ignored.
    script = textwrap.dedent(f"""
        import signal, sys, threading, numpy as np, weightsync
        signal.signal(signal.SIGINT, signal.default_int_handler)
        t = weightsync.Trainer({c.control!r}, 0, job_token={c.job_token!r})
        t.register({{s.name: (np.zeros(s.shape, np.uint16), "bf16") for s in t.layout()}})
        count = [0]
        def spin():
            while True:
                count[0] += 1
        threading.Thread(target=spin, daemon=True).start()
        print("waiting", flush=True)
        try:
            t.push(1).wait()   # trainer-1 never pushes: waits until interrupted
        except KeyboardInterrupt:
            print("interrupted", count[0], flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=tmp_path)
    assert p.stdout is not None
    # A child that never answers fails the test instead of hanging it.
    watchdog = threading.Timer(60, p.kill)
    watchdog.start()
    assert p.stdout.readline().strip() == "waiting", p.stderr.read() if p.stderr else ""
    time.sleep(1.0)
    sent = time.monotonic()
    p.send_signal(signal.SIGINT)
    line = p.stdout.readline().split()
    latency = time.monotonic() - sent
    p.wait(timeout=30)
    watchdog.cancel()
    assert line and line[0] == "interrupted", line
    assert int(line[1]) > 1000, "the other Python thread did not run while the wait held the GIL"
    assert latency < 2.0, latency


# ---- same host, ptrace refused: shared memory ------------------------------------------------

ENGINE_CHILD = textwrap.dedent("""
    import ctypes, hashlib, json, platform, sys
    import numpy as np
    import weightsync

    # Drop CAP_SYS_PTRACE (root keeps it otherwise and may read any process): the kernel's ptrace
    # access check then applies to this engine as to any unprivileged one.
    nr = {"x86_64": (125, 126), "aarch64": (90, 91)}[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    assert libc.syscall(nr[0], hdr, data) == 0
    for i in (0, 1, 2):
        data[i] &= ~(1 << 19)
    assert libc.syscall(nr[1], hdr, data) == 0, ctypes.get_errno()

    control, token = sys.argv[1], sys.argv[2]
    e = weightsync.Engine(control, 0, job_token=token)
    dst = {t.name: np.zeros(t.shape, np.uint16) for t in e.layout()}
    e.register({n: (a, "bf16") for n, a in dst.items()}, format="hf")
    print("READY", flush=True)
    assert e.wait_for_version(1, timeout=60).version == 1
    print("LANDED " + json.dumps({n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in dst.items()}), flush=True)
    e.close()
""")


def test_a_non_dumpable_trainer_is_read_through_shared_memory(tmp_path: Path, procs: Procs) -> None:
    """A colocated job where the kernel refuses the engine ptrace access to the trainer: the
    trainer non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``, as some launchers and hardened images
    leave it), the engine another process without ``CAP_SYS_PTRACE``. ``process_vm_readv`` is
    refused, so the engine copies every byte out of memory the trainer shared by descriptor:
    the outcome names the path, no byte is a socket payload, and what landed is exact. The
    trainer's f32 shards are cast to the engine's bf16 in staging (the shared memory)."""
    import ctypes
    import platform

    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("capset numbers known for x86_64 and aarch64 only")
    if not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("no boot id: same-host transfers are never offered")
    c = controller(tmp_path, procs, train="fsdp=1,dtype=f32", infer="tp=1,dp=1,format=hf")
    # cwd: not python/, whose source tree would shadow the installed package.
    child = subprocess.Popen([sys.executable, "-c", ENGINE_CHILD, c.control, c.job_token],
                             stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_DUMPABLE = 4
    # Non-dumpable from before the trainer starts (as a launcher leaves it), restored at the end.
    assert libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    t = weightsync.Trainer(c.control, 0, job_token=c.job_token)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "READY"
        full, src = {}, {}
        for s in t.layout():
            full[s.name] = full_value(s.name, tuple(s.global_shape), 1)
            # bf16 patterns widened to f32: their casts back are exact.
            src[s.name] = (full[s.name].astype(np.uint32) << 16).view(np.float32)
        t.register(src)
        o = t.push(1).wait(timeout=60)
        line = child.stdout.readline()
        assert child.wait(timeout=60) == 0
        assert line.startswith("LANDED "), line
        seen = json.loads(line.split(" ", 1)[1])
        for n, want in full.items():
            assert seen[n] == hashlib.sha256(want.tobytes()).hexdigest(), f"{n} differs"
        assert o.path == "shared_memory", o
        assert o.path_bytes["payloads"] == 0 and o.path_bytes["process_vm_readv"] == 0, o
        assert o.path_bytes["shared_memory"] == o.bytes > 0, o
        assert o.direct_bytes == 0 and o.staged_bytes > 0, o  # every byte cast in staging
    finally:
        t.close()
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        if child.poll() is None:
            child.kill()
