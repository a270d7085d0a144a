"""Rollout correction (TIS / MIS against the engine's log-probs) and the mismatch split by S2T's
candidates, on hand-computed examples; ``auto`` and its resolution by the staleness bound."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from stapo_megatron.config import ConfigError
from stapo_megatron.loss import (
    AlgoConfig,
    PolicyLoss,
    mismatch_sums,
    resolve_rollout_correction,
    rollout_correction,
    summarize_mismatch,
)
from tests.loss._loss_call import loss_of


def _case():
    """Two sequences; row 0 has w = pi_old / pi_rollout = 3, 1/4, 1, 3/2 (product 9/8) and a padding
    slot holding garbage; row 1 has w = 3, 1, 1 (product 3) and two padding slots."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, 0.0], [-1.0, -0.2, -0.7, 0.0, 0.0]])
    log_w = torch.tensor([[math.log(3), math.log(0.25), 0.0, math.log(1.5), 0.0], [math.log(3), 0.0, 0.0, 0.0, 0.0]])
    rollout = old - log_w
    rollout[0, 4] = -float("inf")  # padding: what the engine never sampled may hold anything
    rollout[1, 3:] = float("nan")
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.float32)
    return old, rollout, mask


def test_truncated_and_masked_weights_by_hand():
    old, rollout, mask = _case()
    tis = rollout_correction(old, rollout, mask, "tis_token", cap=2.0, floor=None)
    torch.testing.assert_close(tis.weight, torch.tensor([[2.0, 0.25, 1.0, 1.5, 1.0], [2.0, 1.0, 1.0, 1.0, 1.0]]))
    assert tis.truncated.tolist() == [[True, False, False, False, False], [True, False, False, False, False]]
    assert tis.accepted.tolist() == mask.bool().tolist()

    seq = rollout_correction(old, rollout, mask, "tis_seq", cap=2.0, floor=None)
    torch.testing.assert_close(seq.weight[0, :4], torch.full((4,), 9 / 8))  # 3 * 1/4 * 1 * 3/2
    torch.testing.assert_close(seq.weight[1, :3], torch.full((3,), 2.0))  # 3, cut at 2
    assert seq.weight[0, 4] == seq.weight[1, 3] == 1.0  # padding: weight 1, never summed
    assert seq.truncated[1, :3].all() and not seq.truncated[0].any() and not seq.truncated[1, 3:].any()

    # floor None is 1 / cap = 0.5: token weights 3 and 1/4 leave; 1 and 3/2 stay
    mis = rollout_correction(old, rollout, mask, "mis_token", cap=2.0, floor=None)
    assert mis.accepted.tolist() == [[False, False, True, True, False], [False, True, True, False, False]]
    assert torch.equal(mis.weight, torch.ones(2, 5))
    floor = rollout_correction(old, rollout, mask, "mis_token", cap=4.0, floor=0.2)
    assert floor.accepted[0].tolist() == [True, True, True, True, False]

    mis_seq = rollout_correction(old, rollout, mask, "mis_seq", cap=2.0, floor=None)
    assert mis_seq.accepted.tolist() == [[True, True, True, True, False], [False] * 5]  # 9/8 in, 3 out

    # geometric means: row 0 (9/8)^(1/4) = 1.030, row 1 3^(1/3) = 1.442; with cap 1.2 row 1 is cut / rejected
    geo = rollout_correction(old, rollout, mask, "tis_geo", cap=1.2, floor=None)
    torch.testing.assert_close(geo.weight[0, :4], torch.full((4,), (9 / 8) ** 0.25))
    torch.testing.assert_close(geo.weight[1, :3], torch.full((3,), 1.2))
    mis_geo = rollout_correction(old, rollout, mask, "mis_geo", cap=1.2, floor=None)
    assert mis_geo.accepted.tolist() == [[True, True, True, True, False], [False] * 5]
    assert rollout_correction(old, rollout, mask, "mis_geo", cap=1.5, floor=None).accepted[1].tolist() == [
        True,
        True,
        True,
        False,
        False,
    ]

    none = rollout_correction(old, rollout, mask, "none", cap=2.0, floor=None)
    assert torch.equal(none.weight, torch.ones(2, 5)) and none.accepted.tolist() == mask.bool().tolist()
    with pytest.raises(ValueError, match="^rollout_correction: 'tis' is not one of"):
        rollout_correction(old, rollout, mask, "tis", cap=2.0, floor=None)
    with pytest.raises(ValueError, match=r"^rollout_logprob: shape \(2, 4\)"):
        rollout_correction(old, rollout[:, :4], mask, "tis_token", cap=2.0, floor=None)


def test_PolicyLoss_applies_the_correction():
    old, rollout, mask = _case()
    logprob = old.clone().requires_grad_()  # ratio 1: each kept token's surrogate loss is -A = -1
    adv = torch.tensor([1.0, 1.0])
    base, base_n, base_m = loss_of(logprob, old, adv, mask, response_mask=mask, rollout_logprob=rollout)
    assert math.isclose(base.item(), -7.0) and int(base_n) == 7 and "rollout_weight_sum" not in base_m

    tis, n, m = loss_of(
        logprob, old, adv, mask, response_mask=mask, rollout_logprob=rollout, rollout_correction="tis_token"
    )
    assert math.isclose(tis.item(), -(2 + 0.25 + 1 + 1.5) - (2 + 1 + 1), rel_tol=1e-6) and int(n) == 7
    tis.backward()
    # d(-A r w)/dlogp = -w at r = 1; padding gets nothing
    torch.testing.assert_close(logprob.grad, -torch.tensor([[2.0, 0.25, 1.0, 1.5, 0.0], [2.0, 1.0, 1.0, 0.0, 0.0]]))
    assert int(m["rollout_truncated_tokens"]) == 2 and int(m["rollout_rejected_tokens"]) == 0
    assert math.isclose(float(m["rollout_weight_sum"]), 8.75, rel_tol=1e-6)

    mis, n, m = loss_of(
        logprob, old, adv, mask, response_mask=mask, rollout_logprob=rollout, rollout_correction="mis_token"
    )
    assert math.isclose(mis.item(), -4.0) and int(n) == 4  # rejected tokens leave the count too
    assert int(m["rollout_rejected_tokens"]) == 3 and int(m["silenced_tokens"]) == 0 and int(m["kept_tokens"]) == 4

    seq, n, _ = loss_of(
        logprob, old, adv, mask, response_mask=mask, rollout_logprob=rollout, rollout_correction="mis_seq"
    )
    assert math.isclose(seq.item(), -4.0) and int(n) == 4

    # a token the rule silenced stays silenced and is not counted as a rejection
    keep = mask.clone()
    keep[0, 0] = 0.0
    _, n, m = loss_of(
        logprob, old, adv, keep, response_mask=mask, rollout_logprob=rollout, rollout_correction="mis_token"
    )
    assert int(n) == 4 and int(m["silenced_tokens"]) == 1 and int(m["rollout_rejected_tokens"]) == 2
    with pytest.raises(ValueError, match="^rollout_logprob: needed when rollout_correction is 'tis_seq'"):
        loss_of(logprob, old, adv, mask, rollout_correction="tis_seq")


def test_mismatch_split_by_candidates_by_hand():
    old, rollout, mask = _case()
    candidates = torch.tensor([[True, False, False, True, True], [False, False, True, False, False]])
    sums = mismatch_sums(old, rollout, mask, candidates)
    # candidates (padding excluded): |log 3|, |log 3/2|, 0; the rest: |log 1/4|, 0, |log 3|, 0
    assert float(sums["mismatch_candidates_tokens"]) == 3 and float(sums["mismatch_rest_tokens"]) == 4
    assert math.isclose(float(sums["mismatch_candidates_abs_sum"]), math.log(3) + math.log(1.5), rel_tol=1e-6)
    assert math.isclose(float(sums["mismatch_rest_abs_sum"]), math.log(4) + math.log(3), rel_tol=1e-6)
    assert float(sums["mismatch_candidates_far_tokens"]) == 1 and float(sums["mismatch_rest_far_tokens"]) == 2
    assert all(v.dtype == torch.float64 and v.dim() == 0 for v in sums.values())
    out = summarize_mismatch(sums)
    assert math.isclose(out["mismatch/candidates_abs_mean"], math.log(4.5) / 3, rel_tol=1e-6)
    assert math.isclose(out["mismatch/rest_abs_mean"], math.log(12) / 4, rel_tol=1e-6)
    assert out["mismatch/candidates_far_fraction"] == pytest.approx(1 / 3)
    assert out["mismatch/rest_far_fraction"] == pytest.approx(0.5)
    assert out["mismatch/candidates_tokens"] == 3.0
    empty = summarize_mismatch(mismatch_sums(old, rollout, mask, torch.zeros_like(candidates)))
    assert empty["mismatch/candidates_abs_mean"] == 0.0 and empty["mismatch/candidates_tokens"] == 0.0


def test_auto_resolves_by_staleness_and_an_explicit_choice_stays():
    auto = AlgoConfig()
    assert auto.rollout_correction == "auto"  # the default, and every preset's
    sync = resolve_rollout_correction(auto, 0)
    assert sync.rollout_correction == "none" and sync == dataclasses.replace(auto, rollout_correction="none")
    for k in (1, 4):
        resolved = resolve_rollout_correction(auto, k)
        assert resolved.rollout_correction == "tis_token" and resolved.rollout_correction_cap == 2.0
    assert auto.rollout_correction == "auto"  # a copy: the input is left as it was
    for explicit in ("none", "mis_token", "tis_seq"):
        cfg = AlgoConfig(rollout_correction=explicit)
        assert resolve_rollout_correction(cfg, 0) == resolve_rollout_correction(cfg, 3) == cfg
    with pytest.raises(ConfigError, match=r"^rollout.async.max_staleness: must be an integer >= 0, got -1$"):
        resolve_rollout_correction(auto, -1)


def test_PolicyLoss_refuses_an_unresolved_auto():
    with pytest.raises(ValueError, match=r"^algo.rollout_correction: 'auto' is unresolved; resolve_rollout_correction"):
        PolicyLoss(AlgoConfig())
    PolicyLoss(resolve_rollout_correction(AlgoConfig(), 0))
