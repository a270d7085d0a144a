"""A real training run with two checkpoints, written once for the checkpoint tests."""

from __future__ import annotations

import shutil

import pytest

from tests.trainer.runs import run, train_command


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """``<run>/checkpoints/iter_0000001`` and ``iter_0000002`` of the tiny CPU run (TP=2): model,
    optimizer, RNG states as sharded objects, hashes in the markers. Copy it before changing it."""
    run_dir = tmp_path_factory.mktemp("checkpoints") / "run"
    run(train_command(run_dir, "run.steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=5"))
    return run_dir


@pytest.fixture
def run_copy(trained_run, tmp_path):
    """A copy of the trained run that a test may damage."""
    target = tmp_path / "run"
    shutil.copytree(trained_run, target)
    return target


@pytest.fixture
def checkpoint(run_copy):
    """The copy's newest checkpoint."""
    return run_copy / "checkpoints" / "iter_0000002"
