"""Where a training process finds NVRTC without an activated venv (device review N5): the wheel's
``nvidia/*/lib/libnvrtc.so.1[23]`` under this interpreter's site folders is named in
``WEIGHTSYNC_NVRTC`` before CUDA tensors are registered, never over an explicit setting. No
GPU needed: the folders are made here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weightsync import _nvrtc


def wheel_tree(root: Path, *libs: str) -> Path:
    for rel in libs:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
    return root


def test_the_wheels_nvrtc_is_found_13_before_12(tmp_path: Path) -> None:
    a = wheel_tree(tmp_path / "a", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    b = wheel_tree(tmp_path / "b", "nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cu13/lib/libnvrtc-builtins.so.13.0")
    assert _nvrtc.wheel_nvrtc([str(a), str(b)]) == str(b / "nvidia/cu13/lib/libnvrtc.so.13")
    assert _nvrtc.wheel_nvrtc([str(a)]) == str(a / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    assert _nvrtc.wheel_nvrtc([str(tmp_path / "none")]) is None


def test_named_only_for_cuda_tensors_and_never_over_a_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = wheel_tree(tmp_path, "nvidia/cu13/lib/libnvrtc.so.13")
    lib = str(site / "nvidia/cu13/lib/libnvrtc.so.13")
    monkeypatch.delenv(_nvrtc.ENV, raising=False)
    assert _nvrtc.name_wheel_nvrtc(False, [str(site)]) is None
    assert _nvrtc.ENV not in os.environ
    assert _nvrtc.name_wheel_nvrtc(True, [str(site)]) == lib
    assert os.environ[_nvrtc.ENV] == lib
    monkeypatch.setenv(_nvrtc.ENV, "/opt/cuda/lib64/libnvrtc.so.13")
    assert _nvrtc.name_wheel_nvrtc(True, [str(site)]) is None
    assert os.environ[_nvrtc.ENV] == "/opt/cuda/lib64/libnvrtc.so.13"


def test_this_interpreters_site_folders_are_searched() -> None:
    import site
    import sys

    folders = _nvrtc.site_folders()
    assert site.getsitepackages()[0] in folders
    assert all(p in folders for p in sys.path if p)
