"""Drives a vLLM *server* with the weightsync backend over HTTP only (run by
tests/test_vllm.py): what an RL orchestrator does next to ``vllm serve``.

    python drive_vllm_server.py --url http://127.0.0.1:P --model-name tiny --controller HOST:PORT \
        --versions 1 2 3 --out OUT

``weightsync.vllm_server.VllmServer`` joins the server to the job (``/init_weight_transfer_engine``),
then for each version: serves the long prompt (its KV is cached under the old weights), brings
the server to the version (``update``: ``/collective_rpc weightsync_ready`` around a long poll of
the controller's ``/v1/versions/{v}`` with ``--controller-http``, polls without; then
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/reset_prefix_cache``), and records to ``OUT/vllm_r0_v{V}.json`` what the server says over
HTTP: ``/weight_info``, its parameters' and arena's SHA-256 (``/collective_rpc
weightsync_digests``), greedy tokens and cached-token counts from ``/v1/completions``, the
backend's status and the sync's timings; then touches ``OUT/vllm_r0_v{V}.done`` for the
lockstep trainer. This process does not import vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_vllm import LONG_PROMPT  # noqa: E402
from tiny import PROMPT  # noqa: E402

from weightsync.vllm_server import VllmServer  # noqa: E402


def complete(url: str, model: str, prompt: list[int]) -> tuple[list[int], int | None]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.loads(r.read())
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return list(out["choices"][0]["token_ids"]), details.get("cached_tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model-name", required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--controller-http", help="the controller's HTTP API: update() waits there, not on the server")
    ap.add_argument("--mode", choices=["staged", "direct"], default="staged")
    ap.add_argument("--versions", type=int, nargs="+", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    srv = VllmServer(args.url, controller=args.controller_http)
    srv.init(args.controller, mode=args.mode, rank=0)
    print("server joined the job", flush=True)
    for v in args.versions:
        complete(args.url, args.model_name, LONG_PROMPT)  # cached under the old weights
        timings = srv.update(v)
        rec = {
            "timings": timings,
            "weight_version": srv.weight_version(),
            "digests": srv.digests()[0],
            "short": complete(args.url, args.model_name, PROMPT),
            "long_first": complete(args.url, args.model_name, LONG_PROMPT),
            "long_cached": complete(args.url, args.model_name, LONG_PROMPT),
            "status": srv.status()[0],
        }
        with open(os.path.join(args.out, f"vllm_r0_v{v}.json"), "w") as f:
            json.dump(rec, f)
        print(json.dumps({"version": v, **{k: timings[k] for k in ("pause_s", "land_s", "load_s", "resume_s")}}),
              flush=True)
        open(os.path.join(args.out, f"vllm_r0_v{v}.done"), "w").close()
    srv.shutdown()


if __name__ == "__main__":
    main()
