"""Tensor- and data-parallel checks on CPU/gloo: one spawn of 4 ranks (TP=2 x DP=2, and TP=4).

- log-prob, entropy and gradients at TP=2 and TP=4 against an fp64 single-process reference,
  Qwen3's vocabulary padded as Megatron pads it, targets on every shard, padding excluded;
- two collectives per forward, none in backward; agreement with Megatron's cross-entropy;
- the exact mini-batch quantile over 2 DP ranks x 2 micro-batches; the token-mean gradient over
  TP=2 x DP=2 equals one process holding the whole mini-batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stapo_megatron.runtime.launch import spawn_ranks
from tests.loss import _workers


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("loss_distributed")
    spawn_ranks(_workers.run_checks, 4, str(out))
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    assert len(ranks) == 4
    return ranks


@pytest.mark.parametrize("check", list(_workers.CHECKS))
def test_distributed(outcomes, check):
    failures = [f"rank {r}:\n{o[check]}" for r, o in enumerate(outcomes) if o[check] != "ok"]
    assert not failures, "\n".join(failures)
