"""Rewards and group-relative advantages: the correctness reward's scale, DAPO's dynamic-sampling
filter and overlong reward shaping.

Rewards are laid out group by group: responses [g*G, (g+1)*G) answer prompt g.
"""

from __future__ import annotations

import torch

SCALES = ("std", "none")
REWARD_SCALES = ("binary", "signed")


def correctness_reward(correct: torch.Tensor, scale: str) -> torch.Tensor:
    """The reward of each response from its verdict (1 correct, 0 not, a score between for a custom
    reward's partial credit): ``binary`` keeps it (the STAPO paper's R in {0, 1}); ``signed`` maps it
    linearly onto [-1, 1] (+1 / -1 for verdicts), as DAPO's verifier
    (verl ``utils/reward_score/math_dapo.py``: ``1.0 if correct else -1.0``), which JustRL and the
    20-Entropy reference code also use. DAPO's overlong penalty (:func:`overlong_penalty`, in
    [-1, 0]) is defined on the signed scale; on the binary one it would weigh twice as much.
    """
    if scale not in REWARD_SCALES:
        raise ValueError(f"scale: {scale!r} is not one of {', '.join(REWARD_SCALES)}")
    correct = correct.to(torch.float32)
    if not bool(((correct >= 0) & (correct <= 1)).all()):
        raise ValueError("correct: expected verdicts or scores in [0, 1]")
    return 2.0 * correct - 1.0 if scale == "signed" else correct


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected one reward per response (1-D), got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size: must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards: {rewards.numel()} responses are not whole groups of {group_size}")
    return rewards.to(torch.float32).view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str | None, eps: float) -> torch.Tensor:
    """One advantage per response: (r - mean) / (std + eps) (GRPO) or r - mean (``scale=None`` or
    ``"none"``: Dr. GRPO), mean and std over the response's group.

    std is the sample standard deviation (Bessel-corrected, ``torch.std``'s default), as verl's
    ``compute_grpo_outcome_advantage``; for G = 8 it is sqrt(8/7) times the population std.
    A group whose rewards are all equal gets 0 for every response. The trainer repeats the value
    over the response's tokens (``token_rules.broadcast_advantages`` does it for the loss).
    """
    if scale not in (None, *SCALES):
        raise ValueError(f"scale: {scale!r} is not one of std, none")
    groups = _groups(rewards, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if scale == "std":
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def dynamic_sampling_filter(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Indices (int64, ascending) of the groups whose rewards are not all equal (DAPO's dynamic
    sampling keeps these and samples more prompts for the rest). Pass correctness rewards: with
    overlong shaping added, equal-accuracy groups could differ by length penalties alone."""
    groups = _groups(rewards, group_size)
    mixed = (groups != groups[:, :1]).any(dim=1)
    return mixed.nonzero().squeeze(-1)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13, L_max = ``max_length``, L_cache =
    ``buffer``; verl's DAPO reward manager), added to the signed reward (<= 0), per response length:

        0                                       if L <= max_length - buffer
        -penalty_factor (L - (max_length - buffer)) / buffer   if max_length - buffer < L <= max_length
        -penalty_factor                         if L > max_length
    """
    if buffer < 1 or buffer > max_length:
        raise ValueError(f"buffer: must be in [1, max_length={max_length}], got {buffer}")
    if lengths.is_floating_point():
        raise ValueError(f"lengths: expected integer token counts, got {lengths.dtype}")
    over = (lengths - (max_length - buffer)).to(torch.float32).clamp(min=0, max=buffer)
    return -penalty_factor * over / buffer
