"""What every framework adapter (``weightsync.trl``, ``weightsync.openrlhf``) shares: where the
job is (:class:`WeightsyncSettings`) and the check, before any training step, that the
framework's model is the job's model (:func:`check_model_against_job`, :func:`refuse_zero3`).

Why a check of its own before registration: the frameworks register at the first sync (their
wrappers place the shards late: FSDP2, DeepSpeed), which comes after the first generation and
maybe after an optimizer step; the check runs when the adapter is built, on the unwrapped model,
so a model that is not the job's fails before any work, naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._tensors import named_tensors, shape_of
from .errors import LayoutMismatchError, RegistrationError
from .trainer import Trainer

__all__ = ["WeightsyncSettings", "check_model_against_job", "refuse_zero3"]

_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float8_e4m3fn": "f8_e4m3"}


@dataclass(frozen=True)
class WeightsyncSettings:
    """Where the job is. ``controller``: the controller's control address ``host:port`` (every
    training rank and the server's workers connect there); ``controller_http``: its HTTP API
    (``http://host:port``), which rank 0 long-polls while the ranks write instead of polling the
    server's workers (recommended); ``job_token``: the job's secret (default
    ``$WEIGHTSYNC_JOB_TOKEN``); ``engine_rank``: the inference rank of the server's first
    worker; ``timeout_s``: how long one sync may take."""

    controller: str
    controller_http: str | None = None
    job_token: str | None = None
    engine_rank: int = 0
    timeout_s: float = 600.0


def check_model_against_job(trainer: Trainer, model: Any) -> int:
    """Raises before any sync when ``model``'s parameters are not the job's: a name the job
    lacks or a job tensor the model lacks (:class:`~weightsync.RegistrationError`), a whole
    shape or a dtype that differs (:class:`~weightsync.LayoutMismatchError`), each naming the
    tensor. Names are read as :meth:`weightsync.Trainer.register` reads them (wrappers' path
    components dropped). Returns the tensors checked (0 for a declared model: the controller
    checks those when every worker registered)."""
    if trainer.declared:
        return 0
    layout: dict[str, Any] = {}
    for shard in trainer.layout():
        layout.setdefault(shard.name, shard)
    ours = dict(named_tensors(model))
    who = trainer.worker_id
    for name, t in ours.items():
        s = layout.get(name)
        if s is None:
            raise RegistrationError(
                f"{who}: the model's parameter {name} is not a tensor of the job (the controller's model "
                "has no such name): the trainer's model and the job's --model differ",
                worker=who, tensor=name)
        shape = shape_of(t)
        if shape is not None and tuple(shape) != tuple(s.global_shape):
            raise LayoutMismatchError(
                f"{who}: tensor {name}: the model's shape {list(shape)}, the job's {list(s.global_shape)}",
                worker=who, tensor=name, expected=str(list(s.global_shape)), actual=str(list(shape)))
        dtype = _DTYPES.get(str(getattr(t, "dtype", "")).removeprefix("torch."))
        if dtype is not None and dtype != s.dtype:
            raise LayoutMismatchError(
                f"{who}: tensor {name}: the model holds {dtype}, the job's training layout {s.dtype}",
                worker=who, tensor=name, expected=s.dtype, actual=dtype)
    # A tensor of the job with no rank's shard here is fine only when this rank has none of it.
    missing = sorted(set(layout) - set(ours))
    if missing:
        raise RegistrationError(
            f"{who}: the job's tensor {missing[0]} is not a parameter of the model "
            f"({len(missing)} missing in all): the trainer's model and the job's --model differ",
            worker=who, tensor=missing[0])
    return len(ours)


def refuse_zero3(model: Any, who: str) -> None:
    """Raises naming the first parameter DeepSpeed ZeRO-3 partitioned (``ds_shape`` /
    ``ds_tensor`` on it): its memory on this rank is a slice of a flat buffer, not a box of the
    tensor weightsync can register."""
    for name, p in model.named_parameters():
        if hasattr(p, "ds_shape") or hasattr(p, "ds_tensor"):
            raise RegistrationError(
                f"{who}: parameter {name} is partitioned by DeepSpeed ZeRO-3 (a flat slice on each rank); "
                "weightsync registers whole tensors or boxes of them: use ZeRO stage 0-2 (--train dp=N) or FSDP2",
                worker=who, tensor=name)
