"""Where a training process finds NVRTC (device review N5).

The worker compiles its CUDA kernels with NVRTC at run time and looks for it on the loader path,
in ``$CUDA_HOME`` / ``/usr/local/cuda`` and in the ``nvidia/*/lib`` folders of ``$VIRTUAL_ENV`` /
``$CONDA_PREFIX``. A job started as ``/path/venv/bin/python train.py`` (or by torchrun from a venv
that was never activated) has no ``VIRTUAL_ENV``, and on a node whose CUDA came from pip wheels
(no toolkit) a plan with casts or fp8 would then be refused, although PyTorch's own wheel puts
``nvidia/cu13/lib/libnvrtc.so.13`` right next to torch. So before CUDA tensors are registered,
this names that library in ``WEIGHTSYNC_NVRTC`` when nothing named one: the same search as
``worker/gpu-check.sh``'s ``nvrtc_candidates``, over this interpreter's own site folders.
"""

from __future__ import annotations

import glob
import os
import site
import sys
from collections.abc import Iterable

ENV = "WEIGHTSYNC_NVRTC"


def site_folders() -> list[str]:
    """This interpreter's package folders, first to last (site-packages, user site, sys.path)."""
    dirs: list[str] = []
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # some embedded interpreters lack it
        pass
    try:
        dirs.append(site.getusersitepackages())
    except AttributeError:
        pass
    dirs += [p for p in sys.path if p]
    return list(dict.fromkeys(dirs))


def wheel_nvrtc(folders: Iterable[str]) -> str | None:
    """The first ``nvidia/*/lib/libnvrtc.so.13`` (then ``.12``) under ``folders``, if any."""
    folders = list(folders)
    for soname in ("libnvrtc.so.13", "libnvrtc.so.12"):
        for d in folders:
            found = sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", soname)))
            if found:
                return found[0]
    return None


def name_wheel_nvrtc(has_cuda: bool, folders: Iterable[str] | None = None) -> str | None:
    """Sets ``WEIGHTSYNC_NVRTC`` to the wheel's NVRTC when CUDA tensors are about to be
    registered and nothing named one (an explicit setting always wins); returns what it set."""
    if not has_cuda or os.environ.get(ENV):
        return None
    found = wheel_nvrtc(site_folders() if folders is None else folders)
    if found is not None:
        os.environ[ENV] = found
    return found
