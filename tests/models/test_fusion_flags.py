"""The fused kernels follow what is installed. Transformer Engine without apex (what
``pip install -e ".[gpu]"`` gives) turns on TE's fusions but not gradient_accumulation_fusion:
Megatron's own ColumnParallelLinear, the output layer of every last pipeline stage, refuses that
flag when apex's ``fused_weight_gradient_mlp_cuda`` does not import.

Transformer Engine cannot be installed on a CPU machine, so the tests stand in for it: the model
module is told TE imports, and Megatron's fused-RoPE hook (which TransformerConfig checks for) is a
function that fails if anything ever calls it.
"""

from __future__ import annotations

import sys
import types

import pytest

from stapo_megatron.config import build
from stapo_megatron.models.qwen3 import model
from stapo_megatron.models.qwen3.config import Qwen3Config, padded_vocab_size
from stapo_megatron.runtime.launch import spawn_ranks


def _never_called(*args, **kwargs):
    raise AssertionError("a Transformer Engine stand-in was called")


def _transformer_engine_installed(patch) -> None:
    """``patch(obj, name, value)``: pytest's monkeypatch.setattr, or plain setattr in a spawned rank."""
    from megatron.core.models.common.embeddings import rope_utils

    patch(model, "transformer_engine_available", lambda: True)
    patch(rope_utils, "fused_apply_rotary_pos_emb", _never_called)


def build_output_layer_with_transformer_engine_without_apex() -> None:
    """A rank: the config of a TE install without apex builds Megatron's output layer."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, layers

    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    init_distributed(ParallelConfig())
    _transformer_engine_installed(setattr)
    assert layers._grad_accum_fusion_available is False  # this machine has no apex: Megatron's own check
    arch = build(Qwen3Config, "qwen3_0.6b")
    config = model.transformer_config(arch, use_cpu_initialization=True, perform_initialization=False)
    assert config.apply_rope_fusion and config.bias_activation_fusion and config.masked_softmax_fusion
    # What GPTModel builds as its output layer (with the flag on, its constructor raises).
    layer = ColumnParallelLinear(
        arch.hidden_size,
        padded_vocab_size(arch.vocab_size, 1),
        config=config,
        init_method=config.init_method,
        bias=False,
        skip_weight_param_allocation=True,
    )
    assert not (config.gradient_accumulation_fusion or layer.gradient_accumulation_fusion)


def test_transformer_engine_without_apex_builds_the_output_layer():
    spawn_ranks(build_output_layer_with_transformer_engine_without_apex, 1)


def test_the_flag_follows_apex_fused_weight_gradient_kernel(monkeypatch):
    _transformer_engine_installed(monkeypatch.setattr)
    arch = build(Qwen3Config, "qwen3_0.6b")
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", None)  # its import raises ImportError
    model.apex_gradient_accumulation_available.cache_clear()
    assert not model.transformer_config(arch).gradient_accumulation_fusion

    kernel = types.ModuleType("fused_weight_gradient_mlp_cuda")  # apex's module, never called here
    kernel.wgrad_gemm_accum_fp32 = kernel.wgrad_gemm_accum_fp16 = _never_called  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", kernel)
    model.apex_gradient_accumulation_available.cache_clear()
    try:
        assert model.transformer_config(arch).gradient_accumulation_fusion
    finally:
        model.apex_gradient_accumulation_available.cache_clear()  # the next caller sees the real install


@pytest.mark.parametrize("installed", [False, True])
def test_the_local_spec_fuses_nothing_that_needs_transformer_engine(monkeypatch, installed):
    monkeypatch.setattr(model, "transformer_engine_available", lambda: False)
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", types.ModuleType("x") if installed else None)
    model.apex_gradient_accumulation_available.cache_clear()
    try:
        config = model.transformer_config(build(Qwen3Config, "qwen3_0.6b"))
    finally:
        model.apex_gradient_accumulation_available.cache_clear()
    assert not (config.apply_rope_fusion or config.bias_activation_fusion or config.masked_softmax_fusion)
    assert config.gradient_accumulation_fusion is installed  # apex's kernel serves Megatron's own linears
