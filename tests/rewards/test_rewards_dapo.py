"""The dapo reward: DAPO's rule-based verifier (verl utils/reward_score/math_dapo.py) as a reward kind.

Every expected value below was derived by reading verl's math_dapo.py (and JustRL's fork of it,
thunlp/JustRL train/verl/utils/reward_score/math_dapo.py); each group names the function of theirs
whose rule it exercises.
"""

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from answer_pairs import boxed_response
from dapo_worker_hooks import hang_on_marker

from stapo_megatron.config import ConfigError
from stapo_megatron.config.core import build
from stapo_megatron.loss.advantages import correctness_reward
from stapo_megatron.rewards import RewardConfig, RewardPool
from stapo_megatron.rewards.dapo_math import DapoVerifier, find_dapo_answer, normalize_final_answer

# (answer, what normalize_final_answer makes of it)
NORMALIZED = [
    # normalize_final_answer's first step: only what follows the last "=" is kept
    ("x = 5", "5"),
    ("a = b = 3", "3"),
    ("y=2x+1", "2x+1"),
    # SUBSTITUTIONS, in order: "an "/"a " (also inside words), ".$", "\$", "\ ", spaces, mbox,
    # ",\text{and}" / "\text{and}" to a comma, "\text{m}" to "\text{}"
    ("1 000", "1000"),
    ("a triangle", "triangle"),
    ("banana split", "banansplit"),
    ("\\$5", "5"),
    ("$5.$", "5"),
    ("10\\ \\text{cm}", "10"),
    ("5\\mbox{ cm}", "5"),
    ("3, \\text{and} 4", "34"),  # a list "3 and 4" becomes the number 34 (then the commas go)
    ("5\\text{m}", "5"),
    # REMOVED_EXPRESSIONS: units and words deleted wherever they occur
    ("5 units", "5"),
    ("12 square feet", "12"),
    ("30^\\circ", "30"),
    ("30^{\\circ}", "30"),
    ("1{,}000", "1000"),
    ("1,\\!000", "1000"),
    ('"yes"', "yes"),
    ("5 centimeters", "5centi"),  # "meters" is on the list, "centimeters" is not
    ("issue", "is"),
    # the "$...$" rule: a line with two dollars keeps only its first math span
    ("the answer is $5$ and $6$", "5"),
    ("$\\frac{1}{2}$.", "\\frac{1}{2}"),
    ("5.", "5."),  # a full stop outside dollars stays
    # \text{}, \textbf{}, \overline{} lose their wrapper (to the first "}"), \boxed{} (to the last)
    ("\\text{(A)}", "(A)"),
    ("\\textbf{Tuesday}", "Tuesday"),
    ("\\overline{AB}", "AB"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    # shorthand TeX: "frac" + two characters, "sqrt" + one
    ("\\frac12", "\\frac{1}{2}"),
    ("\\fracabc", "\\frac{a}{b}c"),
    ("\\frac1{2}", "\\frac{1}{{}2}"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("\\sqrt{2}", "\\sqrt{2}"),
    ("\\dfrac{1}{2}", "\\dfrac{1}{2}"),
    # "Normalize numbers": commas go only when what is left is all digits
    ("1,234", "1234"),
    ("12,345,678", "12345678"),
    ("1,234.5", "1,234.5"),
    ("-1,234", "-1,234"),
    ("(1,2)", "(1,2)"),
]


@pytest.mark.parametrize("text, expected", NORMALIZED)
def test_normalization_follows_dapos_rules(text, expected):
    assert normalize_final_answer(text) == expected


LONG = "z" * 300
# (dapo_answer, response, extracted answer or None, reason or None)
EXTRACTED = [
    # is_correct_minerva's answer_pattern (?i)Answer\s*:\s*([^\n]+): the last match, case-insensitive,
    # the colon's spaces crossing a line break, matches left to right without overlap
    ("answer_line", "so\nAnswer: 42", "42", None),
    ("answer_line", "ANSWER : 42", "42", None),
    ("answer_line", "answer:42", "42", None),
    ("answer_line", "Answer:\n42", "42", None),
    ("answer_line", "Answer: 1\nAnswer: 2", "2", None),
    ("answer_line", "Answer: 1 Answer: 2", "1 Answer: 2", None),
    ("answer_line", "Final Answer: The final answer is $5$.", "The final answer is $5$.", None),
    ("answer_line", "The answer is 5", None, "no_answer_line"),
    ("answer_line", "so $\\boxed{5}$", None, "no_answer_line"),  # boxes are not read
    ("answer_line", "Answer: \\boxed{5}", "\\boxed{5}", None),
    # compute_score's solution_str[-300:]: an Answer line before the last 300 characters is not seen,
    # nor one whose start was cut off
    ("answer_line", "Answer: 5\n" + "z" * 290, "5", None),
    ("answer_line", "Answer: 5\n" + LONG, None, "no_answer_line"),
    ("answer_line", "Answer: 5" + "z" * 292, None, "no_answer_line"),
    # is_correct_strict_box: last_boxed_only_string + remove_boxed over pred[-100:]: the last "\boxed{",
    # braces counted whether escaped or not, nothing stripped; no \fbox, no brace-less \boxed
    ("strict_box", "so $\\boxed{5}$.", "5", None),
    ("strict_box", "\\boxed{5} or \\boxed{6}", "6", None),
    ("strict_box", "\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", None),
    ("strict_box", "\\boxed{ 5 }", " 5 ", None),
    ("strict_box", "\\boxed{\\{1,2\\}}", "\\{1,2\\}", None),
    ("strict_box", "\\boxed{\\}5}", "\\", None),
    ("strict_box", "\\boxed{}", "", None),
    ("strict_box", "\\fbox{5}", None, "no_box"),
    ("strict_box", "\\boxed 5", None, "no_box"),
    ("strict_box", "\\boxed{5", None, "unterminated_box"),
    ("strict_box", "Answer: 5", None, "no_box"),
    ("strict_box", "\\boxed{5}" + "z" * 91, "5", None),  # 100 characters in all
    ("strict_box", "\\boxed{5}" + "z" * 95, None, "no_box"),  # its start is cut off
    # verify() in current verl: the Answer line first, the box (as in strict_box) without one
    ("answer_line_or_box", "\\boxed{6}\nAnswer: 5", "5", None),
    ("answer_line_or_box", "so $\\boxed{5}$.", "5", None),
    ("answer_line_or_box", "Answer:\n\\boxed{5}", "\\boxed{5}", None),
    ("answer_line_or_box", "nothing here", None, "no_box"),
    ("answer_line_or_box", "\\boxed{5", None, "unterminated_box"),
]


@pytest.mark.parametrize("mode, response, answer, reason", EXTRACTED)
def test_answer_extraction_follows_dapos_rules(mode, response, answer, reason):
    span = find_dapo_answer(response, mode)
    assert (span.answer, span.reason) == (answer, reason)


def test_answer_extraction_honours_max_answer_chars_and_rejects_unknown_modes():
    assert find_dapo_answer("Answer: 12345", "answer_line", max_chars=4).reason == "too_long"
    assert find_dapo_answer("Answer: 1234", "answer_line", max_chars=4).answer == "1234"
    assert find_dapo_answer("\\boxed{12345}", "strict_box", max_chars=4).reason == "too_long"
    with pytest.raises(ValueError, match="mode: 'boxed' is not one of strict_box, answer_line, answer_line_or_box"):
        find_dapo_answer("\\boxed{1}", "boxed")


# (dapo_answer, response, ground truth, DAPO's verdict): extraction, normalization (not for
# strict_box) and string equality together, as compute_score scores them
VERDICTS = [
    # strict_box (is_correct_strict_box): the box content must equal the ground truth as written
    ("strict_box", boxed_response("34"), "34", True),
    ("strict_box", boxed_response("35"), "34", False),
    ("strict_box", boxed_response("\\frac{1}{2}"), "\\frac{1}{2}", True),
    ("strict_box", boxed_response("\\frac12"), "\\frac{1}{2}", False),
    ("strict_box", boxed_response("1,234"), "1234", False),
    ("strict_box", boxed_response(" 34"), "34", False),
    ("strict_box", boxed_response("x = 34"), "34", False),
    ("strict_box", "Answer: 34", "34", False),
    # answer_line (is_correct_minerva): both sides normalized
    ("answer_line", "...\nAnswer: 1,234", "1234", True),
    ("answer_line", "...\nAnswer: $\\frac12$", "\\frac{1}{2}", True),
    ("answer_line", "...\nAnswer: x = 5", "5", True),
    ("answer_line", "...\nAnswer: 5 units", "5", True),
    ("answer_line", "...\nAnswer: 30^\\circ", "30", True),
    ("answer_line", "...\nAnswer: \\$10", "10", True),
    ("answer_line", "...\nAnswer: \\text{(B)}", "(B)", True),
    ("answer_line", "...\nAnswer: 5.", "5", False),
    ("answer_line", "...\nAnswer: 0.5", "\\frac{1}{2}", False),
    ("answer_line", "...\nAnswer: 3, \\text{and} 4", "34", True),  # a wrong answer DAPO accepts
    ("answer_line", "...\nAnswer: 5 centimeters", "5", False),
    ("answer_line", boxed_response("34"), "34", False),
    ("answer_line", "...\nAnswer: units", "5", False),  # normalizes to nothing: empty_answer
    # answer_line_or_box (verify with its box fallback): a box is normalized like an Answer line
    ("answer_line_or_box", boxed_response("\\frac12"), "\\frac{1}{2}", True),
    ("answer_line_or_box", boxed_response("1,234"), "1,234", True),
    ("answer_line_or_box", boxed_response("x = 34"), "34", True),
    ("answer_line_or_box", "\\boxed{34}\nAnswer: 35", "34", False),
]


def _direct_verdict(mode, response, gold):
    span = find_dapo_answer(response, mode)
    if span.answer is None:
        return span.reason
    return DapoVerifier(normalize=mode != "strict_box").check(span.answer, gold)


@pytest.mark.parametrize("mode, response, gold, correct", VERDICTS)
def test_verdicts_follow_dapos_compute_score(mode, response, gold, correct):
    reason = _direct_verdict(mode, response, gold)
    assert (reason == "correct") == correct, reason
    if response.endswith("Answer: units"):
        assert reason == "empty_answer"


@pytest.mark.parametrize("mode", ["strict_box", "answer_line", "answer_line_or_box"])
def test_the_pool_gives_the_same_verdicts_and_dapos_plus_minus_one(mode):
    cases = [case for case in VERDICTS if case[0] == mode]
    responses, golds = [c[1] for c in cases], [c[2] for c in cases]
    with RewardPool.from_config(RewardConfig(kind="dapo", dapo_answer=mode, num_workers=1)) as pool:
        assert len(pool._workers) == 1
        results = pool.score(responses, golds)
    assert [r.reason for r in results] == [_direct_verdict(mode, r, g) for r, g in zip(responses, golds)]
    assert [r.reward for r in results] == [1.0 if c[3] else 0.0 for c in cases]
    correct = torch.tensor([r.reward for r in results])
    # compute_score's score: 1.0 if correct else -1.0, under algo.reward_scale signed; 0 / 1 under binary.
    assert correctness_reward(correct, "signed").tolist() == [1.0 if c[3] else -1.0 for c in cases]
    assert correctness_reward(correct, "binary").tolist() == [1.0 if c[3] else 0.0 for c in cases]
    if mode == "answer_line":
        assert results[0].extracted == "1,234"  # the answer as the response wrote it, before normalization


# (box content, ground truth, math, dapo strict_box, dapo answer_line_or_box): the verifiers disagree
DISAGREEMENTS = [
    ("0.5", "\\frac{1}{2}", True, False, False),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True, False, False),
    ("2\\sqrt{2}", "\\sqrt{8}", True, False, False),
    ("10\\%", "10", True, False, False),
    ("\\frac{6}{4}", "\\frac{3}{2}", True, False, False),
    ("\\text{5}", "5", True, False, True),
    ("\\frac12", "\\frac{1}{2}", True, False, True),
    ("1,234", "1234", True, False, True),
    ("x = 5", "5", True, False, True),
    ("3, \\text{and} 4", "34", False, False, True),
]


def test_math_verify_and_dapo_disagree_where_their_rules_differ(math_pool):
    responses = [boxed_response(box) for box, *_ in DISAGREEMENTS]
    golds = [gold for _, gold, *_ in DISAGREEMENTS]
    verdicts = {"math": [r.reward == 1.0 for r in math_pool.score(responses, golds)]}
    for mode in ("strict_box", "answer_line_or_box"):
        with RewardPool(num_workers=1, kind="dapo", dapo_answer=mode) as pool:
            verdicts[mode] = [r.reward == 1.0 for r in pool.score(responses, golds)]
    assert verdicts["math"] == [case[2] for case in DISAGREEMENTS]
    assert verdicts["strict_box"] == [case[3] for case in DISAGREEMENTS]
    assert verdicts["answer_line_or_box"] == [case[4] for case in DISAGREEMENTS]


def test_huge_and_adversarial_responses_are_bounded(tmp_path):
    """Only the last 300 characters are read, in this process by a slice; the normalization's
    quadratic patterns run in the workers on at most those; a worker stuck on one is killed."""
    cases = [
        ("x" * 10_000_000 + "\nAnswer: 5", "5", "correct"),
        ("Answer: 5\n" * 1_000_000, "5", "correct"),
        ("Answer: 5\n" + "y" * 10_000_000, "5", "no_answer_line"),
        ("Answer: " + "$" + "a" * 291, "5", "wrong"),  # one dollar: every start scans to the end
        ("Answer: " + "\\text{" * 48, "5", "wrong"),  # unclosed wrappers
        ("Answer: " + "frac" * 73, "5", "wrong"),
        ("Answer: " + "=" * 290 + "5", "5", "correct"),
        ("Answer: HANG", "5", "timeout"),
        ("Answer: 6", "6", "correct"),
    ]
    hook = functools.partial(hang_on_marker, str(tmp_path))
    with RewardPool(
        num_workers=1, kind="dapo", dapo_answer="answer_line", timeout_s=0.5, kill_grace_s=0.5, worker_init=hook
    ) as pool:
        started = time.perf_counter()
        results = pool.score([c[0] for c in cases], [c[1] for c in cases])
        elapsed = time.perf_counter() - started
        assert [r.reason for r in results] == [c[2] for c in cases]
        assert pool.workers_replaced == 1
        assert all(r.seconds < 0.2 for r, c in zip(results, cases) if c[2] != "timeout")
        assert 0.9 < results[-2].seconds < 5
        assert [r.reason for r in pool.score(["Answer: 7"], ["7"])] == ["correct"]  # the replacement works
    assert elapsed < 15
    # Neither the worker that hung nor its replacement loaded sympy.
    assert sorted(p.read_text() for p in tmp_path.glob("modules.*")) == ["no sympy", "no sympy"]


def test_the_guard_blocks_code_evaluation_without_importing_sympy():
    script = (
        "import sys\n"
        "from stapo_megatron.rewards.guard import CodeEvaluationBlocked, install_code_eval_guard\n"
        "install_code_eval_guard()\n"
        "install_code_eval_guard()\n"
        "print('sympy' in sys.modules)\n"
        "import sympy\n"
        "blocked = 0\n"
        "for attempt in (lambda: eval('1+1'), lambda: exec('x = 1'), lambda: sympy.sympify('1+1')):\n"
        "    try:\n"
        "        attempt()\n"
        "    except CodeEvaluationBlocked:\n"
        "        blocked += 1\n"
        "print(blocked, sympy.Integer(2) + 1)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "3", "3"]


def test_the_dapo_kind_is_a_reward_config_choice():
    assert build(RewardConfig, {"kind": "dapo"}, "reward").dapo_answer == "strict_box"
    assert build(RewardConfig, {"kind": "dapo", "dapo_answer": "answer_line"}, "reward").dapo_answer == "answer_line"
    with pytest.raises(ConfigError, match="reward.dapo_answer"):
        build(RewardConfig, {"kind": "dapo", "dapo_answer": "boxed"}, "reward")
