"""An inference engine process that records the digest of every version it commits (run by
``test_trainer_restarts.py``):

    python engine_digests.py --controller HOST:PORT --rank R --final 7 --out OUT

Numpy destinations (bf16 bit patterns as uint16) in the Hugging Face layout, registered with
``weightsync.Engine``. Its ``after_commit`` hook appends one line per committed version to
``OUT/engine{R}.jsonl``: the version, and each tensor's shape and the SHA-256 of its bytes as
they are at that commit. It runs until ``--final`` committed (syncs that fail meanwhile, e.g.
when a trainer is killed mid-sync, are logged and waited past).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import numpy as np

import weightsync


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--controller", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--final", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout-s", type=float, default=300)
    args = ap.parse_args()
    record = os.path.join(args.out, f"engine{args.rank}.jsonl")

    engine = weightsync.Engine(controller=args.controller, rank=args.rank)
    dst = {t.name: np.zeros(t.shape, np.uint16) for t in engine.layout()}

    def after_commit(version: int) -> None:
        line = {"version": version,
                "tensors": {n: [list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()] for n, a in dst.items()}}
        with open(record, "a") as f:
            f.write(json.dumps(line) + "\n")

    engine.set_hooks(after_commit=after_commit)
    engine.register({n: (a, "bf16") for n, a in dst.items()}, format="hf")
    print(f"{engine.worker_id}: registered", flush=True)
    deadline = time.monotonic() + args.timeout_s
    while True:
        try:
            engine.wait_for_version(args.final, timeout=max(0.1, deadline - time.monotonic()))
            break
        except weightsync.SyncFailedError as e:
            print(f"{engine.worker_id}: a sync failed: {e}", flush=True)
            time.sleep(0.1)
    engine.close()


if __name__ == "__main__":
    main()
