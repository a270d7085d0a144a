"""The STAPO paper's masking ablations as token rules (s2t_high_entropy, s2t_random, lowprob_all)
against an fp64 reference written from the paper's description (tests/loss/_reference.py), their
budget (S2T's floor(q * #candidates), exactly), the random draw's independence of packing,
micro-batches, data-parallel split and resume, the config checks, q = 0.75, no silent threshold
defaults; and a 2-rank spawn: TP=2 equals TP=1 and fp64, DP=2 equals one process."""

from __future__ import annotations

import inspect
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
    quantile_threshold,
    related_rules,
    s2t_candidates,
    select_tokens,
    token_rules,
    zero_advantage_skippable,
)
from stapo_megatron.loss.token_rules import TOKEN_RULES, random_token_scores
from stapo_megatron.runtime.launch import spawn_ranks
from stapo_megatron.trainer.batch import balance_over_ranks, make_microbatches, pack_by_budget
from tests.loss import _ablation_workers, _related_workers
from tests.loss._ablation_workers import (
    ABLATIONS,
    RUN_SEED,
    STEP,
    candidate_count,
    layout_stats,
    rollout_step,
    silenced_tokens,
)
from tests.loss._reference import reference_ablation_keeps, reference_random_score, rule_keeps

TAU_P = 0.01  # rollout_step's rare tokens lie below it


def _cfg(rule, **fields):
    return AlgoConfig(token_rule=rule, **{"tau_p": TAU_P, **fields})


@pytest.fixture(scope="module")
def step():
    batch, lengths, logprob, entropy = rollout_step()
    everyone = list(range(len(batch)))
    return dict(
        batch=batch,
        lengths=lengths,
        logprob=logprob,
        entropy=entropy,
        everyone=everyone,
        packed=layout_stats(batch, logprob, entropy, pack_by_budget(everyone, lengths, 40)),
    )


def _budget(rule, q, candidates):
    return candidates if rule == "lowprob_all" else math.floor(Fraction(repr(q)) * candidates)


@pytest.mark.parametrize("q", [0.0, 0.29, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("rule", [*ABLATIONS, "s2t"])
def test_ablation_matches_fp64_reference_with_s2t_budget(step, rule, q):
    micro = step["packed"]
    entropies = torch.cat([s.entropy[s.response_mask != 0] for s in micro])
    assert entropies.unique().numel() == entropies.numel()  # distinct: the budget is exact
    cfg = _cfg(rule, q=q)
    keeps = rule_keeps(cfg, micro)
    for keep, want in zip(keeps, reference_ablation_keeps(rule, micro, q, TAU_P), strict=True):
        assert keep.dtype == torch.float32
        assert torch.equal(keep.reshape(-1).double(), want), (rule, q)
    candidates = candidate_count(cfg, micro)
    silenced = sum(int(((s.response_mask != 0) & (k == 0)).sum()) for s, k in zip(micro, keeps))
    assert candidates > 50 and silenced == _budget(rule, q, candidates)
    # only candidates are ever silenced: A <= 0 and common tokens keep weight 1, padding 0
    for s, k in zip(micro, keeps):
        real = s.response_mask != 0
        cand = s2t_candidates(s.logprob, s.advantages, s.response_mask, TAU_P)
        assert torch.all(k[real & ~cand] == 1) and torch.all(k[~real] == 0)


def test_high_entropy_silences_the_top_and_s2t_the_bottom_of_the_same_budget(step):
    micro = step["packed"]
    for q in (0.25, 0.5):
        low, high = (rule_keeps(_cfg(r, q=q), micro) for r in ("s2t", "s2t_high_entropy"))
        cand = [s2t_candidates(s.logprob, s.advantages, s.response_mask, TAU_P) for s in micro]
        off_low = torch.cat([s.entropy[c & (k == 0)] for s, c, k in zip(micro, cand, low)])
        off_high = torch.cat([s.entropy[c & (k == 0)] for s, c, k in zip(micro, cand, high)])
        kept_high = torch.cat([s.entropy[c & (k == 1)] for s, c, k in zip(micro, cand, high)])
        assert off_low.numel() == off_high.numel() > 0
        assert float(off_high.min()) > float(kept_high.max())
        assert float(off_high.min()) > float(off_low.max())  # disjoint for q <= 1/2
        # the s2t/tau_h metric of the ablation is that entropy cut: silenced above it, kept at or below
        threshold = minibatch_threshold(_cfg("s2t_high_entropy", q=q), micro)
        sel = select_tokens(_cfg("s2t_high_entropy", q=q), micro[0], threshold)
        assert float(sel.tau_h) == -float(threshold)
        assert float(off_high.min()) > float(sel.tau_h) >= float(kept_high.max())


@pytest.mark.parametrize("q", [0.0, 0.29, 0.5, 0.75, 1.0])
def test_the_complement_budget_silences_what_s2t_keeps_of_its_candidates(step, q):
    """budget complement: s2t_high_entropy silences exactly the candidates S2T keeps (H >= tau_h(q)),
    |C| - floor(q |C|) of them, and s2t_random that many at random; same_as_s2t stays S2T's budget."""
    micro = step["packed"]
    cand = [s2t_candidates(s.logprob, s.advantages, s.response_mask, TAU_P) for s in micro]
    s2t = rule_keeps(_cfg("s2t", q=q), micro)
    high = rule_keeps(_cfg("s2t_high_entropy", q=q, budget="complement"), micro)
    for s, c, k_s2t, k_high in zip(micro, cand, s2t, high, strict=True):
        real = s.response_mask != 0
        assert torch.equal(k_high[c] == 0, k_s2t[c] == 1)  # silenced = what S2T keeps, candidate by candidate
        assert torch.all(k_high[real & ~c] == 1) and torch.all(k_high[~real] == 0)
    candidates = candidate_count(_cfg("s2t", q=q), micro)
    complement = candidates - math.floor(Fraction(repr(q)) * candidates)
    for rule in ("s2t_high_entropy", "s2t_random"):
        keeps = rule_keeps(_cfg(rule, q=q, budget="complement"), micro)
        silenced = sum(int(((s.response_mask != 0) & (k == 0)).sum()) for s, k in zip(micro, keeps))
        assert silenced == complement, (rule, q)
    # the metric's entropy cut is S2T's own threshold then: silenced at or above it
    threshold = minibatch_threshold(_cfg("s2t_high_entropy", q=q, budget="complement"), micro)
    sel = select_tokens(_cfg("s2t_high_entropy", q=q, budget="complement"), micro[0], threshold)
    if sel.tau_h is not None and 0 < q < 1:
        assert float(sel.tau_h) == float(minibatch_threshold(_cfg("s2t", q=q), micro))


def test_rule_properties_and_metrics_threshold(step):
    assert set(TOKEN_RULES) >= {"all", "s2t", "high_entropy", "stare", *ABLATIONS}
    micro = step["packed"]
    for rule in ABLATIONS:
        cfg = _cfg(rule)
        assert needs_statistics_pass(cfg) == (rule != "lowprob_all")
        assert zero_advantage_skippable(cfg)  # candidates need A > 0; the random key reads no statistics
        threshold = minibatch_threshold(cfg, micro)
        for s in micro:
            sel = select_tokens(cfg, s, threshold)
            assert torch.equal(sel.candidates, s2t_candidates(s.logprob, s.advantages, s.response_mask, TAU_P))
            assert (sel.tau_h is None) == (rule != "s2t_high_entropy")
    s2t = select_tokens(_cfg("s2t"), micro[0], minibatch_threshold(_cfg("s2t"), micro))
    assert s2t.tau_h is s2t.threshold
    assert (
        select_tokens(_cfg("s2t_random"), micro[0], minibatch_threshold(_cfg("s2t_random"), micro)).threshold.dtype
        == torch.int64
    )


def test_random_scores_are_the_defined_permutation():
    ids = torch.tensor([0, 0, 1, 5, 2**31 - 1, 2**31 - 1, 123456789])
    pos = torch.tensor([0, 1, 0, 77, 0, 2**31 - 1, 987654321])
    for seed, step in ((0, 0), (RUN_SEED, STEP), (2**40 + 3, 99999)):
        got = random_token_scores(ids, pos, seed, step).tolist()
        assert got == [reference_random_score(i, p, seed, step) for i, p in zip(ids.tolist(), pos.tolist())]
        assert all(0 <= g < 2**62 for g in got)
    # a permutation: no two tokens of a step tie (64 sequences x 4096 positions)
    grid_ids = torch.arange(64).repeat_interleave(4096)
    grid_pos = torch.arange(4096).repeat(64)
    scores = random_token_scores(grid_ids, grid_pos, RUN_SEED, STEP)
    assert scores.unique().numel() == scores.numel()
    # another step or seed draws afresh (nearly uncorrelated ranks)
    for other in (
        random_token_scores(grid_ids, grid_pos, RUN_SEED, STEP + 1),
        random_token_scores(grid_ids, grid_pos, RUN_SEED + 1, STEP),
    ):
        r = torch.corrcoef(torch.stack([scores.double(), other.double()]))[0, 1]
        assert abs(float(r)) < 0.02


def test_random_draw_is_unbiased_in_entropy_and_position():
    """20,000 candidates, q = 0.5: in each entropy quartile and each position quartile about half
    are silenced (binomial sd 0.007 per quartile; the bound is 0.04)."""
    gen = torch.Generator().manual_seed(5)
    rows, cols = 40, 500
    stats = TokenStats(
        torch.full((rows, cols), math.log(1e-3)),
        torch.rand(rows, cols, generator=gen) * 3,
        torch.ones(rows),
        torch.ones(rows, cols, dtype=torch.bool),
        sample_ids=torch.arange(rows)[:, None].expand(rows, cols),
        positions=torch.arange(cols).expand(rows, cols),
        run_seed=RUN_SEED,
        step=STEP,
    )
    (keep,) = rule_keeps(_cfg("s2t_random", q=0.5), [stats])
    assert int((keep == 0).sum()) == rows * cols // 2
    off = (keep == 0).reshape(-1).double()
    for by in (stats.entropy.reshape(-1), stats.positions.reshape(-1).double()):
        order = torch.argsort(by)
        for part in order.chunk(4):
            assert abs(float(off[part].mean()) - 0.5) < 0.04


def test_random_mask_does_not_depend_on_layout_split_skip_or_resume(step):
    batch, lengths, lp, ent, everyone = (step[k] for k in ("batch", "lengths", "logprob", "entropy", "everyone"))
    cfg = _cfg("s2t_random")

    def silenced(micro):
        return silenced_tokens(cfg, micro, minibatch_threshold(cfg, micro) if micro else None)

    packed = silenced(step["packed"])
    padded = silenced(layout_stats(batch, lp, ent, [[i] for i in reversed(everyone)], packed=False))
    split = [pack_by_budget(part, lengths, 32) for part in balance_over_ranks(everyone, lengths, 3)]
    over_ranks = silenced([s for bins in split for s in layout_stats(batch, lp, ent, bins)])
    nonzero = [i for i in everyone if float(batch.advantages[i]) != 0]
    skipped = silenced(layout_stats(batch, lp, ent, pack_by_budget(nonzero, lengths, 64)))
    resumed = silenced(layout_stats(batch, lp, ent, pack_by_budget(everyone, lengths, 40)))
    assert packed == padded == over_ranks == skipped == resumed
    assert len(packed) == math.floor(Fraction(3, 4) * candidate_count(cfg, step["packed"])) > 0
    # the next step draws other tokens, as many; so does another run seed
    for fields in (dict(step=STEP + 1), dict(run_seed=RUN_SEED + 1)):
        other = silenced(layout_stats(batch, lp, ent, pack_by_budget(everyone, lengths, 40), **fields))
        assert len(other) == len(packed) and other != packed
    # the micro_batch scope spends each micro-batch's own budget
    local = _cfg("s2t_random", scope="micro_batch")
    for s in step["packed"]:
        off = int(((s.response_mask != 0) & (select_tokens(local, s, None).keep == 0)).sum())
        assert off == math.floor(Fraction(3, 4) * candidate_count(local, [s]))


def test_sample_ids_row_of_both_layouts(step):
    batch, lengths = step["batch"], step["lengths"]
    for packed in (True, False):
        for mb in make_microbatches(
            batch,
            pack_by_budget(step["everyone"], lengths, 40) + [[]],
            torch.device("cpu"),
            packed=packed,
            pad_to_multiple=8,
        ):
            ids, seg = mb["sample_ids"], mb["segment_ids"]
            assert ids.shape == seg.shape and ids.dtype == torch.long
            index = torch.cat([mb["sequence_index"], torch.tensor([-1])])
            real = seg < mb["sequence_index"].numel()
            if packed:
                assert torch.equal(ids, index[seg])
            else:  # one row per sequence; its padding columns are -1
                assert torch.equal(ids[mb["response_mask"] != 0], index[seg][mb["response_mask"] != 0])
            assert torch.all(ids[mb["response_mask"] != 0] >= 0)
            assert torch.all(ids[~real] == -1)


def test_random_rule_needs_each_tokens_identity(step):
    cfg = _cfg("s2t_random")
    s = max(step["packed"], key=lambda s: candidate_count(cfg, [s]))
    bare = TokenStats(s.logprob, s.entropy, s.advantages, s.response_mask)
    with pytest.raises(
        ValueError,
        match=r"^sample_ids: the s2t_random rule keys each token's draw .* lacks sample_ids, positions, run_seed, step",
    ):
        minibatch_threshold(cfg, [bare])
    no_step = TokenStats(
        s.logprob, s.entropy, s.advantages, s.response_mask, sample_ids=s.sample_ids, positions=s.positions, run_seed=1
    )
    with pytest.raises(ValueError, match="^step: the s2t_random rule"):
        select_tokens(_cfg("s2t_random", scope="micro_batch"), no_step, None)
    huge = TokenStats(
        s.logprob,
        s.entropy,
        s.advantages,
        s.response_mask,
        sample_ids=s.sample_ids + 2**31,
        positions=s.positions,
        run_seed=1,
        step=1,
    )
    with pytest.raises(
        ValueError, match=r"^sample_ids: the s2t_random rule needs sequence indices and positions in \[0, 2\^31\)"
    ):
        minibatch_threshold(cfg, [huge])
    with pytest.raises(ValueError, match="^sample_ids: shape"):
        TokenStats(s.logprob, s.entropy, s.advantages, s.response_mask, sample_ids=s.sample_ids[..., :-1])
    with pytest.raises(ValueError, match="^positions: must be an integer tensor"):
        TokenStats(s.logprob, s.entropy, s.advantages, s.response_mask, positions=s.positions.float())


@pytest.mark.parametrize(
    "override, match",
    [
        ({"token_rule": "s2t_random", "tau_h": 0.4}, r"^algo.tau_h: the s2t_random rule has no entropy threshold"),
        ({"token_rule": "s2t_high_entropy", "tau_h": 0.4}, r"^algo.tau_h: the s2t_high_entropy rule"),
        (
            {"token_rule": "lowprob_all", "population": "all_response_tokens"},
            r"^algo.population: the lowprob_all rule acts on S2T's candidates only",
        ),
        ({"token_rule": "s2t_random", "population": "all_response_tokens"}, r"^algo.population: the s2t_random rule"),
        (
            {"token_rule": "s2t", "budget": "complement"},
            r"^algo.budget: complement is for the masking ablations \(s2t_high_entropy, s2t_random\), not token_rule "
            "s2t$",
        ),
    ],
)
def test_ablation_config_checks(override, match):
    with pytest.raises(ConfigError, match=match):
        build(AlgoConfig, {"preset": "stapo", **override}, "algo")


def test_paper_q_and_no_silent_threshold_defaults():
    assert AlgoConfig().q == 0.75  # STAPO v1, Settings: "tau_p = 0.002 and q = 75%"
    assert AlgoConfig().tau_p == 0.002
    for name in ("s2t_mask", "high_entropy_mask"):  # the second way in beside the registry is gone
        assert not hasattr(token_rules, name)
    thresholds = {"tau_p", "q", "population", "top_fraction", "variant", "weight_w", "weight_m"}
    for fn in (
        token_rules.s2t_candidates,
        token_rules.s2t_threshold,
        token_rules.high_entropy_threshold,
        related_rules.stare_surprisal_cuts,
        related_rules.stare_weights,
    ):
        params = inspect.signature(fn).parameters
        defaulted = {p for p in thresholds & set(params) if params[p].default is not inspect.Parameter.empty}
        assert not defaulted, f"{fn.__name__}: {defaulted} have defaults"


def test_integer_quantile_is_exact_where_fp32_would_tie():
    values = torch.tensor([2**60 + i for i in (7, 3, 9, 1, 5, 0, 8, 2, 6, 4)])
    assert values.float().unique().numel() == 1  # fp32 would make them all one value
    for q in (0.0, 0.3, 0.75, 1.0):
        threshold = quantile_threshold(values.split(3), q)
        assert threshold.dtype == torch.int64
        assert int((values < threshold).sum()) == math.floor(Fraction(repr(q)) * 10)
    assert int(quantile_threshold(torch.zeros(0, dtype=torch.long), 0.5)) == torch.iinfo(torch.int64).max


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("ablation_distributed")
    spawn_ranks(_related_workers.run_checks, 2, str(out), "tests.loss._ablation_workers")
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    assert len(ranks) == 2
    return ranks


@pytest.mark.parametrize("check", list(_ablation_workers.CHECKS))
def test_distributed(outcomes, check):
    failures = [f"rank {r}:\n{o[check]}" for r, o in enumerate(outcomes) if o[check] != "ok"]
    assert not failures, "\n".join(failures)
