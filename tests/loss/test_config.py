"""AlgoConfig and the presets in configs/algo: fields, checks, and the behaviour each preset documents."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from stapo_megatron.config import ConfigError, build, read_yaml
from stapo_megatron.loss import (
    AlgoConfig,
    TokenStats,
    minibatch_threshold,
    needs_statistics_pass,
    resolve_rollout_correction,
    select_tokens,
)
from tests.loss._reference import rule_keeps

PRESETS = (
    "stapo",
    "grpo",
    "dapo",
    "dapo_dynamic_sampling",
    "entropy20",
    "entropy20_dynamic_sampling",
    "justrl",
    "stare",
    "clip_cov",
    "kl_cov",
    "gspo",
)
PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "algo"
FIELDS = {f.name for f in dataclasses.fields(AlgoConfig)}


def _differences(a: AlgoConfig, b: AlgoConfig) -> set[str]:
    return {f for f in FIELDS if getattr(a, f) != getattr(b, f)}


def test_every_preset_sets_every_algo_field_and_nothing_else():
    assert sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) == sorted(PRESETS)
    for name in PRESETS:
        assert set(read_yaml(PRESET_DIR / f"{name}.yaml")) == FIELDS, name
        by_name = build(AlgoConfig, name)
        assert by_name == build(AlgoConfig, str(PRESET_DIR / f"{name}.yaml"))
        assert by_name.name == name


def test_presets_differ_only_where_documented():
    p = {name: build(AlgoConfig, name) for name in PRESETS}
    assert p["stapo"] == AlgoConfig()  # the defaults are STAPO's
    # DeepSeekMath's GRPO: symmetric clip 0.2, KL 0.04 (k3) in the loss, sequence mean, no dual-clip
    assert _differences(p["stapo"], p["grpo"]) == {
        "name",
        "token_rule",
        "eps_high",
        "clip_ratio_c",
        "kl_coef",
        "aggregation",
        "reward_scale",  # DeepSeekMath's 1 / 0 reward
    }
    g = p["grpo"]
    assert (g.token_rule, g.eps_low, g.eps_high, g.kl_coef, g.kl_estimator) == ("all", 0.2, 0.2, 0.04, "k3")
    assert g.aggregation == "seq_mean_token_mean" and g.clip_ratio_c > math.exp(g.log_ratio_clamp)
    # STAPO = JustRL's setting + S2T: the presets differ in the token rule alone (the rule's own fields,
    # tau_p, q, population, scope, are equal and act only in S2T)
    assert _differences(p["stapo"], p["justrl"]) == {"name", "token_rule"}
    assert (p["justrl"].reward_scale, p["justrl"].clip_ratio_c) == ("signed", 10.0)
    # DAPO as the STAPO paper runs baselines (no dynamic sampling) = JustRL's base + overlong shaping
    assert _differences(p["justrl"], p["dapo"]) == {"name", "overlong_shaping"}
    # 20-Entropy on the DAPO base, selecting over the whole mini-batch
    assert _differences(p["dapo"], p["entropy20"]) == {"name", "token_rule"}
    assert (p["entropy20"].token_rule, p["entropy20"].scope, p["entropy20"].top_fraction) == (
        "high_entropy",
        "mini_batch",
        0.2,
    )
    # their own recipes add dynamic sampling, nothing else
    for base in ("dapo", "entropy20"):
        assert _differences(p[base], p[f"{base}_dynamic_sampling"]) == {"name", "dynamic_sampling"}
    assert (p["dapo"].overlong_buffer, p["dapo"].overlong_penalty_factor, p["dapo"].reward_scale) == (
        4096,
        1.0,
        "signed",
    )
    j = p["justrl"]
    assert (1 - j.eps_low, 1 + j.eps_high) == (0.8, 1.28)
    assert j.kl_coef == j.entropy_coef == 0 and not j.dynamic_sampling and not j.overlong_shaping
    for cfg in p.values():
        if cfg.objective != "ppo_clip" or cfg.name == "grpo":  # their papers' clips and aggregation
            continue
        assert (cfg.eps_low, cfg.eps_high, cfg.aggregation, cfg.kl_coef) == (0.2, 0.28, "token_mean", 0.0)
        assert (cfg.log_ratio_clamp, cfg.rollout_correction) == (20.0, "auto")
    for cfg in p.values():  # the papers use no correction: auto is none in the synchronous loop
        assert resolve_rollout_correction(cfg, 0).rollout_correction == "none", cfg.name
        assert resolve_rollout_correction(cfg, 1).rollout_correction == "tis_token", cfg.name


@pytest.mark.parametrize(
    "override, match",
    [
        ({"token_rule": "no_such_rule"}, "^algo.token_rule: unknown rule 'no_such_rule'"),
        ({"q": 1.5}, "^algo.q: must be in"),
        ({"tau_p": 0}, "^algo.tau_p: must be in"),
        ({"top_fraction": 0}, "^algo.top_fraction:"),
        ({"eps_low": 1.5}, "^algo.eps_low:"),
        ({"kl_coef": -1}, "^algo.kl_coef: must be >= 0"),
        ({"tau_h": float("inf")}, "^algo.tau_h: must be a finite"),
        ({"population": "all"}, "^algo.population: 'all' is not one of"),
        ({"scope": "global"}, "^algo.scope:"),
        ({"overlong_buffer": 0}, "^algo.overlong_buffer:"),
        ({"clip_ratio_c": 1.0}, "^algo.clip_ratio_c: must be > 1"),
        ({"log_ratio_clamp": 100}, "^algo.log_ratio_clamp:"),
        ({"reward_scale": "pm1"}, "^algo.reward_scale: 'pm1' is not one of"),
        ({"rollout_correction": "tis"}, "^algo.rollout_correction: 'tis' is not one of"),
        ({"rollout_correction_cap": 0.5}, "^algo.rollout_correction_cap: must be > 1"),
        ({"rollout_correction_floor": 1.0}, "^algo.rollout_correction_floor:"),
    ],
)
def test_checks_name_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        build(AlgoConfig, {"preset": "stapo", **override}, "algo")


def _minibatch(seed, micro=2, rows=4, cols=50):
    """Micro-batches where most positive-advantage tokens are rare: many S2T candidates."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro):
        lp = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, math.log(1e-4), math.log(0.3))
        ent = torch.rand(rows, cols, generator=gen) * 3
        adv = torch.tensor([1.2, -0.8, 0.5, -1.0])[:rows]
        mask = torch.rand(rows, cols, generator=gen) < 0.8
        out.append(TokenStats(lp, ent, adv, mask))
    return out


def _keep(cfg, micro):
    threshold = minibatch_threshold(cfg, micro) if needs_statistics_pass(cfg) else None
    return [select_tokens(cfg, s, threshold).keep for s in micro]


def test_each_preset_behaves_as_documented():
    micro = _minibatch(0)
    for name in ("grpo", "dapo", "justrl"):  # never silence a response token
        for s, keep in zip(micro, _keep(build(AlgoConfig, name), micro)):
            assert torch.equal(keep, s.response_mask.float()), name

    stapo = build(AlgoConfig, "stapo")
    keeps = _keep(stapo, micro)
    whole = rule_keeps(
        stapo,
        [
            TokenStats(
                *(
                    torch.cat([getattr(s, f) for s in micro])
                    for f in ("logprob", "entropy", "advantages", "response_mask")
                )
            )
        ],
    )[0]
    assert torch.equal(torch.cat(keeps), whole)  # one quantile over the whole mini-batch
    candidates = sum(int(select_tokens(stapo, s, minibatch_threshold(stapo, micro)).candidates.sum()) for s in micro)
    silenced = sum(int((s.response_mask & (k == 0)).sum()) for s, k in zip(micro, keeps))
    assert candidates > 20 and silenced == math.floor(Fraction(repr(stapo.q)) * candidates)

    # entropy20: exactly the top 20% of the whole mini-batch's response tokens, not of each micro-batch
    entropy20 = build(AlgoConfig, "entropy20")
    keeps = [k.bool() for k in _keep(entropy20, micro)]
    entropies = torch.cat([s.entropy[s.response_mask] for s in micro])
    kept = torch.cat([s.entropy[s.response_mask & k] for s, k in zip(micro, keeps)])
    dropped = torch.cat([s.entropy[s.response_mask & ~k] for s, k in zip(micro, keeps)])
    assert kept.numel() == math.ceil(0.2 * entropies.numel())
    assert float(kept.min()) > float(dropped.max())
    per_micro = [math.ceil(0.2 * int(s.response_mask.sum())) for s in micro]
    assert [int(k.sum()) for k in keeps] != per_micro  # what the per-micro-batch selection would keep
