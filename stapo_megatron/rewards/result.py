"""The outcome of scoring one response, and the reason counts that go into the metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

# Every reason a response can get. Reward 1 only ever comes with "correct", a reward strictly between
# 0 and 1 (a custom reward's partial credit) with "partial"; every other reason gives reward 0. The
# order is the order of the metric keys.
REASONS: tuple[str, ...] = (
    "correct",  # equivalent to the ground truth (custom reward: score 1)
    "partial",  # custom reward: a score strictly between 0 and 1
    "wrong",  # parsed, and not equivalent (custom reward: score 0)
    "no_box",  # no \boxed{...} / \fbox{...} in the response (math; dapo: no \boxed{ in its last 100 characters)
    "no_answer_line",  # dapo reward, dapo_answer answer_line: no "Answer: ..." in the response's last 300 characters
    "unterminated_box",  # the last box never closes (often a truncated response)
    "empty_answer",  # the last box (or, for the exact reward, the response; for dapo, the answer as compared) is empty
    "too_long",  # the answer is longer than max_answer_chars
    "parse_error",  # the answer is not a mathematical expression the parser understands
    "gold_parse_error",  # the ground truth could not be parsed and the strings differ
    "timeout",  # verification ran past the per-sample time limit
    "error",  # anything else went wrong in the worker (out of memory, a blocked code evaluation; a custom
    # reward function that raised or returned something that is not a score)
)
_REASON_SET = frozenset(REASONS)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """The reward of one response.

    ``reward`` is in [0, 1]: 1 correct, 0 not, in between a custom reward's partial credit.
    ``extracted`` is the answer taken from the response (None when there was none to take);
    ``seconds`` is the time spent on this response (verification in the worker, or extraction
    for a response rejected before verification); ``detail`` is a custom reward's own reason,
    or why its function failed on this response (None for the other kinds).
    """

    reward: float
    reason: str
    extracted: str | None = None
    seconds: float = 0.0
    detail: str | None = None

    def __post_init__(self):
        if self.reason not in _REASON_SET:
            raise ValueError(f"RewardResult.reason: unknown reason {self.reason!r} (known: {', '.join(REASONS)})")
        expected = "correct" if self.reward == 1.0 else "partial" if 0.0 < self.reward < 1.0 else None
        fits = self.reason == expected if expected else self.reward == 0.0 and self.reason not in ("correct", "partial")
        if not fits:
            raise ValueError(f"RewardResult: reward {self.reward} does not go with reason {self.reason!r}")


def summarize_reasons(results: Iterable[RewardResult]) -> dict[str, int]:
    """How many results had each reason; every reason is present so metric keys stay stable."""
    counts = dict.fromkeys(REASONS, 0)
    for result in results:
        counts[result.reason] += 1
    return counts
