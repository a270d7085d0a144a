"""avg@k and the unbiased pass@k estimator against their closed forms."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from stapo_megatron.eval.metrics import avg_at_k, mean_pass_at, pass_at_k, pass_levels


def closed_form(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), exactly (Python integers), then rounded once."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13, 32, 40])
def test_pass_at_k_equals_the_closed_form_on_every_small_case(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), rel=1e-12, abs=1e-15), (n, c, k)


def test_pass_at_k_edge_cases():
    assert pass_at_k(32, 0, 1) == 0.0
    assert pass_at_k(32, 0, 32) == 0.0
    assert pass_at_k(32, 32, 1) == 1.0
    assert pass_at_k(32, 32, 7) == 1.0
    # n = k: one correct sample is enough, none is not.
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    # pass@1 is the fraction correct.
    assert pass_at_k(32, 5, 1) == pytest.approx(5 / 32, rel=1e-15)
    # n - c < k: every draw holds a correct sample.
    assert pass_at_k(10, 8, 3) == 1.0
    assert pass_at_k(10, 7, 3) == pytest.approx(1 - 1 / 120, rel=1e-15)


def test_pass_at_k_is_stable_for_large_n():
    # C(10^6, 1000) has thousands of digits: a float binomial overflows.
    with pytest.raises(OverflowError):
        float(math.comb(10**6, 1000))
    for n, c, k in [(10**6, 1, 1), (10**6, 3, 1000), (10**6, 500_000, 1000), (200_000, 17, 4096), (5000, 4990, 4)]:
        value = pass_at_k(n, c, k)
        assert math.isfinite(value)
        assert value == pytest.approx(closed_form(n, c, k), rel=1e-10), (n, c, k)
    # A tiny probability keeps its relative precision (no cancellation in 1 - x).
    assert pass_at_k(10**7, 1, 1) == pytest.approx(1e-7, rel=1e-12)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_levels_are_powers_of_two_then_k():
    assert pass_levels(1) == [1]
    assert pass_levels(4) == [1, 2, 4]
    assert pass_levels(32) == [1, 2, 4, 8, 16, 32]
    assert pass_levels(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError):
        pass_levels(0)


def test_avg_at_k_on_a_known_set():
    counts = [0, 1, 4, 2]  # correct samples of four problems, k = 4
    assert avg_at_k(counts, 4) == pytest.approx((0 + 0.25 + 1 + 0.5) / 4, rel=1e-15)
    # Unbiased pass@1 is avg@k; pass@k is the fraction of problems with any correct sample.
    assert mean_pass_at(counts, 4, 1) == pytest.approx(avg_at_k(counts, 4), rel=1e-15)
    assert mean_pass_at(counts, 4, 4) == pytest.approx(3 / 4, rel=1e-15)
    assert mean_pass_at(counts, 4, 2) == pytest.approx((0 + 0.5 + 1 + 5 / 6) / 4, rel=1e-15)
    with pytest.raises(ValueError):
        avg_at_k([5], 4)
    with pytest.raises(ValueError):
        avg_at_k([], 4)
