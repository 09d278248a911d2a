"""A whole job with nothing but the installed wheel (run by test_wheel.py in a fresh venv, from
a folder outside the source checkout; no numpy, no torch):

    python wheel_job.py main CONFIG_JSON OUT_DIR

starts ``weightsync.Controller`` in this process, then two trainer processes (fsdp=2) and two
engine processes (format=hf, dp=2), each this script again (``trainer R`` / ``engine R``), whose
tensors are plain ``bytearray``s seen through ``memoryview.cast`` with the layout's shapes (bf16
bit patterns as uint16). The trainers write version V's values in place and push; each engine
waits for V and reports a digest of every tensor it holds; the trainers report the digest of
every full tensor they sliced their shards from. The main process compares the two, closes the
controller and prints ``wheel job ok``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import weightsync

VERSIONS = (1, 2)
# bf16 bit patterns of finite numbers below 2: the high byte (little-endian) masked to 0x3F.
FINITE_HIGH = bytes(b & 0x3F for b in range(256))


def full_value(name: str, shape: tuple[int, ...], version: int) -> bytes:
    """The bytes of tensor ``name`` at ``version`` (C order, 2-byte elements)."""
    n = 2
    for d in shape:
        n *= d
    seed = hashlib.blake2b(f"{name}/{version}".encode()).digest()
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.blake2b(counter.to_bytes(8, "little"), key=seed[:32]).digest()
        counter += 1
    del out[n:]
    out[1::2] = bytes(out[1::2]).translate(FINITE_HIGH)
    return bytes(out)


def box_of(full: bytes, shape: tuple[int, ...], offset: tuple[int, ...], box: tuple[int, ...]) -> bytes:
    """The C-order bytes of the box ``offset`` + ``box`` of a tensor of ``shape``."""
    strides = [2] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    row = box[-1] * 2
    out = bytearray()
    for idx in itertools.product(*(range(o, o + s) for o, s in zip(offset[:-1], box[:-1]))):
        start = sum(i * st for i, st in zip(idx, strides)) + offset[-1] * 2
        out += full[start:start + row]
    return bytes(out)


def buffer(shape: tuple[int, ...]) -> tuple[bytearray, memoryview]:
    n = 2
    for d in shape:
        n *= d
    raw = bytearray(n)
    return raw, memoryview(raw).cast("B").cast("H", list(shape))


def trainer(rank: int, out: Path) -> None:
    t = weightsync.Trainer(os.environ["CONTROL"], rank, job_token=os.environ["JOB_TOKEN"])
    shards = t.layout()
    bufs = {s.name: buffer(s.shape) for s in shards}
    t.register({name: (view, "bf16") for name, (_, view) in bufs.items()})
    for v in VERSIONS:
        digests = {}
        for s in shards:
            full = full_value(s.name, s.global_shape, v)
            digests[s.name] = hashlib.sha256(full).hexdigest()
            raw = bufs[s.name][0]
            raw[:] = box_of(full, s.global_shape, s.offset, s.shape)
        (out / f"trainer{rank}_v{v}.json").write_text(json.dumps(digests))
        outcome = t.push(v).wait(timeout=120)
        assert outcome.version == v and outcome.bytes > 0, outcome
    t.close()


def engine(rank: int, out: Path) -> None:
    e = weightsync.Engine(os.environ["CONTROL"], rank, job_token=os.environ["JOB_TOKEN"])
    bufs = {t.name: buffer(t.shape) for t in e.layout()}
    e.register({name: (view, "bf16") for name, (_, view) in bufs.items()}, format="hf")
    for v in VERSIONS:
        st = e.wait_for_version(v, timeout=120)
        assert st.version == v and st.state == "committed", st
        digests = {name: hashlib.sha256(raw).hexdigest() for name, (raw, _) in bufs.items()}
        (out / f"engine{rank}_v{v}.json").write_text(json.dumps(digests))
    e.close()


def main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    t0 = time.monotonic()
    with weightsync.Controller(model=args.model, train="fsdp=2", infer="tp=1,dp=2,format=hf") as c:
        print(c.control_address, c.http_url)
        assert "job_token" not in repr(c) and c.job_token not in repr(c) and c.api_token not in repr(c)
        assert (c.trainers, c.engines) == (2, 2), c
        env = {**os.environ, "CONTROL": c.control_address, "JOB_TOKEN": c.job_token}
        me = os.path.abspath(__file__)
        children = [
            subprocess.Popen([sys.executable, me, role, str(r), str(out)], env=env)
            for role in ("engine", "trainer")
            for r in range(2)
        ]
        for p in children:
            assert p.wait(timeout=180) == 0, f"{p.args} exited {p.returncode}"
        assert c.client().healthz() is not None
        for v in VERSIONS:
            sent: dict[str, str] = {}
            for r in range(2):
                for name, d in json.loads((out / f"trainer{r}_v{v}.json").read_text()).items():
                    assert sent.setdefault(name, d) == d, f"trainers disagree on {name}"
            for r in range(2):
                got = json.loads((out / f"engine{r}_v{v}.json").read_text())
                assert got.keys() == sent.keys(), (sorted(got), sorted(sent))
                bad = [n for n in got if got[n] != sent[n]]
                assert not bad, f"engine {r} v{v}: {bad} differ from the trainers'"
    assert not c.running
    print(f"wheel job ok: {len(sent)} tensors, versions {list(VERSIONS)}, {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["main", "trainer", "engine"])
    ap.add_argument("model_or_rank", help="main: the model (config.json); else the rank")
    ap.add_argument("out")
    a = ap.parse_args()
    if a.role == "main":
        main(argparse.Namespace(model=a.model_or_rank, out=a.out))
    elif a.role == "trainer":
        trainer(int(a.model_or_rank), Path(a.out))
    else:
        engine(int(a.model_or_rank), Path(a.out))
