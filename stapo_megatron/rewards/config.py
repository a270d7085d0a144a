"""The ``reward`` config section."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from stapo_megatron.config import MAX_TOKENS, ConfigError, option
from stapo_megatron.config.core import check_fields
from stapo_megatron.rewards.custom import FUNCTION_SPEC
from stapo_megatron.rewards.dapo_math import DapoAnswer

RewardKind = Literal["math", "dapo", "exact", "free_words", "custom"]


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
        "every word after it be a free word w0, w1, ...; exact and free_words need no workers; custom: the "
        "function named by reward.function scores the whole response, in worker processes",
    )
    function: str = option(
        "",
        "kind custom: 'package.module:function', importable where stapo runs (installed, or on PYTHONPATH), imported "
        "only inside the reward workers. Called as function(response, ground_truth, extra): the response text, the "
        "ground truth as loaded, and the data row it came from (a dict of all its fields as read; {} for the "
        "synthetic task). Returns a score in [0, 1] (a float, an int or a bool: 1 correct, 0 wrong, in between "
        "partial credit), a (score, reason) pair or a dict {score: ..., reason: ...}; reason is text or None "
        "(stapo eval writes it next to each response as detail). It runs under timeout_s, memory_limit_mb and "
        "forbid_code_eval like the other kinds; an exception, a hang or any other return scores 0 (reason error or "
        "timeout, with why). Checked before training or evaluation starts, in a worker: a module that cannot be "
        "imported or a function that cannot take three positional arguments stops the run in one line. Evaluation "
        "inside training keeps the math verifier, so that runs trained on different rewards compare on one",
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
        "kinds math, dapo, exact, free_words: an answer (box content) longer than this gets reward 0 (reason "
        "'too_long') without being parsed",
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
    pass_env: list[str] = option(
        [],
        "names of environment variables the reward workers see besides their allow-list (the interpreter's, "
        "the locale's, the thread counts: rewards/pool.py WORKER_ENV); no key, token, rank identity or "
        "launcher variable reaches a reward function otherwise",
    )

    def __post_init__(self):
        check_fields(self)  # RewardPool builds this section from its arguments, not through build()
        for name in self.pass_env:
            if not ENV_NAME.fullmatch(name):
                raise ConfigError(f"pass_env: {name!r} is not an environment variable name")
        if self.kind == "custom":
            if not self.function:
                raise ConfigError("function: required with kind custom ('package.module:function')")
            if not FUNCTION_SPEC.fullmatch(self.function):
                raise ConfigError(f"function: expected 'package.module:function', got {self.function!r}")
        elif self.function:
            raise ConfigError(f"function: only kind custom calls a function, kind is {self.kind}")
        if 0 < self.memory_limit_mb < 512:
            raise ConfigError(
                f"memory_limit_mb: must be 0 (no limit) or >= 512 (a worker needs that much to start), "
                f"got {self.memory_limit_mb}"
            )
