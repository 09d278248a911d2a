"""OpenRLHF's own vLLM engine actor class (``openrlhf.trainer.ray.vllm_engine.RolloutRayActor``,
OpenRLHF 0.11.2) receiving through weightsync (``weightsync.openrlhf_engine``), run by
tests/test_openrlhf.py:

    python engine_openrlhf.py --model DIR --controller HOST:PORT --controller-http URL \
        --versions 1 2 3 --out OUT

The class is OpenRLHF's, subclassed by :func:`weightsync.openrlhf_engine.rollout_actor_class`
and built by OpenRLHF's own ``async __init__`` with the engine arguments OpenRLHF's
``create_vllm_engines`` passes (its ``WorkerWrap`` extension among them, which the subclass
replaces), in this process rather than in a Ray actor: OpenRLHF places its engine actors in
placement-group bundles of ``{"GPU": 1}``, which Ray never schedules without a GPU
(docs/openrlhf.md). ``RAY_ADDRESS`` is set so its constructor does not ask a Ray worker for the
cluster's address. Then, as the policy's rank 0 calls them through Ray: ``weightsync_init``
once, ``weightsync_update(v)`` per version; after each, ``OUT/orl_engine_v{V}.json`` holds the
engine's digests (its arena and vLLM's parameters), its ``weight_version`` and the token ids
OpenRLHF's own ``generate`` returned with those weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time


async def run(args: argparse.Namespace) -> None:
    from vllm import SamplingParams

    import openrlhf.trainer.ray.vllm_engine as ve
    from weightsync.openrlhf_engine import rollout_actor_class

    cls = rollout_actor_class(ve.RolloutRayActor, remote=False)
    actor = cls.__new__(cls)
    t = time.perf_counter()
    # create_vllm_engines' actor_kwargs for one engine, tp=1 (CPU: no GPU share, no placement).
    await actor.__init__(model=args.model, enforce_eager=True,
                         worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap",
                         tensor_parallel_size=1, seed=0, distributed_executor_backend="uni", max_model_len=256,
                         enable_prefix_caching=True, dtype="bfloat16", trust_remote_code=True, full_determinism=False,
                         bundle_indices=None, num_gpus=1, enable_sleep_mode=False, agent_func_path=None,
                         remote_rm_url=None, mm_pad_token_ids=set(), skip_tokenizer_init=True, max_num_seqs=4)
    print(f"OpenRLHF RolloutRayActor up in {time.perf_counter() - t:.1f} s", flush=True)
    await actor.weightsync_init(args.controller, rank=0)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for v in args.versions:
        timings = await actor.weightsync_update(v, 300.0, args.controller_http)
        digests = (await actor.weightsync_digests())[0]
        out = await actor.generate([3, 4, 5, 6], sp)  # OpenRLHF's own generation path
        rec = {"version": v, "weight_version": await actor.llm.get_weight_version(), "digests": digests,
               "tokens": list(out.outputs[0].token_ids), "loaded_version": timings["loaded_version"],
               "timings_keys": sorted(timings)}
        with open(os.path.join(args.out, f"orl_engine_v{v}.json"), "w") as f:
            json.dump(rec, f)
    actor.llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--controller-http")
    ap.add_argument("--versions", type=int, nargs="+", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("RAY_ADDRESS", "local")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
