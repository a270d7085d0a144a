"""The STAPO trainer: set-up of one rank, and the training loop, which reads like the algorithm."""

from __future__ import annotations

import logging
import signal

import numpy as np
import torch
import torch.distributed as dist

from stapo_megatron.checkpoint.convert import fill_from_hf, hf_assets, load_model
from stapo_megatron.checkpoint.hf_io import HFCheckpoint
from stapo_megatron.data.prompts import load_tokenizer
from stapo_megatron.models.qwen3.parallelize import build_stage
from stapo_megatron.runtime.distributed import init_distributed
from stapo_megatron.runtime.run_files import STOP_SIGNALS
from stapo_megatron.trainer.batch import RolloutBatch
from stapo_megatron.trainer.checkpoint_directory import CheckpointDirectory
from stapo_megatron.trainer.checkpointing import PIPELINE_KEY, Checkpointer
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.controller import RolloutController
from stapo_megatron.trainer.heartbeat import Heartbeat, job_store
from stapo_megatron.trainer.inspector import SpuriousTokenDump
from stapo_megatron.trainer.metrics import PhaseTimer
from stapo_megatron.trainer.offload import OPTIMIZER, PARAMS, TrainerOffload
from stapo_megatron.trainer.reference import ReferenceModel
from stapo_megatron.trainer.resume import resume_point
from stapo_megatron.trainer.run_record import run_record
from stapo_megatron.trainer.update import PolicyUpdater

logger = logging.getLogger(__name__)


# The config fields behind the scheduler's state, named when a resume changes them.
_SCHEDULE_FIELDS = {
    "max_lr": "optim.lr",
    "min_lr": "optim.min_lr",
    "lr_warmup_steps": "optim.warmup_steps",
    "lr_decay_style": "optim.schedule",
    "lr_decay_steps": "the decay length (run.steps)",
    "start_wd": "optim.weight_decay",
}


def build_scheduler(optimizer, cfg: TrainConfig, report: bool = True):
    """Megatron's learning-rate and weight-decay scheduler for ``cfg``. On resume the config's
    values take effect, at the checkpoint's position in the schedule (Megatron's default would
    keep the checkpoint's values and silently ignore a changed ``optim.lr``); each changed value
    is logged when ``report``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class ConfigScheduler(OptimizerParamScheduler):
        def load_state_dict(self, state_dict: dict) -> None:
            if report:
                for key, field in _SCHEDULE_FIELDS.items():
                    if key in state_dict and state_dict[key] != getattr(self, key):
                        logger.info(
                            "%s changed on resume: %s in the checkpoint, %s now (takes effect)",
                            field,
                            state_dict[key],
                            getattr(self, key),
                        )
            # The optimizer's groups, restored from the checkpoint just before, carry its peak and
            # final rates, which get_lr prefers to the scheduler's own.
            # Adam's betas and eps come back with the optimizer's groups too; the config's win.
            adam: dict[str, tuple[float, float] | float] = {
                "betas": (cfg.optim.beta1, cfg.optim.beta2),
                "eps": cfg.optim.eps,
            }
            changed = {}
            for group in self.optimizer.param_groups:
                group.update(max_lr=self.max_lr, min_lr=self.min_lr)
                for key, value in adam.items():
                    if key in group and tuple(np.atleast_1d(group[key])) != tuple(np.atleast_1d(value)):
                        changed[key] = group[key]
                        group[key] = value
            if report:
                for key, old in changed.items():
                    logger.info(
                        "optim.%s changed on resume: %s in the checkpoint, %s now (takes effect)", key, old, adam[key]
                    )
            super().load_state_dict(state_dict)

    o = cfg.optim
    # The schedule counts training (rollout) steps, one scheduler step after all of a step's
    # mini-batches, as veRL (the paper's trainer) does; its position is then the step count.
    total_updates = cfg.run.steps
    return ConfigScheduler(
        optimizer,
        init_lr=0.0 if o.warmup_steps else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=max(total_updates, o.warmup_steps + 1),
        lr_decay_style=o.schedule,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(total_updates, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


class Trainer:
    """One rank of a run. ``Trainer(cfg).train()`` is the whole job."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = cfg.run.directory
        self.ctx = init_distributed(cfg.parallel, seed=cfg.run.seed)
        self.rank = self.ctx.rank
        self.device = self.ctx.device
        self.arch = cfg.model
        self.params_dtype = getattr(torch, cfg.compute.params_dtype)
        self.tokenizer = load_tokenizer(cfg.data, cfg.hf_tokenizer_dir)
        self.tokenizer_dir = self._tokenizer_files()
        self.stop_requested = False
        # Which of the engine and the trainer holds the GPU, tracked alike on every rank (the weight
        # sync is collective); only rank 0 talks to the engine.
        self.engine_released = False  # the engine gave its memory to training
        self.engine_version: int | None = None  # the weights the engine holds; None: none valid yet, or released
        self.release_engine = cfg.rollout.release_memory_between_steps or cfg.compute.offload_while_generating
        self.checkpoints = CheckpointDirectory(self.run_dir, cfg.checkpoint.keep_last)
        # What this run is, for its checkpoints and the resume check; rank 0's (it wrote the tokenizer files).
        self.record = self.ctx.broadcast_object(run_record(cfg, self.tokenizer_dir) if self.rank == 0 else None)
        # before any weights are built or read
        self.resume_from = resume_point(self.ctx, self.checkpoints, cfg.checkpoint.resume, self.record)
        self._build_policy()
        self.moved_bytes = {"offload": 0, "reload": 0}  # this step's, for its row
        self.step = 0
        self.updater = PolicyUpdater(
            self.model,
            self.optimizer,
            cfg,
            self.arch,
            self.ctx,
            reference=self.reference,
            inspector=SpuriousTokenDump(self.run_dir, self.tokenizer, cfg.logging.inspect_context_tokens, self.ctx),
        )
        self.saved_sampler: dict | None = None  # the sampler position a resume restores
        self.saved_pipeline: dict | None = None  # the batches and samples a resume's rollouts had generated ahead
        self.checkpointer = Checkpointer(
            self.checkpoints,
            self.ctx,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            progress=self,
            record=self.record,
            arch=self.arch,
            params_dtype=self.params_dtype,
            assets=hf_assets(self.tokenizer_dir) if self.tokenizer_dir else None,
        )
        self._resume()
        # Started by train(); rank 0's beats reach every rank through the job's store.
        self.heartbeat = Heartbeat(cfg.run.hang_timeout_s, self.rank, saved_step=self.step, store=job_store())
        self.rollouts = self._start_rollouts(self.saved_sampler, self.saved_pipeline)
        self._install_signal_handlers()

    # ---- set-up -----------------------------------------------------------------------------

    def _build_policy(self) -> None:
        """The policy this rank trains: its stage of the model with the initial weights, the KL
        penalty's reference (a copy of those), Megatron's DDP wrapper, the optimizer and its
        schedule, and the offload of their state while the engine generates."""
        cfg = self.cfg
        model = build_stage(
            self.arch,
            self.ctx,
            params_dtype=self.params_dtype,
            recompute=cfg.compute.recompute,
            sequence_parallel=cfg.parallel.sequence_parallel,
            calculate_per_token_loss=True,
            device=self.device,
        )
        self._load_initial_weights(model)
        # The KL penalty's reference: the initial weights, copied before any checkpoint is resumed.
        self.reference = (
            ReferenceModel(
                model,
                self.arch,
                self.ctx,
                params_dtype=self.params_dtype,
                sequence_parallel=cfg.parallel.sequence_parallel,
                device=self.device,
            )
            if cfg.algo.kl_coef > 0
            else None
        )
        self.model = self._wrap_ddp(model)
        self.optimizer, self.scheduler = self._build_optimizer()
        self.offload = (
            TrainerOffload(
                self.model,
                self.optimizer,
                self.device,
                reference=self.reference.model if self.reference is not None else None,
            )
            if cfg.compute.offload_while_generating
            else None
        )

    def _start_rollouts(self, sampler_state: dict | None, pipeline_state: dict | None) -> RolloutController:
        """The rollout side, its sampler resumed at ``sampler_state`` and what it had generated ahead
        at ``pipeline_state``. Colocated servers size their KV
        cache from the memory free when they start: with offload, the trainer's state waits in host
        memory on every rank before any server launches."""
        if self.offload is not None:
            self.offload.offload(OPTIMIZER)
            self.offload.offload(PARAMS)
            dist.barrier(group=self.ctx.cpu_group)
        return RolloutController.start(
            self.cfg, self.ctx, self.tokenizer, self.heartbeat, sampler_state, self.step, pipeline_state
        )

    def _tokenizer_files(self) -> str:
        """The directory whose tokenizer files every checkpoint carries in its hf_assets/ ('': none):
        the configured one, else load_hf's; the synthetic task's is written to <run>/tokenizer (by
        rank 0, the rank that copies the assets)."""
        if not self.cfg.data.is_synthetic:
            return self.cfg.hf_tokenizer_dir
        directory = self.run_dir / "tokenizer"
        if self.rank == 0:
            self.tokenizer.save_pretrained(directory)
        return str(directory)

    def _load_initial_weights(self, model) -> None:
        """Weights before any training: a Hugging Face or Megatron checkpoint, or the seeded init."""
        ckpt = self.cfg.checkpoint
        if ckpt.load_hf:
            fill_from_hf(model, self.arch, HFCheckpoint(ckpt.load_hf), self.ctx)
        elif ckpt.load_megatron:
            load_model(model, ckpt.load_megatron, self.ctx)

    def _wrap_ddp(self, model):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.cfg.optim.distributed,
        )
        wrapped = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        # Megatron's per-token normalisation: sum token counts over micro-batches and DP ranks,
        # then divide the gradients once (STAPO's renormalisation over the kept tokens).
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = wrapped.no_sync
        return wrapped

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.cfg.optim
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.beta1,
                adam_beta2=o.beta2,
                adam_eps=o.eps,
                clip_grad=o.clip_grad,
                bf16=self.params_dtype == torch.bfloat16,
                params_dtype=self.params_dtype,
                use_distributed_optimizer=o.distributed,
            ),
            [self.model],
        )
        return optimizer, build_scheduler(optimizer, self.cfg, report=self.rank == 0)

    def _resume(self) -> None:
        if self.resume_from is None:
            return
        self.checkpointer.load(self.resume_from.checkpoint, verified=True)  # resume_point verified it
        if self.resume_from.plan.fresh_sampler:  # the saved position belongs to the old prompt order
            self.saved_sampler = self.saved_pipeline = None
        if self.rank == 0:
            logger.info("resumed from %s (step %d)", self.resume_from.checkpoint, self.step)

    def state_dict(self) -> dict:
        """A checkpoint's progress (the checkpointer saves the trainer as a Stateful): the step, the
        updater's outcome counts, the sampler's position and, with generation beside training, what
        was generated ahead; the same on every rank."""
        # before the sampler, which the generation thread moves; its wait counts in the caller's checkpoint phase
        pipeline = self.rollouts.pipeline_state(self.step, self.heartbeat.timer(self.step))
        progress = {"step": self.step, **self.updater.state_dict(), "sampler": self.rollouts.sampler_state()}
        return progress if pipeline is None else {**progress, PIPELINE_KEY: pipeline}

    def load_state_dict(self, progress: dict) -> None:
        self.step = progress["step"]
        self.updater.load_state_dict(progress)
        self.saved_sampler = progress.get("sampler")
        self.saved_pipeline = progress.get(PIPELINE_KEY)

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, frame):
            if signum == signal.SIGINT and self.stop_requested:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now (`stapo` exits with 130)
            self.stop_requested = True  # before the message: a second signal may come while it prints
            if signum == signal.SIGINT:
                logger.info("stopping after the current step (checkpoint follows); Ctrl-C again to stop now")

        for sig in (*STOP_SIGNALS, signal.SIGUSR1):
            signal.signal(sig, request_stop)

    # ---- the loop ---------------------------------------------------------------------------

    def train(self) -> None:
        """sample -> G rollouts -> rewards -> advantages -> old statistics -> per mini-batch: threshold
        and masked update -> evaluation -> checkpoint. The engine receives the weights when it next
        generates (:meth:`ready_to_generate`)."""
        heartbeat = self.heartbeat.start()
        try:
            timer = heartbeat.timer(self.step + 1)
            while self.step < self.cfg.run.steps:
                step = self.step + 1
                batch, metrics = self.collect_rollouts(step, timer)
                if len(batch):
                    metrics.update(self.updater.train_step(batch, step, timer))
                else:
                    logger.info("step %d: every group was filtered out; no update", step)
                with timer("update"):
                    self.scheduler.step(increment=1)  # once per training step, update or not (see build_scheduler)
                if self.cfg.eval.every and step % self.cfg.eval.every == 0:
                    self.ready_to_generate(version=step, timer=timer)
                    metrics.update(self.rollouts.evaluate(step, timer))
                self.step = step
                after_row = self._log(step, metrics, timer, batch, heartbeat)
                with after_row("stop_agreement"):
                    stop = self.rollouts.agree_to_stop(self.stop_requested)
                if (
                    stop
                    or step == self.cfg.run.steps
                    or (self.cfg.checkpoint.save_every and step % self.cfg.checkpoint.save_every == 0)
                ):
                    self._checkpoint(step, after_row, heartbeat)
                # what ran after the row (writing it, the stop agreement, the checkpoint) counts in the next one
                timer = heartbeat.timer(step + 1).absorb(after_row)
                if stop:
                    logger.info("stop requested: checkpoint of step %d written, exiting", step)
                    break
        finally:
            heartbeat.stop()
            self.close()

    def collect_rollouts(self, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, dict]:
        self.ready_to_generate(version=self.step, timer=timer)
        batch, metrics = self.rollouts.collect(step, timer)
        self.ready_to_train(timer)  # the engine's memory back to training before the batch reaches the GPU
        with timer("broadcast"):
            return self.rollouts.broadcast(batch), metrics

    # ---- who holds the GPU: the engine while generating, the trainer while training ---------

    def ready_to_generate(self, version: int, timer: PhaseTimer) -> None:
        """The engine holds its memory and the weights of ``version``; with offload, the trainer's
        state waits in host memory. Optimizer state and gradients leave first, the engine takes its
        memory back, the weights are synced from the still-resident parameters, then those leave."""
        if self.offload is not None:
            with timer("offload"):
                self.moved_bytes["offload"] += self.offload.offload(OPTIMIZER)  # done on this GPU when it returns
                if self.engine_released:
                    # Rank 0 resumes the servers' memory on every GPU of every node: not before every
                    # rank has given its own up (ready_to_train waits the other way).
                    dist.barrier(group=self.ctx.cpu_group)
        if self.engine_released:
            with timer("resume"):
                self.rollouts.resume_engine()
            self.engine_released = False
        if self.engine_version != version:
            if self.offload is not None and self.offload.offloaded(PARAMS):  # offloaded before the servers launched
                with timer("reload"):
                    self.moved_bytes["reload"] += self.offload.reload(PARAMS)
            with timer("sync"):
                self.rollouts.sync_weights(self.model, version, timer)
            self.engine_version = version
        if self.offload is not None:
            with timer("offload"):
                self.moved_bytes["offload"] += self.offload.offload(PARAMS)

    def ready_to_train(self, timer: PhaseTimer) -> None:
        """The trainer holds its memory: the engine releases its own first (its weights are not kept:
        SGLang's are garbage after a resume without a CPU backup), then the trainer reloads."""
        if self.release_engine and not self.engine_released:
            with timer("release"):
                self.rollouts.release_engine()
            self.engine_released, self.engine_version = True, None
        if self.offload is not None and (self.offload.offloaded(OPTIMIZER) or self.offload.offloaded(PARAMS)):
            with timer("reload"):
                dist.barrier(group=self.ctx.cpu_group)  # no rank reloads into memory rank 0's engine still holds
                self.moved_bytes["reload"] += self.offload.reload()

    def _checkpoint(self, step: int, timer: PhaseTimer, heartbeat: Heartbeat) -> None:
        """Save ``step``. It runs after the step's row is written (a resume from it must find that
        row), so its seconds count in the next step's row."""
        if self.offload is not None:
            self.ready_to_train(timer)
        with timer("checkpoint"):
            self.checkpointer.save(step)
        heartbeat.saved(step)

    def _log(
        self, step: int, metrics: dict, timer: PhaseTimer, batch: RolloutBatch, heartbeat: Heartbeat
    ) -> PhaseTimer:
        """Write the step's row; returns a timer started where this step's time ends, for what runs
        after the row (writing it is the first of those)."""
        step_seconds = timer.stop()
        following = heartbeat.timer(step).follow(timer)

        with following("logging"):
            metrics.update(timer.metrics())
            tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
            metrics["throughput/tokens_per_s"] = tokens / step_seconds if step_seconds > 0 else 0.0
            metrics["optim/optimizer_steps"] = float(self.updater.optimizer_steps)
            if self.offload is not None:  # rank 0's own bytes (ranks of other pipeline stages differ)
                metrics["memory/offloaded_gb"] = self.moved_bytes["offload"] / 1e9
                metrics["memory/reloaded_gb"] = self.moved_bytes["reload"] / 1e9
            self.rollouts.write_row(step, metrics)  # to rank 0's sinks; the other ranks write nothing
        self.moved_bytes = dict.fromkeys(self.moved_bytes, 0)
        return following

    def close(self) -> None:
        self.rollouts.close()
