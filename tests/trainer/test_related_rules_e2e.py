"""The STARE preset end to end on the tiny configuration (TP=2): the trainer feeds the step's policy
entropy to the rule's gate. Gate closed (entropy above the target): the update is exactly the one
of the same preset with every token kept; gate open: the same rollouts give a different loss."""

from __future__ import annotations

import math

import pytest

from tests.trainer.runs import metrics, run, train_command

COMPARED = (
    "reward/accuracy",
    "policy/response_tokens",
    "policy/kept_tokens",
    "policy/pg_loss",
    "optim/grad_norm",
    "policy/entropy",
)


@pytest.mark.slow
def test_stare_preset_gate_decides_between_reweighting_and_grpo(tmp_path):
    # 16 prompts a step (a quarter of the default): STARE trains every sequence, and the gate is per step
    common = ["algo=stare", "run.steps=2", "batch.prompts_per_step=16", "batch.prompts_per_minibatch=16"]
    closed, kept_all, open_ = tmp_path / "gate_closed", tmp_path / "token_rule_all", tmp_path / "gate_open"
    run(train_command(closed, *common, "algo.stare_target_entropy=0.0"))
    run(train_command(kept_all, *common, "algo.token_rule=all"))
    run(train_command(open_, *common, "algo.stare_target_entropy=1000.0"))
    rows_closed, rows_all, rows_open = metrics(closed), metrics(kept_all), metrics(open_)
    assert len(rows_closed) == len(rows_all) == len(rows_open) == 2
    assert all(r["policy/entropy"] > 0.0 for r in rows_closed)  # above the target 0: the gate stays closed
    for a, b in zip(rows_closed, rows_all):
        for key in COMPARED:
            assert math.isclose(a[key], b[key], rel_tol=1e-6, abs_tol=1e-9), (key, a[key], b[key])
    first_open, first_all = rows_open[0], rows_all[0]
    # the same rollouts (same seed and weights before the first update) ...
    for key in ("reward/accuracy", "policy/response_tokens", "policy/entropy"):
        assert first_open[key] == first_all[key], key
    # ... but W = 1.1 on the highest-surprisal tokens of A > 0 responses: a different loss, nothing silenced
    assert first_open["policy/kept_tokens"] == first_open["policy/response_tokens"]
    assert not math.isclose(first_open["policy/pg_loss"], first_all["policy/pg_loss"], rel_tol=1e-4)
    assert not math.isclose(first_open["optim/grad_norm"], first_all["optim/grad_norm"], rel_tol=1e-4)
