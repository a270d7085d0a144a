"""Shared, expensive inputs of the trainer tests."""

from __future__ import annotations

import pytest

from tests.trainer.runs import run, train_command


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """A tiny policy after 30 steps of the default run: it answers some prompts right, so every
    step has non-zero gradients, and it is sharp enough that correct responses hold rare tokens."""
    run_dir = tmp_path_factory.mktemp("warmup") / "run"
    run(train_command(run_dir, "run.steps=30"))
    return run_dir / "checkpoints" / "iter_0000030"
