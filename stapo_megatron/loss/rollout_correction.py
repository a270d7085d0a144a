"""Rollout correction: the trainer's pi_old and the engine's pi_rollout differ (bf16 sampler vs
Megatron, kernels, TP layouts), so the "on-policy" samples are slightly off-policy; under
asynchronous rollouts (``rollout.async.max_staleness`` k > 0) each token was also sampled by
weights up to k versions older than pi_old, a sequence's tokens possibly by different versions.
pi_rollout is then per token what sampled it, and the weights below correct for both (decoupled
PPO, pi_old the proximal policy: :mod:`.policy`, docs/async.md).

With w_t = pi_old(o_t) / pi_rollout(o_t) (from the old-log-prob pass and the engine's sampled
log-probs), the decoupled corrections of verl's rollout correction (docs/algo/rollout_corr.md)
and slime's ``--use-tis``:

- ``tis_token``: each token's policy-gradient term times min(w_t, cap) (slime ``--use-tis`` with
  ``--tis-clip`` = cap, ``--tis-clip-low`` 0; verl ``rollout_is: token``);
- ``tis_seq``: each token of sequence i times min(prod_t w_t, cap) (verl ``rollout_is: sequence``);
- ``mis_token``: tokens with w_t outside [floor, cap] leave the loss, numerator and token count
  (verl ``rollout_rs: token_k1``, floor defaulting to 1 / cap as there);
- ``mis_seq``: sequences whose prod_t w_t lies outside [floor, cap] leave it whole (verl
  ``rollout_rs: seq_sum_k1``);
- ``tis_geo`` / ``mis_geo``: as ``tis_seq`` / ``mis_seq`` with the geometric mean
  (prod_t w_t)^(1/T) over the sequence's T response tokens, which does not grow with the length
  (verl's Geo-RS, ``rollout_rs: seq_mean_k1``).

Log-ratios are clamped to [-20, 20] before exp, as both frameworks do, so a weight is always finite.
The weights carry no gradient. ``none`` leaves the loss as the paper has it.

The mismatch itself is logged on every step, split by S2T's candidate set (A > 0, p < tau_p): a
reviewer's question is whether silencing those tokens is mismatch masking in disguise.
"""

from __future__ import annotations

import dataclasses

import torch

from stapo_megatron.loss.metrics import OLD_PASS_ONLY, Reduction, declare

ROLLOUT_CORRECTIONS = ("none", "tis_token", "tis_seq", "tis_geo", "mis_token", "mis_seq", "mis_geo")
WEIGHT_LOG_CLAMP = 20.0  # verl's safety bound on IS log-weights
MISMATCH_THRESHOLD = 1.0  # |log pi_old - log pi_rollout| above which a token counts as far off
METRIC_DTYPE = torch.float64


@dataclasses.dataclass
class Correction:
    weight: torch.Tensor  # fp32 per-token factor on the policy-gradient term (1 where no TIS)
    accepted: torch.Tensor  # bool per token: False where MIS rejects the token or its sequence
    truncated: torch.Tensor  # bool per token: the TIS weight was cut at cap


def rollout_correction(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    cap: float,
    floor: float | None,
    segment_ids: torch.Tensor | None = None,
) -> Correction:
    """The per-token weight and acceptance of ``mode`` (see the module docstring) for tensors of
    shape [sequences, tokens] (one sequence per row; ``response_mask`` nonzero on its response),
    or of any shape with ``segment_ids`` naming each token's sequence (packed rows)."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout_correction: {mode!r} is not one of {', '.join(ROLLOUT_CORRECTIONS)}")
    if tuple(rollout_logprob.shape) != tuple(old_logprob.shape):
        raise ValueError(
            f"rollout_logprob: shape {tuple(rollout_logprob.shape)} does not match old_logprob "
            f"{tuple(old_logprob.shape)}"
        )
    if cap <= 1:
        raise ValueError(f"cap: must be > 1, got {cap}")
    floor = 1.0 / cap if floor is None else floor
    if not 0 < floor < 1:
        raise ValueError(f"floor: must be in (0, 1), got {floor}")
    real = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    ones = torch.ones(old_logprob.shape, dtype=torch.float32, device=old_logprob.device)
    if mode == "none":
        return Correction(ones, real.clone(), torch.zeros_like(real))
    with torch.no_grad():
        # Padding may hold anything: its log-weight is 0 (weight 1) and it never reaches a sum.
        log_w = torch.where(real, old_logprob.double() - rollout_logprob.double(), 0.0)
        if not mode.endswith("_token"):
            if segment_ids is not None:
                # packed rows: sequence sums by segment, read back at every token of the segment
                per_sequence = sequence_sums(log_w, segment_ids)
                if mode.endswith("_geo"):
                    per_sequence = per_sequence / sequence_sums(real.double(), segment_ids).clamp(min=1)
                log_w = per_sequence[segment_ids]
            else:
                if log_w.dim() != 2:
                    raise ValueError(
                        f"old_logprob: {mode} needs [sequences, tokens] or segment_ids, got shape {tuple(log_w.shape)}"
                    )
                per_sequence = log_w.sum(-1, keepdim=True)
                if mode.endswith("_geo"):
                    per_sequence = per_sequence / real.sum(-1, keepdim=True).clamp(min=1)
                log_w = per_sequence.expand_as(log_w)
        w = log_w.clamp(-WEIGHT_LOG_CLAMP, WEIGHT_LOG_CLAMP).exp()
        if mode.startswith("tis"):
            truncated = real & (w > cap)
            return Correction(torch.where(real, w.clamp(max=cap), 1.0).float(), real.clone(), truncated)
        accepted = real & (w >= floor) & (w <= cap)
        return Correction(ones, accepted, torch.zeros_like(real))


def sequence_sums(values: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums ``[S]`` of per-token ``values`` (any shape), sequence s = the tokens
    with ``segment_ids == s`` (S = max + 1). Differentiable in ``values``."""
    flat, segments = values.reshape(-1), segment_ids.reshape(-1)
    count = int(segments.max()) + 1 if segments.numel() else 0
    return torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, segments, flat)


SETS = ("candidates", "rest")


def _declare_mismatch(name: str, what: str) -> None:
    declare(
        Reduction.SUM,
        {
            f"mismatch_{name}_tokens": what,
            f"mismatch_{name}_abs_sum": f"sum over {what} of |log pi_old - log pi_rollout|",
            f"mismatch_{name}_far_tokens": f"{what} with |log pi_old - log pi_rollout| > {MISMATCH_THRESHOLD}",
            f"mismatch/{name}_tokens": f"{what}, all data-parallel ranks" + OLD_PASS_ONLY,
        },
    )
    declare(
        Reduction.WEIGHTED_MEAN,
        {
            f"mismatch/{name}_abs_mean": f"mean |log pi_old - log pi_rollout| over {what} (0: none)" + OLD_PASS_ONLY,
            f"mismatch/{name}_far_fraction": f"fraction of {what} with |delta log p| > {MISMATCH_THRESHOLD}"
            + OLD_PASS_ONLY,
        },
        weight=f"mismatch/{name}_tokens",
    )


_declare_mismatch("candidates", "S2T's candidates (A > 0, p_old < tau_p)")
_declare_mismatch("rest", "the other response tokens")


def mismatch_sums(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    candidates: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Raw metrics (fp64 scalars, declared above) of |log pi_old - log pi_rollout| over S2T's
    candidates and over the other response tokens; :func:`summarize_mismatch` makes the means and
    fractions from the reduced sums."""
    real = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    cand = real & (candidates if candidates.dtype == torch.bool else candidates != 0)
    rest = real & ~cand
    delta = torch.where(real, old_logprob.double() - rollout_logprob.double(), 0.0).abs()
    out = {}
    for name, part in zip(SETS, (cand, rest)):
        out[f"mismatch_{name}_tokens"] = part.to(METRIC_DTYPE).sum()
        out[f"mismatch_{name}_abs_sum"] = torch.where(part, delta, 0.0).sum()
        out[f"mismatch_{name}_far_tokens"] = (part & (delta > MISMATCH_THRESHOLD)).to(METRIC_DTYPE).sum()
    return out


def summarize_mismatch(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Logged metrics (declared above) from reduced :func:`mismatch_sums`: each mean or fraction is
    a ratio of two summed counts over the whole step (0 when the set is empty)."""
    out = {}
    for name in SETS:
        count = float(sums[f"mismatch_{name}_tokens"])
        out[f"mismatch/{name}_tokens"] = count
        out[f"mismatch/{name}_abs_mean"] = float(sums[f"mismatch_{name}_abs_sum"]) / count if count else 0.0
        out[f"mismatch/{name}_far_fraction"] = float(sums[f"mismatch_{name}_far_tokens"]) / count if count else 0.0
    return out
