"""The clipped policy-gradient loss (clip-higher, dual-clip), with the token mask, optional KL and
entropy terms and the rollout correction.

Per token t with weight w_t (``keep``), ratio r = exp(clamp(logprob - old_logprob, -c, c)) with
c = ``log_ratio_clamp`` (veRL's +-20), advantage A and rollout-correction factor rho_t
(:mod:`.rollout_correction`; 1 without it):

    pg_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))     (objective ppo_clip; see .objectives for the others)
    pg_t = min(pg_t, -A clip_ratio_c)           where A < 0 (dual-clip, veRL's clip_ratio_c)
    l_t  = rho_t pg_t + kl_coef * k(log(pi_ref / pi)) - entropy_coef * H_t    (k: kl_estimate's k1/k2/k3)

Masked importance sampling (``mis_*``) removes the tokens it rejects from both sums below.

``token_mean`` returns (sum_t w_t l_t, #{t : w_t > 0}); Megatron's ``calculate_per_token_loss``
sums both over micro-batches and data-parallel ranks and divides, which gives STAPO's
renormalization over the surviving tokens of the whole mini-batch. ``seq_mean_token_mean``
returns (sum over sequences of their token mean, #sequences with a kept token).
"""

from __future__ import annotations

import torch

from stapo_megatron.loss.metrics import Reduction, declare
from stapo_megatron.loss.objectives import SurrogateInputs, get_objective
from stapo_megatron.loss.rollout_correction import rollout_correction as correction_for
from stapo_megatron.loss.rollout_correction import sequence_sums
from stapo_megatron.loss.token_rules import broadcast_advantages

AGGREGATIONS = ("token_mean", "seq_mean_token_mean")
METRIC_DTYPE = torch.float64  # counts summed over a mini-batch exceed fp32's exact integers


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
    gradient of exactly the tokens that have drifted furthest from the reference; ``policy_loss``
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


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    log_ratio_clamp: float = 20.0,
    ref_logprob: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    aggregation: str = "token_mean",
    response_mask: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    tau_h: torch.Tensor | None = None,
    rollout_logprob: torch.Tensor | None = None,
    rollout_correction: str = "none",
    rollout_correction_cap: float = 2.0,
    rollout_correction_floor: float | None = None,
    segment_ids: torch.Tensor | None = None,
    objective: str = "ppo_clip",
    objective_cfg=None,
    objective_seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss_sum, num_tokens, metrics) of one micro-batch; see the module docstring.

    ``advantages``: per token or per sequence. ``keep``: per-token weight (0 on padding and on
    silenced tokens). ``ref_logprob``: the frozen reference's log-probs of the same tokens, for the
    ``kl_estimator`` term (:func:`kl_estimate`) weighted by ``kl_coef`` and the ``ref_kl_sum``
    metric. ``entropy`` must carry a gradient when ``entropy_coef`` > 0. ``response_mask``
    (default: the tokens with ``keep`` > 0), ``candidates`` and ``tau_h`` only feed the metrics.
    ``rollout_logprob``: the engine's sampled log-probs, needed when ``rollout_correction`` is not
    ``none`` (see :mod:`.rollout_correction`; ``cap`` and ``floor`` are its bounds).
    ``segment_ids``: each token's sequence, for packed rows (several sequences in one row); without
    it each row of a 2-D ``logprob`` is one sequence. Only the per-sequence terms read it.
    ``objective``: the policy-gradient term pg_t (:mod:`.objectives`; ``ppo_clip`` is the formula
    above), with its parameters read from ``objective_cfg`` (AlgoConfig fields) and its random
    choices seeded by ``objective_seed`` (the same on every TP rank).

    ``num_tokens`` is an int32 scalar tensor. ``metrics`` are fp64 scalar tensors that add up over
    micro-batches and ranks (:func:`~stapo_megatron.loss.metrics.reduce_metrics`), each by the
    reduction declared above :func:`_metrics`.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
    for name, t in (
        ("old_logprob", old_logprob),
        ("keep", keep),
        ("ref_logprob", ref_logprob),
        ("entropy", entropy),
        ("response_mask", response_mask),
        ("candidates", candidates),
        ("rollout_logprob", rollout_logprob),
    ):
        _check_shape(name, t, logprob)
    if kl_coef and ref_logprob is None:
        raise ValueError("ref_logprob: needed when kl_coef > 0")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: {kl_estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
    if clip_ratio_c <= 1:
        raise ValueError(f"clip_ratio_c: must be > 1 (dual-clip caps -A r at -A clip_ratio_c), got {clip_ratio_c}")
    if rollout_correction != "none" and rollout_logprob is None:
        raise ValueError(f"rollout_logprob: needed when rollout_correction is {rollout_correction!r}")
    if entropy_coef and entropy is None:
        raise ValueError("entropy: needed (with a gradient) when entropy_coef > 0")
    _check_shape("segment_ids", segment_ids, logprob)
    if aggregation == "seq_mean_token_mean" and segment_ids is None and logprob.dim() != 2:
        raise ValueError(f"logprob: seq_mean_token_mean needs [sequences, tokens], got shape {tuple(logprob.shape)}")
    advantages = broadcast_advantages(advantages, logprob).to(torch.float32)
    weight = keep.to(torch.float32)
    rule_kept = weight > 0
    zero = torch.zeros((), dtype=torch.float32, device=logprob.device)
    real = (
        rule_kept
        if response_mask is None
        else (response_mask if response_mask.dtype == torch.bool else response_mask != 0)
    )
    correction = None
    if rollout_correction != "none":
        assert rollout_logprob is not None  # checked above
        correction = correction_for(
            old_logprob,
            rollout_logprob,
            real | rule_kept,
            rollout_correction,
            rollout_correction_cap,
            rollout_correction_floor,
            segment_ids,
        )
    active = rule_kept if correction is None else rule_kept & correction.accepted

    # Padding and silenced positions may hold anything: zero their log-ratios so that no inf/nan
    # there can reach the sum or, through 0 * inf, the gradient. The clamp does the same for a
    # ratio that would overflow exp on a kept token.
    log_ratio = torch.where(active, logprob.float() - old_logprob.float(), zero)
    log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    surrogate = get_objective(objective).surrogate(
        SurrogateInputs(
            logprob,
            log_ratio,
            advantages,
            active,
            eps_low,
            eps_high,
            clip_ratio_c,
            log_ratio_clamp,
            segment_ids,
            objective_cfg,
            objective_seed,
        )
    )
    ratio, pg, dual_clipped = surrogate.ratio, surrogate.pg, surrogate.dual_clipped
    if correction is not None:
        pg = pg * correction.weight
    per_token = pg
    ref_kl = None
    if ref_logprob is not None:
        ref_log_ratio = torch.where(active, ref_logprob.float() - logprob.float(), zero)
        ref_kl = kl_estimate(ref_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp), kl_estimator)
        if kl_coef:
            per_token = per_token + kl_coef * ref_kl
    if entropy_coef:
        assert entropy is not None  # checked above
        per_token = per_token - entropy_coef * torch.where(active, entropy.float(), zero)
    weighted = torch.where(active, per_token * weight, zero)

    if aggregation == "token_mean":
        loss_sum = weighted.sum()
        num_tokens = active.sum().to(torch.int32)
    elif segment_ids is not None:
        per_seq_count = sequence_sums(active.to(torch.float32), segment_ids)
        loss_sum = (sequence_sums(weighted, segment_ids) / per_seq_count.clamp(min=1)).sum()
        num_tokens = (per_seq_count > 0).sum().to(torch.int32)
    else:
        per_seq_count = active.sum(-1)
        seq_has_tokens = per_seq_count > 0
        loss_sum = (weighted.sum(-1) / per_seq_count.clamp(min=1)).sum()
        num_tokens = seq_has_tokens.sum().to(torch.int32)

    with torch.no_grad():
        metrics = _metrics(
            active,
            rule_kept,
            weight,
            ratio,
            advantages,
            pg,
            log_ratio,
            *surrogate.clip_range,
            dual_clipped,
            real,
            candidates,
            tau_h,
            entropy,
            ref_kl,
            logprob,
            correction,
        )
        metrics.update(surrogate.metrics)
        if aggregation == "seq_mean_token_mean":
            metrics["sequences"] = num_tokens.to(METRIC_DTYPE)
    return loss_sum, num_tokens, metrics


# The raw metrics of one micro-batch (:func:`_metrics`), combined over micro-batches and ranks by
# these reductions; the update's ``summarize_loss_metrics`` forms the logged means from them.
declare(
    Reduction.SUM,
    {
        "response_tokens": "response tokens (with the left-out zero-advantage ones, which the update adds)",
        "kept_tokens": "tokens in the loss: kept by the token rule and the rollout correction (the token_mean "
        "denominator)",
        "silenced_tokens": "response tokens the token rule silenced",
        "pg_loss_sum": "sum over kept tokens of the weighted policy-gradient term",
        "clip_low_tokens": "kept tokens with A < 0 and ratio < 1 - eps_low (the clip removes their gradient)",
        "clip_high_tokens": "kept tokens with A > 0 and ratio > 1 + eps_high (the clip removes their gradient)",
        "dual_clip_tokens": "kept tokens with A < 0 whose loss the dual-clip caps",
        "approx_kl_sum": "sum over kept tokens of k3(old || current)",
        "ratio_sum": "sum over kept tokens of the importance ratio",
        "candidate_tokens": "S2T candidates of the token rule",
        "silenced_candidate_tokens": "S2T candidates the rule silenced",
        "tau_h_sum": "sum over micro-batches with a finite entropy threshold of that threshold",
        "tau_h_count": "micro-batches with a finite entropy threshold",
        "entropy_kept_sum": "sum over kept tokens of the current policy's entropy",
        "entropy_silenced_sum": "sum over silenced tokens of the current policy's entropy",
        "ref_kl_sum": "sum over kept tokens of the KL estimate against the reference policy",
        "rollout_rejected_tokens": "rule-kept tokens the masked rollout correction rejected",
        "rollout_truncated_tokens": "kept tokens whose rollout-correction weight was cut at the cap",
        "rollout_weight_sum": "sum over kept tokens of the rollout-correction weight",
        "sequences": "sequences with a kept token (the seq_mean_token_mean denominator)",
    },
)
declare(Reduction.MAX, {"ratio_max": "largest importance ratio of a kept token (-inf: none)"})
declare(Reduction.MIN, {"ratio_min": "smallest importance ratio of a kept token (inf: none)"})


def _metrics(
    active,
    rule_kept,
    weight,
    ratio,
    advantages,
    pg,
    log_ratio,
    eps_low,
    eps_high,
    dual_clipped,
    real,
    candidates,
    tau_h,
    entropy,
    ref_kl,
    like,
    correction,
):
    def total(x):
        return x.to(METRIC_DTYPE).sum()

    silenced = real & ~rule_kept  # by the token rule; rollout-correction rejections are counted apart
    inf = torch.tensor(float("inf"), dtype=METRIC_DTYPE, device=like.device)
    m = {
        "response_tokens": total(real),
        "kept_tokens": total(active),
        "silenced_tokens": total(silenced),
        "pg_loss_sum": total(torch.where(active, pg * weight, 0)),
        # tokens whose gradient the clip removes: ratio beyond the bound on the side A pushes it
        "clip_low_tokens": total(active & (advantages < 0) & (ratio < 1.0 - eps_low)),
        "clip_high_tokens": total(active & (advantages > 0) & (ratio > 1.0 + eps_high)),
        # A < 0 tokens whose loss the dual-clip caps at -A clip_ratio_c (no gradient there)
        "dual_clip_tokens": total(active & dual_clipped),
        # k3 estimate of KL(old || current) at the old policy's samples
        "approx_kl_sum": total(torch.where(active, k3(log_ratio), 0)),
        "ratio_sum": total(torch.where(active, ratio, 0)),
        "ratio_max": torch.where(active, ratio.to(METRIC_DTYPE), -inf).max() if active.numel() else -inf,
        "ratio_min": torch.where(active, ratio.to(METRIC_DTYPE), inf).min() if active.numel() else inf,
    }
    if candidates is not None:
        cand = candidates if candidates.dtype == torch.bool else candidates != 0
        m["candidate_tokens"] = total(cand)
        m["silenced_candidate_tokens"] = total(cand & silenced)
    if tau_h is not None:
        finite = torch.isfinite(torch.as_tensor(tau_h, dtype=METRIC_DTYPE, device=like.device))
        value = torch.as_tensor(tau_h, dtype=METRIC_DTYPE, device=like.device)
        m["tau_h_sum"] = torch.where(finite, value, 0)
        m["tau_h_count"] = finite.to(METRIC_DTYPE)
    if entropy is not None:
        ent = entropy.detach().to(METRIC_DTYPE)
        m["entropy_kept_sum"] = torch.where(active, ent, 0).sum()
        m["entropy_silenced_sum"] = torch.where(silenced, ent, 0).sum()
    if ref_kl is not None:
        m["ref_kl_sum"] = total(torch.where(active, ref_kl, 0))
    if correction is not None:
        m["rollout_rejected_tokens"] = total(real & rule_kept & ~correction.accepted)
        m["rollout_truncated_tokens"] = total(active & correction.truncated)
        m["rollout_weight_sum"] = total(torch.where(active, correction.weight, 0))
    return m
