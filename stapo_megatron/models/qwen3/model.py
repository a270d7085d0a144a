"""Qwen3 as a Megatron-Core ``GPTModel``: the plain definition, no parallel layout decisions.

Transformer Engine's layer spec when it imports, Megatron's local spec otherwise: the choice
is one ``ModuleSpec``, and the fused kernels that need Transformer Engine or apex follow it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from stapo_megatron.models.qwen3.config import Qwen3Config

# Megatron pads the vocabulary to a multiple of this times the tensor-parallel size.
VOCAB_DIVISIBLE_BY = 128


@functools.lru_cache(maxsize=None)
def transformer_engine_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising OSError/RuntimeError
        return False
    return True


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def layer_spec():
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_engine_available():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")


def transformer_config(
    arch: Qwen3Config,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    perform_initialization: bool = True,
    use_cpu_initialization: bool = False,
    init_method_std: float = 0.02,
    recompute: str = "none",
    calculate_per_token_loss: bool = False,
):
    """The Megatron ``TransformerConfig`` that reproduces ``arch`` exactly."""
    from megatron.core.transformer import TransformerConfig

    fused = transformer_engine_available()
    recompute_kwargs = {}
    if recompute == "full":
        recompute_kwargs = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        recompute_kwargs = dict(recompute_granularity="selective")
    return TransformerConfig(
        num_layers=arch.num_hidden_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=init_method_std,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        context_parallel_size=context_parallel,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # False: parameters are created on this rank's device, each TP shard initialised from
        # the model-parallel RNG. True: created with the default device (meta, for counting).
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        # RL batches have a different sequence length in every micro-batch.
        variable_seq_lengths=True,
        # Dense model: no experts. Megatron rejects the default MoE dispatcher with variable lengths.
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=calculate_per_token_loss,
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=fused,
        apply_rope_fusion=fused,
        gradient_accumulation_fusion=fused,
        **recompute_kwargs,
    )


def build_gpt_model(
    arch: Qwen3Config, config, *, pre_process: bool = True, post_process: bool = True, vp_stage=None, pg_collection=None
):
    """One pipeline stage of Qwen3. Logits stay split over the tensor-parallel vocabulary.

    ``pg_collection``: Megatron's process groups to build with (default: the global parallel state).
    """
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(),
        vocab_size=padded_vocab_size(arch.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
