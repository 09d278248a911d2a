"""The wheel alone is the product: built once with ``maturin build`` (python/scripts/test.sh
passes its path as $WEIGHTSYNC_WHEEL), installed into a fresh venv that sees nothing of the
source checkout, the Rust toolchain or the test venv (no cargo on PATH, no target/, no
$WEIGHTSYNC_BIN, cwd a temporary folder), it gives the ``weightsync`` console script and runs a
whole job from Python: ``weightsync.Controller`` in the script's process, two trainer and two
engine processes with plain ``bytearray`` tensors (not even numpy), bytes compared."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import FIGURES, JOBS, REPO

WHEEL = os.environ.get("WEIGHTSYNC_WHEEL")

pytestmark = pytest.mark.skipif(
    not WHEEL, reason="WEIGHTSYNC_WHEEL is not set: python/scripts/test.sh builds the wheel and sets it"
)

# The tiny dense Qwen3 of test_embedded.py: fsdp=2 splits its rows evenly.
CONFIG = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 320,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@dataclass
class FreshVenv:
    root: Path
    work: Path
    env: dict[str, str]
    install_s: float

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    @property
    def script(self) -> str:
        return str(self.root / "bin" / "weightsync")

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=timeout)


def _clean_env(venv: Path) -> dict[str, str]:
    """An environment with no trace of the toolchain, the checkout or the test venv."""
    keep = ("HOME", "LANG", "LC_ALL", "TMPDIR", "TERM", "USER")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PATH"] = f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin"
    env["RUST_BACKTRACE"] = "1"
    env["PYTHONNOUSERSITE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FreshVenv]:
    assert WHEEL is not None
    wheel = Path(WHEEL).resolve()
    assert wheel.is_file(), f"WEIGHTSYNC_WHEEL={WHEEL} is not a file"
    base = tmp_path_factory.mktemp("fresh")
    root, work = base / "venv", base / "work"
    work.mkdir()
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, cwd=base)
    env = _clean_env(root)
    subprocess.run(
        [str(root / "bin" / "python"), "-m", "pip", "install", "--no-index", "--disable-pip-version-check",
         "-q", str(wheel)],
        check=True, cwd=work, env=env, timeout=300,
    )
    install_s = time.monotonic() - t0
    assert shutil.which("cargo", path=env["PATH"]) is None, f"cargo is on the fresh venv's PATH {env['PATH']}"
    assert not str(work).startswith(str(REPO)), work
    yield FreshVenv(root, work, env, install_s)


def test_the_wheel_is_one_abi3_wheel_of_everything() -> None:
    assert WHEEL is not None
    name = Path(WHEEL).name
    assert name.startswith("weightsync-") and "-abi3-" in name, name
    FIGURES["wheel"] = {"file": name, "mib": round(Path(WHEEL).stat().st_size / 2**20, 1)}


def test_fresh_venv_has_only_the_wheel(fresh_venv: FreshVenv) -> None:
    out = fresh_venv.run([fresh_venv.python, "-c",
                          "import importlib.metadata as m, weightsync, sys; "
                          "print(sorted(d.metadata['Name'] for d in m.distributions())); print(weightsync.__file__)"])
    assert out.returncode == 0, out.stderr
    names, where = out.stdout.splitlines()
    assert "numpy" not in names and "torch" not in names, names
    assert where.startswith(str(fresh_venv.root)), where


def test_console_script_help(fresh_venv: FreshVenv) -> None:
    out = fresh_venv.run([fresh_venv.script, "--help"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Move fresh model weights"), out.stdout
    for c in ("demo", "plan", "simulate", "controller", "worker", "bench"):
        assert f"\n  {c} " in out.stdout, out.stdout
    same = fresh_venv.run([fresh_venv.python, "-m", "weightsync", "--help"])
    assert same.returncode == 0 and same.stdout == out.stdout, same.stderr


def test_console_script_input_error_is_one_line(fresh_venv: FreshVenv) -> None:
    out = fresh_venv.run([fresh_venv.script, "plan", "--model", "no-such-model", "--train", "fsdp=2",
                          "--infer", "tp=1"])
    assert out.returncode == 1, out
    assert out.stderr.startswith("error: ") and "no-such-model" in out.stderr, out.stderr
    assert "backtrace" not in out.stderr.lower() and "Traceback" not in out.stderr, out.stderr


def test_console_script_plans(fresh_venv: FreshVenv) -> None:
    cfg = fresh_venv.work / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    out = fresh_venv.run([fresh_venv.script, "plan", "--model", str(cfg), "--train", "fsdp=2",
                          "--infer", "tp=1,dp=2,format=hf", "--json"])
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout)


def test_controller_and_workers_from_the_wheel(fresh_venv: FreshVenv) -> None:
    cfg = fresh_venv.work / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    job = fresh_venv.work / "wheel_job.py"
    shutil.copy(JOBS / "wheel_job.py", job)
    out_dir = fresh_venv.work / "out"
    out_dir.mkdir(exist_ok=True)
    t0 = time.monotonic()
    out = fresh_venv.run([fresh_venv.python, str(job), "main", str(cfg), str(out_dir)], timeout=300)
    took = time.monotonic() - t0
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert "wheel job ok" in out.stdout, out.stdout
    FIGURES["wheel job"] = {"venv_and_install_s": round(fresh_venv.install_s, 1), "job_s": round(took, 1)}


def test_demo_runs_its_workers_through_python(fresh_venv: FreshVenv) -> None:
    """``demo`` starts its trainers and rollouts as copies of itself: from the wheel that is the
    venv's Python with ``-m weightsync``, not ``current_exe()`` (the interpreter)."""
    cfg = fresh_venv.work / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    out = fresh_venv.run([fresh_venv.script, "demo", "--model", str(cfg), "--train", "fsdp=2",
                          "--infer", "tp=1,dp=2", "--dtype", "bf16", "--syncs", "2", "--http", "127.0.0.1:0",
                          "--exit", "--json"], timeout=300)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-4000:]}"
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary, out.stdout
