"""The Megatron Qwen3 model computes exactly what transformers' Qwen3ForCausalLM computes."""

from __future__ import annotations

import pytest
import torch

from stapo_megatron.runtime.launch import spawn_ranks
from tests.helpers import save_tiny_qwen3
from tests.models import _workers


@pytest.fixture(scope="module")
def hf_cases(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    cases = []
    for tie in (True, False):
        root = tmp_path_factory.mktemp(f"tied{tie}")
        hf_dir = save_tiny_qwen3(root / "hf", tie=tie, seed=1 if tie else 2)
        model = Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        torch.manual_seed(3)
        ids = torch.randint(0, model.config.vocab_size, (3, 11))
        with torch.no_grad():
            logits = model(ids).logits
        reference = root / "reference.pt"
        torch.save({"input_ids": ids, "logits": logits}, reference)
        cases.append((str(hf_dir), str(reference)))
    return cases


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)], ids=["TP1", "TP2", "PP2", "TP2xPP2"])
def test_logits_equal_transformers(hf_cases, tp, pp):
    # Tied and untied embeddings, checked in one launch per layout; fp32, max abs diff <= 1e-4.
    spawn_ranks(_workers.check_logits_match_hf, tp * pp, tp, pp, hf_cases)
