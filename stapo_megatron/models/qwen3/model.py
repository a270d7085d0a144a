"""Qwen3 as a Megatron-Core ``GPTModel``: the plain definition, no parallel layout decisions.

Transformer Engine's layer spec when it imports, Megatron's local spec otherwise: the choice
is one ``ModuleSpec``, and the fused kernels that need Transformer Engine follow it; the fused
weight-gradient accumulation follows apex's kernel, which Megatron's own linear layers need.

megatron-core 0.19 deprecates ``GPTModel`` (bug fixes only) for ``HybridModel``, and logs so at
every build: it still builds and trains Qwen3 unchanged, so the notice is shown once per process.
The move to ``HybridModel`` (0.19+ only) is a layer pattern of one attention layer ``*`` and one MLP
layer ``-`` per Qwen3 layer, which renumbers every parameter (``decoder.layers.{2i}`` attention,
``{2i+1}`` MLP): the Hugging Face mapping (``state_dict_adapter.py``), the pipeline split
(``parallelize.py``), the weight sync's names and stored checkpoints follow the names, and a
converter of old checkpoints comes with it.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from stapo_megatron.models.qwen3.config import (
    Qwen3Config,
    first_and_last_stage_layers,
    padded_vocab_size,
    pipeline_split,
)


@functools.cache
def transformer_engine_available() -> bool:
    """Transformer Engine imports and this process sees a GPU (a rank run on the CPU of a GPU host,
    its GPUs hidden, takes the local spec even where TE is installed)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising OSError/RuntimeError
        return False
    return True


@functools.cache
def apex_gradient_accumulation_available() -> bool:
    """Whether apex's fused weight-gradient kernel imports. Megatron's own ``ColumnParallelLinear``
    (the output layer, whatever the layer spec) refuses ``gradient_accumulation_fusion`` without it,
    and Transformer Engine does not bring it: a TE install without apex must leave the flag off."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:  # what Megatron's layers.py catches for the same module
        return False
    return True


class RMSNorm(torch.nn.RMSNorm):
    """The local spec's RMSNorm (torch's), usable under sequence parallelism.

    Megatron's ``WrappedTorchNorm`` refuses sequence parallelism because each tensor-parallel
    rank then normalizes only its slice of the sequence, so the weight's gradient is a partial
    sum: marking the weight ``sequence_parallel`` has ``finalize_model_grads`` sum it over the
    TP group, as Transformer Engine's norms do. Built in fp32 whatever the model's dtype, like
    the norm it replaces (the planner counts it so).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # Megatron's flag


@functools.cache
def packed_local_attention() -> type:
    """Megatron's local (non-Transformer-Engine) attention, also for THD packed rows.

    Megatron's local ``DotProductAttention`` refuses THD. Attention has already applied the
    per-sequence rotary positions from ``cu_seqlens`` by then (its THD RoPE is plain torch) and
    dropped the batch dimension; running the local attention on each sequence's slice with its
    causal mask is what Transformer Engine's THD kernel computes, at the same sum over sequences of
    length^2 (a block-diagonal mask over the row would cost row^2). Built on first use: importing
    Megatron's attention must come after the runtime set-up.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        def forward(
            self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
        ):
            if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            # [t, heads, dim] slices -> [s, 1, heads, dim]; each output is [s, 1, heads * dim]
            return torch.cat(
                [
                    super(PackedDotProductAttention, self).forward(
                        query[lo:hi].unsqueeze(1),
                        key[lo:hi].unsqueeze(1),
                        value[lo:hi].unsqueeze(1),
                        None,
                        attn_mask_type,
                        attention_bias,
                        None,
                    )
                    for lo, hi in zip(bounds[:-1], bounds[1:])
                ]
            )

    return PackedDotProductAttention


def layer_spec():
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_engine_available():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    attention = spec.submodules.self_attention.submodules
    attention.q_layernorm = attention.k_layernorm = RMSNorm
    attention.core_attention = packed_local_attention()
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm
    return spec


def block_spec(config, stage: int):
    """The decoder of pipeline stage ``stage``: its layers and (local spec) its final norm.

    Transformer Engine's layer spec gets Megatron's block (TENorm as final norm); the local
    spec names its final norm here, since Megatron's default for it rejects sequence parallelism.
    """
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if transformer_engine_available():
        return layer_spec()
    layers = pipeline_split(config.num_layers, config.pipeline_model_parallel_size)[stage]
    return TransformerBlockSubmodules(layer_specs=[layer_spec()] * layers, layer_norm=RMSNorm)


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
    first_stage_layers, last_stage_layers = first_and_last_stage_layers(arch.num_hidden_layers, pipeline_parallel)
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
        # uneven splits (models/qwen3/config.py::pipeline_split); None for an even one
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
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
        gradient_accumulation_fusion=apex_gradient_accumulation_available(),
        **recompute_kwargs,
    )


class _FirstDeprecationNotice(logging.Filter):
    """Lets megatron-core 0.19's GPTModel deprecation notice through once per process."""

    def __init__(self):
        super().__init__()
        self.shown = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "GPTModel IS DEPRECATED" not in record.getMessage():
            return True
        shown, self.shown = self.shown, True
        return not shown


_DEPRECATION_NOTICE = _FirstDeprecationNotice()


def build_gpt_model(
    arch: Qwen3Config, config, *, pre_process: bool = True, post_process: bool = True, vp_stage=None, pg_collection=None
):
    """One pipeline stage of Qwen3. Logits stay split over the tensor-parallel vocabulary.

    ``pg_collection``: Megatron's process groups to build with (default: the global parallel state).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    # the logger of megatron.core.models.gpt.gpt_model (0.19+); a logger holds a filter once
    logging.getLogger(GPTModel.__module__).addFilter(_DEPRECATION_NOTICE)
    stage = pg_collection.pp.rank() if pg_collection is not None else ps.get_pipeline_model_parallel_rank()
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, stage),
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


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int):
    """Megatron's THD description of one packed row: sequences back to back, boundaries at
    ``cu_seqlens`` (int32, on the model's device). Attention stays within each sequence and rotary
    positions restart at each boundary: Transformer Engine's attention reads it natively; the local
    spec (CPU) through :mod:`stapo_megatron.runtime.cpu_compat`."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
    )
