"""Reward functions for the custom-reward tests (``reward.function: tests.rewards.custom_reward_functions:NAME``).

Imported by the reward workers only: the tests check that the test process itself never imports
this module. The responses the tests send say what to do.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import numpy

# Valid returns, by response text, and the (reason, reward, detail) each must give.
VALID_RETURNS = {
    "float": (0.25, ("partial", 0.25, None)),
    "int one": (1, ("correct", 1.0, None)),
    "int zero": (0, ("wrong", 0.0, None)),
    "true": (True, ("correct", 1.0, None)),
    "false": (False, ("wrong", 0.0, None)),
    "pair": ((0.75, "three of four steps"), ("partial", 0.75, "three of four steps")),
    "pair without reason": ((1.0, None), ("correct", 1.0, None)),
    "dict": ({"score": 0.0, "reason": "no final answer"}, ("wrong", 0.0, "no final answer")),
    "dict without reason": ({"score": 0.5}, ("partial", 0.5, None)),
    # numpy's scalars, as a function that compares arrays returns them (np.bool_ is no numbers.Real)
    "numpy true": (numpy.bool_(True), ("correct", 1.0, None)),
    "numpy false": (numpy.bool_(False), ("wrong", 0.0, None)),
    "numpy float": (numpy.float32(0.5), ("partial", 0.5, None)),
    "numpy pair": ((numpy.bool_(True), "all equal"), ("correct", 1.0, "all equal")),
}
# Returns that are not scores, by response text, and the detail each must give (reason error, reward 0).
BAD_RETURNS = {
    "text": ("1", "returned the score '1' (str); expected a score in [0, 1]"),
    "none": (None, "returned the score None (NoneType); expected a score in [0, 1]"),
    "nan": (float("nan"), "returned the score nan, outside [0, 1]"),
    "above one": (1.5, "returned the score 1.5, outside [0, 1]"),
    "negative": (-0.5, "returned the score -0.5, outside [0, 1]"),
    "triple": ((1.0, "a", "b"), "returned a tuple of 3; expected a score in [0, 1]"),
    "list": ([1.0, "ok"], "returned the score [1.0, 'ok'] (list); expected a score in [0, 1]"),
    "typo": ({"scor": 1.0}, "returned a dict with unknown keys ['scor']; expected a score in [0, 1]"),
    "extra key": ({"score": 1.0, "acc": 1}, "returned a dict with unknown keys ['acc']; expected a score in [0, 1]"),
    "no score": ({"reason": "x"}, "returned a dict with no 'score'; expected a score in [0, 1]"),
    "reason number": ((1.0, 7), "returned the reason 7 (int); expected text or None"),
}


def scripted(response, ground_truth, extra):
    """Returns what the response names (VALID_RETURNS, BAD_RETURNS)."""
    if response in VALID_RETURNS:
        return VALID_RETURNS[response][0]
    return BAD_RETURNS[response][0]


def with_row(response, ground_truth, extra):
    """1 for the ground truth itself, else the row's partial credit; the reason quotes the row."""
    if response == ground_truth:
        return 1.0, f"exact; row {json.dumps(extra, sort_keys=True)}"
    return float(extra.get("partial_credit", 0.0)), f"row {json.dumps(extra, sort_keys=True)}"


def raises(response, ground_truth, extra):
    if response == "fine":
        return 1.0
    if response == "exit":
        sys.exit(3)
    raise ValueError(f"cannot grade {response!r} against {ground_truth!r}")


def hangs(response, ground_truth, extra):
    """Sleeps for an hour on "HANG" (SIGALRM interrupts it), and on "HANG BLOCKED" with SIGALRM blocked
    (like a long C call: the pool must kill the worker); else 1 when the response is the ground truth."""
    if response == "HANG BLOCKED":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    if response.startswith("HANG"):
        time.sleep(3600)
    return response == ground_truth


def allocates(response, ground_truth, extra):
    """Asks for 64 GiB: over the workers' address-space limit."""
    return len(bytearray(64 << 30)) > 0


def evaluates(response, ground_truth, extra):
    """Evaluates the response as Python: the workers' code-evaluation guard must refuse."""
    return float(eval(response))


def two_arguments(response, ground_truth):
    return 1.0


def extra_by_keyword_only(response, ground_truth, *, extra):
    return 1.0


def any_arguments(*args, **kwargs):
    return 1.0


class Grader:
    """A class is refused (calling it makes an instance); an instance with __call__ is a function."""

    def __init__(self, credit: float = 1.0):
        self.credit = credit

    def __call__(self, response, ground_truth, extra):
        return self.credit if response == ground_truth else 0.0


half_credit = Grader(0.5)
NOT_A_FUNCTION = 3


async def asynchronous(response, ground_truth, extra):
    return 1.0


def cites_row(response, ground_truth, extra):
    """1 when the response boxes the ground truth; the reason names the row's id (benchmark rows have one)."""
    return (1.0 if f"\\boxed{{{ground_truth}}}" in response else 0.0), f"row id {extra.get('id')}"


def reports_its_environment(response, ground_truth, extra):
    """Scores 1 and names, as its reason, the variables of the response's list that it can read."""
    import os

    return 1.0, ",".join(name for name in response.split(",") if name in os.environ)


def prints(response, ground_truth, extra):
    """A reward function that prints as it scores (debugging output, an escape sequence)."""
    print(f"\x1b]0;title\x07scoring {response}")
    return 1.0
