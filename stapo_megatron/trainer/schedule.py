"""Forward and backward passes through Megatron's pipeline schedules.

A micro-batch is a dict of tensors with at least ``input_ids`` and ``position_ids`` ([b, s]); a
packed one ([1, s], see trainer/batch.py) adds ``cu_seqlens`` and ``max_seqlen``.
``step_fn(logits, batch)`` runs on the last pipeline stage on this rank's vocabulary slice of the
logits ([b, s, V/tp]): in training it returns Megatron's per-token loss triple
``(loss_sum, num_tokens, report)``; forward-only, whatever it returns is collected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from stapo_megatron.models.qwen3.model import packed_seq_params


def _forward_step(step_fn: Callable, collect: bool, data_iterator, model):
    batch = next(data_iterator)
    packed = None
    if "cu_seqlens" in batch:  # a packed row (trainer/batch.py)
        packed = packed_seq_params(batch["cu_seqlens"], batch["max_seqlen"])
    logits = model(batch["input_ids"], batch["position_ids"], None, packed_seq_params=packed)

    def loss_func(output, non_loss_data: bool = False):
        return step_fn(output, batch)

    return logits, loss_func if collect else partial(step_fn, batch=batch)


def _run(model, microbatches: Sequence[dict], step_fn: Callable, forward_only: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not microbatches:
        raise ValueError("no micro-batches to run")
    chunks = model if isinstance(model, list) else [model]
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, step_fn, forward_only),
        data_iterator=iter(microbatches),
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=max(int(b["input_ids"].shape[1]) for b in microbatches),
        micro_batch_size=int(microbatches[0]["input_ids"].shape[0]),
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
    )


def forward_only(model, microbatches: Sequence[dict], step_fn: Callable[[torch.Tensor, dict], Any]) -> list[Any]:
    """``step_fn``'s result for each micro-batch on the last pipeline stage; [] elsewhere."""
    with torch.no_grad():
        return list(_run(model, microbatches, step_fn, forward_only=True))


def forward_backward(model, microbatches: Sequence[dict], loss_fn: Callable[[torch.Tensor, dict], tuple]) -> list[dict]:
    """Accumulate gradients over ``microbatches``; returns the per-micro-batch reports (last stage)."""
    return list(_run(model, microbatches, loss_fn, forward_only=False))
