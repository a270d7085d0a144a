"""Rules from related papers (loss.related_rules): STARE against an fp64 reference written here from
the paper's definition (arXiv 2606.19236, github.com/hp-luo/STARE), its config fields and preset,
and a 2-rank spawn: TP=2 gives the same weights, loss and gradient as TP=1, and the mini-batch
scope is exact over data-parallel ranks."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from stapo_megatron.config import ConfigError, build
from stapo_megatron.loss import (
    AlgoConfig,
    TokenStats,
    minibatch_threshold,
    needs_statistics_pass,
    select_tokens,
    zero_advantage_skippable,
)
from stapo_megatron.runtime.launch import spawn_ranks
from tests.loss import _related_workers
from tests.loss._loss_call import loss_of
from tests.loss._reference import rule_keeps


def _micro_batches(seed=0, micro=3, rows=6, cols=20, step_entropy=0.1):
    """Micro-batches with distinct surprisals, advantages of both signs and zero, and padding."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for j in range(micro):
        lp = torch.log(torch.rand(rows, cols + 3 * j, generator=gen) * 0.999 + 1e-4)
        ent = torch.rand(rows, cols + 3 * j, generator=gen) * 2
        adv = torch.tensor([1.2, -0.5, 0.0, 0.3, -1.4, 0.8])[:rows]
        mask = torch.rand(rows, cols + 3 * j, generator=gen) < 0.8
        out.append(TokenStats(lp, ent, adv, mask, step_entropy=step_entropy))
    return out


def reference_weights(micro, p, w, m, variant, gate_on):
    """The paper's weights in fp64 over the whole list, written from its definition: in each of
    T+ = {A > 0} and T- = {A < 0} (C2 only) the ceil(P n) tokens of highest surprisal -log p get W
    (resp. M), every other response token 1, padding 0; all 1 when the gate is off."""
    flat = [
        (s.logprob.double().reshape(-1), s.advantages.double().reshape(-1), s.response_mask.reshape(-1)) for s in micro
    ]
    lp = torch.cat([f[0] for f in flat])
    adv = torch.cat([f[1] for f in flat])
    real = torch.cat([f[2] for f in flat])
    weights = real.double()
    if gate_on:
        for sign, value in ((1, w), (-1, m)) if variant == "C2" else ((1, w),):
            members = torch.nonzero(real & (adv * sign > 0)).reshape(-1)
            k = math.ceil(Fraction(repr(p)) * len(members))
            order = torch.argsort(-lp[members], descending=True)  # by surprisal, highest first
            weights[members[order[:k]]] = value
    return weights.split([f[0].numel() for f in flat])


@pytest.mark.parametrize("variant", ["O1", "C2"])
@pytest.mark.parametrize("p", [0.1, 0.25, 1.0])
def test_stare_weights_match_fp64_reference_over_the_minibatch(variant, p):
    cfg = AlgoConfig(
        token_rule="stare", stare_variant=variant, stare_top_fraction=p, stare_weight_w=1.3, stare_weight_m=0.6
    )
    micro = _micro_batches()
    keeps = rule_keeps(cfg, micro)
    expected = reference_weights(micro, p, 1.3, 0.6, variant, gate_on=True)
    for keep, want in zip(keeps, expected, strict=True):
        assert keep.dtype == torch.float32
        assert torch.equal(keep.reshape(-1).double(), want.float().double()), (variant, p)
    lifted = sum(int((k == 1.3).sum()) for k in keeps)
    positives = sum(int((s.response_mask & (s.advantages > 0)).sum()) for s in micro)
    assert lifted == math.ceil(Fraction(repr(p)) * positives) > 0
    lowered = sum(int((k == 0.6).sum()) for k in keeps)
    assert (lowered > 0) == (variant == "C2")
    # zero-advantage tokens and the rest stay at 1, padding at 0
    for keep, s in zip(keeps, micro):
        assert torch.all(keep[~s.response_mask] == 0)
        assert torch.all(keep[s.response_mask & (s.advantages == 0)] == 1)


def test_stare_gate_is_strict_and_turns_the_rule_into_grpo():
    cfg = AlgoConfig(token_rule="stare", stare_target_entropy=0.5)
    below = _micro_batches(step_entropy=0.499)
    at = _micro_batches(step_entropy=0.5)
    assert any(bool((k > 1).any()) for k in rule_keeps(cfg, below))
    for keep, s in zip(rule_keeps(cfg, at), at):  # the reference reweights only when H < H_tgt
        assert torch.equal(keep, s.response_mask.float())


def test_stare_micro_batch_scope_ranks_each_micro_batch_alone():
    cfg = AlgoConfig(token_rule="stare", scope="micro_batch", stare_variant="C2")
    micro = _micro_batches(seed=3)
    assert not needs_statistics_pass(cfg)
    for s in micro:
        keep = select_tokens(cfg, s, None).keep
        (want,) = reference_weights([s], 0.1, 1.1, 0.9, "C2", gate_on=True)
        assert torch.equal(keep.reshape(-1).double(), want.float().double())
    # the mini-batch scope differs from it on this data: the cut is global
    whole = rule_keeps(AlgoConfig(token_rule="stare", stare_variant="C2"), micro)
    assert any(not torch.equal(a, select_tokens(cfg, s, None).keep) for a, s in zip(whole, micro))


def test_stare_ties_at_the_cut_are_all_lifted():
    lp = torch.log(torch.tensor([[0.01, 0.01, 0.01, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99]]))
    s = TokenStats(
        lp, torch.ones_like(lp), torch.tensor([1.0]), torch.ones_like(lp, dtype=torch.bool), step_entropy=0.0
    )
    keep = select_tokens(AlgoConfig(token_rule="stare", scope="micro_batch"), s, None).keep
    # ceil(0.1 * 10) = 1 token at the cut, but three share its surprisal: all three get W
    assert torch.equal(keep, torch.tensor([[1.1, 1.1, 1.1] + [1.0] * 7]))


def test_stare_loss_and_gradient_match_fp64_reference():
    """PolicyLoss with STARE's weights: sum_t w_t * clipped surrogate_t (dual-clip included) over
    the number of response tokens, against fp64 autograd of the same formula."""
    cfg = AlgoConfig(token_rule="stare", stare_variant="C2", clip_ratio_c=3.0)
    micro = _micro_batches(seed=7)
    keeps = rule_keeps(cfg, micro)
    gen = torch.Generator().manual_seed(1)
    total, count, grads, ref_total, ref_grads = 0.0, 0, [], 0.0, []
    ref_count = sum(int(s.response_mask.sum()) for s in micro)
    for s, keep in zip(micro, keeps):
        old = s.logprob + torch.randn(s.logprob.shape, generator=gen) * 0.4  # ratios beyond both clips
        lp = s.logprob.clone().requires_grad_()
        loss_sum, n, _ = loss_of(lp, old, s.advantages, keep, clip_ratio_c=3.0, response_mask=s.response_mask)
        loss_sum.backward()
        total, count = total + float(loss_sum.detach()), count + int(n)
        grads.append(lp.grad)

        lp64 = s.logprob.double().clone().requires_grad_()
        a = s.advantages.double()  # per token (TokenStats broadcasts)
        r = torch.exp(lp64 - old.double())
        pg = torch.maximum(-a * r, -a * r.clamp(0.8, 1.28))
        pg = torch.where(a < 0, torch.minimum(pg, -a * 3.0), pg)
        w = keep.double()
        ref = (w * pg)[s.response_mask].sum()
        ref.backward()
        ref_total += float(ref.detach())
        ref_grads.append(lp64.grad)
    assert count == ref_count  # the weights never change the normalisation
    assert math.isclose(total / count, ref_total / ref_count, rel_tol=1e-5)
    for g, want in zip(grads, ref_grads):
        assert torch.allclose(g.double(), want, rtol=1e-5, atol=1e-7)
    assert any(bool((k == 0.9).any()) for k in keeps) and any(bool((k == 1.1).any()) for k in keeps)


def test_stare_needs_the_step_entropy_and_its_threshold():
    cfg = AlgoConfig(token_rule="stare")
    micro = _micro_batches(step_entropy=None)
    cuts = minibatch_threshold(cfg, micro)
    with pytest.raises(ValueError, match="^step_entropy: the stare rule's gate"):
        select_tokens(cfg, micro[0], cuts)
    with pytest.raises(ValueError, match="^threshold: the 'stare' rule in the mini_batch scope"):
        select_tokens(cfg, _micro_batches()[0], None)


def test_stare_never_skips_zero_advantage_sequences():
    # the gate's entropy is the mean over every response token of the step, zero advantages included
    assert not zero_advantage_skippable(AlgoConfig(token_rule="stare"))
    assert zero_advantage_skippable(AlgoConfig(token_rule="all"))


def test_stare_preset_is_the_reference_script():
    stare, dapo = build(AlgoConfig, "stare"), build(AlgoConfig, "dapo_dynamic_sampling")
    assert (stare.token_rule, stare.stare_variant, stare.stare_top_fraction) == ("stare", "O1", 0.1)
    assert (stare.stare_weight_w, stare.stare_weight_m, stare.stare_target_entropy) == (1.1, 0.9, 0.3)
    # the script's base: DAPO's clip_ratio_c 10 and filter_groups, on a 0/1 reward, no overlong buffer
    differing = {
        f
        for f in (
            "token_rule",
            "reward_scale",
            "overlong_shaping",
            "clip_ratio_c",
            "dynamic_sampling",
            "eps_low",
            "eps_high",
            "aggregation",
            "kl_coef",
            "entropy_coef",
        )
        if getattr(stare, f) != getattr(dapo, f)
    }
    assert differing == {"token_rule", "reward_scale", "overlong_shaping"}
    assert (stare.reward_scale, stare.overlong_shaping, stare.scope) == ("binary", False, "mini_batch")


@pytest.mark.parametrize(
    "override, match",
    [
        ({"stare_variant": "O2"}, "^algo.stare_variant: 'O2' is not one of"),
        ({"stare_top_fraction": 0}, "^algo.stare_top_fraction:"),
        ({"stare_top_fraction": 1.5}, "^algo.stare_top_fraction:"),
        ({"stare_weight_w": 0}, "^algo.stare_weight_w:"),
        ({"stare_weight_m": -0.5}, "^algo.stare_weight_m:"),
        ({"stare_target_entropy": -1}, "^algo.stare_target_entropy:"),
    ],
)
def test_stare_fields_are_checked(override, match):
    with pytest.raises(ConfigError, match=match):
        build(AlgoConfig, {"preset": "stare", **override}, "algo")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("related_distributed")
    spawn_ranks(_related_workers.run_checks, 2, str(out))
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    assert len(ranks) == 2
    return ranks


@pytest.mark.parametrize("check", list(_related_workers.CHECKS))
def test_distributed(outcomes, check):
    failures = [f"rank {r}:\n{o[check]}" for r, o in enumerate(outcomes) if o[check] != "ok"]
    assert not failures, "\n".join(failures)
