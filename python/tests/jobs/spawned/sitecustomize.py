"""Test-only: carries ``engine_vllm.py --torch-linear`` into vLLM's worker processes.

vLLM's CPU platform starts its tensor-parallel workers with ``spawn`` whatever
``VLLM_WORKER_MULTIPROC_METHOD`` says, so a patch made in the engine process never reaches
them. ``engine_vllm.py`` puts this folder on ``PYTHONPATH`` and sets
``WEIGHTSYNC_TEST_TORCH_LINEAR=1``; every interpreter started from it (the spawned workers)
imports this module at start-up, and it patches ``vllm.model_executor.layers.utils`` as that
module is first imported, the same way ``torch_linear_switch`` does in-process: each linear
layer then reads its live parameter with torch's linear (the stand-in for GPU kernels that read
the parameter directly) instead of a packed copy made at load time. Nothing else is imported
early, and without the variable this module does nothing.
"""

from __future__ import annotations

import os

TARGET = "vllm.model_executor.layers.utils"


def _patch(module: object) -> None:
    import torch

    def dispatch(layer: torch.nn.Module, remove_weight: bool = True) -> None:
        layer.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, w, b)

    module.dispatch_cpu_unquantized_gemm = dispatch  # type: ignore[attr-defined]


if os.environ.get("WEIGHTSYNC_TEST_TORCH_LINEAR") == "1":
    import importlib.abc
    import importlib.machinery
    import sys

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module: object) -> None:
                run(module)  # type: ignore[arg-type]
                _patch(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _PatchOnImport())
