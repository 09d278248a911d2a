"""Issue 36, must show: architectures weightsync has no family for, planned from what the workers
declare. For each, a tiny random model built by transformers from a config this test writes
(``jobs/archs.py``: no downloads), a controller given that config (an unknown ``model_type``: a
declared model), ``torchrun`` training it under FSDP2 (``fully_shard``, gloo, 2 or 3 ranks with
uneven shards, an empty one for gpt-oss's experts) with ``weightsync.Trainer``, and two engine
processes holding the same architecture as transformers models registered with
``weightsync.Engine`` (``format=hf``). After each of 3 optimizer steps every engine tensor must
equal the trainer's gathered ``full_tensor()`` byte for byte, and greedy generation of 16 tokens
must be the same on the engines as on the trainer's model.

One torchrun per architecture; about a minute or two each on a quiet 2-core box (torch and
transformers start-up in six processes dominates)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import FIGURES, JOBS, Procs, start_controller  # noqa: E402
from test_e2e import compare, engine, outcomes, torchrun, wait_all  # noqa: E402

sys.path.insert(0, str(JOBS))
import archs  # noqa: E402


@pytest.mark.e2e
@pytest.mark.parametrize("model_type", sorted(archs.ARCHS))
def test_architecture_fsdp2_to_hf_engines(tmp_path: Path, procs: Procs, model_type: str) -> None:
    arch = archs.ARCHS[model_type]
    config = archs.write_config(str(tmp_path / "model"), model_type)
    folder = str(Path(config).parent)
    out = tmp_path / "out"
    out.mkdir()
    c = start_controller(procs, config, f"fsdp={arch.nproc}", "tp=1,dp=2,format=hf")
    versions = [1, 2, 3]
    common = ["--model", folder, "--controller", c.control, "--out", str(out)]
    es = [engine(procs, r, common + ["--versions", *map(str, versions)], c.env()) for r in (0, 1)]
    tr = torchrun(procs, arch.nproc, [*common, "--steps", "3", "--trigger", "push"], c.env())
    wait_all(procs, [tr, *es])
    compare(out, versions, {0: (0, 1), 1: (0, 1)}, fp8=False, tokens=True)
    fig = outcomes(out, versions)
    FIGURES[f"{model_type} fsdp={arch.nproc} -> hf dp=2 (declared)"] = fig
    # Every sync moved the whole model to both engines (bf16 -> bf16: nothing staged).
    assert len(set(fig["bytes_per_sync"])) == 1 and fig["bytes_per_sync"][0] > 0, fig
