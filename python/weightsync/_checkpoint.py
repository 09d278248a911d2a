"""The tensors of a Hugging Face checkpoint, read from its safetensors headers alone: what a
staged vLLM engine declares when the job's model is *declared* (an architecture the planner has
no family for).

Why the checkpoint: in staged mode the arena is handed to vLLM's own loader
(``model.load_weights``), which takes the checkpoint's names and shapes; vLLM's parameters
(fused ``qkv_proj``, packed kernels, a padded vocabulary) are not what the trainers hold. The
checkpoint vLLM started from is the one description of the model in exactly the loader's terms,
and transformers' ``save_pretrained`` writes the same names the trainer's
``named_parameters()`` has. Only the headers are read (a few kilobytes per file), never the
weights.

Floating-point tensors are declared in the dtype vLLM serves (``--dtype``: what its loader casts
to), whatever the checkpoint stores, except fp8 weights and their scales (``*_scale_inv``,
``*_scale``: f32 in an fp8 checkpoint, whatever vLLM serves), which keep the checkpoint's dtype.
A job whose trainers hold another dtype is then refused by the controller naming the tensor,
before a byte moves.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

__all__ = ["CheckpointTensor", "checkpoint_folder", "checkpoint_tensors"]

#: safetensors header dtypes to the job's dtype names (floating ones are replaced by the
#: served dtype); a dtype not here is refused, naming the tensor.
_SAFETENSORS_DTYPES = {"BF16": "bf16", "F16": "f16", "F32": "f32", "F8_E4M3": "f8_e4m3"}
_FLOATING = frozenset({"bf16", "f16", "f32"})


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of the checkpoint: its name, the dtype to declare it in, its shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def checkpoint_folder(model: str, revision: str | None = None) -> str:
    """The folder holding ``model``'s safetensors files: ``model`` itself when it is a folder,
    else its snapshot in the local Hugging Face cache (where vLLM downloaded it; nothing is
    downloaded here).

    Raises:
        FileNotFoundError: naming the model: no such folder and no cached snapshot.
    """
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model, revision=revision, local_files_only=True,
                                     allow_patterns=["*.safetensors", "*.safetensors.index.json"]))
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        raise FileNotFoundError(f"model {model!r}: not a folder and no cached snapshot ({e})") from None


def _read_header(path: str) -> dict[str, dict[str, object]]:
    """The JSON header of one safetensors file (8-byte little-endian length, then the JSON)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size <= 0 or size > 100 * 1024 * 1024:
            raise ValueError(f"{path}: not a safetensors file (header length {size})")
        header: dict[str, dict[str, object]] = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def checkpoint_tensors(folder: str, served_dtype: str) -> list[CheckpointTensor]:
    """Every tensor of the safetensors files in ``folder`` (sorted by name), floating-point ones
    but fp8 scales in ``served_dtype`` (a job dtype name: ``bf16``, ``f16``, ``f32``).

    Raises:
        FileNotFoundError: the folder holds no ``*.safetensors`` file.
        ValueError: naming the tensor: a dtype with no job name, or a name in two files.
    """
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors file (a declared model's staged "
                                "engine declares the checkpoint's tensors)")
    found: dict[str, CheckpointTensor] = {}
    for path in files:
        for name, info in _read_header(path).items():
            raw = str(info["dtype"])
            dtype = _SAFETENSORS_DTYPES.get(raw)
            if dtype is None:
                raise ValueError(f"{path}: tensor {name} has dtype {raw}, which weightsync does not move")
            if name in found:
                raise ValueError(f"tensor {name} is in two checkpoint files ({path} and another)")
            shape = tuple(int(d) for d in info["shape"])  # type: ignore[attr-defined]
            cast = dtype in _FLOATING and not name.endswith(("_scale_inv", "_scale"))
            found[name] = CheckpointTensor(name, served_dtype if cast else dtype, shape)
    return [found[n] for n in sorted(found)]
