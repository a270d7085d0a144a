"""The step plan: each optimizer mini-batch's sequences split over the data-parallel ranks by
tokens (:func:`~stapo_megatron.trainer.batch.balance_over_ranks`) and packed into micro-batches of
at most ``batch.max_tokens_per_microbatch`` tokens for forward/backward and
``batch.max_tokens_per_forward`` for the forward-only statistics passes, the same number on
every rank (empty ones fill up). Sequences with advantage 0 are left out when nothing of the
configured loss reads them (:func:`~stapo_megatron.loss.zero_advantage_skippable`); the plan
keeps what they add to the loss denominator, and packs them apart for a metrics-only
statistics pass.
"""

from __future__ import annotations

import dataclasses

from stapo_megatron.loss import zero_advantage_skippable
from stapo_megatron.loss.metrics import Reduction, combine_steps, declare
from stapo_megatron.runtime.distributed import ParallelContext
from stapo_megatron.trainer.batch import (
    RolloutBatch,
    TokenSlots,
    balance_over_ranks,
    make_microbatches,
    model_tokens,
    pack_by_budget,
    token_imbalance,
    token_slots,
)


@dataclasses.dataclass
class MinibatchPlan:
    """One optimizer mini-batch on this data-parallel rank."""

    update: list[dict]  # packed micro-batches of the update budget; the same count on every rank
    forward: list[dict]  # packed micro-batches of the forward budget; the same count on every rank
    # Of the whole mini-batch (every rank): what the left-out zero-advantage sequences add to the
    # loss denominator: their response tokens (token_mean), their sequences with one (seq_mean_token_mean).
    skipped_tokens: int
    skipped_sequences: int


@dataclasses.dataclass
class StepPlan:
    minibatches: list[MinibatchPlan]
    slots: TokenSlots  # this rank's sequences of the whole step
    metrics: dict[str, float]  # batch/*: computed alike on every rank from the whole batch
    # The left-out zero-advantage sequences of the whole step, packed by the forward budget, the
    # same count on every rank (none when nothing is left out): the metrics-only statistics pass.
    skipped_forward: list[dict] = dataclasses.field(default_factory=list)


# The plan's metrics: one row per mini-batch, combined over the step by these reductions.
declare(
    Reduction.SUM,
    {
        "batch/sequences": "sequences of the step",
        "batch/model_tokens": "model tokens of the update micro-batches, padding included, all data-parallel ranks",
    },
)
declare(
    Reduction.MAX,
    {
        "batch/dp_token_imbalance": "largest over the mini-batches of (largest rank's tokens - mean) / mean",
    },
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "batch/skipped_fraction": "zero-advantage sequences left out of the passes / sequences",
    },
    weight="batch/sequences",
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "batch/padding_fraction": "padding / model tokens of the update micro-batches",
    },
    weight="batch/model_tokens",
)


def plan_step(batch: RolloutBatch, cfg, ctx: ParallelContext, pad_to_multiple: int = 1) -> StepPlan:
    """Mini-batches of whole groups, split over data-parallel ranks and packed by tokens (see the
    module docstring). Every rank computes every rank's share from the same batch, so the agreed
    micro-batch counts (the largest over the data-parallel ranks) need no communication.

    Metrics: per mini-batch, combined over the step by their declarations (above).
    """
    b = cfg.batch
    groups = int(batch.group_ids.max()) + 1
    count = min(b.minibatches_per_step, groups)
    bounds = [round(i * groups / count) for i in range(count + 1)]
    lengths = [model_tokens(batch, i) for i in range(len(batch))]
    skippable = b.skip_zero_advantage and zero_advantage_skippable(cfg.algo)
    # the largest multiples of pad_to_multiple in the budgets: padding never takes a row over them
    update_budget = b.max_tokens_per_microbatch // pad_to_multiple * pad_to_multiple
    forward_budget = b.max_tokens_per_forward // pad_to_multiple * pad_to_multiple
    mine_all: list[int] = []
    left_out_all: list[int] = []
    shares: list[tuple[list[list[int]], list[list[int]], list[int]]] = []  # this rank's (update, forward, skipped)
    rows: list[dict[str, float]] = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sequences = [i for i in range(len(batch)) if lo <= int(batch.group_ids[i]) < hi]
        zero = [i for i in sequences if skippable and float(batch.advantages[i]) == 0.0]
        left_out = set(zero)
        if b.entropy_over_skipped:  # a forward-only pass for the step's metrics (batch.entropy_over_skipped)
            left_out_all.extend(zero)
        run = [i for i in sequences if i not in left_out]
        parts = balance_over_ranks(run, lengths, ctx.dp_size)
        update_bins = [pack_by_budget(part, lengths, update_budget) for part in parts]
        forward_bins = [pack_by_budget(part, lengths, forward_budget) for part in parts]
        update_count = max(1, *(len(x) for x in update_bins))
        forward_count = max(1, *(len(x) for x in forward_bins))
        update_tokens = padded_tokens = 0
        for bins in update_bins:
            for chunk in bins + [[]] * (update_count - len(bins)):
                tokens = sum(lengths[i] for i in chunk)
                update_tokens += tokens
                padded_tokens += -(-max(tokens, 1) // pad_to_multiple) * pad_to_multiple
        mine = parts[ctx.dp_rank]
        mine_all.extend(mine)
        shares.append(
            (
                update_bins[ctx.dp_rank] + [[]] * (update_count - len(update_bins[ctx.dp_rank])),
                forward_bins[ctx.dp_rank] + [[]] * (forward_count - len(forward_bins[ctx.dp_rank])),
                zero,
            )
        )
        rows.append(
            {
                "batch/dp_token_imbalance": token_imbalance(parts, lengths),
                "batch/sequences": float(len(sequences)),
                "batch/skipped_fraction": len(zero) / len(sequences),
                "batch/model_tokens": float(padded_tokens),
                "batch/padding_fraction": 1.0 - update_tokens / padded_tokens if padded_tokens else 0.0,
            }
        )
    slots = token_slots(batch, mine_all)
    minibatches = []
    for update_share, forward_share, zero in shares:
        minibatches.append(
            MinibatchPlan(
                update=make_microbatches(batch, update_share, ctx.device, slots=slots, pad_to_multiple=pad_to_multiple),
                forward=make_microbatches(
                    batch, forward_share, ctx.device, slots=slots, pad_to_multiple=pad_to_multiple
                ),
                skipped_tokens=sum(len(batch.response_ids[i]) for i in zero),
                skipped_sequences=sum(1 for i in zero if batch.response_ids[i]),
            )
        )
    skipped_bins = [
        pack_by_budget(part, lengths, forward_budget) for part in balance_over_ranks(left_out_all, lengths, ctx.dp_size)
    ]
    skipped_count = max(len(x) for x in skipped_bins)
    mine_skipped = skipped_bins[ctx.dp_rank] + [[]] * (skipped_count - len(skipped_bins[ctx.dp_rank]))
    skipped_forward = (
        make_microbatches(batch, mine_skipped, ctx.device, pad_to_multiple=pad_to_multiple) if skipped_count else []
    )
    return StepPlan(minibatches, slots, combine_steps(rows), skipped_forward)
