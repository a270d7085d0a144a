"""Forward and backward passes through Megatron's pipeline schedules.

A micro-batch is a dict of tensors with at least ``input_ids`` and ``position_ids`` ([b, s]); a
packed one ([1, s], see trainer/batch.py) adds ``cu_seqlens`` and ``max_seqlen``.
A training pass may run any items that carry a micro-batch (``tensors_of(item)``: its dict), for a
loss that reads more than the tensors. ``step_fn(logits, item)`` runs on the last pipeline stage on
this rank's vocabulary slice of the logits ([b, s, V/tp]): in training it returns Megatron's per-token loss triple
``(loss_sum, num_tokens, report)``; forward-only, whatever it returns is collected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from stapo_megatron.models.qwen3.model import packed_seq_params


def _same(microbatch: dict) -> dict:
    return microbatch


def _forward_step(step_fn: Callable, collect: bool, tensors_of: Callable[[Any], dict], data_iterator, model):
    item = next(data_iterator)
    batch = tensors_of(item)
    packed = None
    if "cu_seqlens" in batch:  # a packed row (trainer/batch.py)
        packed = packed_seq_params(batch["cu_seqlens"], batch["max_seqlen"])
    logits = model(batch["input_ids"], batch["position_ids"], None, packed_seq_params=packed)

    def loss_func(output, non_loss_data: bool = False):
        return step_fn(output, item)

    return logits, loss_func


def _run(model, items: Sequence, step_fn: Callable, forward_only: bool, tensors_of: Callable[[Any], dict] = _same):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not items:
        raise ValueError("no micro-batches to run")
    chunks = model if isinstance(model, list) else [model]
    microbatches = [tensors_of(item) for item in items]
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, step_fn, forward_only, tensors_of),
        data_iterator=iter(items),
        model=chunks,
        num_microbatches=len(items),
        seq_length=max(int(b["input_ids"].shape[1]) for b in microbatches),
        micro_batch_size=int(microbatches[0]["input_ids"].shape[0]),
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )


def forward_only(model, microbatches: Sequence[dict], step_fn: Callable[[torch.Tensor, dict], Any]) -> list[Any]:
    """``step_fn``'s result for each micro-batch on the last pipeline stage; [] elsewhere."""
    with torch.no_grad():
        return list(_run(model, microbatches, step_fn, forward_only=True))


def forward_backward(
    model,
    items: Sequence[Any],
    loss_fn: Callable[[torch.Tensor, Any], tuple],
    tensors_of: Callable[[Any], dict] = _same,
) -> list[dict]:
    """Accumulate gradients over ``items`` (micro-batches, or what ``tensors_of`` reads them from);
    returns the per-micro-batch reports (last stage)."""
    return list(_run(model, items, loss_fn, forward_only=False, tensors_of=tensors_of))
