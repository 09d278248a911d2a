"""Shared fixtures of the Python tests: the `weightsync` binary, a controller process, child
processes whose logs are kept and shown when a test fails, and the figures the end-to-end tests
report (printed at the end of the run)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent / "jobs"
FIGURES: dict[str, Any] = {}


def weightsync_bin() -> str:
    """$WEIGHTSYNC_BIN (test.sh: the installed wheel's console script), else that script beside
    this interpreter, else target/release/weightsync, else target/debug/weightsync."""
    env = os.environ.get("WEIGHTSYNC_BIN")
    if env:
        return env
    script = Path(sys.executable).parent / "weightsync"
    if script.exists():
        return str(script)
    for profile in ("release", "debug"):
        p = REPO / "target" / profile / "weightsync"
        if p.exists():
            return str(p)
    pytest.fail("no weightsync binary: run `cargo build --release -p weightsync-cli` or set WEIGHTSYNC_BIN")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first found, then theirs), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: the fields follow its last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kernel_stacks(popen: subprocess.Popen[bytes]) -> str:
    """The kernel stack of a child and of every process below it (readable as root), to say
    where a stalled start-up waits."""
    out = []
    for pid in [popen.pid, *descendants(popen.pid)]:
        try:
            stack = Path(f"/proc/{pid}/stack").read_text().strip()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append(f"pid {pid} ({cmd[:120]}):\n{stack}")
    return "\n".join(out)


def kill_tree(popen: subprocess.Popen[bytes]) -> None:
    """SIGKILLs a child started in its own session, its process group and every process below
    it: torchrun starts its ranks in sessions of their own, which killing its group misses."""
    if popen.poll() is None:
        below = descendants(popen.pid)
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        popen.wait()


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 60) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


@dataclass
class Procs:
    """Child processes of one test; all are killed at its end."""

    folder: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.folder / f"{name}.log"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        f = open(log, "ab")
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        f.close()
        proc = Proc(name, p, log)
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} (rc {p.popen.poll()}) -----\n{p.tail()}" for p in self.procs)

    def kill_all(self) -> None:
        for p in self.procs:
            kill_tree(p.popen)


@pytest.fixture
def procs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Procs]:
    ps = Procs(tmp_path)
    yield ps
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        print(ps.logs(), file=sys.stderr)
    ps.kill_all()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep


@dataclass
class Controller:
    control: str
    http: str
    job_token: str
    api_token: str
    proc: Proc

    def env(self) -> dict[str, str]:
        return {"WEIGHTSYNC_JOB_TOKEN": self.job_token, "WEIGHTSYNC_API_TOKEN": self.api_token}

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.http + path, timeout=10) as r:
            return json.loads(r.read())


def start_controller(procs: Procs, model: str, train: str, infer: str, dtype: str = "bf16",
                     extra: list[str] | None = None) -> Controller:
    """A controller on two free loopback ports, up and answering /healthz (``extra``: more
    arguments, e.g. ``["--delta"]``).

    A port found free can be taken by another process before the controller binds it (the
    tests start many processes with outbound connections on ephemeral ports): a controller that
    exits saying so is started again on fresh ports, a few times, and any other exit fails."""
    for _ in range(5):
        c = _start_controller_once(procs, model, train, infer, dtype, extra or [])
        if c is not None:
            return c
    pytest.fail(f"controller could not bind free ports in 5 tries: {procs.procs[-1].tail()}")


def _start_controller_once(procs: Procs, model: str, train: str, infer: str, dtype: str,
                           extra: list[str]) -> Controller | None:
    control, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    tokens = {"WEIGHTSYNC_JOB_TOKEN": "job-" + os.urandom(8).hex(), "WEIGHTSYNC_API_TOKEN": "api-" + os.urandom(8).hex()}
    argv = [weightsync_bin(), "controller", "--control", control, "--http", http, "--model", model,
            "--train", train, "--infer", infer, "--dtype", dtype, "--sync-timeout-s", "120", *extra]
    log = procs.folder / "controller.log"
    log_start = log.stat().st_size if log.exists() else 0
    proc = procs.start("controller", argv, env={**tokens, "RUST_LOG": os.environ.get("RUST_LOG", "info")})
    c = Controller(control, "http://" + http, tokens["WEIGHTSYNC_JOB_TOKEN"], tokens["WEIGHTSYNC_API_TOKEN"], proc)
    deadline = time.monotonic() + 30
    while True:
        if proc.popen.poll() is not None:
            # Only this attempt's lines: the log is appended to by every attempt.
            said = proc.log.read_bytes()[log_start:].decode(errors="replace")
            if "Address already in use" in said:
                return None
            pytest.fail(f"controller exited: {proc.tail()}")
        try:
            c.get("/healthz")
            return c
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"controller not up after 30 s: {proc.tail()}")
            time.sleep(0.2)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES:
        terminalreporter.section("weightsync figures")
        for name, fig in FIGURES.items():
            terminalreporter.write_line(f"{name}: {json.dumps(fig)}")
