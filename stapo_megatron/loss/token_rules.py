"""Token rules: per-token statistics -> a per-token keep weight (1 keeps a token, 0 silences it).

A rule has three methods; the trainer calls one pair per scope (see :mod:`.selection`):

- ``threshold(stats_list, cfg, group)``: the rule's data-dependent threshold over a list of
  micro-batch statistics, exact across the ranks of ``group`` (a collective on that group when
  the rule needs one), or None when the rule has none;
- ``keep(stats, cfg, threshold)``: the per-token weight of one micro-batch (fp32; 0 on padding);
- ``candidates(stats, cfg)``: the tokens the rule may act on, for metrics (or None).

``cfg`` is any object with the rule's fields (:class:`~stapo_megatron.loss.config.AlgoConfig`).
A new rule is one class registered here (or in :mod:`.related_rules`, e.g. STARE) plus its config fields.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction

import torch
import torch.distributed as dist

from stapo_megatron.loss.quantile import as_fraction, quantile_threshold

POPULATIONS = ("candidates", "all_response_tokens")


@dataclasses.dataclass
class TokenStats:
    """Per-token statistics of one micro-batch, all of the same shape (``advantages`` may be per sequence)."""

    logprob: torch.Tensor  # log pi(o_t) under the current policy (at the rollout temperature)
    entropy: torch.Tensor  # H_t of the next-token distribution
    advantages: torch.Tensor  # per token [..., T] or per sequence [...]
    response_mask: torch.Tensor  # nonzero on real response tokens
    # Mean policy entropy over every response token of the rollout step (all data-parallel ranks,
    # old policy), for rules with an entropy gate (STARE); None where the caller has none.
    step_entropy: float | None = None

    def __post_init__(self):
        shape = tuple(self.logprob.shape)
        for name in ("entropy", "response_mask"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"{name}: shape {tuple(getattr(self, name).shape)} does not match logprob {shape}")
        self.advantages = broadcast_advantages(self.advantages, self.logprob)


def broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages ``[...]`` repeated over the last (token) dim of ``like``; per-token ones as is."""
    if tuple(advantages.shape) == tuple(like.shape):
        return advantages
    if like.dim() >= 1 and tuple(advantages.shape) == tuple(like.shape[:-1]):
        return advantages.unsqueeze(-1).expand_as(like)
    raise ValueError(
        f"advantages: shape {tuple(advantages.shape)} is neither per token {tuple(like.shape)} "
        f"nor per sequence {tuple(like.shape[:-1])}"
    )


def _real(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


# ---------------------------------------------------------------------------------------------
# S2T (STAPO): silence spurious tokens
# ---------------------------------------------------------------------------------------------


def s2t_candidates(
    logprob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, tau_p: float = 0.002
) -> torch.Tensor:
    """Response tokens of positive-advantage responses whose probability is below ``tau_p`` (bool)."""
    advantages = broadcast_advantages(advantages, logprob)
    # p < tau_p  <=>  log p < log tau_p; comparing log-probs avoids exp underflow for rare tokens.
    return _real(response_mask) & (advantages > 0) & (logprob < math.log(tau_p))


def s2t_threshold(
    stats_list: Sequence[TokenStats],
    tau_p: float = 0.002,
    q: float = 0.8,
    population: str = "candidates",
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """tau_h: the q-threshold (see :mod:`.quantile`) of H over the population of all micro-batches
    in ``stats_list`` and all ranks of ``group``. With ``population="candidates"`` exactly the bottom
    floor(q * #candidates) candidates by entropy fall below it (distinct entropies)."""
    if population not in POPULATIONS:
        raise ValueError(f"population: {population!r} is not one of {', '.join(POPULATIONS)}")
    if population == "candidates":
        chosen = [s.entropy[s2t_candidates(s.logprob, s.advantages, s.response_mask, tau_p)] for s in stats_list]
    else:
        chosen = [s.entropy[_real(s.response_mask)] for s in stats_list]
    return quantile_threshold(chosen, q, group)


def s2t_mask(
    logprob: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_p: float = 0.002,
    q: float = 0.8,
    population: str = "candidates",
    group: dist.ProcessGroup | None = None,
    tau_h: float | None = None,
) -> torch.Tensor:
    """STAPO's S2T keep mask (fp32, 1 keeps, 0 silences; padding is 0).

    A token is spurious (silenced) when A > 0, p < tau_p and H < tau_h. tau_h is the given fixed
    value, or else the q-threshold of H over the population (``candidates`` or
    ``all_response_tokens``) of these tokens gathered over ``group`` (data-parallel ranks).
    """
    stats = TokenStats(logprob, entropy, advantages, response_mask)
    if tau_h is None:
        threshold = s2t_threshold([stats], tau_p, q, population, group)
    else:
        threshold = torch.tensor(float(tau_h), device=entropy.device)
    return s2t_keep(stats, tau_p, threshold)


def s2t_keep(stats: TokenStats, tau_p: float, tau_h: torch.Tensor) -> torch.Tensor:
    spurious = s2t_candidates(stats.logprob, stats.advantages, stats.response_mask, tau_p) & (stats.entropy < tau_h)
    return (_real(stats.response_mask) & ~spurious).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# 20-Entropy: gradients only through the highest-entropy response tokens
# ---------------------------------------------------------------------------------------------


def high_entropy_threshold(
    entropies: Sequence[torch.Tensor],
    response_masks: Sequence[torch.Tensor],
    top_fraction: float = 0.2,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The entropy at or above which exactly ceil(top_fraction * n) of the n response tokens lie
    (distinct entropies; ties at the threshold are all kept)."""
    fraction = as_fraction(top_fraction)
    if not 0 < fraction <= 1:
        raise ValueError(f"top_fraction: must be in (0, 1], got {top_fraction}")
    # keep {H >= threshold(1 - f)}: n - floor((1 - f) n) = ceil(f n) tokens
    values = [e[_real(m)] for e, m in zip(entropies, response_masks)]
    return quantile_threshold(values, Fraction(1) - fraction, group)


def high_entropy_mask(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    top_fraction: float = 0.2,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Keep (fp32 1) the top ``top_fraction`` of response tokens by entropy, over ``group``; 0 elsewhere."""
    if tuple(response_mask.shape) != tuple(entropy.shape):
        raise ValueError(
            f"response_mask: shape {tuple(response_mask.shape)} does not match entropy {tuple(entropy.shape)}"
        )
    threshold = high_entropy_threshold([entropy], [response_mask], top_fraction, group)
    return (_real(response_mask) & (entropy >= threshold)).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------


class TokenRule:
    """Keep every response token (GRPO, DAPO, JustRL). Subclasses override what they need."""

    name = "all"

    def uses_threshold(self, cfg) -> bool:
        """Whether ``threshold`` needs statistics of the whole scope (a quantile)."""
        return False

    def threshold(self, stats_list: Sequence[TokenStats], cfg, group=None) -> torch.Tensor | None:
        return None

    def keep(self, stats: TokenStats, cfg, threshold: torch.Tensor | None) -> torch.Tensor:
        return _real(stats.response_mask).to(torch.float32)

    def candidates(self, stats: TokenStats, cfg) -> torch.Tensor | None:
        return None

    def ignores_zero_advantage(self, cfg) -> bool:
        """Whether the rule keeps every response token of a zero-advantage sequence and its
        threshold never reads them: then such sequences can be left out of every pass."""
        return True


class S2TRule(TokenRule):
    """STAPO's S2T: silence positive-advantage, rare (p < tau_p), low-entropy (H < tau_h) tokens."""

    name = "s2t"

    def uses_threshold(self, cfg) -> bool:
        return cfg.tau_h is None

    def threshold(self, stats_list, cfg, group=None):
        if cfg.tau_h is not None:
            device = stats_list[0].entropy.device if stats_list else None
            return torch.tensor(float(cfg.tau_h), device=device)
        return s2t_threshold(stats_list, cfg.tau_p, cfg.q, cfg.population, group)

    def keep(self, stats, cfg, threshold):
        if threshold is None:
            raise ValueError("threshold: the s2t rule needs tau_h (from threshold())")
        return s2t_keep(stats, cfg.tau_p, threshold)

    def candidates(self, stats, cfg):
        return s2t_candidates(stats.logprob, stats.advantages, stats.response_mask, cfg.tau_p)

    def ignores_zero_advantage(self, cfg) -> bool:
        # candidates need A > 0; the all_response_tokens population reads every token's entropy
        return cfg.tau_h is not None or cfg.population == "candidates"


class HighEntropyRule(TokenRule):
    """20-Entropy: keep only the top ``top_fraction`` response tokens by entropy."""

    name = "high_entropy"

    def uses_threshold(self, cfg) -> bool:
        return True

    def threshold(self, stats_list, cfg, group=None):
        return high_entropy_threshold(
            [s.entropy for s in stats_list], [s.response_mask for s in stats_list], cfg.top_fraction, group
        )

    def keep(self, stats, cfg, threshold):
        if threshold is None:
            raise ValueError("threshold: the high_entropy rule needs its entropy cut (from threshold())")
        return (_real(stats.response_mask) & (stats.entropy >= threshold)).to(torch.float32)

    def ignores_zero_advantage(self, cfg) -> bool:
        return False  # every response token is in the quantile and may be dropped by it


TOKEN_RULES: dict[str, TokenRule] = {}


def register_token_rule(rule: TokenRule) -> TokenRule:
    """Add ``rule`` under ``rule.name``; AlgoConfig.token_rule accepts every registered name."""
    if rule.name in TOKEN_RULES:
        raise ValueError(f"token_rule: '{rule.name}' is already registered")
    TOKEN_RULES[rule.name] = rule
    return rule


def get_token_rule(name: str) -> TokenRule:
    try:
        return TOKEN_RULES[name]
    except KeyError:
        raise ValueError(f"token_rule: unknown rule '{name}' (known: {', '.join(sorted(TOKEN_RULES))})") from None


for _rule in (TokenRule(), S2TRule(), HighEntropyRule()):
    register_token_rule(_rule)
