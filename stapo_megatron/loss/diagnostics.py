"""The STAPO paper's diagnostics of every step, the same population for every preset.

- Entropy quantiles: p50, p80, p90, p99 of the policy entropy over every response token of the
  rollout step (its Fig. 3d), exact over data-parallel ranks (:mod:`.quantile`'s definition). The
  trainer gives them every response token, zero-advantage sequences included: those it leaves
  out of the update get a forward-only pass of their own (``trainer/update.py``).
- Quadrants (its Theorem 3.3): the positive-advantage response tokens of the loss pass split by
  probability (p < tau_p: "lowp") and entropy (H < split: "lowh"), with each quadrant's token
  count and share of the summed per-token gradient norm

      ||d loss / dz_t|| = |w_t| sqrt((1 - p_t)^2 + sum_{v != y} p_v^2)

  (= |w_t| sqrt(1 - 2 p_t + sum_v p_v^2); :mod:`.logprob_entropy` says why the first form), with
  z_t = logits / temperature and w_t = d loss_sum / d log p_t read from the loss itself by autograd:
  for the clipped surrogate A_t r_t where the clip lets the gradient through and 0 where it does
  not, times the token rule's weight (0 on a silenced token) and any rollout-correction weight,
  divided by the sequence's length with ``seq_mean_token_mean``, plus the KL term's part. An
  entropy bonus's own gradient is left out (no preset has one). The norm is of the token's term in
  the summed loss, before the division by the mini-batch's token count.

  The entropy split is ``AlgoConfig.tau_h`` when set (then "lowp_lowh" is exactly S2T's spurious
  set) and otherwise the median entropy of the positive-advantage tokens of the mini-batch, exact
  over data-parallel ranks: S2T's own tau_h, a quantile over its rare candidates only, exists for
  no other preset, and the median puts half of the population on each side for every preset.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction

import torch
import torch.distributed as dist

from stapo_megatron.loss.metrics import Reduction, declare
from stapo_megatron.loss.quantile import gather_values, quantile_threshold
from stapo_megatron.loss.token_rules import broadcast_advantages

# (metric suffix, q) of the logged entropy quantiles
ENTROPY_QUANTILES = tuple((f"p{n}", Fraction(n, 100)) for n in (50, 80, 90, 99))

declare(
    Reduction.MEAN,
    {
        f"policy/entropy_{name}": f"the {float(q):g}-quantile of the old policy's entropy over every response token "
        "of the step, zero-advantage sequences included (exact over data-parallel ranks; plain mean when steps "
        "are combined; null without response tokens)"
        for name, q in ENTROPY_QUANTILES
    },
)


def entropy_quantiles(
    entropies: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> dict[str, float]:
    """The ``policy/entropy_p*`` metrics of this rank's response-token entropies (1-D tensors)
    and those of every rank of ``group``: one gather (on ``device`` when there are none here), then
    each quantile of the same values."""
    local = torch.cat([e.reshape(-1).to(torch.float32) for e in entropies] or [torch.zeros(0, device=device)])
    everything = gather_values(local, group)
    if not everything.numel():
        return {f"policy/entropy_{name}": float("nan") for name, _ in ENTROPY_QUANTILES}
    return {f"policy/entropy_{name}": float(quantile_threshold(everything, q)) for name, q in ENTROPY_QUANTILES}


QUADRANTS = ("lowp_lowh", "lowp_highh", "highp_lowh", "highp_highh")

declare(
    Reduction.SUM,
    {
        "quadrant/positive_tokens": "positive-advantage response tokens of the loss pass: the population of the "
        "quadrant/* metrics (lowp: p < tau_p, lowh: entropy below quadrant/entropy_split; current policy)",
        "quadrant/grad_norm_sum": "sum over them of the gradient norm ||d loss_sum / dz_t|| = |w_t| sqrt(1 - 2 p_t + "
        "sum_v p_v^2) of Theorem 3.3, w_t = d loss_sum / d log p_t (the clipped ratio times the advantage and "
        "the token's loss weight: 0 where clipped or silenced)",
        **{f"quadrant/{name}_tokens": f"positive-advantage tokens in quadrant {name}" for name in QUADRANTS},
    },
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        f"quadrant/{name}_grad_share": f"quadrant {name}'s part of quadrant/grad_norm_sum (null: a sum of 0)"
        for name in QUADRANTS
    },
    weight="quadrant/grad_norm_sum",
)
declare(
    Reduction.MEAN,
    {
        "quadrant/entropy_split": "the entropy split of the quadrants: algo.tau_h when set, else the median entropy "
        "of the mini-batch's positive-advantage tokens (mean over the optimizer steps; null: none had any)",
    },
)


@dataclasses.dataclass
class PositiveTokens:
    """The positive-advantage response tokens of one micro-batch in the loss pass (1-D each)."""

    logprob: torch.Tensor
    entropy: torch.Tensor
    grad_norm: torch.Tensor  # fp64 ||d loss_sum / dz_t||


def positive_token_gradients(
    loss_sum: torch.Tensor,
    logprob: torch.Tensor,
    entropy: torch.Tensor,
    others_square_sum: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> PositiveTokens:
    """The positive-advantage tokens of one loss call, with their gradient norms (module docstring).

    ``loss_sum``: the micro-batch's summed loss, computed from ``logprob`` (which carries the
    gradient; the graph is kept for the real backward); ``others_square_sum``: sum_{v != y} p_v^2
    (:func:`~stapo_megatron.loss.logprob_entropy.vocab_parallel_token_statistics`). Only the
    loss's elementwise graph between ``loss_sum`` and ``logprob`` is differentiated, never the model.
    """
    positive = (response_mask != 0) & (broadcast_advantages(advantages, logprob) > 0)
    weight = None
    if loss_sum.requires_grad and logprob.requires_grad:
        (weight,) = torch.autograd.grad(loss_sum, logprob, retain_graph=True, allow_unused=True)
    with torch.no_grad():
        lp = logprob.detach()[positive].double()
        w = weight[positive].double() if weight is not None else torch.zeros_like(lp)
        norm = w.abs() * torch.sqrt(torch.expm1(lp).square() + others_square_sum[positive].double())
        return PositiveTokens(logprob.detach()[positive], entropy.detach()[positive], norm)


def quadrant_metrics(
    tokens: Sequence[PositiveTokens],
    tau_p: float,
    tau_h: float | None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """The logged ``quadrant/*`` metrics (declared above) of one optimizer mini-batch from its
    micro-batches' :class:`PositiveTokens` on this rank and every rank of ``group`` (collective on
    it: one gather for the median unless ``tau_h`` is given, one all-reduce). ``device``: where
    the reductions run (NCCL: the current CUDA device) when this rank has no micro-batch."""
    device = tokens[0].logprob.device if tokens else device
    logprob = torch.cat([t.logprob.reshape(-1) for t in tokens]) if tokens else torch.zeros(0, device=device)
    entropy = torch.cat([t.entropy.reshape(-1) for t in tokens]) if tokens else torch.zeros(0, device=device)
    grad_norm = (
        torch.cat([t.grad_norm.reshape(-1) for t in tokens])
        if tokens
        else torch.zeros(0, dtype=torch.float64, device=device)
    )
    if tau_h is None:
        split = quantile_threshold(entropy, Fraction(1, 2), group)
    else:
        split = torch.tensor(float(tau_h), device=device)
    lowp = logprob < math.log(tau_p)  # p < tau_p without exp underflow
    lowh = entropy < split
    members = (lowp & lowh, lowp & ~lowh, ~lowp & lowh, ~lowp & ~lowh)  # in the order of QUADRANTS
    sums = torch.stack(
        [m.to(torch.float64).sum() for m in members] + [torch.where(m, grad_norm, 0.0).sum() for m in members]
    )
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    counts, norms = sums[: len(QUADRANTS)].tolist(), sums[len(QUADRANTS) :].tolist()
    total = sum(norms)
    out = {
        "quadrant/positive_tokens": sum(counts),
        "quadrant/grad_norm_sum": total,
        "quadrant/entropy_split": float(split) if math.isfinite(float(split)) else float("nan"),
    }
    for name, count, norm in zip(QUADRANTS, counts, norms):
        out[f"quadrant/{name}_tokens"] = count
        out[f"quadrant/{name}_grad_share"] = norm / total if total > 0 else float("nan")
    return out
