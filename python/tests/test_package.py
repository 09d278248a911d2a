"""The package without a running job: it imports without torch, reads tensors of every kind
(torch, numpy via DLPack, the buffer protocol) in place, refuses what it cannot use with a
message that says why, raises its own exception types, and talks to a real controller's API."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import weightsync
from weightsync import _native

from conftest import Procs, start_controller


def test_import_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys, weightsync; weightsync.Trainer, weightsync.Engine, weightsync.Client;"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)"
    )
    # cwd elsewhere: `-c` puts cwd first on sys.path, and the source tree has no native module.
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_exception_hierarchy() -> None:
    for cls in (weightsync.RegistrationError, weightsync.LayoutMismatchError, weightsync.StaleTensorError,
                weightsync.SyncFailedError, weightsync.TimeoutError, weightsync.ClosedError,
                weightsync.ConnectError, weightsync.ClientError):
        assert issubclass(cls, weightsync.SyncError)
    e = weightsync.SyncFailedError("version 3 failed on rollout-1: gone", worker="rollout-1", version=3, cause="gone")
    assert (e.worker, e.version, e.cause, str(e)) == ("rollout-1", 3, "gone", "version 3 failed on rollout-1: gone")
    # A failure's kind is a str enum: compared with its name, OTHER when none or unknown.
    assert e.kind is weightsync.FailureKind.OTHER
    e = weightsync.SyncFailedError("lost", worker="rollout-1", kind="peer_lost")
    assert e.kind is weightsync.FailureKind.PEER_LOST and e.kind == "peer_lost" and str(e.kind) == "peer_lost"
    assert weightsync.SyncFailedError("?", kind="from-a-newer-controller").kind is weightsync.FailureKind.OTHER


def test_sync_result_keeps_the_failure_kind() -> None:
    body = {"id": 4, "version": 2, "state": "failed", "failure": {
        "worker": "rollout-1", "kind": "checksum", "tensor": "w", "cause": "checksum mismatch in w"}}
    f = weightsync.SyncResult.from_json(body).failure
    assert f == weightsync.Failure("rollout-1", "w", "checksum mismatch in w", weightsync.FailureKind.CHECKSUM)


def test_numpy_arrays_in_place() -> None:
    np = pytest.importorskip("numpy")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    info = _native.tensor_info(a)
    assert isinstance(info, _native.TensorMemory)
    assert (info.address, info.bytes, info.dtype, info.shape, info.kind) == (
        a.__array_interface__["data"][0], 48, "f32", [3, 4], "dlpack")
    with pytest.raises(AttributeError):
        info.bytes = 0  # type: ignore[misc]
    bits = np.zeros((2, 3), np.uint16)  # bf16 bits: numpy has no bf16
    info = _native.tensor_info(bits, "bf16")
    assert (info.dtype, info.shape) == ("bf16", [2, 3])
    with pytest.raises(TypeError, match="code 1, 16 bits"):
        _native.tensor_info(bits)
    with pytest.raises(ValueError, match="cannot view 2-byte elements as f32"):
        _native.tensor_info(bits, "f32")
    with pytest.raises(ValueError, match="non-contiguous"):
        _native.tensor_info(np.zeros((4, 4), np.float16)[:, :2])
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    assert _native.tensor_info(ro).bytes == 16
    with pytest.raises(ValueError, match="read-only"):
        _native.tensor_info(ro, writable=True)


def test_buffer_protocol() -> None:
    buf = bytearray(16)
    info = _native.tensor_info(memoryview(buf).cast("f"))
    assert (info.bytes, info.dtype, info.shape, info.kind) == (16, "f32", [4], "buffer")
    with pytest.raises(TypeError, match="not f16 or f32"):
        _native.tensor_info(buf)
    with pytest.raises(TypeError, match="is not a tensor"):
        _native.tensor_info(object())


def test_torch_tensors_without_copy() -> None:
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.randn(4, 5, dtype=torch.bfloat16))  # requires grad: no DLPack
    i = _native.tensor_info(p)
    assert (i.address, i.bytes, i.dtype, i.shape, i.kind) == (p.data_ptr(), 40, "bf16", [4, 5], "torch")
    f8 = _native.tensor_info(torch.zeros(3, 7, dtype=torch.float8_e4m3fn))
    assert (f8.bytes, f8.dtype, f8.shape) == (21, "f8_e4m3", [3, 7])
    view = torch.arange(10, dtype=torch.float32)[2:6]  # a view inside its storage
    v = _native.tensor_info(view)
    assert (v.address, v.bytes) == (view.data_ptr(), 16)
    with pytest.raises(ValueError, match="non-contiguous"):
        _native.tensor_info(p.t())
    with pytest.raises(ValueError, match="empty tensor"):
        _native.tensor_info(torch.zeros(0, 3))
    with pytest.raises(TypeError, match="torch.int64"):
        _native.tensor_info(torch.zeros(3, dtype=torch.int64))


def test_client_against_a_controller(tmp_path: Path, procs: Procs) -> None:
    c = start_controller(procs, "qwen3-0.6b", "fsdp=2", "tp=1,dp=2")
    assert weightsync.Client(c.http).healthz()["status"] == "ok"
    with pytest.raises(weightsync.ClientError) as e:
        weightsync.Client(c.http, "wrong").sync(1)
    assert (e.value.status, e.value.code) == (401, "unauthorized")
    with pytest.raises(weightsync.ClientError) as e:
        weightsync.Client(c.http, c.api_token).sync(1)  # no worker registered yet
    assert e.value.code == "not_ready", e.value
    t0 = time.monotonic()
    with pytest.raises(weightsync.ClientError) as e:
        weightsync.Client(c.http, c.api_token).sync(1, ready_timeout=0.5)  # still nobody
    assert e.value.code == "not_ready" and time.monotonic() - t0 >= 0.5, e.value
    t0 = time.monotonic()
    with pytest.raises(weightsync.ClientError) as e:
        weightsync.Client(c.http, "wrong").sync(1, ready_timeout=30)  # only not_ready is retried
    assert e.value.code == "unauthorized" and time.monotonic() - t0 < 10, e.value
    with pytest.raises(weightsync.ClientError, match="Connection refused|refused"):
        weightsync.Client("127.0.0.1:1", c.api_token, timeout=5).sync(1)


def test_a_bad_same_host_setting_is_refused_by_name(procs: Procs, monkeypatch: pytest.MonkeyPatch) -> None:
    c = start_controller(procs, "qwen3-0.6b", "fsdp=2", "tp=1,dp=2")
    monkeypatch.setenv("WEIGHTSYNC_SAME_HOST", "maybe")
    with pytest.raises(weightsync.ConnectError, match="WEIGHTSYNC_SAME_HOST.*maybe"):
        weightsync.Trainer(controller=c.control, rank=0, job_token=c.job_token)


def test_client_sync_waits_out_not_ready() -> None:
    """``ready_timeout``: the first sync of a training loop may come while the world is still
    accepting its plan; the client retries the controller's ``not_ready`` answers (and only
    those) until it takes the trigger, and sends the same request each time."""
    bodies: list[dict[str, object]] = []

    class Api(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if len(bodies) <= 3:
                status, body = 503, {"error": {"code": "not_ready", "message": "plan 1 is not in force yet"}}
            else:
                status, body = 200, {"sync_id": 7, "version": 5, "state": "committed", "bytes": 64,
                                     "stages": {"total_ms": 12.0}, "created": True}
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"127.0.0.1:{server.server_address[1]}"
        with pytest.raises(weightsync.ClientError) as e:
            weightsync.Client(url, "t").sync(5)  # default: refused at once
        assert e.value.code == "not_ready" and len(bodies) == 1
        r = weightsync.Client(url, "t").sync(5, ready_timeout=30)
        assert (r.id, r.version, r.state, r.seconds) == (7, 5, "committed", 0.012)
        assert bodies == [{"version": 5}] * 4
        with pytest.raises(ValueError, match="ready_timeout"):
            weightsync.Client(url, "t").sync(5, ready_timeout=-1)
    finally:
        server.shutdown()
        server.server_close()
