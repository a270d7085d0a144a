"""One step's rollouts on rank 0: sample G responses per prompt, score them, compute the
advantages (:class:`RolloutCollector`), and the rollout metrics of the step.

With dynamic sampling, groups whose rewards are all equal carry no signal and are dropped;
more prompts are sampled in their place, for at most ``batch.max_sampling_rounds`` rounds.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from stapo_megatron.data.prompts import response_text
from stapo_megatron.loss import correctness_reward, dynamic_sampling_filter, group_advantages, overlong_penalty
from stapo_megatron.loss.metrics import Reduction, declare
from stapo_megatron.rewards import REASONS, summarize_reasons
from stapo_megatron.rollout.engine import SamplingParams
from stapo_megatron.trainer.batch import RolloutBatch


def step_seed(run_seed: int, step: int, round_index: int) -> int:
    """A sampling seed that depends only on (run seed, step, round): resumed runs resample alike."""
    digest = hashlib.sha256(f"{run_seed}:{step}:{round_index}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


@dataclasses.dataclass
class GroupedResponses:
    """Responses in whole groups of ``group_size`` (one prompt's G samples each), with their
    prompts, sampling log-probs, rewards and verdicts, one entry per response."""

    prompt_ids: list[list[int]] = dataclasses.field(default_factory=list)
    response_ids: list[list[int]] = dataclasses.field(default_factory=list)
    logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    truncated: list[bool] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    correct: list[float] = dataclasses.field(default_factory=list)
    groups: int = 0

    def add_groups(self, flat, rewards, correct, groups, group_size: int) -> None:
        """Append the groups ``groups`` (indices) of one round's ``flat`` (prompt, completion) pairs."""
        for g in groups:
            for i in range(g * group_size, (g + 1) * group_size):
                prompt, completion = flat[i]
                self.prompt_ids.append(list(prompt.prompt_ids))
                self.response_ids.append(list(completion.token_ids))
                self.logprobs.append(list(completion.logprobs))
                self.truncated.append(completion.finish_reason == "length")
                self.rewards.append(float(rewards[i]))
                self.correct.append(float(correct[i]))
            self.groups += 1


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

    def sampling(self, seed: int) -> SamplingParams:
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
        kept = GroupedResponses()
        reasons = dict.fromkeys(REASONS, 0)
        sampled = GroupedResponses()  # every response of the step, for the reward/length metrics
        rounds = 0
        while kept.groups < b.prompts_per_step and rounds < (b.max_sampling_rounds if algo.dynamic_sampling else 1):
            prompts = self.dataset.batch(self.sampler.next_indices(b.prompts_per_step - kept.groups))
            with timer("rollout"):
                completions = self.engine.generate(
                    [list(p.prompt_ids) for p in prompts], self.sampling(step_seed(self.cfg.run.seed, step, rounds))
                )
            rounds += 1
            flat = [(p, c) for p, group in zip(prompts, completions) for c in group]
            with timer("reward"):
                texts = [response_text(self.tokenizer, c.token_ids) for _, c in flat]
                results = self.reward_pool.score(
                    texts, [p.record.answer for p, _ in flat], [p.record.extra for p, _ in flat]
                )
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
            sampled.add_groups(flat, rewards, correct, range(len(prompts)), b.group_size)
            room = b.prompts_per_step - kept.groups
            kept.add_groups(flat, rewards, correct, keep_groups[:room], b.group_size)
        metrics = self.metrics(sampled, kept, reasons, rounds)
        return self.batch_of(kept), metrics

    def batch_of(self, kept: GroupedResponses) -> RolloutBatch:
        """The kept groups as the update's batch, with their group-normalised advantages."""
        b, algo = self.cfg.batch, self.cfg.algo
        rewards = torch.tensor(kept.rewards, dtype=torch.float32)
        advantages = (
            group_advantages(
                rewards, b.group_size, scale=None if algo.advantage_scale == "none" else "std", eps=algo.advantage_eps
            )
            if kept.groups
            else rewards
        )
        return RolloutBatch(
            prompt_ids=kept.prompt_ids,
            response_ids=kept.response_ids,
            rollout_logprobs=kept.logprobs,
            truncated=torch.tensor(kept.truncated, dtype=torch.bool),
            rewards=rewards,
            correct=torch.tensor(kept.correct, dtype=torch.float32),
            advantages=advantages.to(torch.float32),
            group_ids=torch.arange(kept.groups, dtype=torch.long).repeat_interleave(b.group_size),
        )

    def metrics(
        self, sampled: GroupedResponses, kept: GroupedResponses, reasons: dict[str, int], rounds: int
    ) -> dict[str, float]:
        total = max(len(sampled.rewards), 1)
        lengths = [len(r) for r in sampled.response_ids] or [0]
        metrics = {
            "reward/mean": sum(sampled.rewards) / total,
            "reward/accuracy": sum(c == 1.0 for c in sampled.correct) / total,  # partial credit is not correct
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
