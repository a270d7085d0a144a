"""Model presets have the published Qwen3 shapes."""

from __future__ import annotations

import pytest
import torch

from stapo_megatron.config import build
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.runtime.launch import spawn_ranks
from tests.models import _workers

# Published totals, in units of 1e9, to 3 decimals.
PUBLISHED = {
    "qwen3_0.6b": 0.596,
    "qwen3_1.7b": 1.721,
    "qwen3_4b": 4.022,
    "qwen3_8b": 8.191,
    "qwen3_14b": 14.768,
    "qwen3_32b": 32.762,
}
TIED = {"qwen3_0.6b", "qwen3_1.7b", "qwen3_4b"}


def test_preset_parameter_counts_match_published(tmp_path):
    out = tmp_path / "counts.pt"
    spawn_ranks(_workers.count_preset_parameters, 1, list(PUBLISHED), str(out))
    megatron_counts = torch.load(out, weights_only=True)
    for name, billions in PUBLISHED.items():
        arch = build(Qwen3Config, name)
        assert arch.tie_word_embeddings == (name in TIED), name
        assert round(arch.num_parameters() / 1e9, 3) == billions, name
        # Megatron's own module tree, built without allocating, has exactly as many parameters.
        assert megatron_counts[name] == arch.num_parameters(), name


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_round_trips_through_hf_config(name):
    arch = build(Qwen3Config, name)
    assert Qwen3Config.from_hf_dict(arch.to_hf_dict()) == arch
