"""The study's statistic over seeds: the mean and its 95% percentile bootstrap interval."""

from __future__ import annotations

import numpy as np
import pytest

from stapo_megatron.experiment.stats import Interval, bootstrap_mean


def test_two_seeds_give_the_whole_range():
    """Resampled means of {0, 1} are 0, 0.5, 1 with chances 1/4, 1/2, 1/4: the 2.5th and 97.5th
    percentiles of 10,000 of them are 0 and 1."""
    assert Interval.of([0.0, 1.0]) == Interval(0.5, 0.0, 1.0, 2)


def test_the_interval_brackets_the_mean_as_the_normal_approximation_says():
    """0..4: the bootstrap mean's sd is sqrt(2 / 5) = 0.632, so about 2 -+ 1.24; resampled means
    are multiples of 0.2."""
    interval = Interval.of([0.0, 1.0, 2.0, 3.0, 4.0])
    assert interval.mean == 2.0
    assert 0.6 <= interval.low <= 1.0 < 2.0 < 3.0 <= interval.high <= 3.4


def test_it_is_deterministic_for_a_seed_and_the_seed_matters():
    values = np.random.default_rng(7).normal(size=8)
    first, again = bootstrap_mean(values), bootstrap_mean(values)
    assert [float(x) for x in first] == [float(x) for x in again]
    other = bootstrap_mean(values, seed=1)
    assert float(other[0]) == float(first[0]) and (float(other[1]), float(other[2])) != (
        float(first[1]),
        float(first[2]),
    )


@pytest.mark.parametrize("values", [[0.3], [0.3] * 5, [0.0] * 4])
def test_one_seed_or_equal_values_give_that_value_exactly(values):
    assert Interval.of(values) == Interval(values[0], values[0], values[0], len(values))


def test_a_column_per_step_is_the_one_dimensional_interval_of_each_column():
    """The figures' bands and the table use the same resamples: column k of a [seeds, steps]
    call is the call on column k alone."""
    data = np.random.default_rng(3).uniform(size=(5, 4))
    mean, low, high = bootstrap_mean(data)
    assert mean.shape == low.shape == high.shape == (4,)
    for k in range(4):
        alone = Interval.of(list(data[:, k]))
        assert (alone.mean, alone.low, alone.high) == pytest.approx((mean[k], low[k], high[k]), abs=1e-15)
        assert low[k] <= high[k]


@pytest.mark.parametrize("values, message", [([], "at least one seed"), ([1.0, float("nan")], "not all finite")])
def test_no_seed_or_a_value_that_is_not_finite_is_refused(values, message):
    with pytest.raises(ValueError, match=message):
        bootstrap_mean(values)


def test_text():
    assert Interval(0.5, 0.25, 0.75, 3).text(".3f") == "0.500 [0.250, 0.750]"
    assert Interval(0.001, 0.0, 0.002, 3).text(".3%") == "0.100% [0.000%, 0.200%]"
