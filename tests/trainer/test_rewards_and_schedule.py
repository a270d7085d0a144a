"""Research-fidelity fixes around the loss: DAPO's reward scale and overlong penalty as the rollout
rank assembles them, and a learning-rate schedule that counts training (rollout) steps."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from stapo_megatron.data.prompts import build_prompt_dataset
from stapo_megatron.data.sampler import PromptSampler
from stapo_megatron.data.synthetic import synthetic_tokenizer
from stapo_megatron.rewards.result import RewardResult
from stapo_megatron.rollout.engine import Completion
from stapo_megatron.trainer.launcher import load_train_config
from stapo_megatron.trainer.rollout_collector import RolloutCollector


class _ScriptedEngine:
    """Returns the responses of ``lengths`` (per prompt, per sample) of token 3, all stopped by length."""

    def __init__(self, lengths):
        self.lengths = lengths

    def generate(self, prompts, params):
        assert len(prompts) == len(self.lengths) and params.n == len(self.lengths[0])
        return [[Completion([3] * n, [-0.5] * n, "length") for n in group] for group in self.lengths]


class _ScriptedVerdicts:
    def __init__(self, verdicts):
        self.verdicts = verdicts

    def score(self, texts, answers, extras=None):
        assert len(texts) == len(self.verdicts)
        return [RewardResult(1.0, "correct") if v else RewardResult(0.0, "wrong") for v in self.verdicts]


def _collect(tmp_path, lengths, verdicts, *overrides):
    cfg = load_train_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "batch.prompts_per_step=2",
            "batch.prompts_per_minibatch=2",
            "batch.group_size=2",
            "batch.max_new_tokens=4",
            *overrides,
        ],
    )
    tokenizer = synthetic_tokenizer(cfg.data.synthetic_distractors)
    dataset = build_prompt_dataset(cfg.data, tokenizer)
    collector = RolloutCollector(
        _ScriptedEngine(lengths),
        _ScriptedVerdicts(verdicts),
        tokenizer,
        dataset,
        PromptSampler(len(dataset), seed=0),
        cfg,
        [1],
    )
    batch, metrics = collector.collect(1, lambda phase: contextlib.nullcontext())
    return cfg, batch, metrics


def test_dapo_rewards_are_signed_with_the_overlong_penalty_on_top(tmp_path):
    # max_new_tokens L_max = 4, L_cache = 2: lengths 2 / 4 / 3 / 3 get penalties 0 / -1 / -1/2 / -1/2,
    # added to DAPO's +1 / -1 verdict reward (on the old 0 / 1 scale: 1, -1, -0.5, 0.5)
    lengths, verdicts = [[2, 4], [3, 3]], [1, 0, 0, 1]
    cfg, batch, metrics = _collect(tmp_path, lengths, verdicts, "algo=dapo", "algo.overlong_buffer=2")
    assert cfg.algo.reward_scale == "signed"
    assert batch.rewards.tolist() == [1.0, -2.0, -1.5, 0.5]
    assert batch.correct.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert metrics["reward/accuracy"] == 0.5 and metrics["reward/mean"] == pytest.approx(-0.5)
    # group advantages (sample std of two values = |a - b| / sqrt 2)
    expected = [1 / math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2), 1 / math.sqrt(2)]
    torch.testing.assert_close(batch.advantages, torch.tensor(expected), atol=1e-5, rtol=0)

    # STAPO in JustRL's setting: DAPO's +-1 verifier, no overlong penalty; the paper's R in {0, 1} on request
    _, stapo_batch, _ = _collect(tmp_path, lengths, verdicts, "algo=stapo")
    assert stapo_batch.rewards.tolist() == [1.0, -1.0, -1.0, 1.0]
    _, binary_batch, _ = _collect(tmp_path, lengths, verdicts, "algo=stapo", "algo.reward_scale=binary")
    assert binary_batch.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    torch.testing.assert_close(binary_batch.advantages, stapo_batch.advantages)  # std-normalized: the same


def test_the_learning_rate_schedule_counts_training_steps(tmp_path):
    """Four mini-batches per step, warm-up 8 steps, cosine decay over run.steps = 20: the schedule
    is stepped once per training step, so warm-up ends after 8 rollout steps (not 2) and the
    decay reaches min_lr at step 20 (not at step 5)."""
    from stapo_megatron.trainer.trainer import build_scheduler

    cfg = load_train_config(
        None,
        [
            f"run.output_dir={tmp_path}",
            "run.steps=20",
            "batch.prompts_per_step=64",
            "batch.prompts_per_minibatch=16",
            "optim.lr=1e-3",
            "optim.min_lr=1e-5",
            "optim.warmup_steps=8",
            "optim.schedule=cosine",
        ],
    )
    assert cfg.batch.minibatches_per_step == 4
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    scheduler = build_scheduler(optimizer, cfg, report=False)
    lr = []
    for _ in range(cfg.run.steps):
        lr.append(optimizer.param_groups[0]["lr"])  # what every mini-batch of this step uses
        scheduler.step(increment=1)  # Trainer.train: once per training step
    assert lr[0] == 0.0 and lr[4] == pytest.approx(0.5e-3) and lr[8] == pytest.approx(1e-3)
    assert lr[2] < 1e-3  # still warming up in step 3 (a per-optimizer-step count ended warm-up at step 2)
    assert 1e-5 < lr[19] < 1e-3 and lr[14] > lr[19]  # decaying over all 20 steps
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-5)  # min_lr after run.steps
    assert scheduler.num_steps == cfg.run.steps  # the checkpointed position is the step count


@pytest.mark.slow
def test_a_run_steps_the_schedule_once_per_training_step(tmp_path):
    """A real run with 4 mini-batches per step and 4 warm-up steps: every mini-batch of step k
    trains at lr * (k - 1) / 4, so the logged step mean is exactly that. The same run carries the
    engine's log-probs into the loss (masked importance sampling on) and logs the mismatch split."""
    from tests.trainer.runs import metrics, run, train_command

    run(
        train_command(
            tmp_path / "run",
            "run.steps=3",
            "batch.prompts_per_step=16",
            "batch.prompts_per_minibatch=4",
            "batch.group_size=4",
            "optim.lr=1e-3",
            "optim.warmup_steps=4",
            "checkpoint.save_every=0",
            "algo.rollout_correction=mis_token",
        )
    )
    rows = metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["optim/optimizer_steps"] for row in rows] == [4.0, 8.0, 12.0]
    assert [row["optim/lr"] for row in rows] == pytest.approx([0.0, 0.25e-3, 0.5e-3], abs=1e-12)
    for row in rows:
        # the embedded engine samples with the trainer's weights: nothing to reject, weights of 1
        assert row["rollout_correction/rejected_fraction"] == 0.0
        assert row["rollout_correction/weight_mean"] == 1.0
        assert row["mismatch/candidates_tokens"] + row["mismatch/rest_tokens"] == row["policy/response_tokens"]
        assert row["mismatch/rest_abs_mean"] < 1e-4 and row["mismatch/rest_far_fraction"] == 0.0
