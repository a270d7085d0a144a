"""Qwen3 under tensor, sequence and pipeline parallelism: layout checks and this rank's model stage.

Any layer count splits over any number of pipeline stages up to it
(:func:`stapo_megatron.models.qwen3.config.pipeline_split`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stapo_megatron.config import ConfigError
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.model import build_gpt_model, transformer_config

if TYPE_CHECKING:
    from stapo_megatron.runtime.distributed import ParallelContext


def check_layout(arch: Qwen3Config, tensor_parallel: int, pipeline_parallel: int) -> None:
    """Reject layouts Megatron cannot build for ``arch``, with the field at fault."""
    if arch.num_attention_heads % tensor_parallel:
        raise ConfigError(
            f"parallel.tensor_parallel: {tensor_parallel} does not divide the "
            f"{arch.num_attention_heads} attention heads"
        )
    if arch.num_key_value_heads % tensor_parallel:
        raise ConfigError(
            f"parallel.tensor_parallel: {tensor_parallel} does not divide the "
            f"{arch.num_key_value_heads} query groups (key/value heads)"
        )
    if pipeline_parallel > arch.num_hidden_layers:
        raise ConfigError(
            f"parallel.pipeline_parallel: {pipeline_parallel} stages is more than the {arch.num_hidden_layers} layers"
        )


def sequence_multiple(tensor_parallel: int, sequence_parallel: bool) -> int:
    """What every micro-batch's sequence length must be a multiple of: under sequence
    parallelism each tensor-parallel rank holds an equal slice of the sequence positions."""
    return tensor_parallel if sequence_parallel else 1


def build_stage(
    arch: Qwen3Config,
    ctx: ParallelContext,
    *,
    params_dtype: torch.dtype = torch.float32,
    perform_initialization: bool = True,
    recompute: str = "none",
    sequence_parallel: bool = False,
    calculate_per_token_loss: bool = False,
    device: torch.device | None = None,
):
    """This rank's pipeline stage of Qwen3, at its place in ``ctx`` (what ``init_distributed`` returned).

    ``sequence_parallel``: Megatron's sequence parallelism (TP > 1); then the inputs' sequence
    length must be a multiple of TP (:func:`sequence_multiple`). The logits come back whole
    along the sequence ([b, s, V/TP]): the output layer gathers it before its matmul.
    """
    check_layout(arch, ctx.tp_size, ctx.pp_size)
    config = transformer_config(
        arch,
        tensor_parallel=ctx.tp_size,
        pipeline_parallel=ctx.pp_size,
        context_parallel=ctx.cp_size,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        perform_initialization=perform_initialization,
        recompute=recompute,
        calculate_per_token_loss=calculate_per_token_loss,
    )
    model = build_gpt_model(
        arch,
        config,
        pre_process=ctx.is_first_stage,
        post_process=ctx.is_last_stage,
    )
    if device is not None:
        model = model.to(device)
    return model
