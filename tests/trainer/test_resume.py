"""Exact resume: a run killed with SIGKILL (after a step, or inside a checkpoint write) and resumed
ends with bit-identical parameters and optimizer state, and logs the same metrics."""

from __future__ import annotations

import time

import pytest
import torch

from stapo_megatron.trainer.launcher import default_config_path
from tests.trainer.runs import (
    checkpoint_tensors,
    kill_when,
    metrics,
    run,
    start_session,
    torchrun_command,
    train_command,
)

STEPS = ["run.steps=6", "checkpoint.save_every=1", "checkpoint.keep_last=10"]


def _steps(trained_tiny) -> list[str]:
    # From a policy that already answers some prompts: every step has non-zero gradients, so a
    # wrong Adam state after the resume would change the parameters.
    return [*STEPS, f"checkpoint.load_megatron={trained_tiny}"]


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


def _assert_same_run(reference_dir, resumed_dir):
    reference, resumed = checkpoint_tensors(
        reference_dir / "checkpoints" / "iter_0000006", resumed_dir / "checkpoints" / "iter_0000006"
    )
    assert sorted(reference) == sorted(resumed)
    # The model's parameters. (The optimizer's flat buffers also hold alignment padding that
    # Megatron leaves uninitialised; a wrong Adam state would already show in these and in the
    # metrics below: bug 3 of megatron_fixes changes every update after a resume.)
    parameters = [k for k in reference if not k.startswith("optimizer.")]
    assert "embedding.word_embeddings.weight" in parameters and len(parameters) == 10
    for key in parameters:
        assert torch.equal(reference[key], resumed[key]), f"{key} differs after resume"
    ref_rows, res_rows = metrics(reference_dir), metrics(resumed_dir)
    assert [r["step"] for r in res_rows] == list(range(1, 7))
    assert all(r["optim/grad_norm"] > 0 for r in ref_rows)
    for step in (4, 5, 6):
        assert _comparable(res_rows[step - 1]) == _comparable(ref_rows[step - 1]), f"metrics of step {step} differ"


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, trained_tiny):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run(train_command(run_dir, *_steps(trained_tiny)))
    return run_dir


def _ranks(run_dir, trained_tiny):
    return torchrun_command(
        default_config_path(),
        2,
        f"run.output_dir={run_dir}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        *_steps(trained_tiny),
    )


@pytest.mark.slow
def test_resume_after_sigkill_following_step_3(reference_run, trained_tiny, tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    process = start_session(_ranks(run_dir, trained_tiny))
    kill_when(process, lambda: (checkpoints / "iter_0000003" / "stapo_complete.json").is_file())
    time.sleep(2)  # nothing may go on writing once the ranks are killed
    assert not (checkpoints / "iter_0000004").exists()
    resumed = run(train_command(run_dir, *_steps(trained_tiny)))
    assert f"[stapo] resumed from {checkpoints / 'iter_0000003'} (step 3)" in resumed.stderr
    _assert_same_run(reference_run, run_dir)


@pytest.mark.slow
def test_resume_after_sigkill_inside_a_checkpoint_write(reference_run, trained_tiny, tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    process = start_session(_ranks(run_dir, trained_tiny))
    kill_when(process, lambda: (checkpoints / ".iter_0000004.partial").exists())
    # The half-written step-4 checkpoint is not taken as the latest: step 3 is.
    assert (checkpoints / ".iter_0000004.partial").exists()
    assert not (checkpoints / "iter_0000004").exists()
    assert (checkpoints / "latest.txt").read_text() == "iter_0000003"
    time.sleep(2)
    assert not (checkpoints / "iter_0000004").exists()
    resumed = run(train_command(run_dir, *_steps(trained_tiny)))
    assert f"[stapo] resumed from {checkpoints / 'iter_0000003'} (step 3)" in resumed.stderr
    assert not (checkpoints / ".iter_0000004.partial").exists()
    _assert_same_run(reference_run, run_dir)
