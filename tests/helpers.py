"""Small builders shared by the tests."""

from __future__ import annotations

import re
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"
# A message of the console channel (stapo_megatron.runtime.console), as opposed to an error line or a product.
CONSOLE_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[stapo( rank \d+)?\] ")

# A Qwen3 small enough to run in seconds, with grouped-query attention (4 heads, 2 groups).
TINY_QWEN3 = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
)


def save_tiny_qwen3(
    directory: Path, *, tie: bool, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> Path:
    """A random-weight transformers Qwen3ForCausalLM saved as safetensors (no download)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**{**TINY_QWEN3, **overrides}, tie_word_embeddings=tie)
    model = Qwen3ForCausalLM(config).float()
    # transformers initialises norms to one; random norms make the comparison meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return Path(directory)
