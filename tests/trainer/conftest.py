"""Shared, expensive inputs of the trainer tests."""

from __future__ import annotations

import pytest

from tests.trainer.runs import run, train_command


@pytest.fixture(scope="session")
def tiny_tp2_run(tmp_path_factory):
    """30 steps of the default run (TP=2) with S2T at tau_p = 0.05, TensorBoard and a dump of the
    silenced tokens every 10 steps: test_train_runs.py checks the run, other tests start from its
    checkpoint (one run instead of two)."""
    run_dir = tmp_path_factory.mktemp("tp2") / "run"
    overrides = ["run.steps=30", "logging.tensorboard=true", "logging.inspect_every=10", "algo.tau_p=0.05"]
    run(train_command(run_dir, *overrides))
    return run_dir


@pytest.fixture(scope="session")
def trained_tiny(tiny_tp2_run):
    """A tiny policy after 30 steps: it answers some prompts right, so every step has non-zero
    gradients, and it is sharp enough that correct responses hold rare tokens."""
    return tiny_tp2_run / "checkpoints" / "iter_0000030"
