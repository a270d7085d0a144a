"""Every knob of the RL algorithm: token rule, clipping, KL/entropy terms, aggregation, advantages.

Presets in ``configs/algo/`` (stapo, grpo, dapo, entropy20, justrl) set only these fields.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

from stapo_megatron.config.core import ConfigError, option
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
    tau_p: float = option(0.002, "S2T: a token is rare when its probability is below tau_p.")
    q: float = option(
        0.8, "S2T: quantile of the population's entropy; the bottom floor(q * #candidates) candidates are silenced."
    )
    population: Literal["candidates", "all_response_tokens"] = option(
        "candidates", "S2T: tokens the entropy quantile is taken over."
    )
    scope: Literal["mini_batch", "micro_batch"] = option(
        "mini_batch",
        "Where quantile thresholds are computed: the whole optimizer mini-batch across micro-batches and "
        "data-parallel ranks (needs a statistics pass), or each micro-batch on its own rank.",
    )
    tau_h: Optional[float] = option(None, "S2T: fixed entropy threshold instead of the quantile (None: use q).")
    # --- 20-Entropy ---
    top_fraction: float = option(0.2, "high_entropy rule: fraction of response tokens kept, by highest entropy.")
    # --- objective ---
    eps_low: float = option(0.2, "Clip range below: the ratio is clipped at 1 - eps_low.")
    eps_high: float = option(0.28, "Clip range above (clip-higher): the ratio is clipped at 1 + eps_high.")
    kl_coef: float = option(0.0, "Weight of the k3 KL term to the reference policy (0: no reference model).")
    entropy_coef: float = option(0.0, "Weight of the entropy bonus (0: entropy carries no gradient).")
    aggregation: Literal["token_mean", "seq_mean_token_mean"] = option(
        "token_mean",
        "token_mean: loss summed over kept tokens / kept tokens of the whole mini-batch; "
        "seq_mean_token_mean: each sequence's token mean, averaged over sequences.",
    )
    # --- advantages and rewards ---
    advantage_scale: Literal["std", "none"] = option(
        "std", "std: (r - mean) / (sample std + eps) per group (GRPO); none: r - mean (Dr. GRPO)."
    )
    advantage_eps: float = option(1e-6, "Added to the group's std before dividing.")
    dynamic_sampling: bool = option(
        False, "Drop groups whose rewards are all equal and sample more prompts in their place (DAPO)."
    )
    overlong_shaping: bool = option(
        False, "Add DAPO's soft length penalty for responses in the last overlong_buffer tokens before the maximum."
    )
    overlong_buffer: int = option(4096, "Overlong shaping: length of the penalty ramp in tokens.")
    overlong_penalty_factor: float = option(1.0, "Overlong shaping: penalty at (and beyond) the maximum length.")

    def __post_init__(self):
        if self.token_rule not in TOKEN_RULES:
            raise ConfigError(f"token_rule: unknown rule '{self.token_rule}' (known: {', '.join(sorted(TOKEN_RULES))})")
        if not 0 < self.tau_p <= 1:
            raise ConfigError(f"tau_p: must be in (0, 1], got {self.tau_p}")
        if not 0 <= self.q <= 1:
            raise ConfigError(f"q: must be in [0, 1], got {self.q}")
        if self.tau_h is not None and not math.isfinite(self.tau_h):
            raise ConfigError(f"tau_h: must be a finite number or null, got {self.tau_h}")
        if not 0 < self.top_fraction <= 1:
            raise ConfigError(f"top_fraction: must be in (0, 1], got {self.top_fraction}")
        if not 0 <= self.eps_low < 1:
            raise ConfigError(f"eps_low: must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            raise ConfigError(f"eps_high: must be >= 0, got {self.eps_high}")
        for name in ("kl_coef", "entropy_coef", "overlong_penalty_factor"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.advantage_eps <= 0:
            raise ConfigError(f"advantage_eps: must be > 0, got {self.advantage_eps}")
        if self.overlong_buffer < 1:
            raise ConfigError(f"overlong_buffer: must be >= 1, got {self.overlong_buffer}")
