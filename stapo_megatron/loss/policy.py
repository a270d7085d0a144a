"""The policy loss: the decoupled clipped surrogate (clip-higher, dual-clip) over the tokens the
token rule keeps, weighted by the rollout correction, with optional KL and entropy terms.

Three policies (decoupled PPO: Hilton, Cobbe & Schulman 2021, "Batch size-invariance for policy
optimization", arXiv 2110.00641; the asynchronous form with a proximal policy: AReaL, Fu et al.
2025, arXiv 2505.24298):

- pi_theta: the weights being updated; ``logprob`` carries their gradient;
- pi_prox: the trainer's weights at the start of the rollout step, before its first optimizer step
  (``old_logprob``: the old-log-prob pass of ``trainer/update.py``); the anchor of the clip;
- mu: the behaviour policy, the engine's log-prob of each token as it sampled it
  (``rollout_logprob``), under whichever weight version produced that token; with asynchronous and
  partial rollouts one sequence can hold tokens of several versions, and mu is per token.

Per response token t of sequence i, with advantage A_i and the token rule's keep weight I_t
(``keep``; S2T: 0 on a silenced token, 1 elsewhere), none of which carries a gradient:

    r_t   = exp(clamp(log pi_theta(o_t) - log pi_prox(o_t), -c, c))     c = log_ratio_clamp (veRL's 20)
    pg_t  = max(-A_i r_t, -A_i clip(r_t, 1 - eps_low, 1 + eps_high))    (ppo_clip; the others: .objectives)
    pg_t  = min(pg_t, -A_i clip_ratio_c)                                 where A_i < 0 (dual-clip)
    w_t   = exp(clamp(log pi_prox(o_t) - log mu(o_t), -20, 20))          (.rollout_correction)
    rho_t = min(w_t, C) for tis_token; min(prod_s w_s, C) over i's response tokens s for tis_seq
            (their geometric mean for tis_geo); 1 for none and mis_*     C = rollout_correction_cap
    a_t   = 1[floor <= w_t <= C] for mis_token (the sequence's product / geometric mean for
            mis_seq / mis_geo); 1 otherwise
    l_t   = rho_t pg_t + kl_coef * k(log pi_ref - log pi_theta) - entropy_coef * H_t
            (k: kl_estimate's k1/k2/k3; the KL and entropy terms are not importance-weighted)

Over the active tokens K = {t : I_t > 0 and a_t = 1} of the whole optimizer mini-batch:

    token_mean:           L = sum_{t in K} I_t l_t / |K|
    seq_mean_token_mean:  L = sum_i (sum_{t in K_i} I_t l_t / |K_i|) / #{i : K_i not empty}
    microbatch_token_mean: L = sum_m (n_m / N) (sum_{t in K_m} I_t l_t / |K_m|)
                           over micro-batches m of n_m sequences (N in all): a token mean per
                           micro-batch, weighted by its sequence count, as the verl version the STAPO
                           paper ran (JustRL's dp_actor.py); it depends on how sequences share
                           micro-batches, and weights a token of a short response's micro-batch more

so grad L = sum_{t in K} I_t rho_t grad pg_t / |K| (token_mean, no KL or entropy term): the ratio
is clipped against pi_prox, the importance weight corrects the samples from mu to pi_prox, and
masked importance sampling removes its rejected tokens from numerator and count alike. With
mu = pi_prox (on-policy) and ``none`` this is the STAPO paper's objective. The exact objective
off-policy, with its sources, is in docs/async.md ("The objective off-policy").

:class:`PolicyLoss` is built once from the algorithm config (checked there; ``rollout_correction:
auto`` must have been resolved by :func:`~stapo_megatron.loss.config.resolve_rollout_correction`)
and called per micro-batch with its :class:`LossInputs`. ``token_mean`` returns
(sum_t I_t l_t, #{t in K}); Megatron's ``calculate_per_token_loss`` sums both over micro-batches
and data-parallel ranks and divides, which gives STAPO's renormalization over the surviving tokens
of the whole mini-batch. ``seq_mean_token_mean`` returns (sum over sequences of their token mean,
#sequences with a kept token); ``microbatch_token_mean`` (n_m x the micro-batch's token mean, n_m).
"""

from __future__ import annotations

import dataclasses

import torch

from stapo_megatron.loss.objectives import SurrogateInputs, get_objective, token_seed
from stapo_megatron.loss.policy_metrics import METRIC_DTYPE, TokenTerms, raw_loss_metrics
from stapo_megatron.loss.rollout_correction import ROLLOUT_CORRECTIONS, sequence_sums
from stapo_megatron.loss.rollout_correction import rollout_correction as correction_for
from stapo_megatron.loss.token_rules import broadcast_advantages

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "microbatch_token_mean")


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(q || p) from log(p/q) at samples of q: exp(x) - x - 1 >= 0."""
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from x = log r = log(pi_ref / pi) at tokens sampled
    from pi (Schulman, "Approximating KL Divergence", 2020; the tokens come from the rollout
    policy, the usual approximation of samples of pi):

    - k1 = -x: unbiased, high variance, negative on some tokens (veRL ``kl_penalty: kl``);
    - k2 = x^2 / 2: biased (exact to second order in x), low variance, >= 0 (veRL ``mse``);
    - k3 = r - 1 - x: unbiased, low variance, >= 0 (veRL ``low_var_kl``; DeepSeekMath's GRPO).

    No clamp of the value: veRL's ``low_var_kl`` clamps k3 to [-10, 10], which silently drops the
    gradient of exactly the tokens that have drifted furthest from the reference; :class:`PolicyLoss`
    clamps x itself (to +-``log_ratio_clamp``, veRL's +-20 before its exp), which only keeps exp finite.
    """
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return k3(log_ratio)
    raise ValueError(f"kl_estimator: {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


def _check_shape(name: str, tensor: torch.Tensor | None, like: torch.Tensor) -> None:
    if tensor is not None and tuple(tensor.shape) != tuple(like.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match logprob {tuple(like.shape)}")


@dataclasses.dataclass
class LossInputs:
    """The tensors of one micro-batch, each shaped like ``logprob`` (``advantages`` may be per sequence)."""

    logprob: torch.Tensor  # log pi_theta of the sampled tokens, carrying the gradient
    old_logprob: torch.Tensor  # log pi_prox: the trainer's weights before this step's first update
    advantages: torch.Tensor  # per token or per sequence
    keep: torch.Tensor  # per-token weight of the token rule: 0 on padding and on silenced tokens
    # nonzero on real response tokens (default: the tokens with keep > 0); feeds only the metrics
    response_mask: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # H_t; carries a gradient when entropy_coef > 0
    ref_logprob: torch.Tensor | None = None  # the frozen reference's log-probs (KL term, ref_kl_sum)
    # log mu: the engine's log-prob of each token as it sampled it, of any weight version (rollout correction)
    rollout_logprob: torch.Tensor | None = None
    # each token's sequence, for packed rows; without it each row of a 2-D logprob is one sequence
    segment_ids: torch.Tensor | None = None
    candidates: torch.Tensor | None = None  # the token rule's candidates, for the metrics
    tau_h: torch.Tensor | None = None  # the entropy cut of the token rule's threshold, for the metrics
    objective_seed: int = 0  # of the objective's random choices, the same on every TP rank


class PolicyLoss:
    """The loss of :mod:`this module <stapo_megatron.loss.policy>` for one algorithm config (an
    :class:`~stapo_megatron.loss.config.AlgoConfig`), checked once here; called per micro-batch.

    ``kl_coef`` weighs the ``kl_estimator`` term (:func:`kl_estimate`) and needs
    ``ref_logprob``; ``entropy_coef`` needs ``entropy`` with a gradient; a ``rollout_correction``
    other than ``none`` needs ``rollout_logprob`` (:mod:`.rollout_correction`). ``objective``: the
    policy-gradient term pg_t (:mod:`.objectives`; ``ppo_clip`` is the formula above), with its
    parameters read from the config."""

    def __init__(self, algo):
        if algo.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation: {algo.aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
        if algo.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator: {algo.kl_estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
        if algo.clip_ratio_c <= 1:
            raise ValueError(
                f"clip_ratio_c: must be > 1 (dual-clip caps -A r at -A clip_ratio_c), got {algo.clip_ratio_c}"
            )
        if algo.rollout_correction == "auto":
            raise ValueError(
                "algo.rollout_correction: 'auto' is unresolved; resolve_rollout_correction(algo, "
                "rollout.async.max_staleness) makes it none or tis_token before the loss is built"
            )
        if algo.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(
                f"rollout_correction: {algo.rollout_correction!r} is not one of {', '.join(ROLLOUT_CORRECTIONS)}"
            )
        self.algo = algo
        self.objective = get_objective(algo.objective)

    def objective_seed(self, labels: torch.Tensor) -> int:
        """:attr:`LossInputs.objective_seed` of a micro-batch with token ids ``labels``."""
        return token_seed(labels) if self.objective.draws_random else 0

    def _check(self, x: LossInputs) -> None:
        algo = self.algo
        for name in ("old_logprob", "keep", "ref_logprob", "entropy", "response_mask", "candidates", "rollout_logprob"):
            _check_shape(name, getattr(x, name), x.logprob)
        if algo.kl_coef and x.ref_logprob is None:
            raise ValueError("ref_logprob: needed when kl_coef > 0")
        if algo.rollout_correction != "none" and x.rollout_logprob is None:
            raise ValueError(f"rollout_logprob: needed when rollout_correction is {algo.rollout_correction!r}")
        if algo.entropy_coef and x.entropy is None:
            raise ValueError("entropy: needed (with a gradient) when entropy_coef > 0")
        _check_shape("segment_ids", x.segment_ids, x.logprob)
        if algo.aggregation == "seq_mean_token_mean" and x.segment_ids is None and x.logprob.dim() != 2:
            raise ValueError(
                f"logprob: seq_mean_token_mean needs [sequences, tokens], got shape {tuple(x.logprob.shape)}"
            )

    def __call__(self, x: LossInputs) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(loss_sum, num_tokens, metrics) of one micro-batch; see the module docstring.

        ``num_tokens`` is an int32 scalar tensor. ``metrics`` are fp64 scalar tensors that add up
        over micro-batches and ranks (:func:`~stapo_megatron.loss.metrics.reduce_metrics`), each
        by its reduction declared in :mod:`.policy_metrics`."""
        self._check(x)
        terms, per_token = self._token_terms(x)
        weighted = torch.where(terms.active, per_token * terms.weight, terms.zero)
        loss_sum, num_tokens = self._aggregate(weighted, terms.active, x)
        with torch.no_grad():
            metrics = raw_loss_metrics(terms, k3(terms.log_ratio), x.candidates, x.tau_h, x.entropy)
            if self.algo.aggregation == "seq_mean_token_mean":
                metrics["sequences"] = num_tokens.to(METRIC_DTYPE)
        return loss_sum, num_tokens, metrics

    def _token_terms(self, x: LossInputs) -> tuple[TokenTerms, torch.Tensor]:
        """The per-token quantities of the loss and its metrics, and l_t (before the keep weight)."""
        algo = self.algo
        logprob = x.logprob
        advantages = broadcast_advantages(x.advantages, logprob).to(torch.float32)
        weight = x.keep.to(torch.float32)
        rule_kept = weight > 0
        zero = torch.zeros((), dtype=torch.float32, device=logprob.device)
        mask = x.response_mask
        real = rule_kept if mask is None else (mask if mask.dtype == torch.bool else mask != 0)
        correction = None
        if algo.rollout_correction != "none":
            assert x.rollout_logprob is not None  # checked in _check
            correction = correction_for(
                x.old_logprob,
                x.rollout_logprob,
                real | rule_kept,
                algo.rollout_correction,
                algo.rollout_correction_cap,
                algo.rollout_correction_floor,
                x.segment_ids,
            )
        active = rule_kept if correction is None else rule_kept & correction.accepted

        # Padding and silenced positions may hold anything: zero their log-ratios so that no inf/nan
        # there can reach the sum or, through 0 * inf, the gradient. The clamp does the same for a
        # ratio that would overflow exp on a kept token.
        log_ratio = torch.where(active, logprob.float() - x.old_logprob.float(), zero)
        log_ratio = log_ratio.clamp(-algo.log_ratio_clamp, algo.log_ratio_clamp)
        surrogate = self.objective.surrogate(
            SurrogateInputs(
                logprob,
                log_ratio,
                advantages,
                active,
                algo.eps_low,
                algo.eps_high,
                algo.clip_ratio_c,
                algo.log_ratio_clamp,
                x.segment_ids,
                algo,
                x.objective_seed,
            )
        )
        pg = surrogate.pg
        if correction is not None:
            pg = pg * correction.weight
        per_token = pg
        ref_kl = None
        if x.ref_logprob is not None:
            ref_log_ratio = torch.where(active, x.ref_logprob.float() - logprob.float(), zero)
            ref_kl = kl_estimate(ref_log_ratio.clamp(-algo.log_ratio_clamp, algo.log_ratio_clamp), algo.kl_estimator)
            if algo.kl_coef:
                per_token = per_token + algo.kl_coef * ref_kl
        if algo.entropy_coef:
            assert x.entropy is not None  # checked in _check
            per_token = per_token - algo.entropy_coef * torch.where(active, x.entropy.float(), zero)
        terms = TokenTerms(
            active, rule_kept, weight, real, zero, advantages, log_ratio, pg, surrogate, ref_kl, correction
        )
        return terms, per_token

    def _aggregate(
        self, weighted: torch.Tensor, active: torch.Tensor, x: LossInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.algo.aggregation == "token_mean":
            return weighted.sum(), active.sum().to(torch.int32)
        if self.algo.aggregation == "microbatch_token_mean":
            sequences = _sequence_count(x)
            return weighted.sum() / active.sum().clamp(min=1) * sequences, sequences
        if x.segment_ids is not None:
            per_seq_count = sequence_sums(active.to(torch.float32), x.segment_ids)
            loss_sum = (sequence_sums(weighted, x.segment_ids) / per_seq_count.clamp(min=1)).sum()
            return loss_sum, (per_seq_count > 0).sum().to(torch.int32)
        per_seq_count = active.sum(-1)
        seq_has_tokens = per_seq_count > 0
        loss_sum = (weighted.sum(-1) / per_seq_count.clamp(min=1)).sum()
        return loss_sum, seq_has_tokens.sum().to(torch.int32)


def _sequence_count(x: LossInputs) -> torch.Tensor:
    """The micro-batch's sequences (those with a response token), an int32 scalar."""
    real = x.keep > 0 if x.response_mask is None else x.response_mask != 0
    if x.segment_ids is not None:
        return (sequence_sums(real.to(torch.float32), x.segment_ids) > 0).sum().to(torch.int32)
    if real.dim() == 1:
        return real.any().to(torch.int32)  # one unpacked sequence
    return real.any(-1).sum().to(torch.int32)
