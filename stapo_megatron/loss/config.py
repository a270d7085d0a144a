"""Every knob of the RL algorithm: token rule, clipping, KL/entropy terms, aggregation, advantages.

Presets in ``configs/algo/`` (stapo, grpo, entropy20, justrl, dapo, dapo_dynamic_sampling,
entropy20_dynamic_sampling, clip_cov, kl_cov, gspo, stare) set only these fields.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from stapo_megatron.config.core import MAX_TOKENS, ConfigError, option
from stapo_megatron.loss.objectives import OBJECTIVES
from stapo_megatron.loss.token_rules import BUDGETED_ABLATIONS, TOKEN_RULES, get_token_rule


@dataclasses.dataclass
class AlgoConfig:
    PRESET_DIR = "algo"

    name: str = option("stapo", "Name of the recipe, for logs and run directories.")
    token_rule: str = option(
        "s2t",
        "Token rule (registry key in loss.token_rules): 's2t' silences spurious tokens (STAPO), "
        "'high_entropy' keeps the top entropy tokens (20-Entropy), 'stare' reweights high-surprisal tokens "
        "under an entropy gate (STARE), 'all' keeps every response token; the STAPO paper's masking "
        "ablations act on S2T's candidates (A > 0, p < tau_p): 's2t_high_entropy' silences the "
        "highest-entropy floor(q * #candidates) of them, 's2t_random' as many drawn at random (keyed by "
        "run.seed, the step and each token's sequence and position), 'lowprob_all' all of them "
        "(JustRL-FullMask).",
    )
    # --- S2T and its ablations ---
    tau_p: float = option(
        0.002,
        "S2T and its ablations: a token is rare when its probability is below tau_p (the paper's value).",
        gt=0,
        le=1,
    )
    # STAPO v1, Settings: "Unless otherwise specified, STAPO uses tau_p = 0.002 and q = 75% across
    # all experiments."
    q: float = option(
        0.75,
        "S2T: quantile of the population's entropy; the bottom floor(q * #candidates) candidates are silenced "
        "(s2t_high_entropy, s2t_random: the same number of candidates, by highest entropy / at random).",
        ge=0,
        le=1,
    )
    population: Literal["candidates", "all_response_tokens"] = option(
        "candidates", "S2T: tokens the entropy quantile is taken over."
    )
    budget: Literal["same_as_s2t", "complement"] = option(
        "same_as_s2t",
        "The masking ablations s2t_high_entropy and s2t_random: same_as_s2t silences floor(q * #candidates) "
        "candidates, as many as S2T (the strategies compared at equal silencing, the default); complement "
        "silences the rest, #candidates - floor(q * #candidates) (for s2t_high_entropy: H >= S2T's tau_h(q), "
        "the reading of the paper's 'decreasing q leads to rapid degradation for high-entropy masking'). "
        "The paper does not settle which it ran.",
    )
    scope: Literal["mini_batch", "micro_batch"] = option(
        "mini_batch",
        "Where quantile thresholds are computed: the whole optimizer mini-batch across micro-batches and "
        "data-parallel ranks (needs a statistics pass), or each micro-batch on its own rank.",
    )
    tau_h: float | None = option(None, "S2T: fixed entropy threshold instead of the quantile (None: use q).", ge=0)
    # --- 20-Entropy ---
    top_fraction: float = option(
        0.2, "high_entropy rule: fraction of response tokens kept, by highest entropy.", gt=0, le=1
    )
    # --- STARE (arXiv 2606.19236, github.com/hp-luo/STARE; see loss.related_rules) ---
    stare_variant: Literal["O1", "C2"] = option(
        "O1",
        "stare rule: O1 weights only L+ (the highest-surprisal tokens of A > 0 responses) by stare_weight_w; "
        "C2 also weights L- (those of A < 0 responses) by stare_weight_m.",
    )
    stare_top_fraction: float = option(
        0.1,
        "stare rule: P, the fraction of the A > 0 (and, for C2, A < 0) response tokens with the highest "
        "surprisal -log p that form L+ (L-): ceil(P n) of n, over the threshold scope.",
        gt=0,
        le=1,
    )
    stare_weight_w: float = option(
        1.1, "stare rule: W, the weight of each L+ token's loss (> 1 raises entropy; 14B/32B: 1.05).", gt=0
    )
    stare_weight_m: float = option(
        0.9, "stare rule: M, the weight of each L- token's loss, variant C2 only (14B/32B: 0.95).", gt=0
    )
    stare_target_entropy: float = option(
        0.3,
        "stare rule: H_tgt of the closed-loop gate; a step reweights only when the mean policy entropy over "
        "its response tokens (policy/entropy, old policy) is below it, else it is plain GRPO.",
        ge=0,
    )
    # --- objective ---
    eps_low: float = option(
        0.2,
        "Clip range below: the ratio is clipped at 1 - eps_low (1: no lower clip, as the Clip-Cov "
        "recipe's clip_ratio_low = 1).",
        ge=0,
        le=1,
    )
    eps_high: float = option(0.28, "Clip range above (clip-higher): the ratio is clipped at 1 + eps_high.", ge=0)
    clip_ratio_c: float = option(
        10.0,
        "Dual-clip (Ye et al. 2020; veRL's actor.clip_ratio_c): for A < 0 a token's surrogate loss is capped "
        "at -A * clip_ratio_c, so a huge ratio on a bad token cannot dominate. 10: JustRL's script, whose "
        "setting the STAPO paper trains under (veRL's own default is 3.0).",
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
        0.0,
        "Weight of the KL penalty to a frozen reference model (the run's initial weights), added to each "
        "kept token's loss (DeepSeekMath's GRPO: 0.04). > 0 builds the reference and runs its forward pass "
        "every step; 0: no reference model.",
        ge=0,
    )
    kl_estimator: Literal["k1", "k2", "k3"] = option(
        "k3",
        "KL penalty estimator of KL(pi || pi_ref) from r = pi_ref / pi (Schulman 2020): k1 = -log r "
        "(veRL kl_penalty 'kl'), k2 = (log r)^2 / 2 ('mse'), k3 = r - 1 - log r ('low_var_kl', "
        "DeepSeekMath's; without veRL's [-10, 10] clamp of the value). Read only when kl_coef > 0.",
    )
    entropy_coef: float = option(0.0, "Weight of the entropy bonus (0: entropy carries no gradient).", ge=0)
    aggregation: Literal["token_mean", "seq_mean_token_mean", "microbatch_token_mean"] = option(
        "token_mean",
        "token_mean: loss summed over kept tokens / kept tokens of the whole mini-batch (the STAPO paper's "
        "equation); seq_mean_token_mean: each sequence's token mean, averaged over sequences; "
        "microbatch_token_mean: each micro-batch's token mean weighted by its sequence count, as the verl "
        "version the paper ran (it depends on batch.max_tokens_per_microbatch's packing, and no "
        "zero-advantage sequence is left out).",
    )
    # --- policy objective (loss.objectives) ---
    objective: str = option(
        "ppo_clip",
        "Policy objective (registry key in loss.objectives): 'ppo_clip' is the token-level clipped "
        "surrogate; 'clip_cov' and 'kl_cov' (Cui et al. 2025) detach / KL-penalise a few high-covariance "
        "tokens, the covariance taken over the tokens of one loss call (a micro-batch on its rank, as the "
        "reference code; kl_cov has no ratio clip, so eps_low, eps_high and clip_ratio_c do not act in it); "
        "'gspo' (Zheng et al. 2025) clips the sequence ratio and needs aggregation seq_mean_token_mean.",
    )
    clip_cov_ratio: float = option(
        2e-4,
        "clip_cov: fraction of the loss call's tokens whose gradient is detached, at least 1 (reference "
        "code and verl: 2e-4).",
        gt=0,
        le=1,
    )
    clip_cov_lb: float = option(
        1.0,
        "clip_cov: a candidate's covariance must exceed this (reference code and verl: 1.0); the method "
        "targets high positive covariance, so it is >= 0.",
        ge=0,
    )
    clip_cov_ub: float = option(
        5.0, "clip_cov: a candidate's covariance must stay below this (reference code and verl: 5.0).", gt=0
    )
    kl_cov_ratio: float = option(
        2e-3,
        "kl_cov: fraction of the loss call's tokens, by largest covariance, that get the |log r| penalty, "
        "at least 1 (authors' code: k_percent 0.2 %, i.e. 2e-3; verl's default 2e-4).",
        gt=0,
        le=1,
    )
    kl_cov_coef: float = option(
        1.0, "kl_cov: weight of |log(pi / pi_old)| on the selected tokens (authors' ppo_kl_coef: 1).", ge=0
    )
    # --- advantages and rewards ---
    advantage_scale: Literal["std", "none"] = option(
        "std", "std: (r - mean) / (sample std + eps) per group (GRPO); none: r - mean (Dr. GRPO)."
    )
    advantage_eps: float = option(1e-6, "Added to the group's std before dividing.", gt=0, le=1)
    reward_scale: Literal["binary", "signed"] = option(
        "signed",
        "Correctness reward: signed gives +1 / -1, the scale of DAPO's verifier (verl "
        "utils/reward_score/math_dapo.py) that JustRL's script (the STAPO paper's setting) scores with, "
        "on which DAPO's overlong penalty in [-1, 0] is defined; binary gives 1 / 0 (the paper writes R "
        "in {0, 1}). With std-normalized advantages both give the same advantages.",
    )
    dynamic_sampling: bool = option(
        False, "Drop groups whose rewards are all equal and sample more prompts in their place (DAPO)."
    )
    overlong_shaping: bool = option(
        False, "Add DAPO's soft length penalty for responses in the last overlong_buffer tokens before the maximum."
    )
    overlong_buffer: int = option(4096, "Overlong shaping: length of the penalty ramp in tokens.", ge=1, le=MAX_TOKENS)
    overlong_penalty_factor: float = option(1.0, "Overlong shaping: penalty at (and beyond) the maximum length.", ge=0)

    # --- rollout correction (train/rollout mismatch, and staleness under async rollouts) ---
    rollout_correction: Literal[
        "auto", "none", "tis_token", "tis_seq", "tis_geo", "mis_token", "mis_seq", "mis_geo"
    ] = option(
        "auto",
        "Correct for pi_old (the trainer's weights at the step's start) != pi_rollout (the engine's "
        "per-token log-probs, of whichever weight version sampled each token) with w = pi_old / "
        "pi_rollout: tis_token multiplies each token's policy-gradient term by min(w_t, cap) (slime "
        "--use-tis); tis_seq by min(prod_t w_t, cap) of its sequence (verl rollout_is: sequence); "
        "mis_token drops tokens with w_t outside [floor, cap] and mis_seq whole sequences with prod_t w_t "
        "outside it (verl rollout_rs token_k1 / seq_sum_k1); *_geo use the sequence's geometric mean of "
        "w_t instead of the product (verl Geo-RS, seq_mean_k1). none: no correction (the paper's "
        "setting). auto: none in the synchronous loop (rollout.async.max_staleness 0, as the paper), "
        "tis_token when generation runs ahead of training (max_staleness > 0; docs/async.md). The "
        "mismatch is logged either way.",
    )
    rollout_correction_cap: float = option(
        2.0,
        "Rollout correction: TIS truncation C and MIS upper bound (slime --tis-clip and verl "
        "rollout_is_threshold both default to 2.0; also auto's cap under async rollouts).",
        gt=1,
    )
    rollout_correction_floor: float | None = option(
        None, "Rollout correction: MIS lower bound (None: 1 / rollout_correction_cap, verl's default).", gt=0, lt=1
    )

    def __post_init__(self):
        if self.token_rule not in TOKEN_RULES:
            raise ConfigError(f"token_rule: unknown rule '{self.token_rule}' (known: {', '.join(sorted(TOKEN_RULES))})")
        rule_error = get_token_rule(self.token_rule).config_error(self)
        if rule_error is not None:
            raise ConfigError(rule_error)
        if self.budget != "same_as_s2t" and self.token_rule not in BUDGETED_ABLATIONS:
            raise ConfigError(
                f"budget: {self.budget} is for the masking ablations ({', '.join(BUDGETED_ABLATIONS)}), "
                f"not token_rule {self.token_rule}"
            )
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                f"objective: unknown objective '{self.objective}' (known: {', '.join(sorted(OBJECTIVES))})"
            )
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ConfigError(f"clip_cov_lb: {self.clip_cov_lb} must be below clip_cov_ub ({self.clip_cov_ub})")
        if self.objective == "gspo" and self.aggregation != "seq_mean_token_mean":
            raise ConfigError(
                "aggregation: objective gspo averages each sequence's token terms (its sequence objective; "
                "verl hard-codes seq-mean-token-mean), set aggregation: seq_mean_token_mean"
            )


def resolve_rollout_correction(algo: AlgoConfig, max_staleness: int) -> AlgoConfig:
    """``algo`` with a concrete ``rollout_correction``: ``auto`` becomes ``none`` in the synchronous
    loop (``max_staleness`` 0: the paper's objective, bit-identical to a run without the field) and
    ``tis_token`` (capped at ``rollout_correction_cap``) when generation runs ahead of training
    (``max_staleness`` > 0: samples of weights up to that many versions old; docs/async.md, "The
    objective off-policy"). Any other value is the user's choice and stays. Returns a copy;
    :class:`~stapo_megatron.loss.policy.PolicyLoss` refuses an unresolved ``auto``."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ConfigError(f"rollout.async.max_staleness: must be an integer >= 0, got {max_staleness!r}")
    mode = algo.rollout_correction
    if mode == "auto":
        mode = "tis_token" if max_staleness > 0 else "none"
    return dataclasses.replace(algo, rollout_correction=mode)
