"""Reward scale, group advantages, dynamic sampling and overlong shaping."""

from __future__ import annotations

import math

import pytest
import torch

from stapo_megatron.loss import correctness_reward, dynamic_sampling_filter, group_advantages, overlong_penalty


def test_grpo_advantages_use_the_sample_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=4, scale="std", eps=1e-6)
    # group 0: mean 0.25, sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6)
    torch.testing.assert_close(adv[:4], expected)
    assert torch.equal(adv[4:], torch.zeros(4))  # all-equal group: no signal
    # the same as torch.std (unbiased) per group, as verl's compute_grpo_outcome_advantage
    g = rewards.view(2, 4)
    torch.testing.assert_close(adv, ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1))


def test_dr_grpo_and_errors():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    assert group_advantages(rewards, 2, scale=None, eps=1e-6).tolist() == [0.5, -0.5, 0.0, 0.0]
    assert group_advantages(rewards, 2, scale="none", eps=1e-6).tolist() == [0.5, -0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="^rewards: 4 responses are not whole groups of 3"):
        group_advantages(rewards, 3, "std", 1e-6)
    with pytest.raises(ValueError, match="^group_size: must be >= 2"):
        group_advantages(rewards, 1, "std", 1e-6)
    with pytest.raises(ValueError, match="^scale:"):
        group_advantages(rewards, 2, scale="max", eps=1e-6)
    with pytest.raises(ValueError, match="^rewards: expected one reward per response"):
        group_advantages(rewards.view(2, 2), 2, "std", 1e-6)


def test_dynamic_sampling_keeps_mixed_groups():
    rewards = torch.tensor([1, 1, 1, 0, 1, 0, 0, 1, 1, 1, 1, 1], dtype=torch.float32)
    assert dynamic_sampling_filter(rewards, 3).tolist() == [1, 2]
    assert dynamic_sampling_filter(torch.zeros(6), 3).tolist() == []


def test_overlong_penalty_ramp():
    lengths = torch.tensor([0, 100, 120, 150, 200, 201, 500])
    penalty = overlong_penalty(lengths, max_length=200, buffer=80, penalty_factor=1.0)
    expected = [0.0, 0.0, 0.0, -30 / 80, -1.0, -1.0, -1.0]
    assert all(math.isclose(p, e, abs_tol=1e-7) for p, e in zip(penalty.tolist(), expected))
    assert overlong_penalty(lengths, 200, 80, penalty_factor=0.5)[4] == -0.5
    with pytest.raises(ValueError, match="^buffer: must be in"):
        overlong_penalty(lengths, 200, 0, 1.0)
    with pytest.raises(ValueError, match="^lengths: expected integer"):
        overlong_penalty(lengths.float(), 200, 80, 1.0)


def test_reward_scales_and_dapo_penalty_on_the_signed_scale():
    correct = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert correctness_reward(correct, "binary").tolist() == [1.0, 0.0, 1.0, 0.0]  # the STAPO paper's R in {0, 1}
    assert correctness_reward(correct, "signed").tolist() == [1.0, -1.0, 1.0, -1.0]  # DAPO's verifier
    # DAPO: a correct answer deep in the buffer nets 1 - 3/4; a truncated wrong one -1 - 1 = -2
    shaped = correctness_reward(correct, "signed") + overlong_penalty(torch.tensor([10, 10, 190, 200]), 200, 40, 1.0)
    assert shaped.tolist() == [1.0, -1.0, 0.25, -2.0]
    with pytest.raises(ValueError, match="^scale: 'pm1' is not one of binary, signed"):
        correctness_reward(correct, "pm1")
    # a custom reward's partial credit: kept on the binary scale, mapped linearly on the signed one
    assert correctness_reward(torch.tensor([0.25, 0.5]), "binary").tolist() == [0.25, 0.5]
    assert correctness_reward(torch.tensor([0.25, 0.5]), "signed").tolist() == [-0.5, 0.0]
    for outside in (-0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"^correct: expected verdicts or scores in \[0, 1\]"):
            correctness_reward(torch.tensor([outside]), "binary")
