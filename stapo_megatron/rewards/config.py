"""The ``reward`` config section."""

from __future__ import annotations

import dataclasses
from typing import Literal

from stapo_megatron.config import MAX_TOKENS, ConfigError, option
from stapo_megatron.config.core import check_fields
from stapo_megatron.rewards.dapo_math import DapoAnswer

RewardKind = Literal["math", "dapo", "exact", "free_words"]


@dataclasses.dataclass
class RewardConfig:
    kind: RewardKind = option(
        "math",
        "math: the last \\boxed{} of the response must be mathematically equivalent to the ground truth "
        "(math-verify on a LaTeX parser that evaluates no code, in worker processes); dapo: DAPO's rule-based "
        "verifier (verl utils/reward_score/math_dapo.py, as DAPO and JustRL train with it): string equality, with "
        "or without DAPO's normalization as dapo_answer says, no sympy, in worker processes; DAPO's +1 / -1 under "
        "algo.reward_scale signed; exact: the last box, "
        "or the whole response when it has none, must equal the answer string after whitespace "
        "normalization; free_words (the synthetic task): the response's first word must equal the answer and "
        "every word after it be a free word w0, w1, ...; exact and free_words need no workers",
    )
    dapo_answer: DapoAnswer = option(
        "strict_box",
        "kind dapo: strict_box (JustRL's, whose setting the STAPO paper trains under): the last \\boxed{} within the "
        "response's last 100 characters must equal the ground truth as written; answer_line (verl's default, for "
        "DAPO's 'Answer: ...' prompt): the last 'Answer:' line within the last 300 characters, normalized, must equal "
        "the normalized ground truth; answer_line_or_box (current verl): answer_line, else the strict_box box, "
        "normalized",
    )
    num_workers: int = option(
        2, "worker processes that verify math and dapo answers; persistent across batches", ge=1, le=1024
    )
    timeout_s: float = option(
        5.0,
        "per-sample verification time limit in seconds; past it the sample gets reward 0 (reason 'timeout')",
        gt=0,
        le=3600,
    )
    kill_grace_s: float = option(
        1.0,
        "a worker still busy timeout_s + kill_grace_s after starting a sample (stuck in code that cannot be "
        "interrupted) is killed and replaced",
        ge=0,
        le=3600,
    )
    max_answer_chars: int = option(
        1000,
        "an answer (box content) longer than this gets reward 0 (reason 'too_long') without being parsed",
        ge=1,
        le=MAX_TOKENS,
    )
    prefetch: int = option(4, "samples queued to each worker ahead of the one it is verifying", ge=1, le=1024)
    memory_limit_mb: int = option(
        4096,
        "address-space limit of each worker in MiB, so a runaway expression fails instead of swapping; 0: none",
        ge=0,
        le=1 << 24,
    )
    forbid_code_eval: bool = option(
        True,
        "after start-up, make eval/exec and sympy's sympify(str)/parse_expr raise inside the workers, as a "
        "second line of defence behind the parser that never calls them",
    )
    cache_size: int = option(
        8192, "parsed (math) or normalized (dapo) answers and verdicts each worker keeps (LRU)", ge=0, le=1 << 24
    )

    def __post_init__(self):
        check_fields(self)  # RewardPool builds this section from its arguments, not through build()
        if 0 < self.memory_limit_mb < 512:
            raise ConfigError(
                f"memory_limit_mb: must be 0 (no limit) or >= 512 (a worker needs that much to start), "
                f"got {self.memory_limit_mb}"
            )
