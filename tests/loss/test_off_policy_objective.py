"""The loss off-policy (docs/async.md, "The objective off-policy") against an fp64 reference.

Samples as asynchronous partial rollouts produce them: each sequence's prefix sampled by weight
version v0, its continuation by v1 (the split point differs per sequence: wholly v0, wholly v1, or
mixed), the proximal policy (the trainer's weights at the step's start) one version on, the current
policy a step further. The real path (S2T's selection from the current policy's statistics, then
PolicyLoss per micro-batch, summed as Megatron's per-token normalisation sums) is compared with
:func:`~tests.loss._reference.reference_off_policy_loss`, plain fp64 arithmetic written from the
formula, for the loss and its gradient with respect to the current policy's logits.

Tolerance: PolicyLoss computes in fp32 whatever its inputs' dtype (the project's rule for token
statistics and the loss: log-ratios, clipping and weights are fp32), so the fp64 reference is
matched to fp32 rounding, not to fp64's: relative 1e-5 (measured: about 1e-7).
"""

from __future__ import annotations

import math

import pytest
import torch

from stapo_megatron.loss import AlgoConfig, TokenStats, minibatch_threshold, select_tokens
from tests.loss._loss_call import loss_of
from tests.loss._reference import reference_ablation_keeps, reference_off_policy_loss

SEQUENCES, TOKENS, VOCAB = 6, 12, 6
# tokens of each sequence sampled by the older version v0 (a prefix); the rest by v1
V0_PREFIX = (0, 4, 7, TOKENS, 2, 9)
ADVANTAGES = (1.3, -0.7, 0.6, -1.2, 0.9, -0.4)
PADDING = 3  # the last sequence's last tokens are padding
MICRO_BATCHES = ((0, 3), (3, 6))  # rows of each micro-batch
# S2T with a tau_p at which this vocabulary has rare sampled tokens; the default q 0.75
CFG = AlgoConfig(tau_p=0.15, clip_ratio_c=3.0)  # veRL's dual-clip: these samples reach it
MODES = ("none", "tis_token", "mis_token", "tis_seq", "mis_seq")
RTOL = 1e-5  # fp32 arithmetic in the loss (module docstring)


def _log_softmax_at(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def _samples():
    """fp64 logits of four weight versions, the sampled tokens and each token's behaviour log-prob."""
    g = torch.Generator().manual_seed(2505)
    shape = (SEQUENCES, TOKENS, VOCAB)
    v0 = 2.5 * torch.randn(shape, generator=g, dtype=torch.float64)
    v1 = v0 + 0.8 * torch.randn(shape, generator=g, dtype=torch.float64)
    prox = v1 + 0.8 * torch.randn(shape, generator=g, dtype=torch.float64)
    current = prox + 0.35 * torch.randn(shape, generator=g, dtype=torch.float64)
    from_v0 = torch.arange(TOKENS)[None, :] < torch.tensor(V0_PREFIX)[:, None]
    behaviour_logits = torch.where(from_v0[..., None], v0, v1)
    probs = torch.softmax(behaviour_logits, -1).reshape(-1, VOCAB)
    tokens = torch.multinomial(probs, 1, generator=g).reshape(SEQUENCES, TOKENS)
    # a token of a negative-advantage sequence whose ratio passes the dual-clip's 3
    current[1, 5, tokens[1, 5]] += 2.5
    response = torch.ones(SEQUENCES, TOKENS, dtype=torch.bool)
    response[-1, -PADDING:] = False
    behaviour = _log_softmax_at(behaviour_logits, tokens)
    old = _log_softmax_at(prox, tokens)
    # padding holds what no sampler wrote: it must reach neither the sums nor the gradient
    behaviour[~response] = 10.0
    old[~response] = -60.0
    return dict(
        current=current,
        tokens=tokens,
        behaviour=behaviour,
        single_version=_log_softmax_at(v1, tokens),
        old=old,
        response=response,
        from_v0=from_v0,
        advantages=torch.tensor(ADVANTAGES, dtype=torch.float64),
    )


def _current_statistics(logits: torch.Tensor, tokens: torch.Tensor):
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _real_path(s, mode: str):
    """The trainer's order: S2T's threshold over the mini-batch from the current policy's
    statistics (fp32, as the statistics pass gives them), then PolicyLoss per micro-batch, the loss
    sums and token counts added over micro-batches; the gradient of their ratio."""
    logits = s["current"].clone().requires_grad_()
    logprob, entropy = _current_statistics(logits, s["tokens"])
    stats = [
        TokenStats(
            logprob[a:b].detach().float(),
            entropy[a:b].detach().float(),
            s["advantages"][a:b].float(),
            s["response"][a:b],
        )
        for a, b in MICRO_BATCHES
    ]
    threshold = minibatch_threshold(CFG, stats)
    loss_sum, count, keeps = 0.0, 0, []
    for (a, b), st in zip(MICRO_BATCHES, stats):
        selection = select_tokens(CFG, st, threshold)
        keeps.append(selection.keep)
        part, n, _ = loss_of(
            logprob[a:b],
            s["old"][a:b],
            s["advantages"][a:b],
            selection.keep,
            CFG,
            response_mask=s["response"][a:b],
            rollout_logprob=s["behaviour"][a:b],
            candidates=selection.candidates,
            tau_h=selection.tau_h,
            rollout_correction=mode,
        )
        loss_sum, count = loss_sum + part, count + int(n)
    loss = loss_sum / count
    loss.backward()
    return float(loss.detach()), count, logits.grad, torch.cat(keeps), stats


def _reference(s, keep, mode: str, behaviour=None):
    logits = s["current"].clone().requires_grad_()
    logprob, _ = _current_statistics(logits, s["tokens"])
    loss, count, scale = reference_off_policy_loss(
        logprob,
        s["old"],
        s["behaviour"] if behaviour is None else behaviour,
        s["advantages"],
        keep,
        s["response"],
        mode,
        CFG.eps_low,
        CFG.eps_high,
        CFG.clip_ratio_c,
        CFG.rollout_correction_cap,
    )
    loss.backward()
    return float(loss.detach()), count, logits.grad, scale


def test_the_samples_exercise_every_part_of_the_objective():
    """The data cover what the comparison below must tell apart (else a wrong branch could pass)."""
    s = _samples()
    real = s["response"]
    lp, ent = _current_statistics(s["current"], s["tokens"])
    ratio = torch.exp(lp - s["old"])[real]
    w = torch.exp(s["old"] - s["behaviour"])[real]
    adv = s["advantages"][:, None].expand(SEQUENCES, TOKENS)[real]
    mixed = [i for i in range(SEQUENCES) if 0 < V0_PREFIX[i] < TOKENS]
    assert len(mixed) >= 3 and 0 in V0_PREFIX and TOKENS in V0_PREFIX
    assert int((ratio > 1 + CFG.eps_high).sum()) >= 5 and int((ratio < 1 - CFG.eps_low).sum()) >= 5
    assert int(((adv < 0) & (ratio > CFG.clip_ratio_c)).sum()) >= 1  # dual-clip
    cap = CFG.rollout_correction_cap
    assert int((w > cap).sum()) >= 2 and int((w < 1 / cap).sum()) >= 5  # truncated, rejected
    # the two versions' log-probs differ where they were switched: a per-sequence mu would be wrong
    assert float((s["behaviour"] - s["single_version"])[real & s["from_v0"]].abs().max()) > 0.5
    # no value within 1e-4 of a branch point, where fp32 and fp64 could take different branches
    for values, points in ((ratio, (1 - CFG.eps_low, 1 + CFG.eps_high, CFG.clip_ratio_c)), (w, (cap, 1 / cap))):
        for point in points:
            assert float((values - point).abs().min()) > 1e-4 * point
    candidates = (adv > 0) & (lp[real] < math.log(CFG.tau_p))
    assert int(candidates.sum()) >= 8
    assert float((lp[real] - math.log(CFG.tau_p)).abs().min()) > 1e-4
    assert ent[real][candidates].unique().numel() == int(candidates.sum())  # distinct: an exact quantile


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradient_match_the_fp64_reference_with_mixed_behaviour_versions(mode):
    s = _samples()
    loss, count, grad, keep, stats = _real_path(s, mode)

    # S2T silenced tokens, chosen from the current policy's statistics as the paper defines them
    expected_keep = torch.cat(reference_ablation_keeps("s2t", stats, CFG.q, CFG.tau_p)).view_as(keep)
    assert torch.equal(keep.double(), expected_keep)
    assert int((s["response"] & (keep == 0)).sum()) >= 5

    ref_loss, ref_count, ref_grad, ref_scale = _reference(s, expected_keep, mode)
    assert count == ref_count
    # relative to the terms' magnitude: their positive and negative parts can cancel in the sum
    assert abs(loss - ref_loss) <= RTOL * ref_scale, (loss, ref_loss)
    scale = float(ref_grad.abs().max())
    assert scale > 0
    assert float((grad - ref_grad).abs().max()) <= RTOL * scale
    # nothing reaches padding, silenced or (masked IS) rejected tokens
    idle = ~s["response"] | (keep == 0)
    if mode == "mis_token":
        w = torch.exp(s["old"] - s["behaviour"])
        idle |= (w < 1 / CFG.rollout_correction_cap) | (w > CFG.rollout_correction_cap)
    assert torch.equal(grad[idle], torch.zeros_like(grad[idle]))

    if mode != "none":
        # the reference is sensitive to each token's version: one version's log-probs for the
        # whole sequence (what a per-sequence behaviour policy would assume) gives another loss
        other = _reference(s, expected_keep, mode, behaviour=s["single_version"])[0]
        assert abs(other - ref_loss) > 100 * RTOL * ref_scale


def test_without_correction_the_objective_ignores_the_behaviour_policy():
    """none: the clip's anchor is the proximal policy, the behaviour log-probs only feed metrics."""
    s = _samples()
    loss, _, grad, _, _ = _real_path(s, "none")
    s["behaviour"] = s["single_version"]
    again, _, grad_again, _, _ = _real_path(s, "none")
    assert loss == again and torch.equal(grad, grad_again)


def test_tis_is_the_default_under_async_and_none_in_the_synchronous_loop():
    s = _samples()
    for max_staleness, expected in ((0, "none"), (2, "tis_token")):
        logprob, _ = _current_statistics(s["current"], s["tokens"])
        keep = s["response"].float()
        common = dict(response_mask=s["response"], rollout_logprob=s["behaviour"])
        auto, n, _ = loss_of(logprob, s["old"], s["advantages"], keep, max_staleness=max_staleness, **common)
        named, named_n, _ = loss_of(logprob, s["old"], s["advantages"], keep, rollout_correction=expected, **common)
        assert torch.equal(auto, named) and int(n) == int(named_n), max_staleness
