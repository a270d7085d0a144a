"""Token rules: per-token statistics -> a per-token keep weight (1 keeps a token, 0 silences it).

A rule has three methods; the trainer calls one pair per scope (see :mod:`.selection`):

- ``threshold(stats_list, cfg, group)``: the rule's data-dependent threshold over a list of
  micro-batch statistics, exact across the ranks of ``group`` (a collective on that group when
  the rule needs one), or None when the rule has none;
- ``keep(stats, cfg, threshold)``: the per-token weight of one micro-batch (fp32; 0 on padding);
- ``candidates(stats, cfg)``: the tokens the rule may act on, for metrics (or None).

``cfg`` is any object with the rule's fields (:class:`~stapo_megatron.loss.config.AlgoConfig`).
A new rule is one class registered here (or in :mod:`.related_rules`, e.g. STARE) plus its config fields.

Rules here: ``all`` (keep everything), ``s2t`` (STAPO), ``high_entropy`` (20-Entropy), and the
STAPO paper's masking-strategy ablations (v1, Masking Strategy Ablation), which act on S2T's
candidates C = {A > 0, p < tau_p}:

- ``s2t_high_entropy``: silence the floor(q |C|) candidates of HIGHEST entropy (S2T silences the
  lowest), the same budget as S2T; with ``budget: complement``, the |C| - floor(q |C|) candidates
  S2T keeps instead (H >= S2T's tau_h(q)), the other reading of the paper;
- ``s2t_random``: silence floor(q |C|) candidates drawn at random (with ``budget: complement``,
  |C| - floor(q |C|) of them), the same budget: each token's
  score is a keyed permutation of (its sequence's index in the rollout step, its position in the
  sequence), keyed by (run seed, step) (:func:`random_token_scores`); the candidates of lowest
  score are silenced. The score reads no packing, micro-batch or data-parallel layout and is the
  same on every TP rank, so a reshard or a resumed step draws the same tokens;
- ``lowprob_all``: silence every candidate (JustRL-FullMask in the paper, whose entropy collapses).

The budgeted rules count floor(q |C|) over the threshold scope (the whole mini-batch across
micro-batches and data-parallel ranks by default) with the exact quantile of :mod:`.quantile`;
the count is exact whenever the scores are distinct, which the random scores always are.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
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
    # Each token's identity in the rollout step, for rules that draw at random (s2t_random): the
    # index of its sequence in the step's RolloutBatch (the micro-batch's ``sample_ids``, -1 on
    # padding), its position in that sequence (``position_ids``), and the run's seed and the step.
    # None where the caller has none; a rule that needs them says so.
    sample_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    run_seed: int | None = None
    step: int | None = None

    def __post_init__(self):
        shape = tuple(self.logprob.shape)
        for name in ("entropy", "response_mask", "sample_ids", "positions"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} does not match logprob {shape}")
        for name in ("sample_ids", "positions"):
            value = getattr(self, name)
            if value is not None and value.dtype.is_floating_point:
                raise ValueError(f"{name}: must be an integer tensor, got {value.dtype}")
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
    logprob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, tau_p: float
) -> torch.Tensor:
    """Response tokens of positive-advantage responses whose probability is below ``tau_p`` (bool)."""
    advantages = broadcast_advantages(advantages, logprob)
    # p < tau_p  <=>  log p < log tau_p; comparing log-probs avoids exp underflow for rare tokens.
    return _real(response_mask) & (advantages > 0) & (logprob < math.log(tau_p))


def _stats_candidates(stats: TokenStats, cfg) -> torch.Tensor:
    return s2t_candidates(stats.logprob, stats.advantages, stats.response_mask, cfg.tau_p)


def s2t_threshold(
    stats_list: Sequence[TokenStats],
    tau_p: float,
    q: float,
    population: str,
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


def s2t_keep(stats: TokenStats, tau_p: float, tau_h: torch.Tensor) -> torch.Tensor:
    """S2T's keep weights: 0 on spurious tokens (A > 0, p < tau_p, H < tau_h) and padding, 1 elsewhere."""
    spurious = s2t_candidates(stats.logprob, stats.advantages, stats.response_mask, tau_p) & (stats.entropy < tau_h)
    return (_real(stats.response_mask) & ~spurious).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# 20-Entropy: gradients only through the highest-entropy response tokens
# ---------------------------------------------------------------------------------------------


def high_entropy_threshold(
    entropies: Sequence[torch.Tensor],
    response_masks: Sequence[torch.Tensor],
    top_fraction: float,
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


# ---------------------------------------------------------------------------------------------
# Random scores of the s2t_random ablation
# ---------------------------------------------------------------------------------------------

_HALF_BITS = 31
_HALF_MASK = (1 << _HALF_BITS) - 1
_FEISTEL_ROUNDS = 6
# Odd multipliers below 2^31 (MurmurHash's): a 31-bit value times one stays below 2^62, so the
# int64 arithmetic never overflows, on CPU and CUDA alike.
_MULTIPLIERS = (0x5BD1E995, 0x1B873593)


def _round_keys(run_seed: int, step: int) -> list[int]:
    digest = hashlib.sha256(f"s2t_random:{run_seed}:{step}".encode()).digest()
    return [int.from_bytes(digest[4 * r : 4 * r + 4], "little") & _HALF_MASK for r in range(_FEISTEL_ROUNDS)]


def _mix(half: torch.Tensor, key: int) -> torch.Tensor:
    """A 31-bit -> 31-bit round function: multiply, then fold the product's high bits into its low ones."""
    y = half ^ key
    for multiplier in _MULTIPLIERS:
        y = y * multiplier
        y = (y ^ (y >> _HALF_BITS)) & _HALF_MASK
    return y


def random_token_scores(sample_ids: torch.Tensor, positions: torch.Tensor, run_seed: int, step: int) -> torch.Tensor:
    """int64 pseudo-random scores in [0, 2^62), one per token, from its (sequence index in the
    step, position) keyed by (run seed, step). A Feistel network on the two 31-bit halves is a
    permutation for every key, so distinct tokens of a step never tie. Values outside
    [0, 2^31) (padding's -1) are masked to 31 bits: give them no weight."""
    left = sample_ids.long() & _HALF_MASK
    right = positions.long() & _HALF_MASK
    for key in _round_keys(run_seed, step):
        left, right = right, left ^ _mix(right, key)
    return (left << _HALF_BITS) | right


def _stats_random_scores(stats: TokenStats, rule: str, members: torch.Tensor) -> torch.Tensor:
    ids, positions, run_seed, step = stats.sample_ids, stats.positions, stats.run_seed, stats.step
    if ids is None or positions is None or run_seed is None or step is None:
        missing = [f for f in ("sample_ids", "positions", "run_seed", "step") if getattr(stats, f) is None]
        raise ValueError(
            f"{missing[0]}: the {rule} rule keys each token's draw by (run seed, step, sequence index, "
            f"position); TokenStats lacks {', '.join(missing)}"
        )
    ids_in, positions_in = ids[members], positions[members]
    if bool(((ids_in < 0) | (ids_in > _HALF_MASK) | (positions_in < 0) | (positions_in > _HALF_MASK)).any()):
        raise ValueError(f"sample_ids: the {rule} rule needs sequence indices and positions in [0, 2^31) on its tokens")
    return random_token_scores(ids, positions, run_seed, step)


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

    def entropy_threshold(self, threshold: torch.Tensor | None, cfg) -> torch.Tensor | None:
        """The entropy cut that ``threshold`` amounts to, for the ``s2t/tau_h`` metric (None: the
        rule's threshold is not one entropy)."""
        return None

    def config_error(self, cfg) -> str | None:
        """A one-line reason, naming the field, why ``cfg`` cannot run this rule (None: it can)."""
        return None


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
        return _stats_candidates(stats, cfg)

    def ignores_zero_advantage(self, cfg) -> bool:
        # candidates need A > 0; the all_response_tokens population reads every token's entropy
        return cfg.tau_h is not None or cfg.population == "candidates"

    def entropy_threshold(self, threshold, cfg):
        return threshold


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

    def entropy_threshold(self, threshold, cfg):
        return threshold


class _S2TCandidatesAblation(TokenRule):
    """An ablation of S2T acting on its candidates only: neither a fixed tau_h nor another
    quantile population applies, and zero-advantage tokens are never read."""

    def candidates(self, stats, cfg):
        return _stats_candidates(stats, cfg)

    # ignores_zero_advantage: True, as TokenRule's (candidates need A > 0, the scores read no other token)

    def config_error(self, cfg) -> str | None:
        if cfg.tau_h is not None:
            return f"tau_h: the {self.name} rule has no entropy threshold to fix (set tau_h: null)"
        if cfg.population != "candidates":
            return f"population: the {self.name} rule acts on S2T's candidates only (set population: candidates)"
        return None


class _CandidateBudgetRule(_S2TCandidatesAblation, abc.ABC):
    """Silence the floor(q * #candidates) candidates of lowest ``score`` over the threshold scope,
    S2T's budget (exact with distinct scores; a tie at the cut is kept, as in S2T); with ``budget:
    complement`` the others: the q-cut is taken on the reversed score, and what falls below it is
    kept."""

    @abc.abstractmethod
    def score(self, stats: TokenStats, candidates: torch.Tensor) -> torch.Tensor:
        """Per-token scores of one micro-batch (read on ``candidates`` only)."""

    def _cut_score(self, stats: TokenStats, candidates: torch.Tensor, cfg) -> torch.Tensor:
        score = self.score(stats, candidates)
        return score if cfg.budget == "same_as_s2t" else -score

    def uses_threshold(self, cfg) -> bool:
        return True

    def threshold(self, stats_list, cfg, group=None):
        chosen = []
        for s in stats_list:
            members = _stats_candidates(s, cfg)
            chosen.append(self._cut_score(s, members, cfg)[members])
        return quantile_threshold(chosen, cfg.q, group)

    def keep(self, stats, cfg, threshold):
        if threshold is None:
            raise ValueError(f"threshold: the {self.name} rule needs its score cut (from threshold())")
        members = _stats_candidates(stats, cfg)
        # compare in the quantile's dtype, so the count is the quantile's exactly
        below = self._cut_score(stats, members, cfg).to(threshold.dtype) < threshold
        silenced = members & (below if cfg.budget == "same_as_s2t" else ~below)
        return (_real(stats.response_mask) & ~silenced).to(torch.float32)


class S2THighEntropyRule(_CandidateBudgetRule):
    """Ablation: silence the highest-entropy floor(q * #candidates) of S2T's candidates."""

    name = "s2t_high_entropy"

    def score(self, stats, candidates):
        return -stats.entropy.to(torch.float32)  # lowest score = highest entropy

    def entropy_threshold(self, threshold, cfg):
        # candidates with H above it are silenced (complement: the cut is on H itself, S2T's tau_h)
        if threshold is None:
            return None
        return -threshold if cfg.budget == "same_as_s2t" else threshold


class S2TRandomRule(_CandidateBudgetRule):
    """Ablation: silence floor(q * #candidates) of S2T's candidates drawn at random, reproducibly."""

    name = "s2t_random"

    def score(self, stats, candidates):
        return _stats_random_scores(stats, self.name, candidates)


class LowProbAllRule(_S2TCandidatesAblation):
    """Ablation JustRL-FullMask: silence every S2T candidate (A > 0, p < tau_p)."""

    name = "lowprob_all"

    def keep(self, stats, cfg, threshold):
        return (_real(stats.response_mask) & ~_stats_candidates(stats, cfg)).to(torch.float32)


TOKEN_RULES: dict[str, TokenRule] = {}
BUDGETED_ABLATIONS = ("s2t_high_entropy", "s2t_random")  # the rules algo.budget acts on


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


for _rule in (TokenRule(), S2TRule(), HighEntropyRule(), S2THighEntropyRule(), S2TRandomRule(), LowProbAllRule()):
    register_token_rule(_rule)
