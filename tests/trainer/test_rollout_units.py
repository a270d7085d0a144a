"""One step's rollouts on the controller rank, in one process with a scripted engine and verdicts:
dynamic sampling's rounds, what it keeps and counts, the seed of each round (step_seed), and the
advantages of what it keeps."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from stapo_megatron.data.prompts import build_prompt_dataset, load_tokenizer
from stapo_megatron.data.sampler import PromptSampler
from stapo_megatron.rewards.result import RewardResult
from stapo_megatron.rollout.engine import Completion
from stapo_megatron.trainer.launcher import load_train_config
from stapo_megatron.trainer.rollout_collector import RolloutCollector, step_seed

GROUP = 2
DAPO = ("algo=dapo_dynamic_sampling", "algo.overlong_buffer=1")  # no length penalty for the 1-3 token responses of 4


class _Engine:
    """Answers every prompt with GROUP responses of 1 + (round) tokens; records each call."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.n, params.seed))
        length = len(self.calls)
        return [[Completion([5] * length, [-0.25] * length, "stop") for _ in range(params.n)] for _ in prompts]


class _Verdicts:
    """The verdicts of each round in turn (one per response, group by group)."""

    def __init__(self, rounds):
        self.rounds = list(rounds)

    def score(self, texts, answers, extras=None):
        verdicts = self.rounds.pop(0)
        assert len(texts) == len(verdicts) == len(answers)
        return [RewardResult(1.0, "correct") if v else RewardResult(0.0, "wrong") for v in verdicts]


def _collect(tmp_path, rounds, *overrides, step=3):
    cfg = load_train_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "run.seed=11",
            "batch.prompts_per_step=2",
            "batch.prompts_per_minibatch=2",
            f"batch.group_size={GROUP}",
            "batch.max_new_tokens=4",
            *overrides,
        ],
    )
    tokenizer = load_tokenizer(cfg.data, cfg.hf_tokenizer_dir)
    dataset = build_prompt_dataset(cfg.data, tokenizer)
    engine, verdicts = _Engine(), _Verdicts(rounds)
    sampler = PromptSampler(len(dataset), seed=0)
    collector = RolloutCollector(engine, verdicts, tokenizer, dataset, sampler, cfg, [1])
    batch, metrics = collector.collect(step, lambda phase: contextlib.nullcontext())
    assert not verdicts.rounds, "every scripted round was used"
    return batch, metrics, engine, sampler


def test_step_seed_depends_on_run_step_and_round_only():
    seeds = {(run, step, r): step_seed(run, step, r) for run in (0, 1, 11) for step in range(1, 201) for r in range(4)}
    assert len(set(seeds.values())) == len(seeds)  # no two (run, step, round) sample alike
    assert all(0 <= s < 2**56 for s in seeds.values())  # 7 bytes: fits every engine's int64 seed
    assert step_seed(11, 3, 0) == seeds[(11, 3, 0)]  # a resumed run resamples its step alike
    # pinned: a change would make runs resumed across it sample differently from the original
    assert step_seed(0, 1, 0) == 10427437503081501


def test_dynamic_sampling_resamples_until_the_step_is_full(tmp_path):
    # round 0: group 0 mixed, group 1 all correct (dropped); round 1 (one prompt): all wrong (dropped);
    # round 2 (one prompt): mixed, so the step is full after three rounds
    rounds = [[1, 0, 1, 1], [0, 0], [0, 1]]
    batch, metrics, engine, sampler = _collect(tmp_path, rounds, *DAPO, "batch.max_sampling_rounds=4")
    assert engine.calls == [(prompts, GROUP, step_seed(11, 3, r)) for r, prompts in enumerate([2, 1, 1])]
    assert sampler.state_dict()["position"] == 4  # 2 + 1 + 1 prompts drawn
    # kept: round 0's group 0 (1 token each) and round 2's group (3 tokens each), in that order
    assert [len(r) for r in batch.response_ids] == [1, 1, 3, 3]
    assert batch.correct.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert batch.rewards.tolist() == [1.0, -1.0, -1.0, 1.0]  # DAPO's signed scale
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(batch.advantages, torch.tensor([1, -1, -1, 1]) / math.sqrt(2), atol=1e-5, rtol=0)
    # the metrics count every response sampled, the dropped groups included
    assert metrics["rollout/sampling_rounds"] == 3
    counts = ("rollout/groups_sampled", "rollout/groups_kept", "rollout/responses_sampled")
    assert [metrics[name] for name in counts] == [4, 2, 8]
    assert metrics["reward/accuracy"] == pytest.approx(4 / 8)
    assert metrics["response/length_mean"] == pytest.approx((4 * 1 + 2 * 2 + 2 * 3) / 8)
    assert metrics["response/length_max"] == 3


def test_dynamic_sampling_that_runs_out_of_rounds_keeps_what_it_has(tmp_path):
    batch, metrics, engine, _ = _collect(tmp_path, [[1, 1, 0, 0], [1, 1, 1, 1]], *DAPO, "batch.max_sampling_rounds=2")
    assert [call[0] for call in engine.calls] == [2, 2]
    assert len(batch) == 0 and batch.advantages.numel() == 0 and batch.group_ids.tolist() == []
    counts = ("rollout/sampling_rounds", "rollout/groups_sampled", "rollout/groups_kept")
    assert [metrics[name] for name in counts] == [2, 4, 0]
    assert metrics["reward/accuracy"] == pytest.approx(6 / 8)


def test_without_dynamic_sampling_one_round_keeps_every_group(tmp_path):
    batch, metrics, engine, _ = _collect(tmp_path, [[1, 1, 0, 1]], "algo=stapo", "batch.max_sampling_rounds=4")
    assert engine.calls == [(2, GROUP, step_seed(11, 3, 0))]
    assert batch.rewards.tolist() == [1.0, 1.0, -1.0, 1.0] and batch.group_ids.tolist() == [0, 0, 1, 1]
    # the all-correct group has advantage 0; the mixed one +-1/sqrt(2) (sample std of two values)
    torch.testing.assert_close(batch.advantages, torch.tensor([0, 0, -1, 1]) / math.sqrt(2), atol=1e-5, rtol=0)
    assert (metrics["rollout/sampling_rounds"], metrics["rollout/groups_kept"]) == (1, 2)
