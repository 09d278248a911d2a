"""``weightsync._checkpoint``: what a staged vLLM engine of a declared model declares, read from
the checkpoint's safetensors headers: every tensor by name (over several files), floating-point
ones in the served dtype, fp8 weights and their f32 scales kept; a dtype weightsync cannot move, a name in two files and a
folder without safetensors are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from weightsync._checkpoint import CheckpointTensor, checkpoint_folder, checkpoint_tensors  # noqa: E402


def test_every_tensor_of_every_file_in_the_served_dtype(tmp_path: Path) -> None:
    safetensors_torch.save_file({"model.norm.weight": torch.ones(8, dtype=torch.float32),
                                 "lm_head.weight": torch.zeros(5, 8, dtype=torch.bfloat16)},
                                str(tmp_path / "model-00001-of-00002.safetensors"))
    safetensors_torch.save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(8, 3, dtype=torch.float16),
                                 "model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(1, 1),
                                 "model.layers.0.mlp.up_proj.weight": torch.zeros(
                                     3, 8, dtype=torch.float8_e4m3fn)},
                                str(tmp_path / "model-00002-of-00002.safetensors"))
    assert checkpoint_tensors(str(tmp_path), "bf16") == [
        CheckpointTensor("lm_head.weight", "bf16", (5, 8)),
        CheckpointTensor("model.layers.0.mlp.down_proj.weight", "bf16", (8, 3)),
        CheckpointTensor("model.layers.0.mlp.down_proj.weight_scale_inv", "f32", (1, 1)),
        CheckpointTensor("model.layers.0.mlp.up_proj.weight", "f8_e4m3", (3, 8)),
        CheckpointTensor("model.norm.weight", "bf16", (8,)),
    ]
    assert checkpoint_folder(str(tmp_path)) == str(tmp_path)


def test_what_cannot_be_declared_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        checkpoint_tensors(str(tmp_path), "bf16")
    safetensors_torch.save_file({"model.position_ids": torch.arange(4)}, str(tmp_path / "a.safetensors"))
    with pytest.raises(ValueError, match="model.position_ids has dtype I64"):
        checkpoint_tensors(str(tmp_path), "bf16")
    (tmp_path / "a.safetensors").unlink()
    for f in ("a", "b"):
        safetensors_torch.save_file({"x.weight": torch.ones(2)}, str(tmp_path / f"{f}.safetensors"))
    with pytest.raises(ValueError, match="x.weight is in two checkpoint files"):
        checkpoint_tensors(str(tmp_path), "bf16")
    with pytest.raises(FileNotFoundError, match="no-such/model"):
        checkpoint_folder("no-such/model")
