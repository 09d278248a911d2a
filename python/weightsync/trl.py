"""weightsync in TRL: GRPO's weight sync (``VLLMGeneration.sync_weights``) through weightsync
instead of TRL's NCCL group, in server mode against a vLLM server that runs the ``weightsync``
backend (``weightsync.vllm``).

TRL's server mode gathers every parameter to rank 0 (``full_tensor()`` under FSDP2, a ZeRO-3
gather under DeepSpeed) and broadcasts it over an NCCL group it opens with the server: a group
that hangs with no error when a peer is gone (huggingface/trl#6796) and that needs CUDA. Here
every training rank registers its own shards once and pushes them (:meth:`weightsync.Trainer.push`);
rank 0 then drives the server over HTTP (:class:`weightsync.vllm_server.VllmServer`: the
version lands in the server's staged arena while it keeps serving, then one load) and nothing is
gathered. What a TRL user changes: the trainer class, and two arguments::

    trainer = WeightsyncGRPOTrainer(model=model, args=args, reward_funcs=reward, train_dataset=dataset,
                                    processing_class=tokenizer, weightsync_controller=controller)

with ``GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, ...)`` as before
and the server started with ``--weight-transfer-config '{"backend": "weightsync"}'
--worker-extension-cls weightsync.vllm.WorkerExtension`` (``VLLM_SERVER_DEV_MODE=1``) instead
of ``'{"backend": "nccl"}'``.

Why a subclass and a class swapped while it is built: GRPOTrainer builds its ``VLLMGeneration``
inside ``__init__`` (no argument chooses the class) and that constructor opens the NCCL group
at once, so the sync class must be the one constructed; :class:`WeightsyncGRPOTrainer` builds
:class:`WeightsyncVLLMGeneration` in its place with TRL's own arguments, and everything else of
GRPO (generation over HTTP, the reward, the loss, when it syncs) is TRL's.

Versions: the version a sync pushes is TRL's ``global_step + 1`` at that sync (TRL syncs before
generating when the step changed: version 1 holds the initial weights, version ``k + 1`` the
weights after optimizer step ``k``), and the server's ``weight_version`` says it.

Bad wiring fails when the trainer is built, before any step: a parameter whose name is not in
the job, a job tensor the model lacks, or a whole shape or dtype that differs from the job's
layout raises naming the tensor (:class:`~weightsync.RegistrationError`,
:class:`~weightsync.LayoutMismatchError`). A job whose model is declared by its workers (an
architecture the planner has no family for) is checked by the controller when every worker
registered, at the first sync, also before the first optimizer step.

Not covered: PEFT adapters (TRL merges them into the base weights for each sync; refused by
name), colocate mode (TRL's in-process ``load_weights`` already moves nothing over a wire),
DeepSpeed ZeRO-3 (flat partitions, which weightsync's trainer does not register: refused by
name when the trainer is built).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from trl.trainer.grpo_trainer import GRPOTrainer
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

from ._adapter import WeightsyncSettings, check_model_against_job, refuse_zero3
from .trainer import PushHandle, SyncOutcome, Trainer
from .vllm_server import VllmServer

__all__ = ["WeightsyncSettings", "WeightsyncVLLMGeneration", "WeightsyncGRPOTrainer", "check_model_against_job"]

class WeightsyncVLLMGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` (server mode) whose :meth:`sync_weights` pushes every rank's own
    shards through weightsync: built by :class:`WeightsyncGRPOTrainer` with TRL's own
    arguments plus ``weightsync``; the generation side (``VLLMClient`` over the server's OpenAI
    routes) is TRL's.

    ``step``: a callable giving TRL's ``global_step`` (the trainer sets it); without it the
    versions count the syncs. ``syncs``: each sync's figures (version, seconds, the trainer's
    :class:`~weightsync.SyncOutcome` and, on rank 0, the server's timings)."""

    def __init__(self, *args: Any, weightsync: WeightsyncSettings, **kwargs: Any) -> None:
        self.weightsync = weightsync
        self.step: Callable[[], int] | None = None
        self.syncs: list[dict[str, Any]] = []
        self._trainer: Trainer | None = None
        self._registered = False
        self._last_version = 0
        self.server: VllmServer | None = None
        super().__init__(*args, **kwargs)

    @property
    def trainer(self) -> Trainer:
        """This rank's :class:`weightsync.Trainer`."""
        if self._trainer is None:
            raise RuntimeError("weightsync.trl: the vLLM backend is not initialised")
        return self._trainer

    def _init_vllm(self) -> None:
        if self.mode != "server":
            raise ValueError(
                f"weightsync.trl: vllm_mode={self.mode!r}; weightsync syncs a vLLM server (vllm_mode='server'). "
                "In colocate mode TRL's in-process load_weights already moves no bytes between processes")
        from accelerate.utils import is_peft_model  # type: ignore[import-untyped,unused-ignore]  # TRL's own test

        if is_peft_model(self.model):
            raise ValueError("weightsync.trl: PEFT models are not supported (TRL merges the adapter into the "
                             "base weights for each sync; weightsync moves registered tensors in place)")
        acc = self.accelerator
        s = self.weightsync
        trainer = Trainer(s.controller, rank=acc.process_index, job_token=s.job_token)
        try:
            refuse_zero3(self.model, trainer.worker_id)
            check_model_against_job(trainer, self.model)
            if acc.is_main_process:
                base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                # TRL's client for generation; its init_communicator (the NCCL group) is not called.
                self.vllm_client = VLLMClient(base_url=base_url, group_port=self.group_port,
                                              connection_timeout=self.server_timeout)
                self.server = VllmServer(base_url, controller=s.controller_http,
                                         request_timeout_s=s.timeout_s)
                # The server's workers join with this job's token: the trainer's own when the
                # settings name none (the server need not have it in its environment).
                token = s.job_token or os.environ.get("WEIGHTSYNC_JOB_TOKEN")
                self.server.init(s.controller, mode="staged", rank=s.engine_rank, job_token=token)
        except BaseException:
            trainer.close()
            raise
        self._trainer = trainer
        acc.wait_for_everyone()

    def _next_version(self) -> int:
        version = self.step() + 1 if self.step is not None else self._last_version + 1
        if version <= self._last_version:
            raise RuntimeError(f"weightsync.trl: version {version} after {self._last_version}: versions must grow")
        return version

    def sync_weights(self) -> None:
        """Every rank pushes its registered shards as the next version (registered at the
        first sync, once the model is wrapped: FSDP2 places its shards then); rank 0 brings the
        server to that version (staged: the server serves while the bytes land, then loads
        once) and resets its prefix cache; every rank waits for the commit."""
        trainer = self.trainer
        t0 = time.perf_counter()
        if not self._registered:
            trainer.register(self.model)
            self._registered = True
        version = self._next_version()
        handle: PushHandle = trainer.push(version)
        timings: dict[str, Any] | None = None
        if self.server is not None:
            timings = self.server.update(version, timeout_s=self.weightsync.timeout_s)
        outcome: SyncOutcome = handle.wait(self.weightsync.timeout_s)
        self.accelerator.wait_for_everyone()
        self._last_version = version
        self.syncs.append({"version": version, "seconds": time.perf_counter() - t0,
                           "outcome": outcome, "server": timings})

    def close(self) -> None:
        """Leaves the job (idempotent)."""
        if self._trainer is not None:
            self._trainer.close()


@contextlib.contextmanager
def _grpo_builds(factory: Callable[..., VLLMGeneration]) -> Iterator[None]:
    """GRPOTrainer's module builds ``factory(...)`` where it builds ``VLLMGeneration``, for the
    duration of one ``GRPOTrainer.__init__``."""
    grpo = importlib.import_module("trl.trainer.grpo_trainer")
    original = grpo.__dict__["VLLMGeneration"]
    grpo.__dict__["VLLMGeneration"] = factory
    try:
        yield
    finally:
        grpo.__dict__["VLLMGeneration"] = original


class WeightsyncGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose weight sync goes through weightsync: the same arguments plus
    ``weightsync_controller`` (the controller's ``host:port``) and optionally
    ``weightsync_controller_http``, ``weightsync_job_token``, ``weightsync_engine_rank`` (see
    :class:`WeightsyncSettings`). ``args`` must say ``use_vllm=True, vllm_mode="server"``."""

    def __init__(self, *args: Any, weightsync_controller: str, weightsync_controller_http: str | None = None,
                 weightsync_job_token: str | None = None, weightsync_engine_rank: int = 0,
                 weightsync_timeout_s: float = 600.0, **kwargs: Any) -> None:
        config = kwargs.get("args")
        if config is None or not getattr(config, "use_vllm", False) or getattr(config, "vllm_mode", None) != "server":
            raise ValueError("weightsync.trl: GRPOConfig(use_vllm=True, vllm_mode='server', vllm_server_base_url=...) "
                             "is required (pass it as args=)")
        settings = WeightsyncSettings(controller=weightsync_controller, controller_http=weightsync_controller_http,
                                      job_token=weightsync_job_token, engine_rank=weightsync_engine_rank,
                                      timeout_s=weightsync_timeout_s)

        def build(*a: Any, **kw: Any) -> VLLMGeneration:
            return WeightsyncVLLMGeneration(*a, weightsync=settings, **kw)

        with _grpo_builds(build):
            super().__init__(*args, **kwargs)
        self.weightsync.step = lambda: int(self.state.global_step)

    @property
    def weightsync(self) -> WeightsyncVLLMGeneration:
        """The weight-sync side: its :attr:`~WeightsyncVLLMGeneration.trainer` and ``syncs``."""
        gen = self.vllm_generation
        assert isinstance(gen, WeightsyncVLLMGeneration)
        return gen
