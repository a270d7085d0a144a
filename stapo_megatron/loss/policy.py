"""The clipped policy-gradient loss (clip-higher), with the token mask, optional KL and entropy terms.

Per token t with weight w_t (``keep``), ratio r = exp(logprob - old_logprob), advantage A:

    l_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
          + kl_coef * k3(ref || current) - entropy_coef * H_t

``token_mean`` returns (sum_t w_t l_t, #{t : w_t > 0}); Megatron's ``calculate_per_token_loss``
sums both over micro-batches and data-parallel ranks and divides, which gives STAPO's
renormalization over the surviving tokens of the whole mini-batch. ``seq_mean_token_mean``
returns (sum over sequences of their token mean, #sequences with a kept token).
"""

from __future__ import annotations

from typing import Optional

import torch

from stapo_megatron.loss.token_rules import broadcast_advantages

AGGREGATIONS = ("token_mean", "seq_mean_token_mean")
METRIC_DTYPE = torch.float64  # counts summed over a mini-batch exceed fp32's exact integers


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(q || p) from log(p/q) at samples of q: exp(x) - x - 1 >= 0."""
    return torch.expm1(log_ratio) - log_ratio


def _check_shape(name: str, tensor: Optional[torch.Tensor], like: torch.Tensor) -> None:
    if tensor is not None and tuple(tensor.shape) != tuple(like.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match logprob {tuple(like.shape)}")


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ref_logprob: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    aggregation: str = "token_mean",
    response_mask: Optional[torch.Tensor] = None,
    candidates: Optional[torch.Tensor] = None,
    tau_h: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss_sum, num_tokens, metrics) of one micro-batch; see the module docstring.

    ``advantages``: per token or per sequence. ``keep``: per-token weight (0 on padding and on
    silenced tokens). ``entropy`` must carry a gradient when ``entropy_coef`` > 0. ``response_mask``
    (default: the tokens with ``keep`` > 0), ``candidates`` and ``tau_h`` only feed the metrics.

    ``num_tokens`` is an int32 scalar tensor. ``metrics`` are fp64 scalar tensors that add up over
    micro-batches and ranks (:func:`~stapo_megatron.loss.metrics.reduce_metrics`): counts and sums,
    except keys ending in ``_max``/``_min``, which reduce by max/min.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
    for name, t in (("old_logprob", old_logprob), ("keep", keep), ("ref_logprob", ref_logprob),
                    ("entropy", entropy), ("response_mask", response_mask), ("candidates", candidates)):
        _check_shape(name, t, logprob)
    if kl_coef and ref_logprob is None:
        raise ValueError("ref_logprob: needed when kl_coef > 0")
    if entropy_coef and entropy is None:
        raise ValueError("entropy: needed (with a gradient) when entropy_coef > 0")
    if aggregation == "seq_mean_token_mean" and logprob.dim() != 2:
        raise ValueError(f"logprob: seq_mean_token_mean needs [sequences, tokens], got shape {tuple(logprob.shape)}")
    advantages = broadcast_advantages(advantages, logprob).to(torch.float32)
    weight = keep.to(torch.float32)
    active = weight > 0
    zero = torch.zeros((), dtype=torch.float32, device=logprob.device)

    # Padding and silenced positions may hold anything: zero their log-ratios so that no inf/nan
    # there can reach the sum or, through 0 * inf, the gradient.
    log_ratio = torch.where(active, logprob.float() - old_logprob.float(), zero)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(-advantages * ratio, -advantages * clipped)
    per_token = pg
    ref_kl = None
    if ref_logprob is not None:
        ref_kl = k3(torch.where(active, ref_logprob.float() - logprob.float(), zero))
        if kl_coef:
            per_token = per_token + kl_coef * ref_kl
    if entropy_coef:
        per_token = per_token - entropy_coef * torch.where(active, entropy.float(), zero)
    weighted = torch.where(active, per_token * weight, zero)

    if aggregation == "token_mean":
        loss_sum = weighted.sum()
        num_tokens = active.sum().to(torch.int32)
    else:
        per_seq_count = active.sum(-1)
        seq_has_tokens = per_seq_count > 0
        loss_sum = (weighted.sum(-1) / per_seq_count.clamp(min=1)).sum()
        num_tokens = seq_has_tokens.sum().to(torch.int32)

    with torch.no_grad():
        metrics = _metrics(
            active, weight, ratio, advantages, pg, log_ratio, eps_low, eps_high,
            response_mask, candidates, tau_h, entropy, ref_kl, logprob,
        )
        if aggregation == "seq_mean_token_mean":
            metrics["sequences"] = num_tokens.to(METRIC_DTYPE)
    return loss_sum, num_tokens, metrics


def _metrics(active, weight, ratio, advantages, pg, log_ratio, eps_low, eps_high,
             response_mask, candidates, tau_h, entropy, ref_kl, like):
    def total(x):
        return x.to(METRIC_DTYPE).sum()

    if response_mask is None:
        real = active
    else:
        real = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    silenced = real & ~active
    inf = torch.tensor(float("inf"), dtype=METRIC_DTYPE, device=like.device)
    m = {
        "response_tokens": total(real),
        "kept_tokens": total(active),
        "silenced_tokens": total(silenced),
        "pg_loss_sum": total(torch.where(active, pg * weight, 0)),
        # tokens whose gradient the clip removes: ratio beyond the bound on the side A pushes it
        "clip_low_tokens": total(active & (advantages < 0) & (ratio < 1.0 - eps_low)),
        "clip_high_tokens": total(active & (advantages > 0) & (ratio > 1.0 + eps_high)),
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
    return m
