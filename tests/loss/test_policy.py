"""The clipped surrogate, its aggregation, KL and entropy terms, and its metrics."""

from __future__ import annotations

import math

import pytest
import torch

from stapo_megatron.loss import all_reduce_metrics, k3, reduce_metrics
from tests.loss._loss_call import loss_of


def _case():
    # one sequence, five tokens: ratios 1.5 (A>0: clipped high), 0.5 (A<0: clipped low),
    # 1.1 (A>0: inside), 0.9 (A<0: inside), and a silenced token
    old = torch.zeros(1, 5, dtype=torch.float64)
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.9, 3.0]], dtype=torch.float64)
    logprob = ratios.log().requires_grad_()
    adv = torch.tensor([[2.0, -1.0, 2.0, -1.0, 2.0]], dtype=torch.float64)
    keep = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    return logprob, old, adv, keep


def test_clip_higher_values_and_gradients():
    logprob, old, adv, keep = _case()
    loss_sum, n, metrics = loss_of(logprob, old, adv, keep, eps_low=0.2, eps_high=0.28, response_mask=torch.ones(1, 5))
    # per token: -min(rA, clip(r)A)
    expected = [-(1.28 * 2.0), -(0.8 * -1.0), -(1.1 * 2.0), -(0.9 * -1.0)]
    assert math.isclose(loss_sum.item(), sum(expected), rel_tol=1e-6)
    assert n.dtype == torch.int32 and int(n) == 4
    loss_sum.backward()
    g = logprob.grad[0].tolist()
    # clipped tokens and the silenced one get no gradient; d(-rA)/dlogp = -rA inside the range
    assert g[0] == 0.0 and g[1] == 0.0 and g[4] == 0.0
    assert math.isclose(g[2], -1.1 * 2.0, rel_tol=1e-6) and math.isclose(g[3], 0.9, rel_tol=1e-6)
    assert int(metrics["clip_high_tokens"]) == 1 and int(metrics["clip_low_tokens"]) == 1
    assert int(metrics["kept_tokens"]) == 4 and int(metrics["silenced_tokens"]) == 1
    assert int(metrics["response_tokens"]) == 5
    assert math.isclose(float(metrics["ratio_sum"]), 1.5 + 0.5 + 1.1 + 0.9, rel_tol=1e-6)
    assert math.isclose(float(metrics["ratio_max"]), 1.5, rel_tol=1e-6)
    assert math.isclose(float(metrics["ratio_min"]), 0.5, rel_tol=1e-6)
    kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.9))  # k3 at the old policy's samples
    assert math.isclose(float(metrics["approx_kl_sum"]), kl, rel_tol=1e-6)
    assert math.isclose(float(metrics["pg_loss_sum"]), loss_sum.item(), rel_tol=1e-6)
    assert all(v.dtype == torch.float64 and v.dim() == 0 for v in metrics.values())


def test_padding_garbage_never_reaches_loss_or_gradient():
    logprob = torch.tensor([[-1.0, float("nan"), 50.0, -float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.2, 0.0, -50.0, 0.0]])
    keep = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    loss_sum, n, metrics = loss_of(logprob, old, torch.tensor([1.0]), keep, response_mask=torch.tensor([[1, 1, 1, 0]]))
    loss_sum.backward()
    assert torch.isfinite(loss_sum) and torch.isfinite(logprob.grad).all()
    assert logprob.grad[0, 1:].abs().sum() == 0
    assert int(metrics["silenced_tokens"]) == 2 and int(metrics["response_tokens"]) == 3
    assert all(torch.isfinite(v) for k, v in metrics.items() if k not in ("ratio_max", "ratio_min"))


def test_seq_mean_token_mean():
    logprob = torch.zeros(3, 4, requires_grad=True)  # ratio 1: loss per token = -A
    adv = torch.tensor([1.0, 2.0, 3.0])
    keep = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    loss_sum, n, metrics = loss_of(logprob, torch.zeros(3, 4), adv, keep, aggregation="seq_mean_token_mean")
    assert math.isclose(loss_sum.item(), -1.0 - 2.0)  # sequence means; the empty one is not counted
    assert int(n) == 2 and int(metrics["sequences"]) == 2
    loss_sum.backward()
    assert torch.allclose(logprob.grad[0], torch.tensor([-0.5, -0.5, 0, 0]))
    assert torch.allclose(logprob.grad[1], torch.full((4,), -0.5))
    token_sum, token_n, _ = loss_of(logprob, torch.zeros(3, 4), adv, keep)
    assert int(token_n) == 6 and math.isclose(token_sum.item(), -(2 * 1.0 + 4 * 2.0))
    with pytest.raises(ValueError, match="^logprob: seq_mean_token_mean needs"):
        loss_of(logprob.view(-1), torch.zeros(12), torch.ones(12), keep.view(-1), aggregation="seq_mean_token_mean")


# Four responses of different lengths (all tokens kept, ratio 1: each token's loss is -A)
LENGTHS, ADVANTAGES = (2, 6, 3, 5), (1.0, -0.5, 2.0, 0.25)


def _minibatch_loss(aggregation: str, packing: list[list[int]], packed: bool) -> float:
    """The mini-batch's loss as the trainer forms it: sum of loss_sum / sum of num_tokens over the
    micro-batches of ``packing`` (sequence indices), each padded rows or one packed row."""
    total, count = 0.0, 0
    for members in packing:
        if packed:  # one row, the sequences back to back (segment_ids)
            segments = torch.tensor([k for k, i in enumerate(members) for _ in range(LENGTHS[i])])
            keep = torch.ones(len(segments))
            adv = torch.tensor([ADVANTAGES[members[k]] for k in segments.tolist()], dtype=torch.float64)
            extra = {"segment_ids": segments}
        else:
            width = max(LENGTHS[i] for i in members)
            keep = torch.tensor([[1.0] * LENGTHS[i] + [0.0] * (width - LENGTHS[i]) for i in members])
            adv = torch.tensor([ADVANTAGES[i] for i in members], dtype=torch.float64)
            extra = {}
        logprob = torch.zeros(keep.shape, dtype=torch.float64)
        loss_sum, n, _ = loss_of(logprob, logprob, adv, keep, aggregation=aggregation, response_mask=keep, **extra)
        total, count = total + loss_sum.item(), count + int(n)
    return total / count


def test_microbatch_token_mean_is_verls_weighting_and_moves_with_the_packing():
    """fp64 references: the exact token mean of the mini-batch (the paper's equation) whatever the
    packing; verl's per-micro-batch token mean weighted by sequence count, which moves with it."""
    lengths, adv = LENGTHS, ADVANTAGES
    exact = sum(-a * n for a, n in zip(adv, lengths)) / sum(lengths)

    def verl(packing):
        means = [sum(-adv[i] * lengths[i] for i in mb) / sum(lengths[i] for i in mb) for mb in packing]
        return sum(len(mb) / len(lengths) * mean for mb, mean in zip(packing, means))

    by_length, mixed, whole = [[0, 2], [1, 3]], [[0, 1], [2, 3]], [[0, 1, 2, 3]]
    for packing in (by_length, mixed, whole):
        for packed in (False, True):
            assert math.isclose(_minibatch_loss("token_mean", packing, packed), exact, rel_tol=1e-6)
            got = _minibatch_loss("microbatch_token_mean", packing, packed)
            assert math.isclose(got, verl(packing), rel_tol=1e-6), (packing, packed)
    # where they differ: short and long responses in separate micro-batches weigh a short one's
    # tokens more; micro-batches of equal sequence and token counts (8 tokens, 2 sequences each), or
    # one micro-batch of everything, make verl's weighting the exact token mean
    assert math.isclose(verl(whole), exact, rel_tol=1e-12) and math.isclose(verl(mixed), exact, rel_tol=1e-12)
    assert abs(verl(by_length) - exact) > 0.3


def test_kl_and_entropy_terms():
    logprob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    entropy = torch.tensor([[0.3, 0.7]], requires_grad=True)
    keep = torch.ones(1, 2)
    base, _, _ = loss_of(logprob, logprob.detach(), torch.tensor([1.0]), keep)
    total, _, metrics = loss_of(
        logprob,
        logprob.detach(),
        torch.tensor([1.0]),
        keep,
        ref_logprob=ref,
        kl_coef=0.1,
        entropy=entropy,
        entropy_coef=0.01,
    )
    kl = k3(ref - logprob.detach())
    assert torch.all(kl >= 0)
    expected = base.item() + 0.1 * float(kl.sum()) - 0.01 * 1.0
    assert math.isclose(total.item(), expected, rel_tol=1e-6)
    assert math.isclose(float(metrics["ref_kl_sum"]), float(kl.sum()), rel_tol=1e-6)
    assert math.isclose(float(metrics["entropy_kept_sum"]), 1.0, rel_tol=1e-6)
    total.backward()
    assert torch.allclose(entropy.grad, torch.full((1, 2), -0.01))
    # d/dlogp [0.1 * (exp(ref - lp) - (ref - lp) - 1)] = 0.1 * (1 - exp(ref - lp)); pg part: -A r = -1
    expected_grad = -1.0 + 0.1 * (1 - torch.exp(ref - logprob.detach()))
    assert torch.allclose(logprob.grad, expected_grad)
    with pytest.raises(ValueError, match="^ref_logprob: needed"):
        loss_of(logprob, logprob.detach(), torch.tensor([1.0]), keep, kl_coef=0.1)
    with pytest.raises(ValueError, match="^entropy: needed"):
        loss_of(logprob, logprob.detach(), torch.tensor([1.0]), keep, entropy_coef=0.1)
    with pytest.raises(ValueError, match=r"^old_logprob: shape \(1, 3\)"):
        loss_of(logprob, torch.zeros(1, 3), torch.tensor([1.0]), keep)
    with pytest.raises(ValueError, match="^aggregation:"):
        loss_of(logprob, logprob.detach(), torch.tensor([1.0]), keep, aggregation="mean")


def test_metrics_reduce_over_micro_batches():
    logprob, old, adv, keep = _case()
    cand = torch.tensor([[True, False, False, False, True]])
    real = torch.ones(1, 5)
    a = loss_of(
        logprob, old, adv, keep, response_mask=real, candidates=cand, tau_h=torch.tensor(0.3), entropy=torch.rand(1, 5)
    )[2]
    b = loss_of(
        logprob * 0.5,
        old,
        adv,
        keep,
        response_mask=real,
        candidates=cand,
        tau_h=torch.tensor(float("inf")),
        entropy=torch.rand(1, 5),
    )[2]
    total = reduce_metrics([a, b])
    assert int(total["kept_tokens"]) == 8 and int(total["candidate_tokens"]) == 4
    assert int(total["silenced_candidate_tokens"]) == 2
    assert float(total["ratio_max"]) == max(float(a["ratio_max"]), float(b["ratio_max"]))
    assert float(total["ratio_min"]) == min(float(a["ratio_min"]), float(b["ratio_min"]))
    # an infinite tau_h (no candidates anywhere) does not enter the mean threshold
    assert float(total["tau_h_count"]) == 1 and math.isclose(float(total["tau_h_sum"]), 0.3, rel_tol=1e-6)
    assert all_reduce_metrics(total, None) == total


def test_dual_clip_caps_negative_advantage_tokens():
    # A < 0 with ratio 5 (dual-clipped at 3), A < 0 with ratio 2 (below the cap), A > 0 with ratio 5
    # (clip-higher at 1.28; dual-clip never acts on A > 0)
    ratios = torch.tensor([[5.0, 2.0, 5.0]], dtype=torch.float64)
    logprob = ratios.log().requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 2.0]], dtype=torch.float64)
    zeros = torch.zeros(1, 3, dtype=torch.float64)
    loss_sum, n, metrics = loss_of(logprob, zeros, adv, torch.ones(1, 3), clip_ratio_c=3.0)  # veRL's default
    # -min(rA, clip(r)A) = 5, 2, -2.56; dual-clip: min(5, 3 * 1) = 3
    assert math.isclose(loss_sum.item(), 3.0 + 2.0 - 2.56, rel_tol=1e-6)
    loss_sum.backward()
    g = logprob.grad[0].tolist()
    assert g[0] == 0.0 and math.isclose(g[1], 2.0, rel_tol=1e-6) and g[2] == 0.0  # d(-A r)/dlogp = -A r
    assert int(metrics["dual_clip_tokens"]) == 1 and int(metrics["clip_low_tokens"]) == 0
    wider, _, wider_metrics = loss_of(logprob, torch.zeros(1, 3), adv, torch.ones(1, 3))  # the default, JustRL's 10
    assert math.isclose(wider.item(), 5.0 + 2.0 - 2.56, rel_tol=1e-6) and int(wider_metrics["dual_clip_tokens"]) == 0
    with pytest.raises(ValueError, match="^clip_ratio_c: must be > 1"):
        loss_of(logprob, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_ratio_c=1.0)


def test_log_ratio_clamp_keeps_a_runaway_ratio_finite():
    # log(pi / pi_old) = 100 overflows exp in fp32: without the clamp the loss is inf and the
    # gradient nan (0 * inf through exp's backward); clamped at 20, the dual-clip holds it at 10.
    logprob = torch.tensor([[100.0, -1.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1.0]])
    loss_sum, _, metrics = loss_of(logprob, old, torch.tensor([-1.0]), torch.ones(1, 2))
    loss_sum.backward()
    assert math.isclose(loss_sum.item(), 10.0 + 1.0, rel_tol=1e-6)
    assert torch.isfinite(logprob.grad).all() and logprob.grad[0, 0] == 0.0
    assert math.isclose(float(metrics["ratio_max"]), math.exp(20.0), rel_tol=1e-6)
    assert math.isclose(float(metrics["approx_kl_sum"]), math.exp(20.0) - 21.0, rel_tol=1e-6)
    tight, _, _ = loss_of(logprob, old, torch.tensor([1.0]), torch.ones(1, 2), log_ratio_clamp=0.1)
    assert math.isclose(tight.item(), -math.exp(0.1) - 1.0, rel_tol=1e-6)  # e^0.1 = 1.105 < 1.28: not clipped
