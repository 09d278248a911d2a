"""``python -m weightsync.bench [--json]``: the Python layer against the CLI sidecars, same job,
same run.

Two syncs paths move one job (default: Qwen3-0.6B's bf16 weights, ``fsdp=2`` trainers -> two
``tp=1`` engines in the Hugging Face layout, loopback TCP fabric), each against its own
controller process, one after the other:

- ``sidecar``: ``weightsync worker trainer --source shm:FILE`` and ``weightsync worker rollout``
  processes, syncs triggered over HTTP; each trainer reads a ``/dev/shm`` file laid out as its
  source arena (as a training process exports it; random bytes here), each rollout lands in the
  arena it allocates (the ``demo:`` source is not the same job: it regenerates the weights
  inside every sync);
- ``python``: four Python processes using this package: each trainer registers numpy arrays
  of its shards (bf16 bits as ``uint16``, ``(array, "bf16")``) and pushes; each engine
  registers numpy arrays of every tensor of its rank as the destinations.

Time per sync is the controller's own (``total_ms`` of ``/v1/syncs``: creation to commit) for
both, the median over the syncs after the first of each round (which faults the destination
pages in); ``--rounds`` rounds of each path run in ABBA order (sidecar, python, python, sidecar).
``ratio_vs_sidecar`` = sidecar seconds per sync / python seconds per sync (1.0: the Python
layer costs nothing on the data path; above 1: faster). ``registration_s``: the slowest
``register()`` call of each role. Needs the ``weightsync`` binary (``--bin``, ``$WEIGHTSYNC_BIN``,
or on ``PATH``) and numpy. The numbers are wall times on a possibly shared machine: compare the
ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from .client import Client
from .errors import ClientError

__all__ = ["main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _find_bin(given: str | None) -> str:
    for cand in (given, os.environ.get("WEIGHTSYNC_BIN"), shutil.which("weightsync")):
        if cand:
            return cand
    here = Path(__file__).resolve()
    for root in here.parents:
        for profile in ("release", "debug"):
            p = root / "target" / profile / "weightsync"
            if p.exists():
                return str(p)
    raise SystemExit("weightsync binary not found: pass --bin, set WEIGHTSYNC_BIN or put it on PATH")


class _Job:
    """One controller and its workers; everything is killed on exit."""

    def __init__(self, args: argparse.Namespace, logs: Path, name: str) -> None:
        self.args, self.logs, self.name = args, logs, name
        self.control = f"127.0.0.1:{_free_port()}"
        self.http = f"http://127.0.0.1:{_free_port()}"
        self.env = {
            **os.environ,
            "WEIGHTSYNC_JOB_TOKEN": "job-" + os.urandom(8).hex(),
            "WEIGHTSYNC_API_TOKEN": "api-" + os.urandom(8).hex(),
            "OMP_NUM_THREADS": "1",
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.spawn("controller", [args.bin, "controller", "--control", self.control,
                                  "--http", self.http.removeprefix("http://"), *self.job_flags()])
        self.client = Client(self.http, self.env["WEIGHTSYNC_API_TOKEN"])
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.healthz()
                break
            except ClientError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name}: controller did not come up (log: {logs})") from None
                time.sleep(0.1)

    def job_flags(self) -> list[str]:
        a = self.args
        return ["--model", a.model, "--train", a.train, "--infer", a.infer, "--dtype", a.dtype]

    def spawn(self, what: str, argv: list[str], pipe: bool = False) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{self.name}-{what}.log", "wb")
        p = subprocess.Popen(argv, env=self.env, stdout=subprocess.PIPE if pipe else log,
                             stderr=log, start_new_session=True)
        log.close()
        self.procs.append(p)
        return p

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not self.client.healthz().get("ready"):
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.name}: world not ready after {timeout} s (logs: {self.logs})")
            for p in self.procs:
                if p.poll() not in (None, 0):
                    raise SystemExit(f"{self.name}: a worker exited with {p.returncode} (logs: {self.logs})")
            time.sleep(0.1)

    def syncs(self) -> dict[int, dict[str, Any]]:
        with urllib.request.urlopen(self.http + "/v1/syncs", timeout=10) as r:
            body = json.loads(r.read())
        rows = body if isinstance(body, list) else body.get("syncs", [])
        return {int(s["version"]): s for s in rows}

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()


def _summary(job: _Job, versions: list[int]) -> dict[str, Any]:
    syncs = job.syncs()
    bad = [v for v in versions if syncs.get(v, {}).get("state") != "committed"]
    if bad:
        raise SystemExit(f"{job.name}: versions {bad} did not commit: {[syncs.get(v) for v in bad]}")
    secs = [syncs[v]["stages"]["total_ms"] / 1e3 for v in versions]
    timed = secs[1:] or secs
    return {
        "seconds_per_sync": statistics.median(timed),
        "all_seconds": [round(s, 4) for s in secs],
        "bytes_per_sync": int(syncs[versions[-1]]["bytes"]),
    }


def _run_sidecars(args: argparse.Namespace, logs: Path, world: tuple[int, int], arena_bytes: int) -> dict[str, Any]:
    job = _Job(args, logs, "sidecar")
    files = [Path(f"/dev/shm/weightsync-bench-{os.getpid()}-{r}") for r in range(world[0])]
    try:
        n_train, n_infer = world
        chunk = os.urandom(64 << 20)
        for f in files:  # an upper bound of a rank's source arena: the whole model
            with open(f, "wb") as out:
                left = arena_bytes
                while left > 0:
                    left -= out.write(chunk[: min(left, len(chunk))])
        common = ["--controller", job.control, *job.job_flags()]
        for r in range(n_infer):
            job.spawn(f"rollout{r}", [args.bin, "worker", "rollout", "--rank", str(r), *common])
        for r in range(n_train):
            job.spawn(f"trainer{r}", [args.bin, "worker", "trainer", "--rank", str(r), "--source", f"shm:{files[r]}", *common])
        job.wait_ready()
        versions = list(range(1, args.syncs + 1))
        for v in versions:
            job.client.sync(v)
        return _summary(job, versions)
    finally:
        job.close()
        for f in files:
            f.unlink(missing_ok=True)


def _merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One path's rounds: the median over every timed sync (the first of each round is not)."""
    out = dict(rounds[-1])
    timed = [t for r in rounds for t in (r["all_seconds"][1:] or r["all_seconds"])]
    out["seconds_per_sync"] = statistics.median(timed)
    out["all_seconds"] = [r["all_seconds"] for r in rounds]
    if "registration_s" in rounds[0]:
        out["registration_s"] = {k: max(r["registration_s"][k] for r in rounds) for k in rounds[0]["registration_s"]}
    return out


def _run_python(args: argparse.Namespace, logs: Path, world: tuple[int, int]) -> dict[str, Any]:
    job = _Job(args, logs, "python")
    try:
        n_train, n_infer = world
        me = [sys.executable, "-m", "weightsync.bench", "--controller", job.control, "--syncs", str(args.syncs)]
        engines = [job.spawn(f"engine{r}", [*me, "--role", "engine", "--rank", str(r)], pipe=True) for r in range(n_infer)]
        trainers = [job.spawn(f"trainer{r}", [*me, "--role", "trainer", "--rank", str(r)], pipe=True) for r in range(n_train)]
        reports = []
        for p in trainers + engines:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"python: a worker exited with {p.returncode} (logs: {logs})")
            reports.append(json.loads(out.decode().strip().splitlines()[-1]))
        versions = list(range(1, args.syncs + 1))
        summary = _summary(job, versions)
        tr = [r for r in reports if r["role"] == "trainer"]
        summary["registration_s"] = {
            "trainer": max(r["register_s"] for r in tr),
            "engine": max(r["register_s"] for r in reports if r["role"] == "engine"),
        }
        summary["tensors_registered"] = {
            "trainer": max(r["tensors"] for r in tr),
            "engine": max(r["tensors"] for r in reports if r["role"] == "engine"),
        }
        last = [r["outcomes"][-1] for r in tr]
        summary["staged_bytes"] = sum(o["staged_bytes"] for o in last)
        summary["direct_bytes"] = sum(o["direct_bytes"] for o in last)
        return summary
    finally:
        job.close()


def _numpy_arrays(shapes: list[tuple[str, str, tuple[int, ...]]], fill: bool) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(7)
    items = {"bf16": np.uint16, "f16": np.float16, "f32": np.float32, "f8_e4m3": np.uint8}
    out: dict[str, Any] = {}
    for name, dtype, shape in shapes:
        ty = items[dtype]
        if fill:
            a = rng.integers(0, 1 << 14, size=shape, dtype=np.uint16).astype(ty) if ty != np.uint8 \
                else rng.integers(0, 120, size=shape, dtype=np.uint8)
        else:
            a = np.zeros(shape, dtype=ty)
        out[name] = (a, dtype)
    return out


def _role(args: argparse.Namespace) -> None:
    from .engine import Engine
    from .trainer import Trainer

    if args.role == "trainer":
        t = Trainer(args.controller, args.rank)
        arrays = _numpy_arrays([(s.name, s.dtype, s.shape) for s in t.layout()], fill=True)
        t0 = time.perf_counter()
        t.register(arrays)
        reg = time.perf_counter() - t0
        outcomes = []
        for v in range(1, args.syncs + 1):
            o = t.push(v).wait(timeout=600)
            outcomes.append({"version": o.version, "bytes": o.bytes, "staged_bytes": o.staged_bytes,
                             "direct_bytes": o.direct_bytes, "seconds": o.seconds})
        t.close()
        print(json.dumps({"role": "trainer", "register_s": reg, "tensors": len(arrays), "outcomes": outcomes}))
    else:
        e = Engine(args.controller, args.rank)
        arrays = _numpy_arrays([(i.name, i.dtype, i.shape) for i in e.layout()], fill=False)
        t0 = time.perf_counter()
        e.register(arrays)
        reg = time.perf_counter() - t0
        e.wait_for_version(args.syncs, timeout=1800)
        e.close()
        print(json.dumps({"role": "engine", "register_s": reg, "tensors": len(arrays)}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m weightsync.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--train", default="fsdp=2")
    ap.add_argument("--infer", default="tp=1,dp=2,format=hf")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--syncs", type=int, default=4, help="syncs per round (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each path, in ABBA order")
    ap.add_argument("--bin", default=None)
    ap.add_argument("--logs", default=None, help="folder for the processes' logs (default: a temp folder)")
    ap.add_argument("--role", choices=["trainer", "engine"], help=argparse.SUPPRESS)
    ap.add_argument("--controller", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        return _role(args)
    args.bin = _find_bin(args.bin)
    import tempfile

    logs = Path(args.logs or tempfile.mkdtemp(prefix="weightsync-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    world, model_bytes = _world(args)
    # Rounds in ABBA order (sidecar, python, python, sidecar, ...), so load that drifts during the
    # run (a shared machine) weighs on both paths alike; medians over every timed sync.
    runs: dict[str, list[dict[str, Any]]] = {"sidecar": [], "python": []}
    for r in range(args.rounds):
        order = ["sidecar", "python"] if r % 2 == 0 else ["python", "sidecar"]
        for path in order:
            if path == "sidecar":
                runs[path].append(_run_sidecars(args, logs, world, model_bytes))
            else:
                runs[path].append(_run_python(args, logs, world))
    sidecar, python = _merge(runs["sidecar"]), _merge(runs["python"])
    result = {
        "bench": "python_vs_sidecar",
        "model": args.model, "train": args.train, "infer": args.infer, "dtype": args.dtype,
        "trainers": world[0], "engines": world[1], "syncs": args.syncs, "rounds": args.rounds,
        "bytes_per_sync": python["bytes_per_sync"],
        "sidecar": sidecar,
        "python": python,
        "ratio_vs_sidecar": sidecar["seconds_per_sync"] / python["seconds_per_sync"],
        "registration_s": python["registration_s"],
        "logs": str(logs),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model} {args.train} -> {args.infer} {args.dtype}, {python['bytes_per_sync'] / 1e6:.1f} MB per sync")
        print(f"  sidecar: {sidecar['seconds_per_sync']:.3f} s per sync  {sidecar['all_seconds']}")
        print(f"  python:  {python['seconds_per_sync']:.3f} s per sync  {python['all_seconds']}")
        print(f"  ratio_vs_sidecar {result['ratio_vs_sidecar']:.3f}  (sidecar s / python s; 1.0 = the same)")
        print(f"  register(): trainer {python['registration_s']['trainer']:.3f} s, engine {python['registration_s']['engine']:.3f} s")
        print(f"  trainer bytes: staged {python['staged_bytes']}, direct {python['direct_bytes']}")


def _world(args: argparse.Namespace) -> tuple[tuple[int, int], int]:
    """((training ranks, inference ranks), bytes of the whole model) as the planner counts them."""
    out = subprocess.run(
        [args.bin, "plan", "--model", args.model, "--train", args.train, "--infer", args.infer,
         "--dtype", args.dtype, "--json"],
        check=True, capture_output=True,
    ).stdout
    plan = json.loads(out)
    model_bytes = 2 * int(plan["elements"])  # the training weights are bf16
    return (int(plan["train_ranks"]), int(plan["infer_ranks"])), model_bytes + (1 << 20)


if __name__ == "__main__":
    main()
