"""The paper's diagnostics on 2 ranks (gloo): sum_v p_v^2 and the per-token gradient norms at TP=2
against the fp64 whole-vocabulary reference, and the quadrants and entropy quantiles exact over
2 data-parallel ranks (see _diagnostics_workers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stapo_megatron.runtime.launch import spawn_ranks
from tests.loss import _diagnostics_workers


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("diagnostics_tp")
    spawn_ranks(_diagnostics_workers.run_checks, 2, str(out))
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    assert len(ranks) == 2
    return ranks


@pytest.mark.parametrize("check", list(_diagnostics_workers.CHECKS))
def test_diagnostics_on_two_ranks(outcomes, check):
    failures = [f"rank {r}:\n{o[check]}" for r, o in enumerate(outcomes) if o[check] != "ok"]
    assert not failures, "\n".join(failures)
