"""The outcome of scoring one response, and the reason counts that go into the metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

# Every reason a response can get. Reward 1 only ever comes with "correct"; every other reason
# gives reward 0. The order is the order of the metric keys.
REASONS: tuple[str, ...] = (
    "correct",  # equivalent to the ground truth
    "wrong",  # parsed, and not equivalent
    "no_box",  # no \boxed{...} / \fbox{...} in the response (math; dapo: no \boxed{ in its last 100 characters)
    "no_answer_line",  # dapo reward, dapo_answer answer_line: no "Answer: ..." in the response's last 300 characters
    "unterminated_box",  # the last box never closes (often a truncated response)
    "empty_answer",  # the last box (or, for the exact reward, the response; for dapo, the answer as compared) is empty
    "too_long",  # the answer is longer than max_answer_chars
    "parse_error",  # the answer is not a mathematical expression the parser understands
    "gold_parse_error",  # the ground truth could not be parsed and the strings differ
    "timeout",  # verification ran past the per-sample time limit
    "error",  # anything else went wrong in the worker (out of memory, a blocked code evaluation)
)
_REASON_SET = frozenset(REASONS)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """The reward of one response.

    ``extracted`` is the answer taken from the response (None when there was none to take);
    ``seconds`` is the time spent on this response (verification in the worker, or extraction
    for a response rejected before verification).
    """

    reward: float
    reason: str
    extracted: str | None = None
    seconds: float = 0.0

    def __post_init__(self):
        if self.reason not in _REASON_SET:
            raise ValueError(f"RewardResult.reason: unknown reason {self.reason!r} (known: {', '.join(REASONS)})")
        if (self.reward == 1.0) != (self.reason == "correct") or self.reward not in (0.0, 1.0):
            raise ValueError(f"RewardResult: reward {self.reward} does not go with reason {self.reason!r}")


def summarize_reasons(results: Iterable[RewardResult]) -> dict[str, int]:
    """How many results had each reason; every reason is present so metric keys stay stable."""
    counts = dict.fromkeys(REASONS, 0)
    for result in results:
        counts[result.reason] += 1
    return counts
