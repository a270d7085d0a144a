"""Scores of sampled responses: avg@k and the unbiased pass@k estimator.

avg@k is the mean accuracy over the k samples of each problem, averaged over problems (the STAPO
paper's metric). pass@j is Chen et al. (2021)'s unbiased estimator from n samples of which c are
correct: 1 - C(n-c, j) / C(n, j), averaged over problems.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct.

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), in log space: the binomial coefficients themselves
    overflow a float long before n reaches the thousands.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    log_all_wrong = math.fsum(math.log1p(-k / i) for i in range(n - c + 1, n + 1))
    # -expm1 keeps precision when pass@k is tiny (log_all_wrong close to 0).
    return -math.expm1(log_all_wrong)


def pass_levels(k: int) -> list[int]:
    """The j of the reported pass@j: 1, 2, 4, ... below k, and k itself."""
    if k < 1:
        raise ValueError(f"pass_levels: k must be >= 1, got {k}")
    levels, j = [], 1
    while j < k:
        levels.append(j)
        j *= 2
    return levels + [k]


def avg_at_k(correct_counts: Sequence[int], k: int) -> float:
    """Mean over problems of the fraction of their k samples that are correct."""
    if not correct_counts:
        raise ValueError("avg_at_k: no problems")
    for c in correct_counts:
        if not 0 <= c <= k:
            raise ValueError(f"avg_at_k: a problem has {c} correct of {k} samples")
    return math.fsum(c / k for c in correct_counts) / len(correct_counts)


def mean_pass_at(correct_counts: Sequence[int], n: int, j: int) -> float:
    """pass@j averaged over problems, each with n samples."""
    if not correct_counts:
        raise ValueError("mean_pass_at: no problems")
    return math.fsum(pass_at_k(n, c, j) for c in correct_counts) / len(correct_counts)
