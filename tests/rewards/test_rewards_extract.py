"""Finding the last box, and the reward config's checks (no worker processes)."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from stapo_megatron.config import ConfigError, build
from stapo_megatron.rewards import REASONS, RewardConfig, RewardResult, extract_boxed, find_last_box, summarize_reasons
from stapo_megatron.rewards.extract import _last_command, exact_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
        ("\\boxed{\\left\\{ x \\right.}", "\\left\\{ x \\right."),  # an unbalanced escaped brace is fine
        ("\\boxed {7}", "7"),
        ("so \\boxed 5.", "5"),
        ("$\\boxed 12$ done", "12"),
        ("\\fbox{3}", "3"),
        ("\\boxed{1} and \\fbox{x+1}", "x+1"),
        ("\\fboxsep=2pt \\boxed{9}", "9"),  # \fboxsep is another command
        ("\\boxed{a} \\boxedfoo", "a"),
        ("\\boxed{  8  }", "8"),
        ("\\boxed{\\boxed{5}}", "5"),
    ],
)
def test_extract_boxed_finds_the_last_box(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, reason",
    [
        ("no box here", "no_box"),
        ("", "no_box"),
        ("\\boxed{5", "unterminated_box"),
        ("\\boxed{1} and then \\boxed{", "unterminated_box"),  # the last box counts, even if broken
        ("answer: \\boxed", "unterminated_box"),
        ("\\boxed   ", "unterminated_box"),
        ("\\boxed{}", "empty_answer"),
        ("\\boxed{   }", "empty_answer"),
        ("\\boxed $", "empty_answer"),
    ],
)
def test_find_last_box_reasons(text, reason):
    span = find_last_box(text)
    assert span.answer is None and span.reason == reason
    assert extract_boxed(text) is None


def test_find_last_box_stops_at_max_chars():
    nested = "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}"
    assert find_last_box(nested, max_chars=1000).reason == "too_long"
    assert find_last_box(nested).answer == "{" * 10_000 + "1" + "}" * 10_000
    assert find_last_box("\\boxed{" + "x" * 1001 + "}", max_chars=1000).reason == "too_long"
    assert find_last_box("\\boxed{" + "x" * 1000 + "}", max_chars=1000).answer == "x" * 1000
    assert find_last_box("\\boxed " + "7" * 1001, max_chars=1000).reason == "too_long"
    # An unterminated box longer than the limit is reported as too long: the scan stops there.
    assert find_last_box("\\boxed{" + "x" * 5000, max_chars=1000).reason == "too_long"


@pytest.mark.parametrize(
    "text, answer, reason",
    [
        ("\\boxed{" + "{" * 5000, None, "unterminated_box"),  # thousands of unmatched opening braces
        ("\\boxed{1}" + "}" * 5000, "1", None),  # ... and closing ones after the box
        ("}" * 5000 + "\\boxed{2}" + "{" * 5000, "2", None),
        ("\\boxed{\\boxed{\\boxed{3}}}", "3", None),  # the innermost box starts last
        ("\\boxed{a} \\fbox{\\boxed{b}}", "b", None),
        ("\\boxed{a} then \\boxed{b", None, "unterminated_box"),
        ("\\boxed x+1 and more", "x+1", None),  # brace-less: up to whitespace
        ("\\boxed\t42$", "42", None),
        ("\\fbox 7.", "7", None),
        ("\\boxed\\fbox{4}", "4", None),
        ("\\fbox{3}" + "\\boxedfoo " * 3000, "3", None),  # thousands of commands that are not boxes
        ("\\boxed{5} " + "\\fboxsep \\boxeda " * 3000, "5", None),
        ("\\boxedz" * 3000, None, "no_box"),
    ],
)
def test_find_last_box_on_adversarial_responses(text, answer, reason):
    span = find_last_box(text)
    assert (span.answer, span.reason) == (answer, reason)


def _reference_last_command(text: str) -> int:
    """Where the last box command starts, by the definition: every position, rightmost first."""
    for at in range(len(text) - 1, -1, -1):
        for command in ("\\boxed", "\\fbox"):
            after = at + len(command)
            if text.startswith(command, at) and not (after < len(text) and text[after].isalpha()):
                return at
    return -1


def test_last_command_agrees_with_its_definition_on_random_text():
    pieces = ["\\boxed", "\\fbox", "\\", "a", "{", "}", " ", "5", "$", "x"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert _last_command(text, len(text))[0] == _reference_last_command(text), text


class _CountingText(str):
    """A response that counts the characters its rfind calls read: from the end of the range back
    to the occurrence found (or to the start of the range)."""

    searched = 0

    def rfind(self, sub, start=0, end=None):
        found = super().rfind(sub, start, end)
        _CountingText.searched += (len(self) if end is None else end) - (found if found >= 0 else start)
        return found


@pytest.mark.parametrize("unit", ["\\boxeda", "\\fboxa", "\\fboxsep\\boxedq "])
def test_box_search_reads_the_response_a_bounded_number_of_times(unit):
    # The former search rescanned the text for each command that was not a box: quadratic, in the
    # trainer's process. Now each command's occurrences are found in one backward pass.
    text = _CountingText(unit * 20_000)
    _CountingText.searched = 0
    assert find_last_box(text).reason == "no_box"
    assert _CountingText.searched <= 2 * len(text)


def test_exact_answer_uses_the_box_or_the_whole_response():
    assert exact_answer(" 7 ").answer == "7"
    assert exact_answer("7 <d3>").answer == "7 <d3>"
    assert exact_answer("so \\boxed{ 7 }.").answer == "7"
    assert exact_answer("the  answer\n is 7.").answer == "the answer is 7"
    assert exact_answer("   ").reason == "empty_answer"
    assert exact_answer("\\boxed{7").reason == "unterminated_box"
    assert exact_answer("8" * 20, max_chars=10).reason == "too_long"


def test_reward_result_checks_reward_and_reason():
    assert RewardResult(1.0, "correct").reward == 1.0
    with pytest.raises(ValueError, match="unknown reason"):
        RewardResult(0.0, "bogus")
    with pytest.raises(ValueError, match="does not go with"):
        RewardResult(1.0, "wrong")
    with pytest.raises(ValueError, match="does not go with"):
        RewardResult(0.0, "correct")
    # A custom reward's partial credit: strictly between 0 and 1, and only with "partial".
    assert RewardResult(0.25, "partial", detail="one of four").reward == 0.25
    for reward, reason in ((0.5, "wrong"), (0.0, "partial"), (1.0, "partial"), (1.5, "correct"), (-0.5, "wrong")):
        with pytest.raises(ValueError, match="does not go with"):
            RewardResult(reward, reason)
    with pytest.raises(ValueError, match="does not go with"):
        RewardResult(float("nan"), "partial")


def test_summarize_reasons_counts_every_reason():
    counts = summarize_reasons(
        [RewardResult(1.0, "correct"), RewardResult(0.0, "timeout"), RewardResult(0.0, "timeout")]
    )
    assert list(counts) == list(REASONS)
    assert counts["correct"] == 1 and counts["timeout"] == 2 and sum(counts.values()) == 3


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_workers": 0}, "reward.num_workers: must be >= 1"),
        ({"timeout_s": 0}, r"reward.timeout_s: must be in \(0, 3600\], got 0.0"),
        ({"timeout_s": "nan"}, "reward.timeout_s: must be a finite number"),
        ({"kill_grace_s": -1}, r"reward.kill_grace_s: must be in \[0, 3600\], got -1.0"),
        ({"kill_grace_s": float("inf")}, "reward.kill_grace_s: must be a finite number"),
        ({"num_workers": 100_000}, "reward.num_workers: must be <= 1024, got 100000"),
        ({"max_answer_chars": 0}, "reward.max_answer_chars"),
        ({"prefetch": 0}, "reward.prefetch"),
        ({"memory_limit_mb": 100}, "reward.memory_limit_mb"),
        ({"kind": "fuzzy"}, "reward.kind: 'fuzzy' is not one of"),
    ],
)
def test_reward_config_rejects_bad_values(fields, message):
    with pytest.raises(ConfigError, match=message):
        build(RewardConfig, fields, "reward")


def test_reward_config_defaults_and_overrides():
    cfg = build(RewardConfig, {"kind": "exact", "timeout_s": "2.5", "memory_limit_mb": 0}, "reward")
    assert (cfg.kind, cfg.timeout_s, cfg.memory_limit_mb, cfg.num_workers) == ("exact", 2.5, 0, 2)


def test_importing_rewards_and_data_is_cheap():
    heavy = ("torch", "sympy", "math_verify", "antlr4", "transformers", "datasets")
    code = f"import sys, stapo_megatron.rewards, stapo_megatron.data; print([m for m in {heavy} if m in sys.modules])"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "[]"
