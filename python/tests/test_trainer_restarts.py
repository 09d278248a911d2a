"""Trainers ``kill -9``ed mid-job and restarted by torchrun, one rank slow in its optimizer step:
no engine ever commits bytes that differ from one consistent version of the whole parameters
(issue 38). Real processes: a controller, ``torchrun --max-restarts 2`` running two ranks of
``jobs/train_restarts.py`` (CPU/gloo, torch bf16 shards registered with ``weightsync.Trainer``),
two engine processes (``jobs/engine_digests.py``) recording the SHA-256 of every tensor at every
commit.

Each version's weights are a pure function of the version, so the expected digests are computed
here, without the job. Twice the slow rank is SIGKILLed while half-updated, after the other rank
pushed that version; torchrun restarts the group, whose slow rank is then the other one, so the
version the dead group left pushed by one rank is pushed again at once by the new fast rank
while the new slow rank is mid-step. A controller that counted a dead rank's push would sync the
half-updated tensors: a torn version (with the controller's two guards against that removed, the
dead process's push dropped at its disconnect and a push counted only from the pusher's current
connection, this test fails: version 3 committed with 13 of its tensors not version 3's).
About 30 s on a quiet 2-core box, 70 s on a loaded one (three torch start-ups per rank)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("numpy")

from conftest import JOBS, Procs  # noqa: E402
from test_embedded import controller  # noqa: E402

sys.path.insert(0, str(JOBS))
from train_restarts import digest  # noqa: E402

FINAL = 7
# (incarnation, version): the slow rank is killed half-updated there. Incarnation 0's slow rank
# is 1, incarnation 1's is 0.
KILLS = [(0, 3), (1, 4)]
TIMEOUT_S = 240


def wait_for_file(path: Path, procs: Procs, deadline: float) -> Any:
    while not path.exists():
        for p in procs.procs:
            if p.popen.poll() is not None:
                pytest.fail(f"{p.name} exited ({p.popen.returncode}) before {path.name}\n{procs.logs()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {path.name} after {TIMEOUT_S} s\n{procs.logs()}")
        time.sleep(0.02)
    return json.loads(path.read_text())


def committed(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"engine{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.e2e
def test_trainers_killed_and_restarted_by_torchrun_commit_only_whole_versions(tmp_path: Path, procs: Procs) -> None:
    t0 = time.monotonic()
    c = controller(tmp_path, procs)
    out = tmp_path / "out"
    out.mkdir()
    engines = [procs.start(f"engine{r}", [sys.executable, str(JOBS / "engine_digests.py"), "--controller", c.control,
                                          "--rank", str(r), "--final", str(FINAL), "--out", str(out)], env=c.env())
               for r in (0, 1)]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "2", "--monitor-interval", "0.1", str(JOBS / "train_restarts.py"),
            "--controller", c.control, "--http", c.http, "--out", str(out), "--final", str(FINAL)]
    for g, v in KILLS:
        argv += ["--kill-at", f"{g}:{v}"]
    torchrun = procs.start("torchrun", argv, env=c.env())
    deadline = time.monotonic() + TIMEOUT_S

    for g, v in KILLS:
        slow, fast = (1, 0) if g % 2 == 0 else (0, 1)
        victim = wait_for_file(out / f"midstep_g{g}_v{v}.json", procs, deadline)["pid"]
        wait_for_file(out / f"pushed_g{g}_r{fast}_v{v}.json", procs, deadline)
        time.sleep(0.3)  # the fast rank's push has reached the controller
        assert victim == wait_for_file(out / f"incarnation_g{g}_r{slow}.json", procs, deadline)["pid"]
        os.kill(victim, signal.SIGKILL)

    for p in (torchrun, *engines):
        try:
            rc = p.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{p.name} still running after {TIMEOUT_S} s\n{procs.logs()}")
        assert rc == 0, f"{p.name} exited with {rc}\n{procs.logs()}"

    # torchrun restarted the group twice; each incarnation resumed after the last committed
    # version: the killed version again.
    firsts = {g: {json.loads((out / f"incarnation_g{g}_r{r}.json").read_text())["first"] for r in (0, 1)}
              for g in range(len(KILLS) + 1)}
    assert firsts == {0: {1}, 1: {KILLS[0][1]}, 2: {KILLS[1][1]}}, firsts

    # Every commit on every engine is one whole version, byte for byte; versions only go up,
    # each committed once, up to the final one.
    for r in (0, 1):
        lines = committed(out, r)
        versions = [line["version"] for line in lines]
        assert versions == list(range(1, FINAL + 1)), f"engine {r} committed {versions}"
        for line in lines:
            v = line["version"]
            torn = [n for n, (shape, got) in line["tensors"].items() if got != digest(n, tuple(shape), v)]
            assert not torn, f"engine {r} committed version {v} with {len(torn)} tensors not version {v}'s: {torn[:5]}"
        assert len(lines[0]["tensors"]) > 0
    health = c.get("/healthz")
    assert health["latest_committed"]["version"] == FINAL, health
    print(f"{len(KILLS)} kills, {FINAL} versions committed whole on 2 engines in {time.monotonic() - t0:.1f} s")
