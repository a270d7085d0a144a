"""The rollout side of the controller rank (rank 0): the engine, rewards, prompts and their sampler,
the evaluator and the metrics logger, behind :class:`RolloutController`; and one step's rollouts:
sample G responses per prompt, score, advantages (:class:`RolloutCollector`).

With dynamic sampling, groups whose rewards are all equal carry no signal and are dropped;
more prompts are sampled in their place, for at most ``batch.max_sampling_rounds`` rounds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

import torch

from stapo_megatron.config import to_dict
from stapo_megatron.data.prompts import response_text
from stapo_megatron.loss import correctness_reward, dynamic_sampling_filter, group_advantages, overlong_penalty
from stapo_megatron.loss.metrics import Reduction, declare
from stapo_megatron.rewards import REASONS, summarize_reasons
from stapo_megatron.rollout.engine import SamplingParams
from stapo_megatron.trainer.batch import RolloutBatch
from stapo_megatron.trainer.launcher import STOP_FILE, write_resolved_config
from stapo_megatron.trainer.metrics import MetricsLogger

logger = logging.getLogger(__name__)


def step_seed(run_seed: int, step: int, round_index: int) -> int:
    """A sampling seed that depends only on (run seed, step, round): resumed runs resample alike."""
    digest = hashlib.sha256(f"{run_seed}:{step}:{round_index}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


@dataclasses.dataclass
class _Groups:
    prompt_ids: list[list[int]] = dataclasses.field(default_factory=list)
    response_ids: list[list[int]] = dataclasses.field(default_factory=list)
    logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    truncated: list[bool] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    correct: list[float] = dataclasses.field(default_factory=list)
    groups: int = 0


# The rollout metrics of a step (RolloutCollector._metrics): over every response sampled in it,
# dynamic sampling's dropped groups and extra rounds included.
declare(
    Reduction.SUM,
    {
        "rollout/responses_sampled": "responses sampled",
        "rollout/groups_kept": "groups kept for the update",
        "rollout/groups_sampled": "groups sampled",
        "rollout/sampling_rounds": "sampling rounds (dynamic sampling resamples)",
    },
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "reward/mean": "mean shaped reward",
        "reward/accuracy": "fraction of responses the reward judged correct",
        "response/length_mean": "mean response length in tokens",
        "response/clipped_fraction": "fraction of responses cut at max_new_tokens",
        **{
            f"reward/reason_{reason}": f"fraction of responses the reward scored with reason {reason!r}"
            for reason in REASONS
        },
    },
    weight="rollout/responses_sampled",
)
declare(Reduction.MAX, {"response/length_max": "longest response in tokens"})


class RolloutCollector:
    """Lives on the rollout rank: the engine, the reward pool, the prompts and their sampler."""

    def __init__(self, engine, reward_pool, tokenizer, dataset, sampler, cfg, stop_token_ids):
        self.engine, self.reward_pool, self.tokenizer = engine, reward_pool, tokenizer
        self.dataset, self.sampler, self.cfg = dataset, sampler, cfg
        self.stop_token_ids = tuple(stop_token_ids)

    def _sampling(self, seed: int) -> SamplingParams:
        b = self.cfg.batch
        return SamplingParams(
            n=b.group_size,
            temperature=b.temperature,
            top_p=b.top_p,
            top_k=b.top_k,
            max_new_tokens=b.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            seed=seed,
        )

    def collect(self, step: int, timer) -> tuple[RolloutBatch, dict[str, float]]:
        b, algo = self.cfg.batch, self.cfg.algo
        kept = _Groups()
        reasons = dict.fromkeys(REASONS, 0)
        sampled = _Groups()  # every response of the step, for the reward/length metrics
        rounds = 0
        while kept.groups < b.prompts_per_step and rounds < (b.max_sampling_rounds if algo.dynamic_sampling else 1):
            prompts = self.dataset.batch(self.sampler.next_indices(b.prompts_per_step - kept.groups))
            with timer("rollout"):
                completions = self.engine.generate(
                    [list(p.prompt_ids) for p in prompts], self._sampling(step_seed(self.cfg.run.seed, step, rounds))
                )
            rounds += 1
            flat = [(p, c) for p, group in zip(prompts, completions) for c in group]
            with timer("reward"):
                texts = [response_text(self.tokenizer, c.token_ids, c.finish_reason) for _, c in flat]
                results = self.reward_pool.score(texts, [p.record.answer for p, _ in flat])
            for reason, count in summarize_reasons(results).items():
                reasons[reason] += count
            correct = torch.tensor([r.reward for r in results], dtype=torch.float32)
            lengths = torch.tensor([len(c.token_ids) for _, c in flat], dtype=torch.long)
            rewards = correctness_reward(correct, algo.reward_scale)
            if algo.overlong_shaping:
                rewards = rewards + overlong_penalty(
                    lengths, b.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty_factor
                )
            keep_groups = (
                dynamic_sampling_filter(correct, b.group_size).tolist()
                if algo.dynamic_sampling
                else list(range(len(prompts)))
            )
            _extend(sampled, flat, rewards, correct, range(len(prompts)), b.group_size)
            room = b.prompts_per_step - kept.groups
            _extend(kept, flat, rewards, correct, keep_groups[:room], b.group_size)
        metrics = self._metrics(sampled, kept, reasons, rounds)
        rewards = torch.tensor(kept.rewards, dtype=torch.float32)
        advantages = (
            group_advantages(
                rewards, b.group_size, scale=None if algo.advantage_scale == "none" else "std", eps=algo.advantage_eps
            )
            if kept.groups
            else rewards
        )
        batch = RolloutBatch(
            prompt_ids=kept.prompt_ids,
            response_ids=kept.response_ids,
            rollout_logprobs=kept.logprobs,
            truncated=torch.tensor(kept.truncated, dtype=torch.bool),
            rewards=rewards,
            correct=torch.tensor(kept.correct, dtype=torch.float32),
            advantages=advantages.to(torch.float32),
            group_ids=torch.arange(kept.groups, dtype=torch.long).repeat_interleave(b.group_size),
        )
        return batch, metrics

    def _metrics(self, sampled: _Groups, kept: _Groups, reasons: dict[str, int], rounds: int) -> dict[str, float]:
        total = max(len(sampled.rewards), 1)
        lengths = [len(r) for r in sampled.response_ids] or [0]
        metrics = {
            "reward/mean": sum(sampled.rewards) / total,
            "reward/accuracy": sum(sampled.correct) / total,
            "response/length_mean": sum(lengths) / len(lengths),
            "response/length_max": float(max(lengths)),
            "rollout/responses_sampled": float(len(sampled.rewards)),
            "response/clipped_fraction": sum(sampled.truncated) / total,
            "rollout/groups_kept": float(kept.groups),
            "rollout/groups_sampled": float(sampled.groups),
            "rollout/sampling_rounds": float(rounds),
        }
        metrics.update({f"reward/reason_{reason}": count / total for reason, count in reasons.items()})
        return metrics


class RolloutController:
    """Everything the training loop asks of the controller rank, which alone talks to the engine,
    scores rewards, samples prompts, evaluates and writes the metrics rows. Built on rank 0 only."""

    def __init__(self, collector: RolloutCollector, evaluator, logger, run_dir):
        self.collector, self.evaluator, self.logger, self.run_dir = collector, evaluator, logger, run_dir

    @classmethod
    def build(
        cls, cfg, tokenizer, arch, device, servers, stop_token_ids, progress: dict, step: int
    ) -> RolloutController:
        """The controller for ``cfg``, its sampler at the resumed ``progress``, logging from ``step``."""
        from stapo_megatron.data.prompts import build_prompt_dataset
        from stapo_megatron.data.sampler import PromptSampler
        from stapo_megatron.rewards import RewardPool
        from stapo_megatron.rollout.factory import build_engine

        write_resolved_config(cfg)  # also when started by an outside torchrun / SLURM launch
        dataset = build_prompt_dataset(cfg.data, tokenizer)
        logger.info("training prompts: %s", dataset.report.summary())
        sampler = PromptSampler(len(dataset), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        if "sampler" in progress:
            sampler.load_state_dict(progress["sampler"])
        engine = build_engine(
            cfg.rollout, arch, device, hf_dir=cfg.checkpoint.load_hf, run_dir=cfg.run.directory, servers=servers
        )
        collector = RolloutCollector(
            engine, RewardPool.from_config(cfg.reward), tokenizer, dataset, sampler, cfg, stop_token_ids
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
                stop_token_ids=stop_token_ids,
            )
        return cls(collector, evaluator, metrics_logger, cfg.run.directory)

    @property
    def engine(self):
        return self.collector.engine

    def collect(self, step: int, timer) -> tuple[RolloutBatch, dict[str, float]]:
        return self.collector.collect(step, timer)

    def resume_engine(self) -> None:
        self.engine.resume_memory()

    def release_engine(self) -> None:
        self.engine.release_memory()

    def sampler_state(self) -> dict:
        return self.collector.sampler.state_dict()

    def evaluate(self, step: int) -> dict[str, float]:
        return self.evaluator.evaluate_in_training(step, self.run_dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logger.log(step, metrics)

    def stop_file_present(self) -> bool:
        return (self.run_dir / STOP_FILE).exists()

    def remove_stop_file(self) -> None:
        (self.run_dir / STOP_FILE).unlink(missing_ok=True)

    def close(self) -> None:
        self.engine.shutdown()
        self.collector.reward_pool.close()
        self.logger.close()


def _extend(target: _Groups, flat, rewards, correct, groups, group_size: int) -> None:
    for g in groups:
        for i in range(g * group_size, (g + 1) * group_size):
            prompt, completion = flat[i]
            target.prompt_ids.append(list(prompt.prompt_ids))
            target.response_ids.append(list(completion.token_ids))
            target.logprobs.append(list(completion.logprobs))
            target.truncated.append(completion.finish_reason == "length")
            target.rewards.append(float(rewards[i]))
            target.correct.append(float(correct[i]))
        target.groups += 1
