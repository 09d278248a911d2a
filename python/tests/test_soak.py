"""A soak of the controller's memory (issue 38): 1,000 syncs of a small job (two numpy trainers
and two numpy engines in this process, a real controller process), the controller's resident
memory read from /proc after the first 250 (warm: the 200-sync history full, the allocator
settled) and after the last. A sync record used to keep every trainer's checksums and every span for the whole history;
ended syncs now drop their checksums and old ones keep a summary, so memory stays flat."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import FIGURES, Procs
from test_embedded import Job, controller

np = pytest.importorskip("numpy")

SYNCS = 1000
WARM = 250  # past the 200 syncs the history keeps


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_a_thousand_syncs_keep_the_controllers_memory_flat(tmp_path: Path, procs: Procs) -> None:
    c = controller(tmp_path, procs)
    job = Job(c)
    pid = c.proc.popen.pid
    try:
        t0 = time.monotonic()
        start = 0
        for v in range(1, SYNCS + 1):
            if v % 50 == 1:
                full = job.step(v)
            outcomes = job.push(v)
            assert all(o.version == v for o in outcomes), outcomes
            if v == WARM:
                start = rss_kib(pid)
        end = rss_kib(pid)
        seconds = time.monotonic() - t0
        # The last step's bytes are what every engine holds.
        last = (SYNCS - 1) // 50 * 50 + 1
        for e, dst in zip(job.engines, job.dst):
            assert e.wait_for_version(SYNCS, timeout=30).version == SYNCS
            assert all(np.array_equal(a, full[n]) for n, a in dst.items()), f"v{last} bytes differ"
        FIGURES["soak"] = {"syncs": SYNCS, "rss_kib_after_250": start, "rss_kib_after_1000": end,
                           "ratio": round(end / start, 3), "seconds": round(seconds, 1)}
        print(FIGURES["soak"])
        # Flat: within 10 % (allocator noise) of the warm figure, 900 syncs later.
        assert end <= start * 1.10, FIGURES["soak"]
    finally:
        job.close()
