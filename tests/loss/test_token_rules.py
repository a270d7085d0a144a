"""S2T, 20-Entropy, the exact quantile, the rule registry and the scopes, on hand-built cases."""

from __future__ import annotations

import math
import random

import pytest
import torch

from stapo_megatron.loss import (
    AlgoConfig,
    TokenRule,
    TokenStats,
    get_token_rule,
    minibatch_threshold,
    needs_statistics_pass,
    quantile_threshold,
    register_token_rule,
    s2t_candidates,
    select_tokens,
)
from stapo_megatron.loss.token_rules import TOKEN_RULES
from tests.loss._reference import rule_keeps

RARE = math.log(0.001)  # p = 0.001 < tau_p = 0.002
COMMON = math.log(0.5)
TAU_P = 0.002


def s2t_mask(logprob, entropy, advantages, response_mask, **fields):
    """S2T's keep mask of one batch through the registry (one threshold over the whole batch)."""
    cfg = AlgoConfig(**{"tau_p": TAU_P, **fields})
    return rule_keeps(cfg, [TokenStats(logprob, entropy, advantages, response_mask)])[0]


def high_entropy_mask(entropy, response_mask, top_fraction):
    cfg = AlgoConfig(token_rule="high_entropy", top_fraction=top_fraction)
    zeros = torch.zeros_like(entropy)
    return rule_keeps(cfg, [TokenStats(zeros, entropy, zeros, response_mask)])[0]


def _row(logprobs, entropies, mask=None):
    n = len(logprobs)
    return (
        torch.tensor([logprobs], dtype=torch.float32),
        torch.tensor([entropies], dtype=torch.float32),
        torch.tensor([mask if mask is not None else [1] * n], dtype=torch.bool),
    )


def test_exactly_the_bottom_q_of_candidates_are_silenced():
    # 10 rare tokens of a positive-advantage response, distinct entropies in shuffled order
    entropies = [0.9, 0.1, 0.5, 0.3, 1.0, 0.7, 0.2, 0.8, 0.4, 0.6]
    lp, ent, mask = _row([RARE] * 10, entropies)
    keep = s2t_mask(lp, ent, torch.tensor([1.0]), mask, q=0.8)
    silenced = sorted(e for e, k in zip(entropies, keep[0].tolist()) if k == 0)
    assert silenced == sorted(entropies)[:8]  # floor(0.8 * 10) = 8 lowest, the top 2 kept
    assert keep.dtype == torch.float32

    # 7 candidates: floor(0.8 * 7) = 5 silenced; q = 0.29 on 100 candidates: exactly 29 (no float slip)
    lp, ent, mask = _row([RARE] * 7, [0.7, 0.1, 0.6, 0.2, 0.5, 0.3, 0.4])
    assert int((s2t_mask(lp, ent, torch.tensor([2.0]), mask, q=0.8) == 0).sum()) == 5
    gen = torch.Generator().manual_seed(0)
    ent = torch.randperm(100, generator=gen).float()[None] / 100
    keep = s2t_mask(torch.full((1, 100), RARE), ent, torch.tensor([1.0]), torch.ones(1, 100, dtype=torch.bool), q=0.29)
    assert int((keep == 0).sum()) == 29
    assert torch.equal(keep[0] == 0, ent[0] < 0.29)


def test_only_positive_advantage_rare_tokens_can_be_silenced():
    # row 0: A < 0, rare, tiny entropy; row 1: A > 0 but common, tiny entropy; row 2: A = 0
    lp = torch.tensor([[RARE, RARE], [COMMON, COMMON], [RARE, RARE]])
    ent = torch.full((3, 2), 1e-3)
    mask = torch.ones(3, 2, dtype=torch.bool)
    adv = torch.tensor([-1.0, 1.0, 0.0])
    assert torch.equal(s2t_mask(lp, ent, adv, mask), torch.ones(3, 2))
    assert not s2t_candidates(lp, adv, mask, TAU_P).any()
    # p exactly at tau_p is not rare (strict inequality)
    lp_edge = torch.full((1, 3), math.log(0.002), dtype=torch.float64)
    assert not s2t_candidates(lp_edge, torch.tensor([1.0]), torch.ones(1, 3), TAU_P).any()


def test_no_candidates_and_padding():
    lp, ent, _ = _row([COMMON] * 4, [0.1, 0.2, 0.3, 0.4])
    mask = torch.tensor([[1, 1, 1, 0]])
    keep = s2t_mask(lp, ent, torch.tensor([1.0]), mask)
    assert keep.tolist() == [[1.0, 1.0, 1.0, 0.0]]  # nothing silenced; padding never kept

    # all-padding rows contribute nothing and change nothing for the others
    lp = torch.full((3, 5), RARE)
    ent = torch.arange(15, dtype=torch.float32).view(3, 5) / 15
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1] = True
    adv = torch.tensor([1.0, 1.0, 1.0])
    keep = s2t_mask(lp, ent, adv, mask, q=0.8)
    assert keep[0].sum() == 0 and keep[2].sum() == 0
    assert keep[1].tolist() == [0, 0, 0, 0, 1]  # floor(0.8 * 5) = 4 silenced within the one real row
    assert torch.equal(s2t_mask(lp, ent, adv, torch.zeros(3, 5)), torch.zeros(3, 5))
    # the paper's q = 0.75 is the default: floor(0.75 * 5) = 3
    assert s2t_mask(lp, ent, adv, mask)[1].tolist() == [0, 0, 0, 1, 1]


def test_ties_are_kept_and_order_does_not_matter():
    # entropies 1,1,1,1,2 with q = 0.5: threshold = 3rd smallest = 1; nothing is strictly below it
    lp, ent, mask = _row([RARE] * 5, [1.0, 1.0, 2.0, 1.0, 1.0])
    assert torch.equal(s2t_mask(lp, ent, torch.tensor([1.0]), mask, q=0.5), torch.ones(1, 5))
    # a tie below the threshold is silenced in full
    lp, ent, mask = _row([RARE] * 5, [0.5, 0.5, 2.0, 3.0, 4.0])
    assert s2t_mask(lp, ent, torch.tensor([1.0]), mask, q=0.5).tolist() == [[0, 0, 1, 1, 1]]
    gen = random.Random(0)
    values = [gen.choice([0.1, 0.2, 0.3, 0.4]) for _ in range(50)]
    reference = quantile_threshold(torch.tensor(values), 0.8)
    for _ in range(5):
        gen.shuffle(values)
        assert quantile_threshold(torch.tensor(values), 0.8) == reference


def test_quantile_threshold_matches_its_definition():
    gen = torch.Generator().manual_seed(1)
    for n in (0, 1, 2, 5, 10, 37):
        values = torch.randn(n, generator=gen)
        parts = list(values.split(max(1, n // 3))) if n else [values]
        for q in (0.0, 0.2, 0.5, 0.8, 1.0):
            threshold = quantile_threshold(parts, q)
            k = math.floor(round(q * 10) * n / 10)  # q has one decimal here: exact
            assert int((values < threshold).sum()) == k, (n, q)
            if k < n:
                assert threshold == values.sort().values[k]
            else:
                assert threshold == float("inf")
    with pytest.raises(ValueError, match="^q: must be in"):
        quantile_threshold(torch.ones(3), 1.5)


def test_population_fixed_threshold_and_per_sequence_advantages():
    lp = torch.tensor([[RARE, COMMON, RARE, COMMON], [RARE, RARE, COMMON, COMMON]])
    ent = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]])
    mask = torch.ones(2, 4, dtype=torch.bool)
    adv_seq = torch.tensor([1.0, -1.0])
    adv_tok = adv_seq[:, None].expand(2, 4)
    # candidates: (0,0) H=.1 and (0,2) H=.3; floor(.5*2) = 1 silenced: (0,0)
    keep = s2t_mask(lp, ent, adv_seq, mask, q=0.5)
    assert keep.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    assert torch.equal(keep, s2t_mask(lp, ent, adv_tok, mask, q=0.5))
    # all response tokens: tau_h = 5th smallest of 8 = 0.5 (q = 0.5): both candidates lie below
    keep = s2t_mask(lp, ent, adv_seq, mask, q=0.5, population="all_response_tokens")
    assert keep.tolist() == [[0, 1, 0, 1], [1, 1, 1, 1]]
    # fixed tau_h
    assert s2t_mask(lp, ent, adv_seq, mask, tau_h=0.2).tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    assert s2t_mask(lp, ent, adv_seq, mask, tau_h=0.05).tolist() == [[1] * 4, [1] * 4]
    with pytest.raises(ValueError, match="^population:"):
        s2t_mask(lp, ent, adv_seq, mask, population="everything")
    with pytest.raises(ValueError, match=r"^advantages: shape \(3,\)"):
        s2t_mask(lp, ent, torch.ones(3), mask)


def test_high_entropy_mask_keeps_exactly_the_top_fraction():
    gen = torch.Generator().manual_seed(2)
    for n_real in (10, 7, 1, 23):
        ent = torch.rand(3, 10, generator=gen)
        mask = torch.zeros(3, 10, dtype=torch.bool)
        mask.view(-1)[torch.randperm(30, generator=gen)[:n_real]] = True
        ent[~mask] = 10.0  # high-entropy padding must not be kept nor count
        keep = high_entropy_mask(ent, mask, top_fraction=0.2)
        k = math.ceil(0.2 * n_real)
        assert int(keep.sum()) == k
        kept_values = ent[keep.bool()]
        assert torch.equal(kept_values.sort().values, ent[mask].sort().values[-k:])
    with pytest.raises(ValueError, match="^top_fraction:"):
        high_entropy_mask(ent, mask, top_fraction=0.0)


def test_registry():
    assert set(TOKEN_RULES) >= {"all", "s2t", "high_entropy"}
    with pytest.raises(ValueError, match="^token_rule: unknown rule 'nope'"):
        get_token_rule("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_token_rule(TokenRule())

    class Halve(TokenRule):  # a new rule is one class plus a config naming it
        name = "test_halve"

        def keep(self, stats, cfg, threshold):
            return 0.5 * stats.response_mask.float()

    register_token_rule(Halve())
    try:
        cfg = AlgoConfig(token_rule="test_halve")
        stats = TokenStats(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.tensor([[1, 0]]))
        assert select_tokens(cfg, stats).keep.tolist() == [[0.5, 0.0]]
        assert not needs_statistics_pass(cfg)
    finally:
        del TOKEN_RULES["test_halve"]


def _stats(seed, rows=3, cols=6):
    gen = torch.Generator().manual_seed(seed)
    lp = torch.where(torch.rand(rows, cols, generator=gen) < 0.6, RARE, COMMON)
    ent = torch.rand(rows, cols, generator=gen)
    adv = torch.tensor([1.0, -1.0, 2.0])[:rows]
    mask = torch.rand(rows, cols, generator=gen) < 0.9
    return TokenStats(lp, ent, adv, mask)


def test_scopes_threshold_then_keep():
    micro = [_stats(s) for s in range(3)]
    stapo = AlgoConfig()
    assert needs_statistics_pass(stapo)
    threshold = minibatch_threshold(stapo, micro)
    # the mini-batch threshold is the one over the concatenated mini-batch
    cat = TokenStats(
        *(torch.cat([getattr(s, f) for s in micro]) for f in ("logprob", "entropy", "advantages", "response_mask"))
    )
    whole = s2t_mask(cat.logprob, cat.entropy, cat.advantages, cat.response_mask)
    keeps = [select_tokens(stapo, s, threshold).keep for s in micro]
    assert torch.equal(torch.cat(keeps), whole)
    with pytest.raises(ValueError, match="^threshold: the 's2t' rule in the mini_batch scope"):
        select_tokens(stapo, micro[0])

    local = AlgoConfig(scope="micro_batch")
    assert not needs_statistics_pass(local) and minibatch_threshold(local, micro) is None
    for s in micro:
        sel = select_tokens(local, s, threshold)  # the given threshold is ignored in this scope
        assert torch.equal(sel.keep, s2t_mask(s.logprob, s.entropy, s.advantages, s.response_mask))
        assert torch.equal(sel.candidates, s2t_candidates(s.logprob, s.advantages, s.response_mask, local.tau_p))

    fixed = AlgoConfig(tau_h=0.5)
    assert not needs_statistics_pass(fixed)
    sel = select_tokens(fixed, micro[0])
    assert float(sel.threshold) == 0.5
    assert torch.equal(
        sel.keep, s2t_mask(micro[0].logprob, micro[0].entropy, micro[0].advantages, micro[0].response_mask, tau_h=0.5)
    )

    grpo = AlgoConfig(token_rule="all")
    assert not needs_statistics_pass(grpo)
    sel = select_tokens(grpo, micro[0])
    assert sel.threshold is None and sel.candidates is None
    assert torch.equal(sel.keep, micro[0].response_mask.float())
