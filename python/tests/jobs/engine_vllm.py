"""A vLLM engine process with the weightsync backend in it (run by tests/test_vllm.py):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python engine_vllm.py --model DIR --controller HOST:PORT \
        --mode staged|direct --versions 1 2 3 --out OUT

One offline ``vllm.LLM`` (CPU, enforce_eager, prefix caching on) over ``DIR`` (config and a
random initial checkpoint), ``weight_transfer_config={"backend": "weightsync"}``. For each
version: serve the long prompt (so its KV is cached under the old weights), bring the engine to
the version with ``weightsync.vllm.update``, then record vLLM's own parameters (a list: one dict
per vLLM worker, in tp rank order), each worker's arena and layout (staged), its
``weight_version``, its greedy tokens for the short and the long prompt (twice: the second
serve comes from the prefix cache) and the sync's timings to ``OUT/vllm_r{R}_v{V}.pt`` (R: the
engine's index, ``--rank`` / ``--tp``; ``--rank`` is the inference rank of its first worker), then touch ``OUT/vllm_r{R}_v{V}.done`` (the lockstep trainer waits for it before its next step).
``--tp N``: ``tensor_parallel_size=N`` (vLLM's workers are then processes of their own; the
records come from them through ``collective_rpc`` of ``WorkerExtension`` methods).
``--kill-trainer-at V``: when version V starts landing (in the engine's ``before_landing``, so
no byte of it has landed yet) the engine SIGKILLs trainer rank 1 (pid from
``OUT/trainer_r1.pid``): the sync fails mid-way; the engine records what it serves then to
``OUT/vllm_r{R}_failed_v{V}.pt`` and goes on with the next version (the test restarts the
trainer, which pushes it).
``--sleep-after V``: after recording version V the engine sleeps and wakes up through
``weightsync.vllm.sleep`` / ``wake_up`` (it leaves the job and rejoins with its memory as it is
after the wake-up). vLLM's CPU build ignores sleep, so in direct mode the engine moves every
parameter to new memory between the two, as a GPU wake-up may; the memory registered before
the sleep (old parameters, or the old arena) is kept and its bytes are compared after the next
version landed: ``OUT/vllm_r{R}_slept.pt``.
``--kill-trainer-at`` and ``--sleep-after`` reach into the in-process worker: tp=1 only.
``--torch-linear``: the test switch for direct landing on CPU hosts whose linear kernels pack
the weights (AVX-512): every linear layer reads its live parameter with torch's linear.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402



def long_prompt(vocab: int) -> list[int]:
    """A prompt longer than one CPU KV block (128 tokens), every token below ``vocab``."""
    return [(7 * i + 3) % min(vocab - 1, 1000) + 1 for i in range(144)]


LONG_PROMPT = long_prompt(1024)  # the tiny Qwen3's


def torch_linear_switch() -> None:
    """Test-only: stands in for GPU kernels that read the parameter directly. In this process,
    and in the workers vLLM's CPU platform spawns for tensor parallelism (it forces ``spawn``):
    they import ``spawned/sitecustomize.py``, which makes the same patch."""
    spawned = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spawned")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (spawned, os.environ.get("PYTHONPATH")) if p)
    os.environ["WEIGHTSYNC_TEST_TORCH_LINEAR"] = "1"
    import vllm.model_executor.layers.utils as lu

    def dispatch(layer: torch.nn.Module, remove_weight: bool = True) -> None:
        layer.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)

    lu.dispatch_cpu_unquantized_gemm = dispatch  # looked up at each layer's load


def kill_trainer_when_landing(llm: object, version: int, pid_file: str) -> None:
    """Test-only: wraps the in-process backend's before_landing hook (see the module doc)."""
    import signal

    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker  # type: ignore[attr-defined]
    backend = worker.weight_transfer_engine
    gate = backend.gate

    def before_landing(v: int) -> None:
        if v == version:
            with open(pid_file) as f:
                os.kill(int(f.read()), signal.SIGKILL)
            time.sleep(0.5)
        gate.before_landing(v)

    backend.engine.set_hooks(before_landing=before_landing, after_commit=gate.after_commit)


def in_process_backend(llm: object) -> object:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.weight_transfer_engine  # type: ignore[attr-defined]


def sleep_and_wake(llm: object, mode: str, wv: object) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Test-only: see ``--sleep-after``; returns the memory registered before the sleep and a
    copy of its bytes taken before the sleep."""
    backend = in_process_backend(llm)
    model = backend.model  # type: ignore[attr-defined]
    old = dict(backend.arena) if mode == "staged" else {n: p.data for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    snapshot = {n: t.clone() for n, t in old.items()}
    wv.sleep(llm)  # type: ignore[attr-defined]
    if mode == "direct":
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()  # the weights come back at new addresses
    wv.wake_up(llm)  # type: ignore[attr-defined]
    return old, snapshot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--mode", choices=["staged", "direct"], default="staged")
    ap.add_argument("--versions", type=int, nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--torch-linear", action="store_true")
    ap.add_argument("--kill-trainer-at", type=int, default=None)
    ap.add_argument("--rank", type=int, default=0,
                    help="inference rank of the engine's first worker (engine e: e * tp)")
    ap.add_argument("--sleep-after", type=int, default=None)
    ap.add_argument("--tp", type=int, default=1, help="vLLM's tensor_parallel_size")
    args = ap.parse_args()
    if args.tp > 1 and (args.kill_trainer_at is not None or args.sleep_after is not None):
        ap.error("--kill-trainer-at and --sleep-after need the in-process worker (--tp 1)")
    engine = args.rank // args.tp  # the engine's index (dp replica): names its files
    if args.torch_linear:
        torch_linear_switch()

    from vllm import LLM, SamplingParams

    import weightsync.vllm as wv

    t = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=512, max_num_seqs=4, seed=0, enable_prefix_caching=True,
              tensor_parallel_size=args.tp, weight_transfer_config={"backend": wv.BACKEND},
              worker_extension_cls="weightsync.vllm.WorkerExtension")
    start_s = time.perf_counter() - t
    llm.init_weight_transfer_engine({"init_info": {"controller": args.controller, "mode": args.mode,
                                                "rank": args.rank}})
    if args.kill_trainer_at is not None:
        kill_trainer_when_landing(llm, args.kill_trainer_at, os.path.join(args.out, "trainer_r1.pid"))
    print(f"vllm engine up in {start_s:.1f} s, weightsync {args.mode} registered", flush=True)
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    long = long_prompt(llm.llm_engine.model_config.get_vocab_size())

    def gen(prompt: list[int]) -> tuple[list[int], int | None]:
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        return list(o.outputs[0].token_ids), o.num_cached_tokens

    slept: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
    for v in args.versions:
        gen(long)  # cached under the old weights
        if v == args.kill_trainer_at:
            try:
                wv.update(llm, v, timeout_s=30)
            except Exception as e:  # noqa: BLE001 - recorded for the test to judge
                error = f"{type(e).__name__}: {e}"
            else:
                error = None
            llm.reset_prefix_cache()
            torch.save({"error": error, "weight_version": llm.get_weight_version(),
                        "params": llm.collective_rpc("weightsync_params")[0],
                        "short": gen(tiny.PROMPT), "status": llm.collective_rpc("weightsync_status")[0]},
                       os.path.join(args.out, f"vllm_r{engine}_failed_v{v}.pt"))
            print(f"version {v}: {error}", flush=True)
            continue  # the next version (from a restarted trainer) must commit
        timings = wv.update(llm, v)
        rec = {
            "timings": timings,
            "weight_version": llm.get_weight_version(),
            "params": llm.collective_rpc("weightsync_params"),
            "arena": llm.collective_rpc("weightsync_arena") if args.mode == "staged" else None,
            "layout": llm.collective_rpc("weightsync_layout") if args.mode == "staged" else None,
            "short": gen(tiny.PROMPT),
            "long_prompt": long,
            "long_first": gen(long),
            "long_cached": gen(long),
            "status": llm.collective_rpc("weightsync_status"),
        }
        torch.save(rec, os.path.join(args.out, f"vllm_r{engine}_v{v}.pt"))
        print(json.dumps({"version": v, **{k: timings[k] for k in ("pause_s", "land_s", "load_s", "resume_s")}}),
              flush=True)
        if slept is not None:
            old, snapshot = slept
            torch.save({"old": {n: t.clone() for n, t in old.items()}, "before": snapshot, "after_version": v,
                        "status": rec["status"][0]}, os.path.join(args.out, f"vllm_r{engine}_slept.pt"))
            slept = None
        if v == args.sleep_after:
            slept = sleep_and_wake(llm, args.mode, wv)
            print(f"slept and woke after version {v}", flush=True)
        open(os.path.join(args.out, f"vllm_r{engine}_v{v}.done"), "w").close()
    llm.collective_rpc("shutdown_weight_transfer_engine")


if __name__ == "__main__":
    main()
