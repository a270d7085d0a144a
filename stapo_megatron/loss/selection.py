"""Where a token rule's threshold is computed: the two scopes.

``mini_batch`` (default): one threshold over the whole optimizer mini-batch, every micro-batch
and every data-parallel rank, from the current policy's statistics. The trainer runs a
forward-only statistics pass over the mini-batch (the old-log-prob pass gives it before the
first update), calls :func:`minibatch_threshold` once on every DP rank, then
:func:`select_tokens` in each micro-batch's loss with that threshold.

``micro_batch``: each micro-batch's threshold from its own statistics on its own rank, inside
:func:`select_tokens`; no extra pass, no communication (the 20-Entropy reference code).

    if needs_statistics_pass(cfg):
        threshold = minibatch_threshold(cfg, [stats of every micro-batch], dp_group)
    ...                                     # per micro-batch, in the loss function:
    sel = select_tokens(cfg, stats, threshold)
    loss(LossInputs(..., keep=sel.keep, candidates=sel.candidates, tau_h=sel.tau_h))  # loss = PolicyLoss(cfg)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from stapo_megatron.loss.objectives import get_objective
from stapo_megatron.loss.token_rules import TokenStats, get_token_rule


@dataclasses.dataclass
class Selection:
    keep: torch.Tensor  # fp32 per-token weight, 0 on padding and silenced tokens
    candidates: torch.Tensor | None  # bool, tokens the rule may act on (None: the rule has none)
    threshold: torch.Tensor | None  # the threshold used (None: the rule has none)
    # the entropy cut that threshold amounts to, for the s2t/tau_h metric (None: it is not one
    # entropy, e.g. STARE's surprisal cuts or s2t_random's score cut)
    tau_h: torch.Tensor | None


def needs_statistics_pass(cfg) -> bool:
    """Whether the trainer must gather the mini-batch's statistics before the update."""
    return cfg.scope == "mini_batch" and get_token_rule(cfg.token_rule).uses_threshold(cfg)


def zero_advantage_skippable(cfg) -> bool:
    """Whether sequences with advantage 0 can be left out of the statistics passes and of
    forward/backward without changing the update: their policy-gradient term is -0 * r (no
    gradient), and no configured term reads them: no entropy bonus, no KL, no masked importance
    sampling (its rejections change the token count), and a token rule that keeps them all and
    never puts them in its threshold, and an objective that does not read them (Clip-Cov and
    KL-Cov centre their covariance on the mean advantage over every token and may pick A = 0
    tokens; GSPO's A = 0 sequences contribute exactly 0). Their kept tokens must still be added to the loss
    denominator (the trainer does, see ``trainer/update.py``). In the ``micro_batch`` scope a
    threshold depends on which sequences share a micro-batch, which the token budget decides
    with or without them."""
    return (
        cfg.entropy_coef == 0
        and cfg.kl_coef == 0
        and not cfg.rollout_correction.startswith("mis")
        and get_token_rule(cfg.token_rule).ignores_zero_advantage(cfg)
        and not get_objective(cfg.objective).reads_zero_advantage
        # a left-out sequence would change the token mean of the micro-batch it shares
        and cfg.aggregation != "microbatch_token_mean"
    )


def minibatch_threshold(
    cfg, minibatch_stats: Sequence[TokenStats], dp_group: dist.ProcessGroup | None = None
) -> torch.Tensor | None:
    """The rule's threshold over all micro-batches of the mini-batch on all ranks of ``dp_group``.

    A collective on ``dp_group`` when the rule needs a quantile: call it on every DP rank (a rank
    without tokens passes an empty-statistics list entry, not nothing). Returns None for the
    ``micro_batch`` scope and for rules without a threshold.
    """
    if cfg.scope == "micro_batch":
        return None
    return get_token_rule(cfg.token_rule).threshold(list(minibatch_stats), cfg, dp_group)


def select_tokens(cfg, stats: TokenStats, threshold: torch.Tensor | None = None) -> Selection:
    """The keep weights of one micro-batch. ``threshold``: from :func:`minibatch_threshold` in the
    ``mini_batch`` scope (required when the rule has a quantile); ignored in the ``micro_batch``
    scope, which computes it here from ``stats`` alone."""
    rule = get_token_rule(cfg.token_rule)
    if cfg.scope == "micro_batch" or (threshold is None and not rule.uses_threshold(cfg)):
        threshold = rule.threshold([stats], cfg, None)
    elif threshold is None:
        raise ValueError(
            f"threshold: the '{rule.name}' rule in the mini_batch scope needs the threshold from "
            "minibatch_threshold() over the whole mini-batch"
        )
    return Selection(
        rule.keep(stats, cfg, threshold), rule.candidates(stats, cfg), threshold, rule.entropy_threshold(threshold, cfg)
    )
