"""A math answer counts only in ASCII digits, as the benchmarks' reference answers and Math-Verify
read numbers (see :mod:`stapo_megatron.rewards.math_equiv`); Python's ``int()`` and ``\\d`` accept
the digits of every script, which made ``٤٢`` and ``４２`` correct against 42."""

from __future__ import annotations

import pytest

from stapo_megatron.rewards import RewardPool
from stapo_megatron.rewards.extract import free_words_answer
from stapo_megatron.rewards.math_equiv import MathVerifier, safe_number

OTHER_SCRIPTS = [
    "٤٢",  # Arabic-Indic
    "۴۲",  # extended Arabic-Indic (Persian)
    "४२",  # Devanagari
    "４２",  # fullwidth
    "4２",  # mixed
    "-٤٢",
    "⁴²",  # superscripts
    "𝟒𝟐",  # mathematical bold digits
    "٤٢.٠",
    "\\frac{٨٤}{٢}",
]


@pytest.mark.parametrize("answer", ["42", "+42", "42.0", "4.2e1", "\\frac{84}{2}", "042"])
def test_ascii_digits_score_correct(answer):
    assert MathVerifier(cache_size=0).check(answer, "42") == "correct"


@pytest.mark.parametrize("answer", OTHER_SCRIPTS)
def test_digits_of_other_scripts_are_not_a_number(answer):
    assert MathVerifier(cache_size=0).check(answer, "42") == "parse_error"


def test_thousands_separators_in_other_scripts_are_not_a_number():
    verifier = MathVerifier(cache_size=0)
    assert verifier.check("1,234", "1234") == "correct"
    assert verifier.check("1,٢٣٤", "1234") == "parse_error"
    with pytest.raises(ValueError, match="not a numeric literal"):
        safe_number("٤٢")


def test_free_words_are_ascii():
    assert free_words_answer("42 w3 w17").answer == "42"
    assert free_words_answer("42 w٣").reason == "wrong"


def test_the_reward_pool_scores_them_so():
    with RewardPool(num_workers=1) as pool:
        results = pool.score(["\\boxed{42}", "\\boxed{٤٢}", "\\boxed{４２}"], ["42", "42", "42"])
    assert [(r.reward, r.reason) for r in results] == [(1.0, "correct"), (0.0, "parse_error"), (0.0, "parse_error")]
