"""The STAPO paper's comparison set as its authors ran it: each baseline preset differs from
``stapo`` exactly where the papers differ, none has dynamic sampling, q is the paper's 0.75, GRPO
computes DeepSeekMath's objective, and the paper configs cap prompts at 1,024 tokens and evaluate
up to 20,480."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from stapo_megatron.config import build, load_config, read_yaml
from stapo_megatron.experiment.paper import ALGO_DIFFERENCES, OUTSIDE_ALGO_SETTINGS, PAPER_COMPARISON
from stapo_megatron.loss import AlgoConfig
from stapo_megatron.trainer.config import TrainConfig
from tests.helpers import REPO_ROOT
from tests.loss._loss_call import loss_of

PRESET_DIR = REPO_ROOT / "configs" / "algo"
FIELDS = [f.name for f in dataclasses.fields(AlgoConfig) if f.name != "name"]
PAPER_CONFIGS = sorted((REPO_ROOT / "configs").glob("qwen3_*_stapo.yaml"))

# Per preset: every field whose value differs from the stapo preset's, and that value. Sources:
# DeepSeekMath (arXiv 2402.03300) eq. (3)-(4) and Sec. 4.2; thunlp/JustRL's training script;
# the 20-Entropy reference script on veRL's DAPO recipe; the STAPO paper (no dynamic sampling).
EXPECTED_DIFFERENCES = {
    "grpo": {
        "token_rule": "all",
        "eps_high": 0.2,  # symmetric clip, eps_low = eps_high = 0.2
        "clip_ratio_c": 1.0e9,  # no dual-clip: beyond exp(log_ratio_clamp), no ratio reaches it
        "kl_coef": 0.04,  # k3, as stapo's kl_estimator
        "aggregation": "seq_mean_token_mean",
        "reward_scale": "binary",
    },
    "entropy20": {"token_rule": "high_entropy", "overlong_shaping": True},
    # STAPO is trained in JustRL's setting: the two differ in the token rule alone
    "justrl": {"token_rule": "all"},
    "dapo": {"token_rule": "all", "overlong_shaping": True},
}


def _preset(name: str) -> AlgoConfig:
    return build(AlgoConfig, name)


def _differences(a: AlgoConfig, b: AlgoConfig) -> dict[str, object]:
    return {f: getattr(b, f) for f in FIELDS if getattr(a, f) != getattr(b, f)}


def test_each_baseline_differs_from_stapo_exactly_where_its_papers_differ():
    assert PAPER_COMPARISON == ("grpo", "entropy20", "justrl", "stapo")  # the abstract's order, STAPO last
    assert ALGO_DIFFERENCES == {"stapo": {}, **EXPECTED_DIFFERENCES}
    stapo = _preset("stapo")
    assert (stapo.token_rule, stapo.tau_p, stapo.q, stapo.eps_low, stapo.eps_high) == ("s2t", 0.002, 0.75, 0.2, 0.28)
    # JustRL's script's dual-clip and +-1 verifier
    assert (stapo.kl_coef, stapo.aggregation, stapo.reward_scale, stapo.clip_ratio_c) == (
        0.0,
        "token_mean",
        "signed",
        10.0,
    )
    for name, expected in EXPECTED_DIFFERENCES.items():
        cfg = _preset(name)
        assert cfg.name == name
        assert _differences(stapo, cfg) == expected, name
    # JustRL is STAPO's setting without S2T; GRPO is not JustRL
    assert set(_differences(_preset("grpo"), _preset("justrl"))) >= {"eps_high", "kl_coef", "aggregation"}


def test_own_recipes_with_dynamic_sampling_differ_only_by_it():
    for base in ("dapo", "entropy20"):
        own, compared = _preset(f"{base}_dynamic_sampling"), _preset(base)
        assert _differences(compared, own) == {"dynamic_sampling": True}, base


def test_no_compared_preset_samples_dynamically_and_q_is_the_papers_everywhere():
    for name in (*PAPER_COMPARISON, "dapo"):
        assert _preset(name).dynamic_sampling is False, name
    presets = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    assert "grpo_kl" not in presets  # grpo is DeepSeekMath's GRPO, KL included
    for name in presets:
        # every preset spells out every field, the inert S2T ones too
        assert read_yaml(PRESET_DIR / f"{name}.yaml")["q"] == 0.75, name
        assert _preset(name).q == 0.75, name
    assert '"Unless otherwise specified, STAPO uses' in (PRESET_DIR / "stapo.yaml").read_text()


def _deepseekmath_objective(lp, old, ref, adv, eps, beta):
    """DeepSeekMath eq. (3) as a loss, in fp64: per token -min(r A, clip(r, 1 - eps, 1 + eps) A)
    + beta k3, averaged over each output's tokens, then over the outputs (no dual-clip)."""
    ratio = torch.exp(lp - old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    log_r = ref - lp
    kl = torch.exp(log_r) - log_r - 1  # eq. (4)
    return (-(surrogate - beta * kl)).mean(-1).mean()


def test_grpo_preset_computes_deepseekmaths_objective_without_dual_clip():
    g = torch.Generator().manual_seed(3)
    rows, cols = 4, 7
    old = -2 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    lp64 = old + 0.5 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    lp64[1, :3] = old[1, :3] + 4.0  # ratios of e^4 ~ 55 on a negative-advantage output: dual-clip 3 or 10 caps them
    ref = old + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.1, -0.9, 0.4, -0.6], dtype=torch.float64)[:, None].expand(rows, cols)
    mask = torch.ones(rows, cols)

    def ours(cfg):
        x = lp64.float().requires_grad_()
        loss_sum, n, metrics = loss_of(
            x,
            old.float(),
            adv[:, 0].float(),
            mask,
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            clip_ratio_c=cfg.clip_ratio_c,
            log_ratio_clamp=cfg.log_ratio_clamp,
            ref_logprob=ref.float(),
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
            aggregation=cfg.aggregation,
        )
        (loss_sum / n).backward()
        return float(loss_sum.detach() / n), int(n), metrics, x.grad

    grpo = _preset("grpo")
    loss, n, metrics, grad = ours(grpo)
    x = lp64.clone().requires_grad_()
    expected = _deepseekmath_objective(x, old, ref, adv, eps=0.2, beta=0.04)
    expected.backward()
    assert n == rows  # the denominator counts outputs, not tokens
    assert math.isclose(loss, float(expected), rel_tol=1e-5)
    assert torch.allclose(grad.double(), x.grad, atol=1e-6, rtol=1e-5)
    assert float(metrics["dual_clip_tokens"]) == 0
    # the cap lies beyond the largest ratio the clamp lets through
    assert grpo.clip_ratio_c > math.exp(grpo.log_ratio_clamp)
    # JustRL's dual-clip acts on the same tokens: the check above can tell
    assert float(ours(_preset("justrl"))[2]["dual_clip_tokens"]) == 3


@pytest.mark.parametrize("path", PAPER_CONFIGS, ids=lambda p: p.stem)
def test_paper_configs_cap_prompts_at_1024_and_evaluate_up_to_20480(path):
    cfg = load_config(TrainConfig, path)
    assert cfg.data.max_prompt_tokens == 1024
    assert cfg.eval.max_new_tokens == 20480
    longest_eval = cfg.data.max_prompt_tokens + cfg.eval.max_new_tokens
    assert cfg.rollout.sglang.context_length == longest_eval == 21504
    longest = cfg.data.max_prompt_tokens + cfg.batch.max_new_tokens
    assert cfg.batch.max_tokens_per_microbatch >= longest == 16384
    assert cfg.algo.q == 0.75 and cfg.algo.dynamic_sampling is False


def test_outside_algo_settings_apply_to_a_paper_config():
    path = REPO_ROOT / "configs" / "qwen3_8b_stapo.yaml"
    base = load_config(TrainConfig, path)
    assert base.optim.weight_decay == 0.1  # JustRL's, whose setting the paper trains STAPO under
    for preset, settings in OUTSIDE_ALGO_SETTINGS.items():
        assert (PRESET_DIR / f"{preset}.yaml").is_file(), preset
        overrides = [f"algo={preset}", *(f"{key}={value}" for key, value in settings.items())]
        cfg = load_config(TrainConfig, path, overrides)
        assert cfg.algo.name == preset
        for key, value in settings.items():
            section, field = key.split(".")
            assert section != "algo" and getattr(getattr(cfg, section), field) == value, (preset, key)
            assert getattr(getattr(base, section), field) != value, (preset, key)  # only what differs
    assert "justrl" not in OUTSIDE_ALGO_SETTINGS  # STAPO's paper configs are in JustRL's setting
