"""Config errors before any process starts; non-finite steps; empty rollout batches; Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from stapo_megatron.cli import main
from stapo_megatron.runtime.launch import kill_tree
from tests.trainer.runs import FAST, metrics, run, start_session, train_command


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallel.tensor_parallel=3", "parallel.tensor_parallel: 3 does not divide the 4 attention heads"),
        ("optim.lrr=1", "optim.lrr: unknown field"),
        ("optim.lr=-1", "optim.lr: must be > 0, got -1.0"),
        ("batch.prompts_per_minibatch=48", "batch.prompts_per_minibatch: 48 does not divide prompts_per_step 64"),
        ("data.source=/nonexistent/train.parquet", "data.source: /nonexistent/train.parquet does not exist"),
        ("checkpoint.load_hf=/nonexistent/model", "checkpoint.load_hf: /nonexistent/model is not a directory"),
        ("algo=ppo", "algo: unknown algo preset 'ppo'"),
        ("model.vocab_size=8", "model.vocab_size: 8 is smaller than the synthetic task's tokenizer (24 tokens)"),
        ("checkpoint.resume=required", "checkpoint.resume: required, but"),
    ],
)
def test_config_errors_are_one_line_before_any_process_group(tmp_path, capsys, override, message):
    """In this process (the ``stapo`` script calls the same ``main``): the next test runs one in a process."""
    run_dir = tmp_path / "run"
    assert main(["train", f"run.output_dir={run_dir}", *FAST, override]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stapo: error: ") and message in lines[0], lines
    assert not run_dir.exists()  # nothing was started or written


def test_a_config_error_is_all_that_a_stapo_train_process_prints(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(train_command(run_dir, "optim.lr=-1"), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == "stapo: error: optim.lr: must be > 0, got -1.0\n" and result.stdout == ""
    assert not run_dir.exists()


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_the_run_stops(tmp_path):
    run_dir = tmp_path / "run"
    # A learning rate of 1e30 blows the weights up after one step: every later loss is inf/NaN.
    command = train_command(run_dir, "run.steps=10", "optim.lr=1e30", "faults.max_skipped_steps=2")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "non-finite loss or gradient, optimizer step skipped (1 so far)" in output
    assert "3 optimizer steps skipped for non-finite values, more than faults.max_skipped_steps=2" in output
    skipped = [r["optim/skipped_steps"] for r in metrics(run_dir)]
    # Step 1 is finite; afterwards steps are skipped (a step whose advantages are all 0 can stay finite).
    assert skipped[0] == 0 and skipped[-1] >= 1 and skipped == sorted(skipped)


@pytest.mark.slow
def test_a_step_whose_groups_are_all_filtered_out_makes_no_update(tmp_path):
    run_dir = tmp_path / "run"
    # 256 tokens and exact answers: a random policy never answers right, so DAPO's dynamic sampling
    # drops every group.
    run(
        train_command(
            run_dir,
            "run.steps=2",
            "data.synthetic_distractors=241",
            "model.vocab_size=256",
            "reward.kind=exact",
            "algo=dapo_dynamic_sampling",
            "algo.overlong_buffer=1",
            "batch.max_sampling_rounds=2",
        )
    )
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/groups_kept"] == 0 and row["rollout/groups_sampled"] == 128
        assert row["rollout/sampling_rounds"] == 2
        assert "optim/grad_norm" not in row  # no optimizer step was taken
    assert (run_dir / "checkpoints" / "iter_0000002" / "stapo_complete.json").is_file()


def _signalled_after_two_steps(run_dir, signum) -> tuple[subprocess.Popen, str]:
    """A long `stapo train` sent ``signum`` once it has logged two steps; the process and its output."""
    process = start_session(train_command(run_dir, "run.steps=10000"))
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").is_file() and len(metrics(run_dir)) >= 2):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        process.send_signal(signum)
        output, _ = process.communicate(timeout=300)
    finally:
        kill_tree(process.pid)  # nothing is left running if the test fails
    return process, output


@pytest.mark.slow
def test_a_hangup_stops_like_sigterm_with_a_checkpoint_and_no_private_file_left(tmp_path):
    """SIGHUP (a closed terminal, a dropped ssh session) is SIGTERM: the ranks stop after the current
    step with a checkpoint, the command exits 0, and neither the lock nor the ranks' private config
    (which holds the run's secrets) stays behind."""
    from stapo_megatron.runtime.run_files import RANKS_CONFIG
    from stapo_megatron.runtime.run_lock import LOCK_FILE

    run_dir = tmp_path / "run"
    process, output = _signalled_after_two_steps(run_dir, signal.SIGHUP)
    assert process.returncode == 0, output[-3000:]
    last = metrics(run_dir)[-1]["step"]
    assert last < 10000 and (run_dir / "checkpoints" / f"iter_{last:07d}" / "stapo_complete.json").is_file()
    assert not (run_dir / LOCK_FILE).exists() and not (run_dir / RANKS_CONFIG).exists()
    assert not (run_dir / "STOP").exists()


def test_ctrl_c_writes_a_checkpoint_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    # SIGINT: what Ctrl-C sends to the foreground `stapo train`
    process, output = _signalled_after_two_steps(run_dir, signal.SIGINT)
    assert process.returncode == 0, output[-3000:]
    last = metrics(run_dir)[-1]["step"]
    assert last < 10000
    assert (run_dir / "checkpoints" / f"iter_{last:07d}" / "stapo_complete.json").is_file()
    assert "stop requested" in output
    assert not (run_dir / "STOP").exists()
