"""weightsync in TRL's experimental async GRPO trainer
(``trl.experimental.async_grpo.AsyncGRPOTrainer``): its weight sync through weightsync instead
of TRL's NCCL ``WeightTransferClient``.

TRL's async trainer syncs in ``_sync_weight_merged``: rank 0 pauses the vLLM server, every rank
walks ``_streaming_iter`` (under FSDP2 each parameter's ``full_tensor()``, an all-gather of the
whole model parameter by parameter) and rank 0 streams every tensor into the server over an
NCCL group (``WeightTransferClient.send_weights``), then resumes it and bumps ``model_version``,
the version its rollout worker tags samples with. The group needs CUDA and cannot be
interrupted (TRL runs it on a daemon thread so a failure surfaces as the HTTP error).

:class:`WeightsyncAsyncGRPOTrainer` keeps TRL's sequence and its bookkeeping (pause, barrier,
transfer, barrier, resume, ``model_version`` + 1, ``rollout_worker.update_model_version``, the
``perf/weight_sync_*`` metrics, the cold sync at train begin) and replaces the transfer: every
rank registers its own shards once (FSDP2's local shards, in place) and pushes them; rank 0
brings the server to that version over HTTP (:class:`weightsync.vllm_server.VllmServer`); nothing
is gathered and ``_streaming_iter`` is never walked. Rank 0's ``weight_transfer`` is a
:class:`WeightsyncWeightTransfer` (TRL's ``WeightTransferProtocol``, the trainer's own
extension point): it joins the server to the job at train begin and pauses / resumes it with
TRL's own client. What a user changes::

    from weightsync.trl_async import WeightsyncAsyncGRPOTrainer  # was: ...async_grpo import AsyncGRPOTrainer

    trainer = WeightsyncAsyncGRPOTrainer(model=path, args=config, reward_funcs=..., train_dataset=...,
                                         weightsync_controller=controller, weightsync_controller_http=http)

with the server started with ``--weight-transfer-config '{"backend": "weightsync"}'
--worker-extension-cls weightsync.vllm.WorkerExtension`` (``VLLM_SERVER_DEV_MODE=1``, which TRL's
async trainer already requires) instead of ``'{"backend": "nccl"}'``.

Why a subclass and not only a ``weight_transfer``: TRL calls the weight-transfer object on rank 0
alone, and makes every other rank walk ``_streaming_iter`` (the gather) meanwhile; pushing every
rank's own shards needs the other ranks too, so ``_sync_weight_merged`` is the method replaced.

Versions: weightsync's version continues the job's (one past the server's ``weight_version`` at
train begin, then + 1 per sync: a trainer restarted against a running server continues where the
job is); TRL's ``model_version`` counts as TRL counts (it is restored from checkpoints).
``syncs`` records both.

Bad wiring fails when the trainer is built, before train begin: a parameter not in the job, a job
tensor the model lacks, a shape or dtype not the job's (naming the tensor), a PEFT model
(TRL's adapter-only sync goes through a LoRA directory, not weights) and DeepSpeed ZeRO-3.
"""

from __future__ import annotations

import os
import time
from typing import Any

from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer
from trl.experimental.async_grpo.vllm_client import VLLMClient

from ._adapter import WeightsyncSettings, check_model_against_job, refuse_zero3
from .trainer import SyncOutcome, Trainer
from .vllm_server import VllmServer

__all__ = ["WeightsyncSettings", "WeightsyncWeightTransfer", "WeightsyncAsyncGRPOTrainer"]


class WeightsyncWeightTransfer:
    """TRL's ``WeightTransferProtocol`` for rank 0 of a :class:`WeightsyncAsyncGRPOTrainer`:
    ``init_weight_transfer`` joins the server's workers to the job (unless they are in it
    already: a restarted trainer against a running server), ``pause`` / ``resume`` are TRL's own
    client calls, :meth:`update` brings the server to a version. ``send_weights`` (TRL's gathered
    stream) is refused: the ranks push their own shards instead."""

    def __init__(self, server_url: str, settings: WeightsyncSettings, *, server_timeout_s: float = 240.0,
                 control_timeout_s: int = 300) -> None:
        self.settings = settings
        self.client = VLLMClient(server_url, server_timeout_s)
        self.server = VllmServer(server_url, controller=settings.controller_http,
                                 request_timeout_s=settings.timeout_s)
        self.control_timeout_s = control_timeout_s
        self.first_version = 1

    def init_weight_transfer(self) -> None:
        self.client.wait_for_server_ready()
        try:
            workers = self.server.status()
        except Exception:  # noqa: BLE001  # the backend is not built yet: init below says what is wrong
            workers = []
        if not workers or any(w.get("worker") is None for w in workers):
            s = self.settings
            # The server's workers join with this job's token: the trainer's own when the
            # settings name none (the server need not have it in its environment).
            token = s.job_token or os.environ.get("WEIGHTSYNC_JOB_TOKEN")
            self.server.init(s.controller, mode="staged", rank=s.engine_rank, job_token=token)
        current = self.server.weight_version()
        self.first_version = int(current) + 1 if current is not None and current.isdigit() else 1

    def pause(self) -> None:
        self.client.pause(timeout=self.control_timeout_s)

    def send_weights(self, iterator: Any) -> None:
        raise TypeError("weightsync.trl_async: WeightsyncWeightTransfer does not take TRL's gathered stream of "
                        "full tensors; use WeightsyncAsyncGRPOTrainer, whose ranks push their own shards")

    def update(self, version: int) -> dict[str, Any]:
        """Brings the server to ``version`` (staged: the bytes land in its arena, then one load)
        and resets its prefix cache; returns the timings."""
        return self.server.update(version, timeout_s=self.settings.timeout_s)

    def resume(self) -> None:
        self.client.resume(timeout=self.control_timeout_s)

    def destroy(self) -> None:
        """The server stays in the job (a later trainer continues it); nothing to release."""


class WeightsyncAsyncGRPOTrainer(AsyncGRPOTrainer):
    """``AsyncGRPOTrainer`` whose weight sync goes through weightsync: the same arguments plus
    ``weightsync_controller`` (the controller's ``host:port``) and optionally
    ``weightsync_controller_http``, ``weightsync_job_token``, ``weightsync_engine_rank``,
    ``weightsync_timeout_s`` (see :class:`WeightsyncSettings`). ``weight_transfer`` is this
    class's; ``syncs`` holds each sync's figures."""

    def __init__(self, *args: Any, weightsync_controller: str, weightsync_controller_http: str | None = None,
                 weightsync_job_token: str | None = None, weightsync_engine_rank: int = 0,
                 weightsync_timeout_s: float = 600.0, **kwargs: Any) -> None:
        if kwargs.get("weight_transfer") is not None:
            raise ValueError("weightsync.trl_async: weight_transfer is WeightsyncAsyncGRPOTrainer's own")
        config = kwargs.get("args")
        url = getattr(config, "vllm_server_base_url", None)
        if config is None or not url:
            raise ValueError("weightsync.trl_async: AsyncGRPOConfig(vllm_server_base_url=...) is required "
                             "(pass it as args=)")
        settings = WeightsyncSettings(controller=weightsync_controller, controller_http=weightsync_controller_http,
                                      job_token=weightsync_job_token, engine_rank=weightsync_engine_rank,
                                      timeout_s=weightsync_timeout_s)
        self.weightsync_settings = settings
        self.syncs: list[dict[str, Any]] = []
        self._ws_trainer: Trainer | None = None
        self._ws_registered = False
        self._ws_last_version = 0
        kwargs["weight_transfer"] = WeightsyncWeightTransfer(url, settings,
                                                             server_timeout_s=getattr(config, "vllm_server_timeout",
                                                                                      240.0))
        super().__init__(*args, **kwargs)
        from accelerate.utils import is_peft_model  # type: ignore[import-untyped,unused-ignore]  # TRL's own test

        model = self.accelerator.unwrap_model(self.model)
        if is_peft_model(model):
            raise ValueError("weightsync.trl_async: PEFT models are not supported (TRL syncs them as a merged copy "
                             "or an adapter directory; weightsync moves registered tensors in place)")
        trainer = Trainer(settings.controller, rank=self.accelerator.process_index, job_token=settings.job_token)
        try:
            refuse_zero3(model, trainer.worker_id)
            check_model_against_job(trainer, model)
        except BaseException:
            trainer.close()
            raise
        self._ws_trainer = trainer

    @property
    def weightsync_trainer(self) -> Trainer:
        """This rank's :class:`weightsync.Trainer`."""
        if self._ws_trainer is None:
            raise RuntimeError("weightsync.trl_async: the trainer is not built")
        return self._ws_trainer

    def _ws_next_version(self) -> int:
        """Rank 0's next version (one past the job's at train begin), the same on every rank."""
        from accelerate.utils import broadcast_object_list  # type: ignore[import-untyped,unused-ignore]

        proposal = self._ws_last_version + 1
        if isinstance(self.weight_transfer, WeightsyncWeightTransfer):
            proposal = max(proposal, self.weight_transfer.first_version)
        version = int(broadcast_object_list([proposal], from_process=0)[0])
        if version <= self._ws_last_version:
            raise RuntimeError(f"weightsync.trl_async: version {version} after {self._ws_last_version}: "
                               "versions must grow")
        return version

    def _sync_weight_merged(self, t0: float) -> tuple[float, float, float]:
        """TRL's sequence with weightsync's transfer: rank 0 pauses the server, every rank pushes
        its own shards as the next version (registered at the first sync, once FSDP2 placed
        them), rank 0 brings the server to it, every rank waits for the commit; rank 0 resumes
        the server and bumps TRL's ``model_version``. Returns TRL's phase marks."""
        ws = self.weightsync_trainer
        main = self.accelerator.is_main_process
        transfer = self.weight_transfer if main else None
        if transfer is not None:
            transfer.pause()
        t_pause = time.time()
        self.accelerator.wait_for_everyone()
        t_barrier = time.time()
        timings: dict[str, Any] | None = None
        try:
            if not self._ws_registered:
                ws.register(self.accelerator.unwrap_model(self.model))
                self._ws_registered = True
            version = self._ws_next_version()
            handle = ws.push(version)
            if isinstance(transfer, WeightsyncWeightTransfer):
                timings = transfer.update(version)
            outcome: SyncOutcome = handle.wait(self.weightsync_settings.timeout_s)
            t_transfer = time.time()
            self.accelerator.wait_for_everyone()
        finally:
            if transfer is not None:
                # Resumed after a failure too: the staged server keeps serving its last version.
                transfer.resume()
        self._ws_last_version = version
        if main:
            self.model_version += 1
            if self.rollout_worker:
                self.rollout_worker.update_model_version(self.model_version)
        self.syncs.append({"version": version, "model_version": self.model_version, "seconds": time.time() - t0,
                           "outcome": outcome, "server": timings})
        return t_pause, t_barrier, t_transfer

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._inner_training_loop(*args, **kwargs)  # type: ignore[no-untyped-call]
        finally:
            self.close()

    def close(self) -> None:
        """Leaves the job (idempotent; also at the end of ``train()``)."""
        if self._ws_trainer is not None:
            self._ws_trainer.close()
