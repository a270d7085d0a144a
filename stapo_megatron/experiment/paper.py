"""The STAPO paper's comparison as data: which presets, how their algo sections differ from
``stapo``, and the settings their sources give outside the algo section.

The paper (arXiv 2602.15620, v1) compares STAPO with GRPO, 20-Entropy and JustRL (its abstract:
"over GRPO, 20-Entropy, and JustRL"); "For all baselines, we follow the parameter settings
reported in their original papers" and "For a fair comparison, we do not apply the dynamic
sampling technique introduced in [DAPO] to any method" (Settings). Each preset's comment in
``configs/algo/`` cites its source line by line and marks what the sources leave open.

:data:`ALGO_DIFFERENCES` is, per preset, every AlgoConfig field (but ``name``) whose value differs
from the ``stapo`` preset's, with that value: the methods differ exactly there
(tests/config/test_algo_presets.py holds the presets to it). :data:`OUTSIDE_ALGO_SETTINGS` holds
the settings outside the algo section that a method's source sets and the STAPO paper configs
(``configs/qwen3_*_stapo.yaml``) set otherwise, as dotted ``stapo train`` overrides; settings equal
to those configs (JustRL's lr 1e-6, 10 warm-up steps, grad clip 1.0, 256 x 8 prompts, mini-batch 64,
1,024 / 15,360 tokens) are left out, and so are the learning rate and the batch and length
settings, which belong to a model's scale and a workload (the sources' values are in the preset
comments): an experiment applies these overrides at any scale.
"""

from __future__ import annotations

# The methods of the paper's tables, STAPO last.
PAPER_COMPARISON: tuple[str, ...] = ("grpo", "entropy20", "justrl", "stapo")

_DAPO_BASE = {"token_rule": "all", "overlong_shaping": True}

# preset -> {AlgoConfig field: value} where it differs from the stapo preset (sources: the presets' comments).
ALGO_DIFFERENCES: dict[str, dict[str, object]] = {
    "stapo": {},
    # DeepSeekMath (arXiv 2402.03300): symmetric clip, KL 0.04 by k3 in the loss, sequence mean then
    # group mean, no dual-clip (a cap beyond exp(log_ratio_clamp), which no ratio reaches)
    "grpo": {
        "token_rule": "all",
        "eps_high": 0.2,
        "clip_ratio_c": 1.0e9,
        "kl_coef": 0.04,
        "aggregation": "seq_mean_token_mean",
        "reward_scale": "binary",
    },
    # 20-Entropy's reference script on its DAPO base, without dynamic sampling
    "entropy20": {**_DAPO_BASE, "token_rule": "high_entropy"},
    # JustRL's script: STAPO is trained in its setting, so they differ in the token rule alone
    "justrl": {"token_rule": "all"},
    # DAPO without dynamic sampling, as the paper would run it (not in its tables)
    "dapo": dict(_DAPO_BASE),
}

# preset -> {dotted train-config key: value} of its sources outside the algo section.
OUTSIDE_ALGO_SETTINGS: dict[str, dict[str, object]] = {
    # JustRL's weight decay 0.1 (thunlp/JustRL train/examples/justrl/run_scaling_ssh_distill.sh:
    # actor.optim.weight_decay=0.1) is the paper configs' own, as are 20-Entropy's
    # (run_only_top20_high_entropy_tokens_dapo_qwen3_14b.sh) and DAPO's (veRL recipe/dapo/
    # run_dapo_qwen2.5_32b.sh), all 0.1.
    # PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/7b_clip_cov.sh, 7b_kl_cov.sh: weight_decay=0,
    # warmup_style=constant with no warm-up steps (its lr, 5e-7 for 7B, is in the presets' comments)
    "clip_cov": {"optim.weight_decay": 0.0, "optim.warmup_steps": 0},
    "kl_cov": {"optim.weight_decay": 0.0, "optim.warmup_steps": 0},
}
