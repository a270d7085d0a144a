"""The old policy's statistics of a whole step, over every data-parallel rank: the policy entropy
with its quantiles and the train/rollout log-prob mismatch, also split by S2T's candidate set."""

from __future__ import annotations

import dataclasses

import torch

from stapo_megatron.loss import (
    TokenStats,
    all_reduce_metrics,
    mismatch_sums,
    reduce_metrics,
    s2t_candidates,
    summarize_mismatch,
)
from stapo_megatron.loss.diagnostics import entropy_quantiles
from stapo_megatron.loss.metrics import Reduction, declare
from stapo_megatron.runtime.distributed import ParallelContext


def candidate_mismatch(
    ctx: ParallelContext, old_stats: list[TokenStats], microbatches: list[dict], tau_p: float
) -> dict[str, float]:
    """The train/rollout log-prob mismatch split by S2T's candidate set (A > 0 and p < ``tau_p``
    under the old policy) and the other response tokens, over the data-parallel group
    (:func:`~stapo_megatron.loss.summarize_mismatch` names each metric and its reduction).
    Computed on the last stage (empty elsewhere); collective over ``ctx.dp_group``."""
    if not ctx.is_last_stage:
        return {}
    sums = reduce_metrics(
        mismatch_sums(
            stats.logprob,
            mb["rollout_logprobs"],
            mb["response_mask"],
            s2t_candidates(stats.logprob, stats.advantages, mb["response_mask"], tau_p),
        )
        for stats, mb in zip(old_stats, microbatches)
    )
    return summarize_mismatch(all_reduce_metrics(sums, ctx.dp_group))


declare(
    Reduction.SUM,
    {
        "old_response_tokens": "response tokens of the old-policy statistics passes",
        "old_entropy_sum": "sum of the old policy's entropy over them",
        "old_mismatch_abs_sum": "sum of |log pi_old - log pi_rollout| over them",
        "policy/statistics_tokens": "response tokens of the step, all data-parallel ranks, zero-advantage ones "
        "included (what policy/entropy, its quantiles and mismatch/logprob_abs_* cover; with "
        "batch.entropy_over_skipped off: only the sequences run)",
    },
)
declare(
    Reduction.MAX,
    {
        "old_mismatch_abs_max": "largest |log pi_old - log pi_rollout| over them (0: none)",
        "mismatch/logprob_abs_max": "largest |log pi_old - log pi_rollout| over every response token of the step",
    },
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "policy/entropy": "mean entropy of the old policy over every response token of the step, zero-advantage "
        "sequences included (those batch.skip_zero_advantage leaves out of the update get a forward-only pass "
        "for it; with batch.entropy_over_skipped off: only the sequences run), the same population for every "
        "preset",
        "mismatch/logprob_abs_mean": "mean |log pi_old - log pi_rollout| over every response token of the step",
    },
    weight="policy/statistics_tokens",
)


@dataclasses.dataclass
class RolloutStatistics:
    # the mean policy entropy over the tokens (STARE's gate reads it); None off the last stage
    mean_entropy: float | None
    metrics: dict[str, float]  # declared above; empty off the last stage


def rollout_statistics(
    ctx: ParallelContext, old_stats: list[TokenStats], microbatches: list[dict]
) -> RolloutStatistics:
    """Policy entropy with its quantiles (:func:`~stapo_megatron.loss.diagnostics.entropy_quantiles`)
    and the train/rollout log-prob mismatch (declared above) over the response tokens of
    ``microbatches`` on every rank of the data-parallel group (the update passes every response
    token of the step); computed on the last stage. Collective over ``ctx.dp_group``."""
    if not ctx.is_last_stage:
        return RolloutStatistics(None, {})

    def raw(stats: TokenStats, mb: dict) -> dict[str, torch.Tensor]:
        mask = mb["response_mask"] > 0
        mismatch = (stats.logprob - mb["rollout_logprobs"])[mask].abs().double()
        return {
            "old_response_tokens": mask.sum().double(),
            "old_entropy_sum": stats.entropy[mask].double().sum(),
            "old_mismatch_abs_sum": mismatch.sum(),
            "old_mismatch_abs_max": mismatch.max() if mismatch.numel() else mismatch.new_zeros(()),
        }

    zero = torch.zeros((), dtype=torch.float64, device=ctx.device)
    local = reduce_metrics(
        [
            dict.fromkeys(
                ("old_response_tokens", "old_entropy_sum", "old_mismatch_abs_sum", "old_mismatch_abs_max"), zero
            )
        ]
        + [raw(stats, mb) for stats, mb in zip(old_stats, microbatches)]
    )
    totals = all_reduce_metrics(local, ctx.dp_group, device=ctx.device)
    tokens = float(totals["old_response_tokens"])
    entropies = [stats.entropy[mb["response_mask"] > 0] for stats, mb in zip(old_stats, microbatches)]
    mean_entropy = float(totals["old_entropy_sum"]) / max(tokens, 1.0)
    metrics = {
        "policy/statistics_tokens": tokens,
        "policy/entropy": mean_entropy,
        **entropy_quantiles(entropies, ctx.dp_group, device=ctx.device),
        "mismatch/logprob_abs_mean": float(totals["old_mismatch_abs_sum"]) / max(tokens, 1.0),
        "mismatch/logprob_abs_max": float(totals["old_mismatch_abs_max"]),
    }
    return RolloutStatistics(mean_entropy, metrics)
