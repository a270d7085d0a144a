"""Qwen3 under tensor and pipeline parallelism: layout checks and this rank's model stage."""

from __future__ import annotations

import torch

from stapo_megatron.config import ConfigError
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.model import build_gpt_model, transformer_config


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
            f"parallel.pipeline_parallel: {pipeline_parallel} stages is more than the "
            f"{arch.num_hidden_layers} layers"
        )
    if arch.num_hidden_layers % pipeline_parallel:
        raise ConfigError(
            f"parallel.pipeline_parallel: {pipeline_parallel} does not divide the "
            f"{arch.num_hidden_layers} layers evenly"
        )


def build_stage(
    arch: Qwen3Config,
    *,
    params_dtype: torch.dtype = torch.float32,
    perform_initialization: bool = True,
    recompute: str = "none",
    calculate_per_token_loss: bool = False,
    device: torch.device | None = None,
):
    """This rank's pipeline stage of Qwen3, after ``init_distributed``."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    check_layout(arch, tp, pp)
    config = transformer_config(
        arch,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        context_parallel=ps.get_context_parallel_world_size(),
        params_dtype=params_dtype,
        perform_initialization=perform_initialization,
        recompute=recompute,
        calculate_per_token_loss=calculate_per_token_loss,
    )
    model = build_gpt_model(
        arch,
        config,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    if device is not None:
        model = model.to(device)
    return model
