"""The RL loss: token statistics under TP, token rules (S2T, 20-Entropy), the clipped objective, advantages.

- :mod:`.logprob_entropy`: log-prob and entropy from vocabulary-parallel logits (custom autograd, chunked);
- :mod:`.quantile`: exact quantile thresholds over values spread across ranks;
- :mod:`.token_rules`: per-token statistics -> keep weights, and the registry of rules;
- :mod:`.related_rules`: rules from related papers (STARE) and why ICT is absent;
- :mod:`.selection`: the mini-batch and micro-batch scopes of a rule's threshold;
- :mod:`.policy`: :class:`PolicyLoss`, the clipped surrogate with clip-higher, KL and entropy terms, aggregation;
- :mod:`.policy_metrics`: the loss's raw and logged metrics, one table;
- :mod:`.objectives`: the registry of policy-gradient terms (PPO clip, Clip-Cov, KL-Cov, GSPO);
- :mod:`.metrics`: reduction of the loss metrics over micro-batches and ranks;
- :mod:`.advantages`: reward scale, group advantages, dynamic sampling, overlong shaping;
- :mod:`.rollout_correction`: truncated / masked importance sampling against the engine's log-probs, mismatch metrics;
- :mod:`.config`: :class:`AlgoConfig` (presets in ``configs/algo``).
"""

from stapo_megatron.loss.advantages import (
    correctness_reward,
    dynamic_sampling_filter,
    group_advantages,
    overlong_penalty,
)
from stapo_megatron.loss.config import AlgoConfig, resolve_rollout_correction
from stapo_megatron.loss.logprob_entropy import DEFAULT_CHUNK_SIZE, vocab_parallel_logprob_entropy
from stapo_megatron.loss.metrics import all_reduce_metrics, reduce_metrics
from stapo_megatron.loss.objectives import OBJECTIVES, Objective, get_objective, register_objective, token_seed
from stapo_megatron.loss.policy import LossInputs, PolicyLoss, k3
from stapo_megatron.loss.quantile import gather_values, quantile_threshold
from stapo_megatron.loss.related_rules import STARERule  # registers the related-paper rules
from stapo_megatron.loss.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    mismatch_sums,
    rollout_correction,
    summarize_mismatch,
)
from stapo_megatron.loss.selection import (
    Selection,
    minibatch_threshold,
    needs_statistics_pass,
    select_tokens,
    zero_advantage_skippable,
)
from stapo_megatron.loss.token_rules import (
    TOKEN_RULES,
    HighEntropyRule,
    S2TRule,
    TokenRule,
    TokenStats,
    get_token_rule,
    register_token_rule,
    s2t_candidates,
    s2t_threshold,
)

__all__ = [
    "AlgoConfig",
    "DEFAULT_CHUNK_SIZE",
    "HighEntropyRule",
    "LossInputs",
    "OBJECTIVES",
    "Objective",
    "PolicyLoss",
    "S2TRule",
    "STARERule",
    "Selection",
    "TOKEN_RULES",
    "TokenRule",
    "TokenStats",
    "ROLLOUT_CORRECTIONS",
    "all_reduce_metrics",
    "correctness_reward",
    "dynamic_sampling_filter",
    "gather_values",
    "get_objective",
    "get_token_rule",
    "group_advantages",
    "k3",
    "minibatch_threshold",
    "mismatch_sums",
    "needs_statistics_pass",
    "overlong_penalty",
    "quantile_threshold",
    "reduce_metrics",
    "rollout_correction",
    "register_objective",
    "register_token_rule",
    "resolve_rollout_correction",
    "s2t_candidates",
    "s2t_threshold",
    "select_tokens",
    "summarize_mismatch",
    "token_seed",
    "vocab_parallel_logprob_entropy",
    "zero_advantage_skippable",
]
