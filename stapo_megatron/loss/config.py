"""Every knob of the RL algorithm: token rule, clipping, KL/entropy terms, aggregation, advantages.

Presets in ``configs/algo/`` (stapo, grpo, dapo, entropy20, justrl) set only these fields.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from stapo_megatron.config.core import MAX_TOKENS, ConfigError, option
from stapo_megatron.loss.token_rules import TOKEN_RULES


@dataclasses.dataclass
class AlgoConfig:
    PRESET_DIR = "algo"

    name: str = option("stapo", "Name of the recipe, for logs and run directories.")
    token_rule: str = option(
        "s2t",
        "Token rule (registry key in loss.token_rules): 's2t' silences spurious tokens (STAPO), "
        "'high_entropy' keeps the top entropy tokens (20-Entropy), 'all' keeps every response token.",
    )
    # --- S2T ---
    tau_p: float = option(0.002, "S2T: a token is rare when its probability is below tau_p.", gt=0, le=1)
    q: float = option(
        0.8,
        "S2T: quantile of the population's entropy; the bottom floor(q * #candidates) candidates are silenced.",
        ge=0,
        le=1,
    )
    population: Literal["candidates", "all_response_tokens"] = option(
        "candidates", "S2T: tokens the entropy quantile is taken over."
    )
    scope: Literal["mini_batch", "micro_batch"] = option(
        "mini_batch",
        "Where quantile thresholds are computed: the whole optimizer mini-batch across micro-batches and "
        "data-parallel ranks (needs a statistics pass), or each micro-batch on its own rank.",
    )
    tau_h: Optional[float] = option(
        None, "S2T: fixed entropy threshold instead of the quantile (None: use q).", ge=0
    )
    # --- 20-Entropy ---
    top_fraction: float = option(
        0.2, "high_entropy rule: fraction of response tokens kept, by highest entropy.", gt=0, le=1
    )
    # --- objective ---
    eps_low: float = option(0.2, "Clip range below: the ratio is clipped at 1 - eps_low.", ge=0, lt=1)
    eps_high: float = option(
        0.28, "Clip range above (clip-higher): the ratio is clipped at 1 + eps_high.", ge=0
    )
    clip_ratio_c: float = option(
        3.0,
        "Dual-clip (Ye et al. 2020; veRL's actor.clip_ratio_c, default 3.0): for A < 0 a token's "
        "surrogate loss is capped at -A * clip_ratio_c, so a huge ratio on a bad token cannot dominate.",
        gt=1,
    )
    log_ratio_clamp: float = option(
        20.0,
        "log(pi / pi_old) is clamped to [-log_ratio_clamp, log_ratio_clamp] before exp, as veRL does "
        "(+-20), so exp never overflows into inf (and inf * 0 into nan gradients).",
        gt=0,
        le=80,
    )
    kl_coef: float = option(
        0.0, "Weight of the k3 KL term to the reference policy (0: no reference model).", ge=0
    )
    entropy_coef: float = option(0.0, "Weight of the entropy bonus (0: entropy carries no gradient).", ge=0)
    aggregation: Literal["token_mean", "seq_mean_token_mean"] = option(
        "token_mean",
        "token_mean: loss summed over kept tokens / kept tokens of the whole mini-batch; "
        "seq_mean_token_mean: each sequence's token mean, averaged over sequences.",
    )
    # --- advantages and rewards ---
    advantage_scale: Literal["std", "none"] = option(
        "std", "std: (r - mean) / (sample std + eps) per group (GRPO); none: r - mean (Dr. GRPO)."
    )
    advantage_eps: float = option(1e-6, "Added to the group's std before dividing.", gt=0, le=1)
    reward_scale: Literal["binary", "signed"] = option(
        "binary",
        "Correctness reward: binary gives 1 / 0 (the STAPO paper's R in {0, 1}); signed gives +1 / -1, "
        "the scale of DAPO's verifier (verl utils/reward_score/math_dapo.py), on which DAPO's overlong "
        "penalty in [-1, 0] is defined.",
    )
    dynamic_sampling: bool = option(
        False, "Drop groups whose rewards are all equal and sample more prompts in their place (DAPO)."
    )
    overlong_shaping: bool = option(
        False, "Add DAPO's soft length penalty for responses in the last overlong_buffer tokens before the maximum."
    )
    overlong_buffer: int = option(
        4096, "Overlong shaping: length of the penalty ramp in tokens.", ge=1, le=MAX_TOKENS
    )
    overlong_penalty_factor: float = option(
        1.0, "Overlong shaping: penalty at (and beyond) the maximum length.", ge=0
    )

    # --- rollout correction (train/rollout mismatch) ---
    rollout_correction: Literal["none", "tis_token", "tis_seq", "tis_geo", "mis_token", "mis_seq", "mis_geo"] = option(
        "none",
        "Correct for pi_old (trainer) != pi_rollout (engine) with w = pi_old / pi_rollout: tis_token "
        "multiplies each token's policy-gradient term by min(w_t, cap) (slime --use-tis); tis_seq by "
        "min(prod_t w_t, cap) of its sequence (verl rollout_is: sequence); mis_token drops tokens with "
        "w_t outside [floor, cap] and mis_seq whole sequences with prod_t w_t outside it (verl rollout_rs "
        "token_k1 / seq_sum_k1); *_geo use the sequence's geometric mean of w_t instead of the product "
        "(verl Geo-RS, seq_mean_k1). none: no correction (the paper's setting); the mismatch is logged either way.",
    )
    rollout_correction_cap: float = option(
        2.0,
        "Rollout correction: TIS truncation C and MIS upper bound (slime --tis-clip and verl "
        "rollout_is_threshold both default to 2.0).",
        gt=1,
    )
    rollout_correction_floor: Optional[float] = option(
        None, "Rollout correction: MIS lower bound (None: 1 / rollout_correction_cap, verl's default).", gt=0, lt=1
    )

    def __post_init__(self):
        if self.token_rule not in TOKEN_RULES:
            raise ConfigError(f"token_rule: unknown rule '{self.token_rule}' (known: {', '.join(sorted(TOKEN_RULES))})")
