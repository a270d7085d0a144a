"""Reduce the loss metrics over micro-batches and ranks: sums, except ``*_max`` (max) and ``*_min`` (min).

Means are formed only after the reduction (e.g. masked fraction = silenced_tokens /
response_tokens, mean tau_h = tau_h_sum / tau_h_count), so they are exact mini-batch values.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch
import torch.distributed as dist


def _kind(key: str) -> str:
    return "max" if key.endswith("_max") else "min" if key.endswith("_min") else "sum"


def reduce_metrics(items: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine the metrics of several micro-batches; a key missing from some items is reduced over the others."""
    out: dict[str, torch.Tensor] = {}
    for item in items:
        for key, value in item.items():
            value = value.detach()
            if key not in out:
                out[key] = value.clone()
            elif _kind(key) == "max":
                out[key] = torch.maximum(out[key], value)
            elif _kind(key) == "min":
                out[key] = torch.minimum(out[key], value)
            else:
                out[key] = out[key] + value
    return out


def all_reduce_metrics(
    metrics: Mapping[str, torch.Tensor], group: Optional[dist.ProcessGroup] = None
) -> dict[str, torch.Tensor]:
    """``metrics`` reduced over the ranks of ``group`` (every rank must hold the same keys); at most
    three all-reduces. ``group=None``: returned as is."""
    if group is None or dist.get_world_size(group) == 1:
        return dict(metrics)
    out = {}
    for kind, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
        keys = sorted(k for k in metrics if _kind(k) == kind)
        if not keys:
            continue
        packed = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys])
        dist.all_reduce(packed, op=op, group=group)
        out.update(zip(keys, packed.unbind()))
    return out
