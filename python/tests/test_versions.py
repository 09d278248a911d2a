"""Versions bound to bytes, runs and a controller that survives its own crash, against a real
controller process (issue 38): an optimizer step during a sync fails it naming the tensor and
the next one commits; a push while the previous sync runs is refused; a job restarted from a
checkpoint two versions back goes on under a new run; the controller `kill -9`ed mid-sync and
restarted from its state file: the in-flight `wait()` raises, the workers rejoin unaided and
the next version commits byte-exact, no engine version going back. Seconds each."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import weightsync

from conftest import Controller, Procs, free_port, start_controller, weightsync_bin
from test_embedded import CONFIG, full_value, in_threads, settled

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")


class TorchJob:
    """Two trainers (fsdp=2) holding torch bf16 CPU tensors, and two numpy engines (hf, dp=2),
    in this process. ``run`` is the trainers' run."""

    def __init__(self, c: Controller, run: int = 0, hold: threading.Event | None = None) -> None:
        tok = c.job_token
        self.entered = threading.Event()
        self.seen: dict[str, list[tuple[int | None, int]]] = {}
        self.engines = [weightsync.Engine(c.control, r, job_token=tok) for r in range(2)]
        if hold is not None:
            # rollout-0 holds every sync in its before_landing hook until `hold` is set.
            def before(version: int) -> None:
                self.entered.set()
                hold.wait(60)

            self.engines[0].set_hooks(before_landing=before)
        self.dst = [{t.name: np.zeros(t.shape, np.uint16) for t in e.layout()} for e in self.engines]
        in_threads([lambda e=e, d=d: e.register({n: (a, "bf16") for n, a in d.items()}, format="hf")
                    for e, d in zip(self.engines, self.dst)])
        self.trainers: list[weightsync.Trainer] = []
        self.src: list[dict[str, Any]] = []
        self.shards: list[dict[str, Any]] = []
        self.start_trainers(c, run)

    def start_trainers(self, c: Controller, run: int) -> None:
        self.trainers = [weightsync.Trainer(c.control, r, job_token=c.job_token, run=run) for r in range(2)]
        self.shards = [{s.name: s for s in t.layout()} for t in self.trainers]
        self.src = [{n: torch.zeros(tuple(s.shape), dtype=torch.bfloat16) for n, s in sh.items()}
                    for sh in self.shards]
        in_threads([lambda t=t, s=s: t.register(s) for t, s in zip(self.trainers, self.src)])

    def step(self, version: int) -> dict[str, Any]:
        """An optimizer step: every trainer's tensors take `version`'s values in place (which
        torch counts in `tensor._version`); returns the full tensors."""
        full: dict[str, Any] = {}
        with torch.no_grad():
            for shards, src in zip(self.shards, self.src):
                for name, s in shards.items():
                    full.setdefault(name, full_value(name, tuple(s.global_shape), version))
                    box = tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape))
                    src[name].copy_(torch.from_numpy(np.ascontiguousarray(full[name][box])).view(torch.bfloat16))
        return full

    def push(self, version: int) -> list[weightsync.SyncOutcome]:
        return in_threads([lambda t=t: t.push(version).wait(timeout=60) for t in self.trainers])

    def check(self, version: int, full: dict[str, Any], run: int | None = None) -> None:
        for e, dst in zip(self.engines, self.dst):
            assert e.wait_for_version(version, timeout=30).version == version
            st = e.status()
            assert (st.version, st.state) == (version, "committed"), st
            if run is not None:
                assert st.run == run, st
            for name, a in dst.items():
                assert np.array_equal(a, full[name]), f"{e.worker_id} v{version}: {name} differs"

    def close_trainers(self) -> None:
        for t in self.trainers:
            t.close()

    def close(self) -> None:
        self.close_trainers()
        for e in self.engines:
            e.close()


def controller(tmp_path: Path, procs: Procs) -> Controller:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    return start_controller(procs, str(cfg), "fsdp=2", "tp=1,dp=2,format=hf")


def test_an_optimizer_step_during_a_sync_fails_it_naming_the_tensor_and_the_next_commits(
    tmp_path: Path, procs: Procs
) -> None:
    job = TorchJob(controller(tmp_path, procs))
    try:
        full = job.step(1)
        job.push(1)
        job.check(1, full)
        # trainer-0 pushes 2, then steps its optimizer on one tensor before its sync ended (the
        # sync starts once trainer-1 pushes): what it would send mixes two versions.
        job.step(2)
        p0 = job.trainers[0].push(2)
        victim = sorted(job.src[0])[3]
        with torch.no_grad():
            job.src[0][victim].add_(1)
        p1 = job.trainers[1].push(2)
        errors = []
        for p in (p0, p1):
            with pytest.raises(weightsync.SyncFailedError) as e:
                p.wait(timeout=60)
            errors.append(e.value)
        err = errors[0]
        assert err.kind is weightsync.FailureKind.MODIFIED, err
        assert err.worker == "trainer-0" and err.tensor == victim, err
        assert victim in str(err) and "written while version 2" in str(err), err
        assert all((x.kind, x.tensor) == (err.kind, err.tensor) for x in errors), errors
        # The engines never commit the mixed bytes: they still hold version 1.
        for e in job.engines:
            with pytest.raises(weightsync.SyncFailedError) as failed:
                e.wait_for_version(2, timeout=10)
            assert failed.value.kind is weightsync.FailureKind.MODIFIED, failed.value
            assert settled(e).version == 1
        # The next step and push commit, byte-exact.
        full = job.step(3)
        outcomes = job.push(3)
        assert all(o.version == 3 and o.superseded is None for o in outcomes), outcomes
        job.check(3, full)
    finally:
        job.close()


def test_a_push_while_the_previous_sync_runs_is_refused(tmp_path: Path, procs: Procs) -> None:
    hold = threading.Event()
    job = TorchJob(controller(tmp_path, procs), hold=hold)
    try:
        full = job.step(1)
        pushes = [t.push(1) for t in job.trainers]
        assert job.entered.wait(30), "the sync never reached rollout-0's hook"
        time.sleep(0.5)  # every trainer has had the Prepare by now
        with pytest.raises(weightsync.PushRefusedError) as e:
            job.trainers[0].push(2)
        assert e.value.running == 1 and "version 1" in str(e.value), e.value
        hold.set()
        outcomes = in_threads([lambda p=p: p.wait(timeout=60) for p in pushes])
        assert [o.version for o in outcomes] == [1, 1]
        job.check(1, full)
        # Once it ended, the next push goes.
        full = job.step(2)
        job.push(2)
        job.check(2, full)
    finally:
        hold.set()
        job.close()


def test_a_restart_from_a_checkpoint_two_versions_back_goes_on_under_a_new_run(
    tmp_path: Path, procs: Procs
) -> None:
    c = controller(tmp_path, procs)
    job = TorchJob(c)
    try:
        for v in (1, 2, 3):
            full = job.step(v)
            job.push(v)
        job.check(3, full, run=0)
        # The training processes die and restart from the checkpoint of version 1.
        job.close_trainers()
        job.start_trainers(c, run=0)
        job.step(2)
        # Without a new run, version 2 is stale: said so by kind, not a hang, not a crash loop.
        pushes = [t.push(2) for t in job.trainers]
        for p in pushes:
            with pytest.raises(weightsync.SyncFailedError) as e:
                p.wait(timeout=30)
            assert e.value.kind is weightsync.FailureKind.STALE, e.value
            assert "new run" in str(e.value), e.value
        # Declaring a new run, the job goes on from version 2.
        for t in job.trainers:
            t.begin_run(1)
            assert t.run == 1
        with pytest.raises(weightsync.RegistrationError):
            job.trainers[0].begin_run(1)
        for v in (2, 3, 4):
            full = job.step(v)
            outcomes = job.push(v)
            assert all(o.version == v and o.superseded is None for o in outcomes), outcomes
            job.check(v, full, run=1)
        health = c.get("/healthz")
        assert health["run"] == 1 and health["latest_committed"] == {"run": 1, "version": 4}, health
    finally:
        job.close()


def test_a_newer_version_pushed_first_supersedes_without_an_error(tmp_path: Path, procs: Procs) -> None:
    job = TorchJob(controller(tmp_path, procs))
    try:
        job.step(1)
        # trainer-0 ran ahead: it pushed 1 and then 2 before trainer-1 pushed anything.
        first = job.trainers[0].push(1)
        full = job.step(2)
        second = job.trainers[0].push(2)
        out = first.wait(timeout=30)
        assert out.superseded is not None and "superseded by version 2" in out.superseded, out
        assert out.bytes == 0 and out.version == 1
        late = job.trainers[1].push(2)
        assert [h.wait(timeout=60).version for h in (second, late)] == [2, 2]
        job.check(2, full)
    finally:
        job.close()


def start_at(procs: Procs, c: Controller, model: str, state: Path) -> None:
    """(Re)starts the controller `c` names on its own ports, with a state file."""
    argv = [weightsync_bin(), "controller", "--control", c.control, "--http", c.http.removeprefix("http://"),
            "--model", model, "--train", "fsdp=2", "--infer", "tp=1,dp=2,format=hf", "--dtype", "bf16",
            "--sync-timeout-s", "120", "--state-file", str(state)]
    c.proc = procs.start("controller", argv, env={**c.env(), "RUST_LOG": os.environ.get("RUST_LOG", "info")})
    deadline = time.monotonic() + 30
    while True:
        assert c.proc.popen.poll() is None, f"controller exited: {c.proc.tail()}"
        try:
            c.get("/healthz")
            return
        except OSError:
            assert time.monotonic() < deadline, f"controller not up after 30 s: {c.proc.tail()}"
            time.sleep(0.2)


def test_the_controller_killed_mid_sync_and_restarted_carries_on(tmp_path: Path, procs: Procs) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    state = tmp_path / "controller-state.json"
    tokens = {"job": "job-" + os.urandom(8).hex(), "api": "api-" + os.urandom(8).hex()}
    c = Controller(f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}", tokens["job"], tokens["api"],
                   None)  # type: ignore[arg-type]
    start_at(procs, c, str(cfg), state)
    hold = threading.Event()
    hold.set()
    job = TorchJob(c, hold=hold)
    versions: list[int | None] = []
    try:
        full = job.step(1)
        job.push(1)
        job.check(1, full)
        before = c.get("/healthz")
        first_sync = c.get("/v1/syncs")
        # Version 2's sync stops in rollout-0's hook; the controller is killed meanwhile.
        hold.clear()
        job.entered.clear()
        job.step(2)
        pushes = [t.push(2) for t in job.trainers]
        assert job.entered.wait(30)
        # Every worker but rollout-0 (in its hook) answered Prepared: the sync is in flight
        # everywhere. (Killed before a trainer hears of it, its push would be re-sent instead.)
        deadline = time.monotonic() + 30
        while c.get("/v1/syncs")["syncs"][0]["waiting_on"] != ["rollout-0"]:
            assert time.monotonic() < deadline, c.get("/v1/syncs")["syncs"][0]
            time.sleep(0.05)
        os.kill(c.proc.popen.pid, 9)
        c.proc.popen.wait()
        t0 = time.monotonic()
        for p in pushes:
            with pytest.raises(weightsync.SyncFailedError) as e:
                p.wait(timeout=30)
            assert e.value.kind is weightsync.FailureKind.PEER_LOST, e.value
            assert "lost the controller" in str(e.value), e.value
        raised_after = time.monotonic() - t0
        hold.set()
        versions += [e.version for e in job.engines]
        # Restarted from its state file on the same ports: the workers rejoin by themselves.
        start_at(procs, c, str(cfg), state)
        after = c.get("/healthz")
        assert after["incarnation"] != before["incarnation"], (before, after)
        assert after["latest_committed"] == {"run": 0, "version": 1}, after
        deadline = time.monotonic() + 60
        while not c.get("/healthz")["ready"]:
            assert time.monotonic() < deadline, f"workers did not rejoin: {c.proc.tail()}"
            time.sleep(0.2)
        # The next version commits byte-exact, under a sync id (epoch) never used before.
        full = job.step(3)
        outcomes = job.push(3)
        assert [o.version for o in outcomes] == [3, 3]
        job.check(3, full)
        versions += [e.version for e in job.engines]
        new_ids = [s["id"] for s in c.get("/v1/syncs")["syncs"]]
        old_ids = [s["id"] for s in first_sync["syncs"]]
        assert min(new_ids) > max(old_ids) + 1, (old_ids, new_ids)
        assert versions == [1, 1, 3, 3], versions
        print(f"in-flight wait() raised {raised_after:.2f} s after the kill")
    finally:
        hold.set()
        job.close()
