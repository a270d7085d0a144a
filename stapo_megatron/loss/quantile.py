"""Exact quantile thresholds over values spread across ranks.

Definition used everywhere (S2T's tau_h, the 20-Entropy cut): for n values and a fraction q,

    k = floor(q * n)  (q taken as the decimal it is written as, so 0.8 * 10 is exactly 8)
    threshold(q) = the (k+1)-th smallest value  (+inf when k == n, i.e. q == 1; +inf for n == 0)

so that ``values < threshold`` selects exactly the k smallest values when they are distinct.
Equivalently threshold = min{x : #{v <= x} > q n}, the "inverted CDF" quantile. Values tied
with the threshold are never below it: with ties the selection is smaller than k, never larger,
and it does not depend on the order of the values or on how they are split across ranks.

Floating values are compared in fp32; integer values (the s2t_random rule's per-token scores) stay
int64, so distinct integers never round to a tie, and "+inf" is then the int64 maximum (integer
values must lie below it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import torch
import torch.distributed as dist

Number = float | Fraction


def as_fraction(q: Number) -> Fraction:
    """``q`` as the decimal it is written as (``0.8`` -> 4/5), so ``floor(q * n)`` has no rounding error."""
    return q if isinstance(q, Fraction) else Fraction(repr(float(q)))


def gather_values(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate 1-D ``values`` of every rank of ``group`` (counts may differ per rank), rank order."""
    values = values.reshape(-1)
    if group is None or dist.get_world_size(group) == 1:
        return values
    world = dist.get_world_size(group)
    count = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
    gathered_counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(gathered_counts, count, group=group)
    counts = [int(c) for c in gathered_counts]
    longest = max(counts)
    if longest == 0:
        return values
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def quantile_threshold(
    values: torch.Tensor | Sequence[torch.Tensor],
    q: Number,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The threshold(q) of the module docstring over all ``values`` of all ranks of ``group``.

    ``values``: one tensor or a list (e.g. one per micro-batch) of this rank's values; the
    result is the same scalar on every rank: fp32, or int64 when every value tensor is integer.
    """
    if isinstance(values, torch.Tensor):
        values = [values]
    if not values:
        raise ValueError("values: need at least one tensor (it may be empty)")
    integer = not any(v.dtype.is_floating_point for v in values)
    dtype = torch.int64 if integer else torch.float32
    local = torch.cat([v.reshape(-1).to(dtype) for v in values])
    q = as_fraction(q)
    if not 0 <= q <= 1:
        raise ValueError(f"q: must be in [0, 1], got {float(q)}")
    everything = gather_values(local, group)
    n = everything.numel()
    k = math.floor(q * n)
    if k >= n:
        above_all = torch.iinfo(torch.int64).max if integer else float("inf")
        return torch.tensor(above_all, dtype=dtype, device=local.device)
    return torch.kthvalue(everything, k + 1).values
