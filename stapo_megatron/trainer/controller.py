"""The rollout side of a run behind one facade, :class:`RolloutController`, which the trainer holds
on every rank and calls once per operation a step needs.

Rank 0 (the controller rank) alone talks to the engine, scores rewards, samples prompts, evaluates
and writes the metrics rows (:class:`Rank0Rollouts`); every other rank takes part in the
collectives around that work and gets rank 0's results. Each node's leader owns its node's SGLang
servers, and every rank its own link to them for the weight sync.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from stapo_megatron.config import to_dict
from stapo_megatron.data.prompts import default_stop_token_ids
from stapo_megatron.runtime.run_files import STOP_FILE, write_resolved_config
from stapo_megatron.trainer.batch import RolloutBatch, broadcast_rollouts
from stapo_megatron.trainer.heartbeat import Heartbeat
from stapo_megatron.trainer.metrics import MetricsLogger, PhaseTimer
from stapo_megatron.trainer.rollout_collector import RolloutCollector

if TYPE_CHECKING:
    from stapo_megatron.eval.evaluator import Evaluator
    from stapo_megatron.rollout.node_servers import JobServers
    from stapo_megatron.rollout.weight_sync.session import WeightSync
    from stapo_megatron.runtime.distributed import ParallelContext
    from stapo_megatron.trainer.config import TrainConfig
    from stapo_megatron.trainer.rollout_pipeline import RolloutPipeline

logger = logging.getLogger(__name__)

_Result = TypeVar("_Result")


def stop_token_ids(cfg: TrainConfig, tokenizer) -> list[int]:
    """The tokens that end a response: the configured ones, else the chat template's defaults."""
    return list(cfg.batch.stop_token_ids) or default_stop_token_ids(tokenizer, cfg.data.chat_template)


@dataclasses.dataclass
class Rank0Rollouts:
    """What rank 0 alone holds: the collector (engine, rewards, prompts and their sampler), the
    evaluator (None without in-training evaluation), the metrics logger, and the generation thread
    when generation runs beside training (None in the synchronous loop)."""

    collector: RolloutCollector
    evaluator: Evaluator | None
    metrics_logger: MetricsLogger
    run_dir: Path
    pipeline: RolloutPipeline | None = None

    @classmethod
    def build(
        cls,
        cfg: TrainConfig,
        tokenizer,
        device,
        servers: JobServers | None,
        sampler_state: dict | None,
        step: int,
        pipeline_state: dict | None = None,
    ) -> Rank0Rollouts:
        """Rank 0's side for ``cfg``, its sampler at the resumed ``sampler_state`` (and the generation
        thread at ``pipeline_state``), logging from ``step``."""
        from stapo_megatron.data.prompts import build_prompt_dataset
        from stapo_megatron.data.sampler import PromptSampler
        from stapo_megatron.rewards import RewardPool
        from stapo_megatron.rollout.factory import build_engine

        write_resolved_config(cfg)  # also when started by an outside torchrun / SLURM launch
        dataset = build_prompt_dataset(cfg.data, tokenizer)
        logger.info("training prompts: %s", dataset.report.summary())
        sampler = PromptSampler(len(dataset), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        if sampler_state is not None:
            sampler.load_state_dict(sampler_state)
        engine = build_engine(
            cfg.rollout, cfg.model, device, hf_dir=cfg.checkpoint.load_hf, run_dir=cfg.run.directory, servers=servers
        )
        stops = stop_token_ids(cfg, tokenizer)
        collector = RolloutCollector(
            engine, RewardPool.from_config(cfg.reward), tokenizer, dataset, sampler, cfg, stops
        )
        metrics_logger = MetricsLogger(
            cfg.run.directory, cfg.logging, cfg.run.name, to_dict(cfg, redact=True), step, cfg.run.steps
        )
        evaluator = None
        if cfg.eval.every:
            from stapo_megatron.eval.evaluator import Evaluator

            evaluator = Evaluator(
                engine,
                tokenizer,
                cfg.eval,
                cfg.data,
                cfg.reward,
                default_max_new_tokens=cfg.batch.max_new_tokens,
                stop_token_ids=stops,
            )
        pipeline = None
        if cfg.rollout.pipelined:
            from stapo_megatron.config import ConfigError
            from stapo_megatron.trainer.rollout_pipeline import RolloutPipeline
            from stapo_megatron.trainer.sample_pool import SamplePool

            try:
                pipeline = RolloutPipeline.resumed(
                    SamplePool(collector), cfg.rollout.generation_lag, cfg.run.steps, step, pipeline_state
                )
            except (ValueError, KeyError, TypeError) as err:
                raise ConfigError(f"the checkpoint's rollout state does not fit this run: {err}") from None
        elif pipeline_state is not None:
            logger.warning(
                "the checkpoint was written by a run that generated ahead of training (rollout.async.max_staleness "
                "> 0) and this run generates in turn: its %d batches generated ahead and %d groups in flight are "
                "discarded (their prompts are not trained on)",
                len(pipeline_state.get("ready", {})),
                len(pipeline_state.get("pool", {}).get("groups", [])),
            )
        return cls(collector, evaluator, metrics_logger, cfg.run.directory, pipeline)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        self.collector.engine.shutdown()
        self.collector.reward_pool.close()
        self.metrics_logger.close()


class RolloutController:
    """Everything a training step asks of the rollout side, on every rank: the rank-0 work and the
    collectives that hand its results to the others are inside. ``rank0`` is None on every rank
    but 0; ``servers`` are the job's SGLang servers (None with the local engine)."""

    def __init__(
        self,
        ctx: ParallelContext,
        arch,
        heartbeat: Heartbeat,
        rank0: Rank0Rollouts | None,
        servers: JobServers | None = None,
        *,
        pipelined: bool = False,
    ):
        self.ctx, self.arch, self.heartbeat = ctx, arch, heartbeat
        self._rank0 = rank0
        self._servers = servers
        self.pipelined = pipelined  # generation runs beside training (rank 0's RolloutPipeline)
        self._stretches_alone = 0  # rank 0's stretches alone so far, counted alike on every rank
        self._weight_sync: WeightSync | None = None  # every rank's link to the SGLang servers, made at the first sync

    @classmethod
    def start(
        cls,
        cfg: TrainConfig,
        ctx: ParallelContext,
        tokenizer,
        heartbeat: Heartbeat,
        sampler_state: dict | None,
        step: int,
        pipeline_state: dict | None = None,
    ) -> RolloutController:
        """Collective: the node leaders launch their node's SGLang servers and every rank learns every
        endpoint; rank 0 builds its side (:class:`Rank0Rollouts`), resumed at ``sampler_state`` and
        ``pipeline_state`` and logging from ``step``."""
        from stapo_megatron.rollout.factory import start_rollout_servers

        servers = start_rollout_servers(ctx, cfg.rollout, cfg.checkpoint.load_hf, cfg.run.directory)
        rank0 = (
            Rank0Rollouts.build(cfg, tokenizer, ctx.device, servers, sampler_state, step, pipeline_state)
            if ctx.rank == 0
            else None
        )
        return cls(ctx, cfg.model, heartbeat, rank0, servers, pipelined=cfg.rollout.pipelined)

    def collect(self, step: int, timer: PhaseTimer) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Rank 0 samples the step's prompts, generates, scores and computes the advantages (or, with
        generation beside training, takes the batch its thread generated) while every other rank
        waits. Returns rank 0's batch (None elsewhere: :meth:`broadcast` hands it to every rank) and
        the step's rollout metrics (rank 0's; none elsewhere)."""

        def collect(rank0: Rank0Rollouts) -> tuple[RolloutBatch, dict[str, float]]:
            with timer("rollout"):  # sampling bookkeeping; generation and rewards time themselves inside
                if rank0.pipeline is not None:
                    return rank0.pipeline.take(step)
                return rank0.collector.collect(step, timer)

        return self._alone_on_rank0(collect, (None, {}), "rollout", step, timer)

    def broadcast(self, batch: RolloutBatch | None) -> RolloutBatch:
        """Collective: rank 0's ``batch`` of :meth:`collect` on every rank."""
        return broadcast_rollouts(self.ctx, batch)

    def evaluate(self, step: int, timer: PhaseTimer) -> dict[str, float]:
        """Rank 0 evaluates the engine's current weights while every other rank waits; its metrics
        (none elsewhere)."""

        def evaluate(rank0: Rank0Rollouts) -> dict[str, float]:
            assert rank0.evaluator is not None, "evaluate needs eval.every"
            with timer("eval"):
                return rank0.evaluator.evaluate_in_training(step, rank0.run_dir)

        return self._alone_on_rank0(evaluate, {}, "eval", step, timer)

    def sync_weights(self, model, version: int, timer: PhaseTimer) -> None:
        """Collective: every rank sends its own share of ``model``'s weights, straight to the SGLang
        servers, or to rank 0's in-process engine (see rollout/weight_sync/session.py). With
        generation beside training, once the thread has generated every batch of an older version."""
        from stapo_megatron.rollout.weight_sync.session import sync_engine_weights

        if self.pipelined:
            self._alone_on_rank0(self._boundary_waiter(version), None, "rollout", version + 1, timer)
        engine = self._rank0.collector.engine if self._rank0 is not None else None
        self._weight_sync = sync_engine_weights(self.ctx, model, self.arch, engine, version, self._weight_sync)

    def resume_engine(self) -> None:
        """The engine takes its memory back (rank 0 asks the servers of every node)."""
        if self._rank0 is not None:
            self._rank0.collector.engine.resume_memory()

    def release_engine(self) -> None:
        """The engine gives its memory up for training (rank 0 asks the servers of every node)."""
        if self._rank0 is not None:
            self._rank0.collector.engine.release_memory()

    def pipeline_state(self, version: int, timer: PhaseTimer) -> dict | None:
        """Collective: the rollout side generated ahead of the trainer at ``version`` (its step), rank
        0's on every rank, once the thread has reached that version's boundary; None in the
        synchronous loop. Read it before :meth:`sampler_state`: the thread moves the sampler."""
        if not self.pipelined:
            return None

        def state(rank0: Rank0Rollouts) -> dict:
            assert rank0.pipeline is not None  # built with pipelined
            return rank0.pipeline.state_dict(version)

        return self.ctx.broadcast_object(self._alone_on_rank0(state, None, "rollout", version, timer))

    @staticmethod
    def _boundary_waiter(version: int) -> Callable[[Rank0Rollouts], None]:
        def wait(rank0: Rank0Rollouts) -> None:
            assert rank0.pipeline is not None  # built with pipelined
            rank0.pipeline.wait_for_boundary(version)

        return wait

    def sampler_state(self) -> dict:
        """Collective: the prompt sampler's state, rank 0's on every rank (every rank hands
        dist_checkpointing the same common state)."""
        return self.ctx.broadcast_object(
            self._rank0.collector.sampler.state_dict() if self._rank0 is not None else None
        )

    def agree_to_stop(self, requested: bool) -> bool:
        """Collective: whether the run stops after this step, ``requested`` (a signal) on any rank or
        a stop file in the run directory (rank 0 looks, and removes it once agreed)."""
        stop_file = self._rank0.run_dir / STOP_FILE if self._rank0 is not None else None
        stop = self.ctx.any_rank(requested or (stop_file is not None and stop_file.exists()))
        if stop and stop_file is not None:
            stop_file.unlink(missing_ok=True)
        return stop

    def write_row(self, step: int, metrics: dict[str, float]) -> None:
        """The step's metrics row, to rank 0's sinks (nothing elsewhere)."""
        if self._rank0 is not None:
            self._rank0.metrics_logger.log(step, metrics)

    def close(self) -> None:
        if self._rank0 is not None:
            self._rank0.close()
        if self._weight_sync is not None:
            self._weight_sync.close()
        if self._servers is not None:
            self._servers.shutdown()  # this node's servers, on its leader

    def _alone_on_rank0(
        self,
        action: Callable[[Rank0Rollouts], _Result],
        default: Any,
        phase: str,
        step: int,
        timer: PhaseTimer,
    ) -> _Result:
        """``action(rank0)`` on rank 0 while every other rank waits for it (``default``
        there). Rollouts and evaluation may outlast run.hang_timeout_s and parallel.timeout_minutes: rank 0
        beats through them (their requests and rewards have time limits of their own) and the waiting
        ranks, waiting in the job's store, beat whenever rank 0 does: a long rollout ends no rank, and a
        lost or frozen rank 0 still ends those waiting for it."""
        result = default
        if self._rank0 is not None:
            with self.heartbeat.keep_alive():
                result = action(self._rank0)
        self._stretches_alone += 1
        with timer(phase):
            self.heartbeat.wait_for_rank0(
                phase, step, self._stretches_alone, lambda: dist.barrier(group=self.ctx.cpu_group)
            )
        return result
