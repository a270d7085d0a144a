"""Rewards: the final boxed answer of a response checked against the ground truth, or a
user-defined reward function (``reward.kind: custom``).

Importing this package is cheap (no sympy, no torch): verification runs in worker processes
that :class:`RewardPool` starts.
"""

from stapo_megatron.rewards.config import RewardConfig
from stapo_megatron.rewards.extract import (
    AnswerSpan,
    exact_answer,
    extract_boxed,
    find_last_box,
    free_words_answer,
    normalize_exact,
)
from stapo_megatron.rewards.pool import RewardPool, check_reward_function
from stapo_megatron.rewards.result import REASONS, RewardResult, summarize_reasons

__all__ = [
    "REASONS",
    "AnswerSpan",
    "RewardConfig",
    "RewardPool",
    "RewardResult",
    "check_reward_function",
    "exact_answer",
    "extract_boxed",
    "find_last_box",
    "free_words_answer",
    "normalize_exact",
    "summarize_reasons",
]
