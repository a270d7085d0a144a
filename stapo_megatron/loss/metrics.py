"""Every metric declares its reduction once, next to where it is computed.

:func:`declare` registers a metric's name with its :class:`Reduction` and what it is. Two levels
read the declarations:

- raw metrics (fp64 scalar tensors of one micro-batch, e.g. the loss's ``kept_tokens``) are
  combined over micro-batches by :func:`reduce_metrics` and over data-parallel ranks by
  :func:`all_reduce_metrics`; they are sums, maxima or minima, so that every mean is formed only
  after the reduction (masked fraction = silenced_tokens / response_tokens) and is the exact
  mini-batch value;
- logged metrics (floats of one optimizer step, e.g. ``s2t/masked_fraction``) are combined over
  the optimizer steps of a training step by :func:`combine_steps`: counts are summed, extremes
  kept, and a per-token mean or fraction is weighted by the token count it was divided by (a
  logged metric of the same row), which gives the exact value over the whole step rather than a
  mean of the steps' means.

A metric without a declaration is an error naming it, at either level.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist


class Reduction(enum.Enum):
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    MEAN = "mean"  # plain mean: for values without a token weight (grad norm, a threshold)
    WEIGHTED_MEAN = "weighted_mean"  # sum(value * weight) / sum(weight), weight: a summed metric


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    name: str
    reduction: Reduction
    doc: str
    weight: str | None = None  # WEIGHTED_MEAN: the name of the metric it is weighted by


_DECLARED: dict[str, MetricSpec] = {}

# The doc of a metric of the old-statistics pass: with batch.skip_zero_advantage that pass runs
# only the sequences with a nonzero advantage, and so does the metric.
OLD_PASS_ONLY = "; covers only the sequences the old-statistics pass ran (not the skipped zero-advantage ones)"

# Raw metrics go over the wire: one all-reduce per kind.
_TENSOR_OPS = {Reduction.SUM: dist.ReduceOp.SUM, Reduction.MAX: dist.ReduceOp.MAX, Reduction.MIN: dist.ReduceOp.MIN}


def declare(reduction: Reduction, docs: Mapping[str, str], weight: str | None = None) -> None:
    """Declare each metric of ``docs`` (name -> what it is) with ``reduction`` (and, for
    ``WEIGHTED_MEAN``, the metric ``weight`` it is weighted by). Declaring a name again with the
    same reduction and doc is a no-op; with another, an error."""
    if (reduction is Reduction.WEIGHTED_MEAN) != (weight is not None):
        raise ValueError(
            f"declare: weight is needed by WEIGHTED_MEAN and only by it (got {reduction.name}, weight={weight!r})"
        )
    for name, doc in docs.items():
        spec = MetricSpec(name, reduction, doc, weight)
        known = _DECLARED.setdefault(name, spec)
        if known != spec:
            raise ValueError(f"metric {name!r}: declared twice ({known.reduction.value} and {spec.reduction.value})")


def spec_of(name: str) -> MetricSpec:
    """The declaration of ``name``; an undeclared metric is a ``KeyError`` naming it."""
    try:
        return _DECLARED[name]
    except KeyError:
        raise KeyError(
            f"metric {name!r} has no declared reduction (declare it with "
            f"stapo_megatron.loss.metrics.declare where it is computed)"
        ) from None


def declared() -> dict[str, MetricSpec]:
    """Every declaration so far (name -> spec), for documentation and tests."""
    return dict(_DECLARED)


def _tensor_reduction(name: str) -> Reduction:
    reduction = spec_of(name).reduction
    if reduction not in _TENSOR_OPS:
        raise ValueError(
            f"metric {name!r}: a raw metric must be a sum, max or min (form {reduction.value}s "
            f"after the reduction), declared {reduction.value}"
        )
    return reduction


def reduce_metrics(items: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine the raw metrics of several micro-batches by their declared reductions; a key
    missing from some items is reduced over the others."""
    out: dict[str, torch.Tensor] = {}
    for item in items:
        for key, value in item.items():
            reduction = _tensor_reduction(key)
            value = value.detach()
            if key not in out:
                out[key] = value.clone()
            elif reduction is Reduction.MAX:
                out[key] = torch.maximum(out[key], value)
            elif reduction is Reduction.MIN:
                out[key] = torch.minimum(out[key], value)
            else:
                out[key] = out[key] + value
    return out


def all_reduce_metrics(
    metrics: Mapping[str, torch.Tensor],
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """Raw ``metrics`` reduced over the ranks of ``group`` by their declared reductions (every
    rank must hold the same keys): at most one all-reduce per kind, of one fp64 vector on
    ``device`` (default: where the metrics are; NCCL needs the current CUDA device).
    ``group=None``: returned as is."""
    kinds = {key: _tensor_reduction(key) for key in metrics}
    if group is None or dist.get_world_size(group) == 1:
        return dict(metrics)
    out: dict[str, torch.Tensor] = {}
    for reduction, op in _TENSOR_OPS.items():
        keys = sorted(k for k, kind in kinds.items() if kind is reduction)
        if not keys:
            continue
        packed = torch.stack([metrics[k].detach().reshape(()).to(device=device, dtype=torch.float64) for k in keys])
        dist.all_reduce(packed, op=op, group=group)
        out.update(zip(keys, packed.unbind()))
    return out


def combine_steps(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The logged metrics of a training step from those of its optimizer steps (``rows``), each
    by its declared reduction. Non-finite values (a threshold that did not exist, logged as null)
    are left out, with their weight; a metric with no finite value is NaN. A weighted mean whose
    weights are all 0 is the plain mean."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        spec = spec_of(key)
        present = [row for row in rows if key in row and math.isfinite(row[key])]
        values = [row[key] for row in present]
        if not values:
            out[key] = float("nan")  # logged as null: the key stays in every row
        elif spec.reduction is Reduction.SUM:
            out[key] = sum(values)
        elif spec.reduction is Reduction.MAX:
            out[key] = max(values)
        elif spec.reduction is Reduction.MIN:
            out[key] = min(values)
        elif spec.reduction is Reduction.MEAN:
            out[key] = sum(values) / len(values)
        else:
            weight = spec.weight
            assert weight is not None  # declare() gives every WEIGHTED_MEAN its weight
            if any(weight not in row for row in present):
                raise KeyError(f"metric {key!r}: its weight {weight!r} is missing from an optimizer step's metrics")
            weights = [row[weight] for row in present]
            total = sum(weights)
            out[key] = sum(v * w for v, w in zip(values, weights)) / total if total > 0 else sum(values) / len(values)
    return out
