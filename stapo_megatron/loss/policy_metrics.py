"""The metrics of :class:`~stapo_megatron.loss.policy.PolicyLoss`: the raw ones of one micro-batch
and the logged ones of one optimizer step, in one table (:data:`LOSS_METRICS`).

Raw metrics (fp64 sums, maxima, minima) add up over micro-batches and data-parallel ranks
(:mod:`.metrics`); the update reduces them, then :func:`summarize_loss_metrics` forms each logged
metric of the table from its raw one: a count as is, a mean or fraction divided by the count named
in its row's ``per`` (0 when that count is 0), which is also its weight over the optimizer steps of
a training step (:func:`~stapo_megatron.loss.metrics.combine_steps`).

"Run tokens": kept tokens of the sequences run through the loss (left-out zero-advantage ones
count in the loss denominator but were not computed).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from stapo_megatron.loss.metrics import Reduction, declare
from stapo_megatron.loss.objectives import Surrogate
from stapo_megatron.loss.rollout_correction import Correction

METRIC_DTYPE = torch.float64  # counts summed over a mini-batch exceed fp32's exact integers

RESPONSE = "policy/response_tokens"
KEPT = "policy/kept_tokens"
RUN = "policy/run_tokens"
SILENCED = "s2t/silenced_tokens"
GSPO_SEQUENCES = "objective/gspo_sequences"


@dataclasses.dataclass(frozen=True)
class LossMetric:
    """One logged metric of an optimizer step and the raw metric it is formed from."""

    name: str  # logged
    doc: str
    raw: str | None  # None: formed from other metrics (run tokens)
    # the raw metric's reduction and doc; None: declared where it is computed (the objectives')
    raw_reduction: Reduction | None = Reduction.SUM
    raw_doc: str | None = None
    per: str | None = None  # the logged count it is divided by; None: logged as the raw value
    # logged only on steps that have the raw metric (a term that is configured); else 0 when absent
    optional: bool = False


LOSS_METRICS = (
    LossMetric(
        RESPONSE,
        "response tokens, all data-parallel ranks (left-out zero-advantage ones included)",
        "response_tokens",
        raw_doc="response tokens (with the left-out zero-advantage ones, which the update adds)",
    ),
    LossMetric(
        KEPT,
        "tokens in the loss denominator (left-out zero-advantage ones included)",
        "kept_tokens",
        raw_doc="tokens in the loss: kept by the token rule and the rollout correction (the token_mean denominator)",
    ),
    LossMetric(RUN, "kept tokens of the sequences run through the loss", None),
    LossMetric(
        SILENCED,
        "response tokens the token rule silenced",
        "silenced_tokens",
        raw_doc="response tokens the token rule silenced",
    ),
    LossMetric(
        "s2t/masked_fraction", "silenced / response tokens", "silenced_tokens", raw_reduction=None, per=RESPONSE
    ),
    LossMetric(
        "policy/pg_loss",
        "policy-gradient term per token of the loss denominator",
        "pg_loss_sum",
        raw_doc="sum over kept tokens of the weighted policy-gradient term",
        per=KEPT,
    ),
    LossMetric(
        "policy/clip_low_fraction",
        "run tokens with A < 0 clipped at 1 - eps_low",
        "clip_low_tokens",
        raw_doc="kept tokens with A < 0 and ratio < 1 - eps_low (the clip removes their gradient)",
        per=RUN,
    ),
    LossMetric(
        "policy/clip_high_fraction",
        "run tokens with A > 0 clipped at 1 + eps_high",
        "clip_high_tokens",
        raw_doc="kept tokens with A > 0 and ratio > 1 + eps_high (the clip removes their gradient)",
        per=RUN,
    ),
    LossMetric(
        "policy/dual_clip_fraction",
        "run tokens the dual-clip caps",
        "dual_clip_tokens",
        raw_doc="kept tokens with A < 0 whose loss the dual-clip caps",
        per=RUN,
    ),
    LossMetric(
        "policy/approx_kl",
        "mean k3(old || current) per run token",
        "approx_kl_sum",
        raw_doc="sum over kept tokens of k3(old || current)",
        per=RUN,
    ),
    LossMetric(
        "policy/ratio_mean",
        "mean importance ratio per run token",
        "ratio_sum",
        raw_doc="sum over kept tokens of the importance ratio",
        per=RUN,
    ),
    LossMetric(
        "policy/entropy_kept",
        "mean entropy of the current policy per run token (only the sequences run)",
        "entropy_kept_sum",
        raw_doc="sum over kept tokens of the current policy's entropy",
        per=RUN,
    ),
    LossMetric(
        "s2t/entropy_silenced",
        "mean entropy of the current policy over the silenced tokens",
        "entropy_silenced_sum",
        raw_doc="sum over silenced tokens of the current policy's entropy",
        per=SILENCED,
    ),
    LossMetric(
        "policy/ref_kl",
        "mean KL estimate against the reference policy per run token",
        "ref_kl_sum",
        raw_doc="sum over kept tokens of the KL estimate against the reference policy",
        per=RUN,
        optional=True,
    ),
    LossMetric(
        "rollout_correction/weight_mean",
        "mean rollout-correction weight per run token",
        "rollout_weight_sum",
        raw_doc="sum over kept tokens of the rollout-correction weight",
        per=RUN,
        optional=True,
    ),
    LossMetric(
        "rollout_correction/truncated_fraction",
        "run tokens whose rollout-correction weight was cut at the cap",
        "rollout_truncated_tokens",
        raw_doc="kept tokens whose rollout-correction weight was cut at the cap",
        per=RUN,
        optional=True,
    ),
    LossMetric(
        "rollout_correction/rejected_fraction",
        "tokens the masked rollout correction rejected / response tokens",
        "rollout_rejected_tokens",
        raw_doc="rule-kept tokens the masked rollout correction rejected",
        per=RESPONSE,
        optional=True,
    ),
    LossMetric(
        "s2t/candidates",
        "S2T candidates",
        "candidate_tokens",
        raw_doc="S2T candidates of the token rule",
        optional=True,
    ),
    LossMetric(
        "s2t/silenced_candidates",
        "S2T candidates the rule silenced",
        "silenced_candidate_tokens",
        raw_doc="S2T candidates the rule silenced",
        optional=True,
    ),
    # the policy objective's (stapo_megatron.loss.objectives), logged when it reports them
    LossMetric(
        "objective/cov_candidate_tokens",
        "clip_cov: unclipped tokens with clip_cov_lb < Cov < clip_cov_ub",
        "cov_candidate_tokens",
        raw_reduction=None,
        optional=True,
    ),
    LossMetric(
        "objective/cov_selected_tokens",
        "clip_cov / kl_cov: tokens the covariance picked",
        "cov_selected_tokens",
        raw_reduction=None,
        optional=True,
    ),
    LossMetric(
        "objective/cov_selected_fraction",
        "clip_cov / kl_cov: picked tokens / run tokens",
        "cov_selected_tokens",
        raw_reduction=None,
        per=RUN,
        optional=True,
    ),
    LossMetric(
        "objective/kl_cov_penalty",
        "kl_cov: kl_cov_coef * |log r| summed over the picked tokens, per run token",
        "kl_cov_penalty_sum",
        raw_reduction=None,
        per=RUN,
        optional=True,
    ),
    LossMetric(
        GSPO_SEQUENCES,
        "gspo: sequences with a token in the loss",
        "gspo_sequences",
        raw_reduction=None,
        optional=True,
    ),
    LossMetric(
        "objective/gspo_clipped_fraction",
        "gspo: sequences whose ratio s_i is clipped on the side A pushes it / sequences",
        "gspo_clipped_sequences",
        raw_reduction=None,
        per=GSPO_SEQUENCES,
        optional=True,
    ),
)

for _metric in LOSS_METRICS:
    if _metric.raw is not None and _metric.raw_reduction is not None:
        declare(_metric.raw_reduction, {_metric.raw: _metric.raw_doc or ""})
    if _metric.per is None:
        declare(Reduction.SUM, {_metric.name: _metric.doc})
    else:
        declare(Reduction.WEIGHTED_MEAN, {_metric.name: _metric.doc}, weight=_metric.per)

# The raw metrics outside the table: the extremes, the threshold and the denominators' parts.
declare(
    Reduction.SUM,
    {
        "tau_h_sum": "sum over micro-batches with a finite entropy threshold of that threshold",
        "tau_h_count": "micro-batches with a finite entropy threshold",
        "sequences": "sequences with a kept token (the seq_mean_token_mean denominator)",
        "skipped_tokens": "response tokens of the left-out zero-advantage sequences (in the loss denominator, not run)",
    },
)
declare(Reduction.MAX, {"ratio_max": "largest importance ratio of a kept token (-inf: none)"})
declare(Reduction.MIN, {"ratio_min": "smallest importance ratio of a kept token (inf: none)"})
declare(Reduction.MAX, {"policy/ratio_max": "largest importance ratio of a run token"})
declare(Reduction.MIN, {"policy/ratio_min": "smallest importance ratio of a run token"})
declare(
    Reduction.MEAN,
    {"s2t/tau_h": "entropy threshold, mean over the optimizer steps that had one (null: none had)"},
)


@dataclasses.dataclass
class TokenTerms:
    """The per-token quantities of one micro-batch's loss that its metrics read."""

    active: torch.Tensor  # bool: in the loss (kept by the token rule, accepted by the rollout correction)
    rule_kept: torch.Tensor  # bool: kept by the token rule
    weight: torch.Tensor  # fp32 keep weight of the token rule
    real: torch.Tensor  # bool: response tokens
    zero: torch.Tensor  # fp32 scalar 0 on the tokens' device
    advantages: torch.Tensor  # fp32 per token
    log_ratio: torch.Tensor  # fp32 log(pi_theta / pi_old), clamped, 0 where not active
    pg: torch.Tensor  # fp32 policy-gradient term, times the rollout-correction weight
    surrogate: Surrogate
    ref_kl: torch.Tensor | None  # the KL estimate against the reference (None: no reference)
    correction: Correction | None  # None: no rollout correction


def raw_loss_metrics(
    t: TokenTerms,
    approx_kl: torch.Tensor,
    candidates: torch.Tensor | None,
    tau_h: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The raw metrics of one micro-batch (declared above). ``approx_kl``: k3(old || current) per token."""

    def total(x):
        return x.to(METRIC_DTYPE).sum()

    active, ratio = t.active, t.surrogate.ratio
    eps_low, eps_high = t.surrogate.clip_range
    silenced = t.real & ~t.rule_kept  # by the token rule; rollout-correction rejections are counted apart
    inf = torch.tensor(float("inf"), dtype=METRIC_DTYPE, device=active.device)
    m = {
        "response_tokens": total(t.real),
        "kept_tokens": total(active),
        "silenced_tokens": total(silenced),
        "pg_loss_sum": total(torch.where(active, t.pg * t.weight, 0)),
        # tokens whose gradient the clip removes: ratio beyond the bound on the side A pushes it
        "clip_low_tokens": total(active & (t.advantages < 0) & (ratio < 1.0 - eps_low)),
        "clip_high_tokens": total(active & (t.advantages > 0) & (ratio > 1.0 + eps_high)),
        # A < 0 tokens whose loss the dual-clip caps at -A clip_ratio_c (no gradient there)
        "dual_clip_tokens": total(active & t.surrogate.dual_clipped),
        # k3 estimate of KL(old || current) at the old policy's samples
        "approx_kl_sum": total(torch.where(active, approx_kl, 0)),
        "ratio_sum": total(torch.where(active, ratio, 0)),
        "ratio_max": torch.where(active, ratio.to(METRIC_DTYPE), -inf).max() if active.numel() else -inf,
        "ratio_min": torch.where(active, ratio.to(METRIC_DTYPE), inf).min() if active.numel() else inf,
    }
    if candidates is not None:
        cand = candidates if candidates.dtype == torch.bool else candidates != 0
        m["candidate_tokens"] = total(cand)
        m["silenced_candidate_tokens"] = total(cand & silenced)
    if tau_h is not None:
        finite = torch.isfinite(torch.as_tensor(tau_h, dtype=METRIC_DTYPE, device=active.device))
        value = torch.as_tensor(tau_h, dtype=METRIC_DTYPE, device=active.device)
        m["tau_h_sum"] = torch.where(finite, value, 0)
        m["tau_h_count"] = finite.to(METRIC_DTYPE)
    if entropy is not None:
        ent = entropy.detach().to(METRIC_DTYPE)
        m["entropy_kept_sum"] = torch.where(active, ent, 0).sum()
        m["entropy_silenced_sum"] = torch.where(silenced, ent, 0).sum()
    if t.ref_kl is not None:
        m["ref_kl_sum"] = total(torch.where(active, t.ref_kl, 0))
    if t.correction is not None:
        m["rollout_rejected_tokens"] = total(t.real & t.rule_kept & ~t.correction.accepted)
        m["rollout_truncated_tokens"] = total(active & t.correction.truncated)
        m["rollout_weight_sum"] = total(torch.where(active, t.correction.weight, 0))
    m.update(t.surrogate.metrics)
    return m


def summarize_loss_metrics(m: dict[str, torch.Tensor]) -> dict[str, float]:
    """The logged metrics of one optimizer step (:data:`LOSS_METRICS` and the extremes and threshold
    declared above) from its reduced raw ones: exact mini-batch means from summed counts."""

    def value(key: str) -> float:
        return float(m[key]) if key in m else 0.0

    # Left-out zero-advantage tokens are in kept/response tokens (the loss denominator) but were
    # not run: per-token means of what was computed divide by the tokens run.
    out = {RUN: value("kept_tokens") - value("skipped_tokens")}
    for metric in LOSS_METRICS:
        if metric.raw is None or (metric.optional and metric.raw not in m):
            continue
        if metric.per is None:
            out[metric.name] = value(metric.raw)
        else:
            count = out[metric.per]  # every denominator precedes the metrics divided by it in the table
            out[metric.name] = value(metric.raw) / count if count > 0 else 0.0
    if "ratio_max" in m and math.isfinite(float(m["ratio_max"])):
        out["policy/ratio_max"] = float(m["ratio_max"])
        out["policy/ratio_min"] = float(m["ratio_min"])
    # No candidates (no threshold) is logged as null, so the series keeps its gaps.
    count = value("tau_h_count")
    out["s2t/tau_h"] = value("tau_h_sum") / count if count > 0 else float("nan")
    return out
