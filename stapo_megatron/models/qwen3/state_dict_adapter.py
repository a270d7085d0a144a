"""Hugging Face Qwen3 names and layouts <-> Megatron ``GPTModel`` parameters.

Every Megatron parameter of a pipeline stage maps to one or more Hugging Face tensors and a
layout rule:

- ``replicated``: the same tensor on every tensor-parallel rank (the RMSNorm weights);
- ``vocab``: rows split over TP ranks, the vocabulary padded with zero rows that never leave;
- ``row``: split along the input dimension (``linear_proj``, ``linear_fc2``);
- ``qkv``: q, k and v interleaved per query group (each group: its query heads, then its key
  head, then its value head), whole groups per TP rank;
- ``gate_up``: this rank's slice of the gate projection followed by its slice of the up projection.

Loading reads only this rank's slice of each Hugging Face tensor; exporting takes the TP-gathered
full Megatron tensor and returns the Hugging Face tensors it holds.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator

import torch

from stapo_megatron.config import ConfigError
from stapo_megatron.models.qwen3.config import Qwen3Config

# (Megatron suffix inside a layer, Hugging Face suffix inside a layer, layout)
_LAYER_PARAMS = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    # Transformer Engine fuses the norm into the next linear layer.
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

SliceReader = Callable[[str, int, "int | None", "int | None"], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    """How one Megatron parameter of this rank is made of Hugging Face tensors."""

    megatron_name: str
    hf_names: tuple[str, ...]
    layout: str


def hf_tensor_shapes(arch: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face Qwen3 checkpoint holds, in the order it is exported."""
    h, f, hd = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for layer in range(arch.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "self_attn.o_proj.weight": (h, q),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


def param_mappings(model: torch.nn.Module, arch: Qwen3Config, layer_offset: int) -> list[ParamMapping]:
    """The mapping of each parameter of this stage, in ``named_parameters`` order."""
    mappings = []
    for name, _ in model.named_parameters():
        if name == "embedding.word_embeddings.weight":
            mappings.append(ParamMapping(name, ("model.embed_tokens.weight",), "vocab"))
        elif name == "output_layer.weight":
            # Tied embeddings under pipeline parallelism keep a copy of them on the last stage.
            hf = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
            mappings.append(ParamMapping(name, (hf,), "vocab"))
        elif name == "decoder.final_layernorm.weight":
            mappings.append(ParamMapping(name, ("model.norm.weight",), "replicated"))
        else:
            match = _LAYER_RE.match(name)
            if not match or match.group(2) not in _LAYER_PARAMS:
                raise ConfigError(f"Megatron parameter {name} has no Hugging Face Qwen3 counterpart")
            layer = layer_offset + int(match.group(1))
            hf_suffixes, layout = _LAYER_PARAMS[match.group(2)]
            mappings.append(ParamMapping(name, tuple(f"model.layers.{layer}.{s}" for s in hf_suffixes), layout))
    return mappings


def load_shard(
    mapping: ParamMapping,
    read: SliceReader,
    arch: Qwen3Config,
    local_shape: torch.Size,
    dtype: torch.dtype,
    tp_rank: int,
) -> torch.Tensor:
    """This rank's shard of a Megatron parameter, reading only the rows/columns it needs.

    ``read(name, dim, start, stop)`` returns rows (dim 0) or columns (dim 1) [start, stop) of
    a Hugging Face tensor, or all of it when ``start`` is None.
    """
    layout = mapping.layout
    if layout == "replicated":
        return read(mapping.hf_names[0], 0, None, None)
    if layout == "row":
        cols = local_shape[1]
        return read(mapping.hf_names[0], 1, tp_rank * cols, (tp_rank + 1) * cols)
    if layout == "vocab":
        rows = local_shape[0]
        start = tp_rank * rows
        stop = min(start + rows, arch.vocab_size)
        shard = torch.zeros(local_shape, dtype=dtype)
        if stop > start:
            shard[: stop - start] = read(mapping.hf_names[0], 0, start, stop)
        return shard
    if layout == "gate_up":
        rows = local_shape[0] // 2
        return torch.cat([read(n, 0, tp_rank * rows, (tp_rank + 1) * rows) for n in mapping.hf_names])
    if layout == "qkv":
        hd = arch.head_dim
        heads_per_group = arch.num_attention_heads // arch.num_key_value_heads
        groups = local_shape[0] // ((heads_per_group + 2) * hd)
        g0, g1 = tp_rank * groups, (tp_rank + 1) * groups
        q = read(mapping.hf_names[0], 0, g0 * heads_per_group * hd, g1 * heads_per_group * hd)
        k = read(mapping.hf_names[1], 0, g0 * hd, g1 * hd)
        v = read(mapping.hf_names[2], 0, g0 * hd, g1 * hd)
        parts = [
            q.reshape(groups, heads_per_group * hd, -1),
            k.reshape(groups, hd, -1),
            v.reshape(groups, hd, -1),
        ]
        return torch.cat(parts, dim=1).reshape(local_shape)
    raise ValueError(f"unknown layout {layout!r} for {mapping.megatron_name}")


def gather_dim(mapping: ParamMapping) -> int:
    """The dimension along which TP shards of this parameter are concatenated."""
    return 1 if mapping.layout == "row" else 0


def to_hf(
    mapping: ParamMapping, full: torch.Tensor, arch: Qwen3Config, tp_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors held by a TP-gathered Megatron parameter."""
    layout = mapping.layout
    if layout in ("replicated", "row"):
        yield mapping.hf_names[0], full
    elif layout == "vocab":
        yield mapping.hf_names[0], full[: arch.vocab_size]
    elif layout == "gate_up":
        gate, up = full.reshape(tp_size, 2, -1, full.shape[-1]).unbind(dim=1)
        yield mapping.hf_names[0], gate.reshape(-1, full.shape[-1])
        yield mapping.hf_names[1], up.reshape(-1, full.shape[-1])
    elif layout == "qkv":
        hd = arch.head_dim
        heads_per_group = arch.num_attention_heads // arch.num_key_value_heads
        grouped = full.reshape(arch.num_key_value_heads, (heads_per_group + 2) * hd, full.shape[-1])
        q, k, v = grouped.split([heads_per_group * hd, hd, hd], dim=1)
        for name, part in zip(mapping.hf_names, (q, k, v)):
            yield name, part.reshape(-1, full.shape[-1])
    else:
        raise ValueError(f"unknown layout {layout!r} for {mapping.megatron_name}")
