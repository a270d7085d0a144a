"""Qwen3 dense architecture: the Hugging Face ``config.json`` fields, validated.

The presets in ``configs/model/`` are instances of :class:`Qwen3Config` with the published
shapes; ``Qwen3Config.from_hf(path)`` reads a checkpoint's own ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from stapo_megatron.config import MAX_VOCAB, ConfigError, option
from stapo_megatron.config.core import check_fields

MAX_WIDTH = 1 << 18  # hidden and MLP widths (Qwen3-32B: 5,120 and 25,600)
MAX_POSITIONS = 1 << 24


@dataclasses.dataclass
class Qwen3Config:
    PRESET_DIR = "model"

    vocab_size: int = option(
        151936, "Tokenizer vocabulary size (rows of the embedding before TP padding).", ge=1, le=MAX_VOCAB
    )
    hidden_size: int = option(1024, "Width of the residual stream.", ge=1, le=MAX_WIDTH)
    intermediate_size: int = option(3072, "Width of the SwiGLU MLP (each of gate and up).", ge=1, le=MAX_WIDTH)
    num_hidden_layers: int = option(28, "Number of transformer layers.", ge=1, le=1024)
    num_attention_heads: int = option(16, "Query heads per layer.", ge=1, le=1024)
    num_key_value_heads: int = option(8, "Key/value heads per layer (grouped-query attention).", ge=1, le=1024)
    head_dim: int = option(
        128, "Width of each attention head (Qwen3 sets it independently of hidden_size).", ge=1, le=4096
    )
    rms_norm_eps: float = option(1e-6, "Epsilon of every RMSNorm, QK-norm included.", gt=0, lt=1)
    rope_theta: float = option(1000000.0, "Base of the rotary position embedding.", gt=0)
    tie_word_embeddings: bool = option(True, "Output projection shares the input embedding's weights.")
    max_position_embeddings: int = option(
        40960, "Longest sequence the rotary embedding is built for.", ge=1, le=MAX_POSITIONS
    )
    torch_dtype: str = option("bfloat16", "dtype written into config.json when exporting to Hugging Face.")

    def __post_init__(self):
        check_fields(self)  # also built straight from a checkpoint's config.json or metadata
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )

    @classmethod
    def from_hf_dict(cls, hf: dict, source: str = "config.json") -> Qwen3Config:
        model_type = hf.get("model_type")
        architectures = hf.get("architectures") or ["Qwen3ForCausalLM"]
        if model_type != "qwen3" or "Qwen3ForCausalLM" not in architectures:
            raise ConfigError(
                f"{source}: not a dense Qwen3 model (model_type={model_type!r}, "
                f"architectures={architectures!r}); expected model_type 'qwen3' and Qwen3ForCausalLM"
            )
        if hf.get("attention_bias", False):
            raise ConfigError(f"{source}: attention_bias=true is not Qwen3's architecture")
        if hf.get("use_sliding_window", False):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported")
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise ConfigError(f"{source}: rope_scaling {rope_scaling!r} is not supported")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 1000000.0)
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
        try:
            head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_hidden_layers=hf["num_hidden_layers"],
                num_attention_heads=hf["num_attention_heads"],
                num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
                head_dim=head_dim,
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_position_embeddings=hf.get("max_position_embeddings", 40960),
                torch_dtype=str(dtype).replace("torch.", ""),
            )
        except KeyError as err:
            raise ConfigError(f"{source}: missing field {err.args[0]!r}") from None
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
        except (TypeError, ValueError, ZeroDivisionError) as err:  # a field of the wrong type, or 0 heads
            raise ConfigError(f"{source}: malformed architecture field ({err})") from None

    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> Qwen3Config:
        """Read ``config.json`` from a Hugging Face checkpoint directory (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            with open(file, encoding="utf-8") as f:
                hf = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{file}: no such file (expected a Hugging Face config.json)") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"{file}: not valid JSON ({err})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{file}: not UTF-8 text") from None
        except RecursionError:
            raise ConfigError(f"{file}: JSON nested too deeply") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"{file}: expected a JSON object, got {type(hf).__name__}")
        return cls.from_hf_dict(hf, str(file))

    def to_hf_dict(self) -> dict:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "torch_dtype": self.torch_dtype,
        }

    def layers_per_stage(self, pipeline_parallel: int) -> tuple[int, ...]:
        """Decoder layers of each pipeline stage: :func:`pipeline_split` of this model."""
        return pipeline_split(self.num_hidden_layers, pipeline_parallel)

    def num_parameters(self) -> int:
        """Exact parameter count of the unpadded model (as Hugging Face counts it)."""
        h, v, f = self.hidden_size, self.vocab_size, self.intermediate_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 2 * self.head_dim + 3 * h * f + 2 * h
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * per_layer + h


# Megatron pads the vocabulary to a multiple of this (its make_vocab_size_divisible_by default)
# times the tensor-parallel size, so that each TP rank holds an equal, aligned slice.
VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """The vocabulary size of the embedding and output layers: ``vocab_size`` rounded up to a
    multiple of ``VOCAB_DIVISIBLE_BY * tensor_parallel``."""
    multiple = VOCAB_DIVISIBLE_BY * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def pipeline_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """Decoder layers of each pipeline stage, for any number of stages up to ``num_layers``.

    Megatron-Core builds uneven splits from two fields, the first and the last stage's layer
    counts, and gives every middle stage the same count, so a split is (first, m, ..., m, last).
    Of those, this one has the fewest layers on its largest stage; ties go to the larger middle
    count (the first stage also embeds, the last one computes the output layer and the loss),
    and the last stage never holds more than the first. 28 layers at 3 stages: (9, 10, 9);
    3 at 2: (2, 1); an even split stays even.
    """
    if not 1 <= stages <= num_layers:
        raise ConfigError(
            f"parallel.pipeline_parallel: {stages} stages for {num_layers} layers (needs 1 to {num_layers})"
        )
    if stages == 1:
        return (num_layers,)
    if stages == 2:
        return (num_layers - num_layers // 2, num_layers // 2)
    best = None
    middle_stages = stages - 2
    for middle in range(1, (num_layers - 2) // middle_stages + 1):
        ends = num_layers - middle_stages * middle
        first, last = ends - ends // 2, ends // 2
        key = (max(first, middle), -middle)
        if best is None or key < best[0]:
            best = (key, (first, *([middle] * middle_stages), last))
    assert best is not None  # stages <= num_layers: at least one middle count is tried
    return best[1]


def first_and_last_stage_layers(num_layers: int, stages: int) -> tuple[int | None, int | None]:
    """Megatron's ``num_layers_in_first/last_pipeline_stage`` for :func:`pipeline_split`;
    (None, None) when the split is even (Megatron's default)."""
    split = pipeline_split(num_layers, stages)
    if len(set(split)) == 1:
        return None, None
    return split[0], split[-1]


def first_layer_of_stage(num_layers: int, stages: int, stage: int) -> int:
    """Index of the first decoder layer of pipeline stage ``stage`` in the whole model."""
    return sum(pipeline_split(num_layers, stages)[:stage])
