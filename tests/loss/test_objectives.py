"""The policy objectives (loss.objectives) against fp64 references written here from the papers'
formulas: Clip-Cov and KL-Cov (Cui et al. 2025, arXiv 2505.22617), GSPO (Zheng et al. 2025,
arXiv 2507.18071); loss value and gradient w.r.t. the log-probs, packed rows, the zero-advantage
skip, the config checks and the presets. TP=2: test_objectives_tp (2 gloo ranks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from stapo_megatron.config import ConfigError, build
from stapo_megatron.loss import (
    AlgoConfig,
    get_objective,
    reduce_metrics,
    token_seed,
    zero_advantage_skippable,
)
from stapo_megatron.loss.objectives import SurrogateInputs
from tests.loss._loss_call import loss_of

# ---------------------------------------------------------------------------------------------
# fp64 references from the papers' definitions
# ---------------------------------------------------------------------------------------------


def ref_covariance(adv, lp, mask):
    """Cov_t = (A_t - mean A)(log pi_t - mean log pi), means over the masked tokens (Eq. of Sec. 4)."""
    return (adv - adv[mask].mean()) * (lp - lp[mask].mean())


def ref_ppo_terms(lp, old, adv, eps_low, eps_high, c):
    r = torch.exp(lp - old)
    pg = torch.maximum(-adv * r, -adv * r.clamp(1 - eps_low, 1 + eps_high))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * c), pg)
    clipped = -adv * r.clamp(1 - eps_low, 1 + eps_high) > -adv * r
    return pg, clipped


def ref_clip_cov_candidates(lp, old, adv, mask, cfg):
    _, clipped = ref_ppo_terms(lp, old, adv, cfg.eps_low, cfg.eps_high, cfg.clip_ratio_c)
    cov = ref_covariance(adv, lp, mask)
    return mask & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)


def ref_clip_cov_loss(lp, old, adv, mask, cfg, detached):
    """L = mean over the masked tokens of the PPO term, 0 on the detached tokens (which stay in the count)."""
    pg, _ = ref_ppo_terms(lp, old, adv, cfg.eps_low, cfg.eps_high, cfg.clip_ratio_c)
    return torch.where(detached, 0.0, pg)[mask].sum() / mask.sum()


def ref_kl_cov(lp, old, adv, mask, cfg):
    """L = mean over the masked tokens of -A r, plus beta |log r| on the top-k tokens by Cov."""
    n = int(mask.sum())
    k = max(math.floor(cfg.kl_cov_ratio * n), 1)
    cov = ref_covariance(adv, lp.detach(), mask)
    flat = torch.where(mask, cov, -math.inf).reshape(-1)
    top = torch.zeros(flat.numel(), dtype=torch.bool)
    top[flat.argsort(descending=True)[:k]] = True
    top = top.view(mask.shape)
    term = -adv * torch.exp(lp - old) + torch.where(top, cfg.kl_cov_coef * (lp - old).abs(), 0.0)
    return term[mask].sum() / n, top


def ref_gspo(lp, old, adv_per_seq, masks, cfg):
    """J = mean_i min(s_i A_i, clip(s_i) A_i) with s_i = exp(mean_t log(pi / pi_old)) over sequence
    i's tokens (and veRL's dual-clip cap for A < 0); returns the loss -J. ``masks``: one bool mask per
    sequence over the flat tokens."""
    losses = []
    for a, m in zip(adv_per_seq, masks):
        s = torch.exp((lp[m] - old[m]).mean())
        term = torch.maximum(-a * s, -a * s.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
        if a < 0:
            term = torch.minimum(term, -a * cfg.clip_ratio_c)
        losses.append(term)
    return torch.stack(losses).mean()


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


def _batch(seed=0, rows=6, cols=40, spread=0.3):
    """Log-probs spread over [-8, 0], old log-probs near them, advantages +-1 per sequence (and 0
    for one), ragged response masks."""
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 8
    old = lp + torch.randn(rows, cols, generator=gen, dtype=torch.float64) * spread
    adv = torch.tensor([1.2, -0.8, 1.2, -0.8, 0.0, 0.5], dtype=torch.float64)[:rows]
    lengths = torch.randint(cols // 2, cols + 1, (rows,), generator=gen)
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    return lp, old, adv, mask


def _ours(lp, old, adv, mask, cfg, **kw):
    """PolicyLoss of the objective in ``cfg`` on fp32 inputs; returns (loss, n, metrics, grad)."""
    x = lp.float().clone().requires_grad_()
    loss_sum, n, metrics = loss_of(
        x,
        old.float(),
        adv.float(),
        mask.float(),
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        clip_ratio_c=cfg.clip_ratio_c,
        aggregation=cfg.aggregation,
        response_mask=mask,
        objective=cfg.objective,
        cfg=cfg,
        **kw,
    )
    (loss_sum / n).backward()
    return loss_sum / n, n, metrics, x.grad


def _ref_grad(fn, lp):
    x = lp.clone().requires_grad_()
    out = fn(x)
    (out[0] if isinstance(out, tuple) else out).backward()
    return x.grad


def _close(ours, ref, what, tol=2e-6):
    diff = (ours.double() - ref.double()).abs().max().item()
    scale = max(ref.double().abs().max().item(), 1.0)
    assert diff <= tol * scale, f"{what}: max difference {diff:.3g} (scale {scale:.3g})"


def _selected(lp, old, adv, mask, cfg, seed=0):
    """The objective's own token choice on the same inputs PolicyLoss gets."""
    advantages = adv.float()[:, None].expand_as(lp).contiguous()
    log_ratio = torch.where(mask, lp.float() - old.float(), 0.0).clamp(-20, 20)
    return (
        get_objective(cfg.objective)
        .surrogate(
            SurrogateInputs(
                lp.float(),
                log_ratio,
                advantages,
                mask,
                cfg.eps_low,
                cfg.eps_high,
                cfg.clip_ratio_c,
                20.0,
                None,
                cfg,
                seed,
            )
        )
        .selected
    )


# ---------------------------------------------------------------------------------------------
# Clip-Cov
# ---------------------------------------------------------------------------------------------


def test_clip_cov_detaches_every_candidate_within_budget_against_reference():
    lp, old, adv, mask = _batch(seed=1)
    # budget 0.2 * n exceeds the candidate count: the choice is every candidate, no randomness
    cfg = AlgoConfig(objective="clip_cov", token_rule="all", clip_cov_ratio=0.2, clip_cov_lb=1.0, clip_cov_ub=5.0)
    cand = ref_clip_cov_candidates(lp, old, adv[:, None].expand_as(lp), mask, cfg)
    assert 3 <= int(cand.sum()) <= math.floor(0.2 * int(mask.sum())), int(cand.sum())
    loss, n, metrics, grad = _ours(lp, old, adv, mask, cfg)
    a = adv[:, None].expand_as(lp)
    ref = lambda x: ref_clip_cov_loss(x, old, a, mask, cfg, cand)  # noqa: E731
    _close(loss, ref(lp), "clip_cov loss")
    _close(grad, _ref_grad(ref, lp), "clip_cov gradient")
    assert int(n) == int(mask.sum())  # detached tokens stay in the token count (the reference's corr * loss)
    assert (grad[cand] == 0).all() and (grad[mask & ~cand & (a != 0)] != 0).any()
    assert float(metrics["cov_selected_tokens"]) == float(metrics["cov_candidate_tokens"]) == float(cand.sum())
    # without the objective (ppo_clip) the same tokens do carry a gradient: the test tells them apart
    _, _, _, plain = _ours(lp, old, adv, mask, AlgoConfig(token_rule="all"))
    assert (plain[cand] != 0).all()


def test_clip_cov_random_pick_is_seeded_and_sized():
    lp, old, adv, mask = _batch(seed=2, rows=6, cols=400)
    cfg = AlgoConfig(objective="clip_cov", token_rule="all", clip_cov_ratio=0.002)
    a = adv[:, None].expand_as(lp)
    cand = ref_clip_cov_candidates(lp, old, a, mask, cfg)
    budget = max(math.floor(0.002 * int(mask.sum())), 1)
    assert int(cand.sum()) > budget
    picks = [_selected(lp, old, adv, mask, cfg, seed) for seed in (0, 0, 1)]
    assert torch.equal(picks[0], picks[1]) and not torch.equal(picks[0], picks[2])
    for pick in picks:
        assert int(pick.sum()) == budget and not (pick & ~cand).any()
    loss, _, _, grad = _ours(lp, old, adv, mask, cfg, objective_seed=1)
    ref = lambda x: ref_clip_cov_loss(x, old, a, mask, cfg, picks[2])  # noqa: E731
    _close(loss, ref(lp), "clip_cov loss, random pick")
    _close(grad, _ref_grad(ref, lp), "clip_cov gradient, random pick")


def test_token_seed_depends_on_the_tokens_only():
    labels = torch.tensor([[5, 9, 1, 1]])
    assert token_seed(labels) == token_seed(labels.clone())
    assert token_seed(labels) != token_seed(torch.tensor([[9, 5, 1, 1]]))
    assert 0 <= token_seed(torch.tensor([[151935] * 4096])) < 2**31 - 1


# ---------------------------------------------------------------------------------------------
# KL-Cov
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.002, 0.05])
def test_kl_cov_against_reference(ratio):
    lp, old, adv, mask = _batch(seed=3, cols=100)
    cfg = AlgoConfig(objective="kl_cov", token_rule="all", kl_cov_ratio=ratio, kl_cov_coef=1.0)
    a = adv[:, None].expand_as(lp)
    loss, n, metrics, grad = _ours(lp, old, adv, mask, cfg)
    ref = lambda x: ref_kl_cov(x, old, a, mask, cfg)  # noqa: E731
    ref_loss, top = ref(lp)
    _close(loss, ref_loss, "kl_cov loss")
    _close(grad, _ref_grad(ref, lp), "kl_cov gradient")
    assert int(n) == int(mask.sum())
    assert float(metrics["cov_selected_tokens"]) == max(math.floor(ratio * int(mask.sum())), 1)
    assert torch.equal(_selected(lp, old, adv, mask, cfg), top)
    expected_penalty = (cfg.kl_cov_coef * (lp - old).abs())[top].sum()
    assert abs(float(metrics["kl_cov_penalty_sum"]) - float(expected_penalty)) < 1e-4
    # no ratio clip: far ratios keep their gradient -A r (ppo_clip would zero it)
    far = mask & ~top & (a > 0) & (torch.exp(lp - old) > 1 + cfg.eps_high)
    assert far.any() and (grad[far] != 0).all()
    assert (
        float(metrics["clip_high_tokens"])
        == float(metrics["clip_low_tokens"])
        == float(metrics["dual_clip_tokens"])
        == 0
    )


# ---------------------------------------------------------------------------------------------
# GSPO
# ---------------------------------------------------------------------------------------------


def _gspo_cfg(**kw):
    return AlgoConfig(
        objective="gspo", token_rule="all", aggregation="seq_mean_token_mean", eps_low=3e-4, eps_high=4e-4, **kw
    )


@pytest.mark.parametrize("spread", [0.0005, 0.05])  # inside the clip range / mostly clipped
def test_gspo_rows_against_sequence_reference(spread):
    lp, old, adv, mask = _batch(seed=4, spread=spread)
    old = torch.where(torch.arange(6)[:, None] == 2, lp + spread * 0.1, old)  # one sequence unclipped
    cfg = _gspo_cfg()
    loss, n, metrics, grad = _ours(lp, old, adv, mask, cfg)
    flat_masks = [mask & (torch.arange(6)[:, None] == i) for i in range(6)]
    ref = lambda x: ref_gspo(x, old, adv, flat_masks, cfg)  # noqa: E731
    _close(loss, ref(lp), "gspo loss")
    _close(grad, _ref_grad(ref, lp), "gspo gradient")
    assert int(n) == 6 and float(metrics["gspo_sequences"]) == 6
    s = torch.stack([torch.exp((lp[m] - old[m]).mean()) for m in flat_masks])
    clipped = ((adv > 0) & (s > 1 + 4e-4)) | ((adv < 0) & (s < 1 - 3e-4))
    assert float(metrics["gspo_clipped_sequences"]) == float(clipped.sum())
    # every token of a sequence gets the same gradient -A s_i / |y_i| (unclipped) or 0 (clipped)
    for i, m in enumerate(flat_masks):
        g = grad[m]
        assert torch.allclose(g, g[0].expand_as(g))
        expected = 0.0 if clipped[i] else float(-adv[i] * s[i] / m.sum() / 6)
        assert abs(float(g[0]) - expected) < 1e-6 * max(1.0, abs(expected))


def test_gspo_packed_rows_equal_one_row_per_sequence():
    lp, old, adv, mask = _batch(seed=5, spread=0.0003)
    cfg = _gspo_cfg()
    row_loss, row_n, _, row_grad = _ours(lp, old, adv, mask, cfg)
    # pack the 6 sequences' response tokens into one row, plus 3 padding tokens (own segment, mask 0)
    lengths = mask.sum(-1)
    flat = lambda t: torch.cat([t[i, : lengths[i]] for i in range(6)] + [torch.zeros(3, dtype=t.dtype)])[None]  # noqa: E731
    segments = torch.cat([torch.full((int(lengths[i]),), i) for i in range(6)] + [torch.full((3,), 6)])[None]
    packed_adv = flat(adv[:, None].expand_as(lp))
    packed_mask = flat(mask)
    x = flat(lp).float().clone().requires_grad_()
    loss_sum, n, _ = loss_of(
        x,
        flat(old).float(),
        packed_adv.float(),
        packed_mask.float(),
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        aggregation=cfg.aggregation,
        response_mask=packed_mask,
        segment_ids=segments,
        objective="gspo",
        cfg=cfg,
    )
    (loss_sum / n).backward()
    assert int(n) == int(row_n) == 6
    _close(loss_sum / n, row_loss, "gspo packed loss", tol=1e-6)
    _close(
        x.grad[0, : int(lengths.sum())], torch.cat([row_grad[i, : lengths[i]] for i in range(6)]), "gspo packed grad"
    )


def test_gspo_needs_rows_or_segments():
    # the config pairs gspo with seq_mean_token_mean, whose own check comes first in the loss: the objective alone
    flat = torch.zeros(8)
    with pytest.raises(ValueError, match="^logprob: gspo needs"):
        get_objective("gspo").surrogate(
            SurrogateInputs(flat, flat, torch.ones(8), torch.ones(8, dtype=torch.bool), 0.2, 0.28, 3.0, 20.0)
        )


# ---------------------------------------------------------------------------------------------
# zero-advantage skip: exact for GSPO, not allowed for the covariance methods
# ---------------------------------------------------------------------------------------------


def test_zero_advantage_skippable_per_objective():
    assert zero_advantage_skippable(AlgoConfig(token_rule="all"))
    assert zero_advantage_skippable(_gspo_cfg())
    assert not zero_advantage_skippable(AlgoConfig(token_rule="all", objective="clip_cov"))
    assert not zero_advantage_skippable(AlgoConfig(token_rule="all", objective="kl_cov"))


def test_skipping_zero_advantage_sequences_is_exact_for_gspo_and_not_for_kl_cov():
    lp, old, adv, mask = _batch(seed=6, spread=0.0003)
    keep = adv != 0  # sequence 4 has A = 0
    cfg = _gspo_cfg()
    full, _, _, full_grad = _ours(lp, old, adv, mask, cfg)
    x = lp[keep].float().clone().requires_grad_()
    loss_sum, n, _ = loss_of(
        x,
        old[keep].float(),
        adv[keep].float(),
        mask[keep].float(),
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        aggregation=cfg.aggregation,
        objective="gspo",
        cfg=cfg,
    )
    (loss_sum / (n + 1)).backward()  # the left-out sequence counts in the denominator, as the trainer adds it
    _close(loss_sum / (n + 1), full, "gspo loss without the A = 0 sequence", tol=1e-6)
    _close(x.grad, full_grad[keep], "gspo gradient without the A = 0 sequence", tol=1e-6)
    assert (full_grad[~keep] == 0).all()

    cfg = AlgoConfig(objective="kl_cov", token_rule="all", kl_cov_ratio=0.05)
    with_zero = _selected(lp, old, adv, mask, cfg)
    without = _selected(lp[keep], old[keep], adv[keep], mask[keep], cfg)
    # the covariance is centred on the mean advantage of every token, and k counts every token:
    # leaving the A = 0 sequence out changes which tokens of the others get the penalty
    assert not torch.equal(with_zero[keep], without)


# ---------------------------------------------------------------------------------------------
# composition with token rules, metrics, config, presets
# ---------------------------------------------------------------------------------------------


def test_objective_acts_on_the_tokens_the_rule_keeps_and_metrics_reduce():
    lp, old, adv, mask = _batch(seed=7, cols=100)
    cfg = AlgoConfig(objective="kl_cov", token_rule="all", kl_cov_ratio=0.05)
    keep = mask.clone()
    keep[0, :10] = False  # silenced by a token rule: out of the loss, the covariance and the count
    x = lp.float().clone().requires_grad_()
    _, n, m1 = loss_of(x, old.float(), adv.float(), keep.float(), response_mask=mask, objective="kl_cov", cfg=cfg)
    assert int(n) == int(keep.sum())
    ref_loss, top = ref_kl_cov(lp, old, adv[:, None].expand_as(lp), keep, cfg)
    assert not (top & ~keep).any()
    _, _, m2 = loss_of(x, old.float(), adv.float(), keep.float(), response_mask=mask, objective="kl_cov", cfg=cfg)
    total = reduce_metrics([m1, m2])
    assert float(total["cov_selected_tokens"]) == 2 * float(top.sum())


def test_config_checks_name_the_field():
    with pytest.raises(ConfigError, match="^algo.objective: unknown objective 'ppo'"):
        build(AlgoConfig, {"preset": "stapo", "objective": "ppo"}, "algo")
    with pytest.raises(ConfigError, match="^algo.clip_cov_lb: 5.0 must be below clip_cov_ub"):
        build(AlgoConfig, {"preset": "clip_cov", "clip_cov_lb": 5.0}, "algo")
    with pytest.raises(ConfigError, match="^algo.aggregation: objective gspo"):
        build(AlgoConfig, {"preset": "gspo", "aggregation": "token_mean"}, "algo")
    for field, value in (("clip_cov_ratio", 0), ("kl_cov_ratio", 1.5), ("kl_cov_coef", -1)):
        with pytest.raises(ConfigError, match=f"^algo.{field}:"):
            build(AlgoConfig, {"preset": "stapo", field: value}, "algo")


def test_presets_follow_the_reference_recipes():
    # the Cov recipes are DAPO's scripts with dynamic sampling, as their authors run them
    justrl, dapo = (build(AlgoConfig, name) for name in ("justrl", "dapo_dynamic_sampling"))
    clip_cov, kl_cov, gspo = (build(AlgoConfig, name) for name in ("clip_cov", "kl_cov", "gspo"))
    assert (clip_cov.objective, clip_cov.clip_cov_ratio, clip_cov.clip_cov_lb, clip_cov.clip_cov_ub) == (
        "clip_cov",
        2e-4,
        1.0,
        5.0,
    )
    assert (clip_cov.eps_low, clip_cov.eps_high, clip_cov.clip_ratio_c) == (1.0, 1.0, 10.0)
    assert (kl_cov.objective, kl_cov.kl_cov_ratio, kl_cov.kl_cov_coef) == ("kl_cov", 2e-3, 1.0)
    assert (kl_cov.eps_low, kl_cov.eps_high, kl_cov.clip_ratio_c) == (0.2, 0.2, 10.0)
    for cfg in (clip_cov, kl_cov):  # the authors' DAPO-based scripts, overlong buffer off
        assert cfg.dynamic_sampling and not cfg.overlong_shaping and cfg.reward_scale == "signed"
        assert (cfg.token_rule, cfg.aggregation, cfg.kl_coef, cfg.entropy_coef) == ("all", "token_mean", 0.0, 0.0)
    diff = lambda a, b: {f for f in AlgoConfig.__dataclass_fields__ if getattr(a, f) != getattr(b, f)}  # noqa: E731
    assert diff(dapo, clip_cov) == {"name", "objective", "eps_low", "eps_high", "overlong_shaping"}
    assert diff(dapo, kl_cov) == {"name", "objective", "eps_high", "overlong_shaping"}
    assert (gspo.objective, gspo.eps_low, gspo.eps_high, gspo.aggregation) == (
        "gspo",
        3e-4,
        4e-4,
        "seq_mean_token_mean",
    )
    assert diff(justrl, gspo) == {"name", "objective", "eps_low", "eps_high", "aggregation", "clip_ratio_c"}
    assert gspo.clip_ratio_c == 3.0  # veRL's default (GSPO has no dual-clip)


# ---------------------------------------------------------------------------------------------
# TP=2: the same selection and loss as TP=1 (2 gloo ranks)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp_outcomes(tmp_path_factory):
    from stapo_megatron.runtime.launch import spawn_ranks
    from tests.loss import _objective_workers

    out = tmp_path_factory.mktemp("objectives_tp")
    spawn_ranks(_objective_workers.run_checks, 2, str(out))
    return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


@pytest.mark.parametrize("objective", ["clip_cov", "kl_cov", "gspo"])
def test_objectives_tp(tp_outcomes, objective):
    assert len(tp_outcomes) == 2
    failures = [f"rank {r}:\n{o[objective]}" for r, o in enumerate(tp_outcomes) if o[objective] != "ok"]
    assert not failures, "\n".join(failures)
