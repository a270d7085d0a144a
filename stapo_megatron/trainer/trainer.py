"""The STAPO trainer: set-up of one rank, and the training loop, which reads like the algorithm."""

from __future__ import annotations

import math
import signal

import torch

from stapo_megatron.checkpoint.convert import export_hf_tensors, fill_from_hf, hf_assets, load_model
from stapo_megatron.checkpoint.hf_io import HFCheckpoint
from stapo_megatron.config import to_dict
from stapo_megatron.data.prompts import default_stop_token_ids
from stapo_megatron.loss import needs_statistics_pass
from stapo_megatron.models.qwen3.parallelize import build_stage
from stapo_megatron.runtime.distributed import init_distributed
from stapo_megatron.trainer import megatron_fixes
from stapo_megatron.trainer.batch import RolloutBatch, broadcast_rollouts, make_microbatches, partition_for_rank
from stapo_megatron.trainer.checkpointing import Checkpointer
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.heartbeat import Heartbeat
from stapo_megatron.trainer.inspector import SpuriousTokenDump
from stapo_megatron.trainer.launcher import STOP_FILE
from stapo_megatron.trainer.metrics import MetricsLogger, PhaseTimer
from stapo_megatron.trainer.update import PolicyUpdater, candidate_mismatch, merge_reporter_metrics, rollout_statistics


def build_tokenizer(cfg: TrainConfig):
    if cfg.data.is_synthetic:
        from stapo_megatron.data.synthetic import TinyTokenizer

        return TinyTokenizer(distractors=cfg.data.synthetic_distractors)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.checkpoint.load_hf)


def stop_token_ids(cfg: TrainConfig, tokenizer) -> list[int]:
    return list(cfg.batch.stop_token_ids) or default_stop_token_ids(tokenizer, cfg.data.chat_template)


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
    is printed when ``report``."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class ConfigScheduler(OptimizerParamScheduler):
        def load_state_dict(self, state_dict: dict) -> None:
            if report:
                for key, field in _SCHEDULE_FIELDS.items():
                    if key in state_dict and state_dict[key] != getattr(self, key):
                        print(f"[stapo] {field} changed on resume: {state_dict[key]} in the checkpoint, "
                              f"{getattr(self, key)} now (takes effect)", flush=True)
            # The optimizer's groups, restored from the checkpoint just before, carry its peak and
            # final rates, which get_lr prefers to the scheduler's own.
            for group in self.optimizer.param_groups:
                group.update(max_lr=self.max_lr, min_lr=self.min_lr)
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
        megatron_fixes.apply()
        self.rank = self.ctx.rank
        self.device = self.ctx.device
        self.arch = cfg.model
        self.params_dtype = getattr(torch, cfg.compute.params_dtype)
        self.tokenizer = build_tokenizer(cfg)
        self.stop_requested = False
        self.engine_released = False  # rank 0: the engine gave its memory to training
        self.skipped_steps = 0
        self.optimizer_steps = 0

        model = build_stage(
            self.arch,
            params_dtype=self.params_dtype,
            recompute=cfg.compute.recompute,
            calculate_per_token_loss=True,
            device=self.device,
        )
        self._load_initial_weights(model)
        self.model = self._wrap_ddp(model)
        self.optimizer, self.scheduler = self._build_optimizer()
        self.checkpointer = Checkpointer(self.run_dir, cfg.checkpoint.keep_last, self.ctx)
        self.step = 0
        progress = self._resume()

        self.updater = PolicyUpdater(self.model, self.optimizer, cfg, self.arch, self.ctx)
        self.inspector = SpuriousTokenDump(self.run_dir, self.tokenizer, cfg.logging.inspect_context_tokens, self.ctx)
        self.collector = self.logger = self.evaluator = None
        if self.rank == 0:
            from stapo_megatron.trainer.launcher import write_resolved_config

            write_resolved_config(cfg)  # also when started by an outside torchrun / SLURM launch
            self._setup_rollout_rank(progress)
        self._install_signal_handlers()

    # ---- set-up -----------------------------------------------------------------------------

    def _load_initial_weights(self, model) -> None:
        """Weights before any training: a Hugging Face or Megatron checkpoint, or the seeded init."""
        ckpt = self.cfg.checkpoint
        if ckpt.load_hf:
            fill_from_hf(model, self.arch, HFCheckpoint(ckpt.load_hf))
        elif ckpt.load_megatron:
            load_model(model, ckpt.load_megatron)

    def _wrap_ddp(self, model):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

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

    def _resume(self) -> dict:
        mode = self.cfg.checkpoint.resume
        latest = self.checkpointer.latest_intact() if mode != "never" else None
        if latest is None:
            if mode == "required":
                raise RuntimeError(f"checkpoint.resume=required but {self.checkpointer.root} has no complete checkpoint")
            return {}
        progress = self.checkpointer.load(latest, self.model, self.optimizer, self.scheduler)
        self.step = progress["step"]
        self.skipped_steps = progress.get("skipped_steps", 0)
        self.optimizer_steps = progress.get("optimizer_steps", 0)
        if self.rank == 0:
            print(f"[stapo] resumed from {latest} (step {self.step})", flush=True)
        return progress

    def _setup_rollout_rank(self, progress: dict) -> None:
        from stapo_megatron.data.prompts import build_prompt_dataset
        from stapo_megatron.data.sampler import PromptSampler
        from stapo_megatron.rewards import RewardPool
        from stapo_megatron.rollout.factory import build_engine
        from stapo_megatron.trainer.rollout import RolloutCollector

        cfg = self.cfg
        dataset = build_prompt_dataset(cfg.data, self.tokenizer)
        print(f"[stapo] {dataset.report.summary()}", flush=True)
        sampler = PromptSampler(len(dataset), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        if "sampler" in progress:
            sampler.load_state_dict(progress["sampler"])
        engine = build_engine(cfg.rollout, self.arch, self.device, hf_dir=cfg.checkpoint.load_hf, run_dir=self.run_dir)
        reward_pool = RewardPool.from_config(cfg.reward)
        self.collector = RolloutCollector(engine, reward_pool, self.tokenizer, dataset, sampler, cfg, stop_token_ids(cfg, self.tokenizer))
        self.logger = MetricsLogger(self.run_dir, cfg.logging, cfg.run.name, to_dict(cfg, redact=True), self.step, cfg.run.steps)
        if cfg.eval.every:
            from stapo_megatron.eval.evaluator import Evaluator

            self.evaluator = Evaluator(
                engine, self.tokenizer, cfg.eval, cfg.data, cfg.reward,
                default_max_new_tokens=cfg.batch.max_new_tokens, stop_token_ids=stop_token_ids(cfg, self.tokenizer),
            )

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, frame):
            self.stop_requested = True

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, request_stop)

    # ---- the loop ---------------------------------------------------------------------------

    def train(self) -> None:
        """sample -> G rollouts -> rewards -> advantages -> old statistics -> per mini-batch: threshold
        and masked update -> weight sync -> evaluation -> checkpoint."""
        heartbeat = Heartbeat(self.cfg.run.hang_timeout_s, self.rank, saved_step=self.step).start()
        try:
            heartbeat.beat("sync", self.step)
            self.sync_weights(version=self.step)
            while self.step < self.cfg.run.steps:
                step = self.step + 1
                timer = heartbeat.timer(step)
                batch, metrics = self.collect_rollouts(step, timer)
                if len(batch):
                    metrics.update(self.update_policy(batch, step, timer))
                else:
                    self._message(f"[stapo] step {step}: every group was filtered out; no update")
                self.scheduler.step(increment=1)  # once per training step, update or not (see build_scheduler)
                with timer("sync"):
                    self.sync_weights(version=step)
                if self.cfg.eval.every and step % self.cfg.eval.every == 0:
                    with timer("eval"):
                        metrics.update(self.evaluate(step))
                self.step = step
                heartbeat.beat("metrics and stop agreement", step)
                self._log(step, metrics, timer, batch)
                stop = self._agree_to_stop()
                if stop or step == self.cfg.run.steps or (self.cfg.checkpoint.save_every and step % self.cfg.checkpoint.save_every == 0):
                    heartbeat.beat("checkpoint", step)
                    self.save()
                    heartbeat.saved(step)
                if stop:
                    self._message(f"[stapo] stop requested: checkpoint of step {step} written, exiting")
                    break
        finally:
            heartbeat.stop()
            self.close()

    def collect_rollouts(self, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, dict]:
        batch, metrics = (None, {})
        if self.rank == 0:
            batch, metrics = self.collector.collect(step, timer)
            if self.cfg.rollout.release_memory_between_steps:
                self.collector.engine.release_memory()
                self.engine_released = True
        with timer("broadcast"):
            return broadcast_rollouts(self.ctx, batch), metrics

    def update_policy(self, batch: RolloutBatch, step: int, timer: PhaseTimer) -> dict:
        minibatches = self._microbatches(batch)
        flat = [mb for group in minibatches for mb in group]
        with timer("statistics"):
            old_all = self.updater.statistics(flat)
        old, start = [], 0
        for group in minibatches:
            old.append(old_all[start : start + len(group)])
            start += len(group)
        metrics = rollout_statistics(self.ctx, old_all, flat)
        metrics.update(candidate_mismatch(self.ctx, old_all, flat, self.cfg.algo.tau_p))
        results, decided_on = [], []
        for j, microbatches in enumerate(minibatches):
            current = None
            if needs_statistics_pass(self.cfg.algo):
                if j == 0:
                    current = old[0]
                else:
                    with timer("statistics"):
                        current = self.updater.statistics(microbatches)
            with timer("update"):
                result = self.updater.train_minibatch(microbatches, old[j], current)
            results.append(result)
            decided_on.append(current or old[j])
            if result.skipped:
                self.skipped_steps += 1
                self._message(f"[stapo] step {step}: non-finite loss or gradient, optimizer step skipped ({self.skipped_steps} so far)")
                if self.skipped_steps > self.cfg.faults.max_skipped_steps:
                    raise RuntimeError(
                        f"{self.skipped_steps} optimizer steps skipped for non-finite values, more than "
                        f"faults.max_skipped_steps={self.cfg.faults.max_skipped_steps}"
                    )
            else:
                self.optimizer_steps += 1
        if self.cfg.logging.inspect_every and step % self.cfg.logging.inspect_every == 0:
            self.inspector.dump(step, minibatches, decided_on, [r.selections for r in results], batch)
        metrics.update(_average([r.metrics for r in results]))
        metrics["optim/skipped_steps"] = float(self.skipped_steps)
        return metrics

    def _microbatches(self, batch: RolloutBatch) -> list[list[dict]]:
        """This data-parallel rank's micro-batches of each optimizer mini-batch."""
        b = self.cfg.batch
        groups = int(batch.group_ids.max()) + 1
        count = min(b.minibatches_per_step, groups)
        bounds = [round(i * groups / count) for i in range(count + 1)]
        dp_rank, dp_size = self.ctx.dp_rank, self.ctx.dp_size
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        minibatches = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            sequences = [i for i in range(len(batch)) if lo <= int(batch.group_ids[i]) < hi]
            mine = partition_for_rank(len(sequences), [lengths[i] for i in sequences], dp_rank, dp_size)
            indices = [sequences[i] for i in mine]
            minibatches.append(make_microbatches(batch, indices, b.micro_batch_size, self.device))
        return minibatches

    def sync_weights(self, version: int) -> None:
        """Send the current weights to the rollout engine (rank 0) through the export stream."""
        if self.ctx.dp_rank != 0:
            return
        stream = export_hf_tensors(self.model, self.arch, destination="first_rank")
        if self.rank == 0:
            if self.engine_released:
                self.collector.engine.resume_memory()
                self.engine_released = False
            self.collector.engine.load_weights(stream, version=version)
        else:
            for _ in stream:
                pass

    def evaluate(self, step: int) -> dict:
        metrics = {}
        if self.rank == 0:
            metrics = self.evaluator.evaluate_in_training(step, self.run_dir)
        return metrics

    def save(self) -> None:
        progress = [None]
        if self.rank == 0:
            progress[0] = {
                "step": self.step,
                "skipped_steps": self.skipped_steps,
                "optimizer_steps": self.optimizer_steps,
                "sampler": self.collector.sampler.state_dict(),
            }
        # The sampler lives on rank 0; every rank must hand dist_checkpointing the same common state.
        progress = self.ctx.broadcast_object(progress[0], src=0)
        assets = hf_assets(self.cfg.tokenizer or self.cfg.checkpoint.load_hf) if (self.cfg.tokenizer or self.cfg.checkpoint.load_hf) else None
        self.checkpointer.save(self.step, self.model, self.optimizer, self.scheduler, progress, self.arch, self.params_dtype, assets)

    def _agree_to_stop(self) -> bool:
        requested = self.stop_requested or (self.rank == 0 and (self.run_dir / STOP_FILE).exists())
        stop = self.ctx.any_rank(requested)
        if stop and self.rank == 0 and (self.run_dir / STOP_FILE).exists():
            (self.run_dir / STOP_FILE).unlink()
        return stop

    def _log(self, step: int, metrics: dict, timer: PhaseTimer, batch: RolloutBatch) -> None:
        metrics = merge_reporter_metrics(self.ctx, metrics)
        if self.rank != 0:
            return
        metrics.update(timer.metrics())
        total = sum(timer.seconds.values())
        tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
        metrics["time/step"] = total
        metrics["throughput/tokens_per_s"] = tokens / total if total > 0 else 0.0
        metrics["optim/optimizer_steps"] = float(self.optimizer_steps)
        self.logger.log(step, metrics)

    def _message(self, text: str) -> None:
        if self.rank == 0:
            (self.logger.message if self.logger else print)(text)

    def close(self) -> None:
        if self.rank == 0 and self.collector is not None:
            self.collector.engine.shutdown()
            self.collector.reward_pool.close()
            self.logger.close()


def _average(rows: list[dict]) -> dict:
    """Mean over the step's optimizer steps of each metric (counts are summed)."""
    if not rows:
        return {}
    out = {}
    for key in rows[0]:
        values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
        if not values:
            out[key] = float("nan")  # logged as null: the key stays in every row
            continue
        summed = key.endswith(("_tokens", "/candidates", "/silenced_candidates"))
        out[key] = sum(values) if summed else sum(values) / len(values)
    return out
