"""Statistics over a study's seeds: the mean and its 95% percentile bootstrap interval.

Resampling: :data:`RESAMPLES` resamples of the seeds with replacement (multinomial counts from
numpy's ``default_rng(SEED)``, so a table or figure is the same every time it is written), the
mean of each, and the 2.5th and 97.5th percentiles of those means (``numpy.quantile``'s linear
interpolation). The interval is clipped to the range of the data, which holds every resampled
mean, so that one seed or equal values give the interval of that value exactly rather than
rounding noise. With 5 seeds there are only 126 distinct resamples and the percentile interval is
known to be too narrow (it covers the true mean less often than 95%); it describes the spread of
these seeds, not a test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

RESAMPLES = 10_000
SEED = 0
CONFIDENCE = 0.95


def bootstrap_mean(
    samples: Sequence[float] | Sequence[Sequence[float]] | np.ndarray,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mean over axis 0 of ``samples`` (``[seeds]`` or ``[seeds, k]``: a column per step or
    quantity) and its percentile bootstrap interval, as arrays of shape ``samples.shape[1:]``.
    Every column is resampled with the same seeds, so a column's interval is the one its own
    1-D call gives."""
    data = np.asarray(samples, dtype=np.float64)
    if data.ndim not in (1, 2) or data.shape[0] == 0:
        raise ValueError(f"samples: expected [seeds] or [seeds, k] with at least one seed, got shape {data.shape}")
    if not np.isfinite(data).all():
        raise ValueError("samples: not all finite")
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError(f"resamples {resamples} must be >= 1 and confidence {confidence} in (0, 1)")
    seeds = data.shape[0]
    flat = data.reshape(seeds, -1)
    counts = np.random.default_rng(seed).multinomial(seeds, np.full(seeds, 1.0 / seeds), size=resamples)
    means = counts @ flat / seeds  # [resamples, k]
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail], axis=0)
    smallest, largest = flat.min(axis=0), flat.max(axis=0)
    shape = data.shape[1:]
    return (
        flat.mean(axis=0).reshape(shape),
        np.clip(low, smallest, largest).reshape(shape),
        np.clip(high, smallest, largest).reshape(shape),
    )


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean over seeds with its bootstrap interval."""

    mean: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Interval:
        mean, low, high = bootstrap_mean(values)
        return cls(float(mean), float(low), float(high), len(values))

    def text(self, spec: str) -> str:
        """``mean [low, high]``, each formatted with ``spec`` (``.3f``, ``.3%``)."""
        return f"{self.mean:{spec}} [{self.low:{spec}}, {self.high:{spec}}]"
