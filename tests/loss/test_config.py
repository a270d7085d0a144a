"""AlgoConfig and the presets in configs/algo: fields, checks, and the behaviour each preset documents."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from stapo_megatron.config import ConfigError, build, read_yaml
from stapo_megatron.loss import (
    AlgoConfig,
    TokenStats,
    minibatch_threshold,
    needs_statistics_pass,
    s2t_mask,
    select_tokens,
)

PRESETS = ("stapo", "grpo", "dapo", "entropy20", "justrl")
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
    assert _differences(p["stapo"], p["grpo"]) == {"name", "token_rule"}
    assert p["grpo"].token_rule == "all"
    assert _differences(p["grpo"], p["dapo"]) == {"name", "dynamic_sampling", "overlong_shaping"}
    assert _differences(p["grpo"], p["entropy20"]) == {"name", "token_rule", "scope"}
    assert (p["entropy20"].token_rule, p["entropy20"].scope, p["entropy20"].top_fraction) == ("high_entropy", "micro_batch", 0.2)
    assert _differences(p["grpo"], p["justrl"]) == {"name"}
    j = p["justrl"]
    assert (1 - j.eps_low, 1 + j.eps_high) == (0.8, 1.28)
    assert j.kl_coef == j.entropy_coef == 0 and not j.dynamic_sampling and not j.overlong_shaping
    for cfg in p.values():
        assert (cfg.eps_low, cfg.eps_high, cfg.aggregation, cfg.kl_coef) == (0.2, 0.28, "token_mean", 0.0)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"token_rule": "stare"}, "^algo.token_rule: unknown rule 'stare'"),
        ({"q": 1.5}, "^algo.q: must be in"),
        ({"tau_p": 0}, "^algo.tau_p: must be in"),
        ({"top_fraction": 0}, "^algo.top_fraction:"),
        ({"eps_low": 1.0}, "^algo.eps_low:"),
        ({"kl_coef": -1}, "^algo.kl_coef: must be >= 0"),
        ({"tau_h": float("inf")}, "^algo.tau_h: must be a finite"),
        ({"population": "all"}, "^algo.population: 'all' is not one of"),
        ({"scope": "global"}, "^algo.scope:"),
        ({"overlong_buffer": 0}, "^algo.overlong_buffer:"),
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
    whole = s2t_mask(*(torch.cat([getattr(s, f) for s in micro]) for f in ("logprob", "entropy", "advantages", "response_mask")))
    assert torch.equal(torch.cat(keeps), whole)  # one quantile over the whole mini-batch
    candidates = sum(int(select_tokens(stapo, s, minibatch_threshold(stapo, micro)).candidates.sum()) for s in micro)
    silenced = sum(int((s.response_mask & (k == 0)).sum()) for s, k in zip(micro, keeps))
    assert candidates > 20 and silenced == math.floor(0.8 * candidates)

    entropy20 = build(AlgoConfig, "entropy20")
    for s, keep in zip(micro, _keep(entropy20, micro)):  # per micro-batch: exactly its top 20%
        n = int(s.response_mask.sum())
        assert int(keep.sum()) == math.ceil(0.2 * n)
        assert float(s.entropy[keep.bool()].min()) > float(s.entropy[s.response_mask & ~keep.bool()].max())
