"""Token rules from related papers, registered next to S2T and 20-Entropy.

STARE (Luo et al., "STARE: Surprisal-Guided Token-Level Advantage Reweighting for Policy Entropy
Stability", arXiv 2606.19236; reference code github.com/hp-luo/STARE, ``compute_stare_token_weights``
and ``STAREController`` in verl/trainer/ppo/core_algos.py, recipe/STARE/scripts/*_STARE.sh):

- T+ = response tokens of sequences with A > 0, T- = those with A < 0;
- surprisal s_t = -log pi_theta(o_t) under the current policy (at the rollout temperature);
- L+ = the top P of T+ by surprisal (ceil(P |T+|) tokens), L- likewise in T- (variant C2 only);
- weight w_t = W on L+, M on L- (C2), 1 elsewhere; it multiplies the token's clipped surrogate
  (dual-clip included), and the loss stays normalised by the number of response tokens;
- closed-loop gate: the weights apply in a step only when the mean policy entropy over the
  step's response tokens, from the old-policy pass (the reference's ``actor/entropy``), is below
  the target H_tgt; otherwise every weight is 1 and the step is plain GRPO.

Defaults from the reference script (7B): variant O1, P = 0.1, W = 1.1, M = 0.9, H_tgt = 0.3.
Differences from the reference, all deliberate:

- scope: the reference ranks tokens within each loss call, i.e. per token-budget micro-batch and
  rank (``use_dynamic_bsz``); here the ``scope`` field decides, ``mini_batch`` (default) being
  exact over the optimizer mini-batch across micro-batches and data-parallel ranks, and
  ``micro_batch`` the reference's layout;
- ties: the reference's ``torch.topk`` picks exactly ceil(P n) tokens, breaking ties in surprisal
  arbitrarily; here every token tied with the cut is in L+ (the same set when surprisals differ);
- the paper's adaptive schedule of W and M (``stare_adaptive``, off in the paper's main runs) is
  not implemented: W and M are fixed;
- :class:`~stapo_megatron.loss.PolicyLoss` multiplies the whole per-token term by the weight, so
  with ``kl_coef`` or ``entropy_coef`` > 0 those terms are reweighted too (the reference has
  neither in STARE runs).

ICT (Feng et al., "Beyond Entropy: Learning from Token-Level Distributional Deviations for LLM
Reasoning", arXiv 2606.19771) is not here: its abstract says it updates the top 10% of unique
tokens by the Jensen-Shannon divergence "between token logits distributions", but which two
distributions are compared, and over which population the ranking runs, is not defined in any
source available to this project (no public code was found), so it is not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import torch
import torch.distributed as dist

from stapo_megatron.loss.quantile import as_fraction, quantile_threshold
from stapo_megatron.loss.token_rules import TokenRule, TokenStats, register_token_rule

STARE_VARIANTS = ("O1", "C2")


def _real(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def stare_surprisal_cuts(
    stats_list: Sequence[TokenStats],
    top_fraction: float,
    variant: str,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """[c+, c-] (fp32): L+ = {A > 0, -log p >= c+}, L- = {A < 0, -log p >= c-}, each the top
    ``top_fraction`` of its sign's response tokens over all micro-batches in ``stats_list`` and all
    ranks of ``group`` (ceil(P n) tokens of n with distinct surprisals). c- is +inf for O1.
    A collective on ``group`` (one quantile per sign used): call it on every rank."""
    if variant not in STARE_VARIANTS:
        raise ValueError(f"stare_variant: {variant!r} is not one of {', '.join(STARE_VARIANTS)}")
    fraction = as_fraction(top_fraction)
    if not 0 < fraction <= 1:
        raise ValueError(f"stare_top_fraction: must be in (0, 1], got {top_fraction}")
    if not stats_list:
        raise ValueError("stats_list: need at least one micro-batch's statistics (they may be empty)")
    device = stats_list[0].logprob.device

    def cut(sign: int) -> torch.Tensor:
        surprisals = [-s.logprob[_real(s.response_mask) & (s.advantages * sign > 0)] for s in stats_list]
        # keep {s >= threshold(1 - P)}: n - floor((1 - P) n) = ceil(P n) tokens
        return quantile_threshold(surprisals, Fraction(1) - fraction, group)

    negative = cut(-1) if variant == "C2" else torch.tensor(float("inf"), device=device)
    return torch.stack([cut(1), negative.to(device)]).to(torch.float32)


def stare_weights(
    stats: TokenStats,
    cuts: torch.Tensor,
    gate_on: bool,
    weight_w: float,
    weight_m: float,
    variant: str,
) -> torch.Tensor:
    """STARE's per-token loss weights of one micro-batch: W on L+, M on L- (C2), 1 on the other
    response tokens, 0 on padding; all response tokens 1 when the gate is off."""
    real = _real(stats.response_mask)
    weights = real.to(torch.float32)
    if not gate_on:
        return weights
    surprisal = -stats.logprob
    plus = real & (stats.advantages > 0) & (surprisal >= cuts[0])
    weights = torch.where(plus, torch.full_like(weights, weight_w), weights)
    if variant == "C2":
        minus = real & (stats.advantages < 0) & (surprisal >= cuts[1])
        weights = torch.where(minus, torch.full_like(weights, weight_m), weights)
    return weights


def stare_gate_on(step_entropy: float | None, target_entropy: float) -> bool:
    """The closed-loop gate: reweight only while the step's mean policy entropy is below the target."""
    if step_entropy is None:
        raise ValueError(
            "step_entropy: the stare rule's gate needs the step's mean policy entropy (TokenStats.step_entropy)"
        )
    return step_entropy < target_entropy


class STARERule(TokenRule):
    """STARE: weight W (> 1) on the highest-surprisal positive-advantage tokens (and M on the
    negative ones for C2) while the policy entropy is below a target; see the module docstring."""

    name = "stare"

    def uses_threshold(self, cfg) -> bool:
        return True

    def threshold(self, stats_list, cfg, group=None):
        return stare_surprisal_cuts(stats_list, cfg.stare_top_fraction, cfg.stare_variant, group)

    def keep(self, stats, cfg, threshold):
        if threshold is None:
            raise ValueError("threshold: the stare rule needs its surprisal cuts (from threshold())")
        gate = stare_gate_on(stats.step_entropy, cfg.stare_target_entropy)
        return stare_weights(stats, threshold, gate, cfg.stare_weight_w, cfg.stare_weight_m, cfg.stare_variant)

    def ignores_zero_advantage(self, cfg) -> bool:
        # The gate's entropy is the mean over every response token of the step (the reference
        # averages over its whole batch), zero-advantage ones included: they must be run.
        return False


register_token_rule(STARERule())
