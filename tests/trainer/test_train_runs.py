"""End-to-end runs of `stapo train` on the tiny configuration (TP=2, PP=2), and their outputs."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.trainer.runs import metrics, run, train_command

# Every metric the trainer logs each step (the list, by the names it is logged under).
STEP_METRICS = [
    "reward/mean", "reward/accuracy",
    "response/length_mean", "response/length_max", "response/clipped_fraction",
    "policy/entropy",
    "s2t/masked_fraction", "s2t/candidates", "s2t/tau_h",
    "policy/clip_low_fraction", "policy/clip_high_fraction",
    "optim/grad_norm", "optim/lr",
    "mismatch/logprob_abs_mean", "mismatch/logprob_abs_max",
    "time/rollout", "time/reward", "time/statistics", "time/update", "time/sync", "time/broadcast", "time/logging",
    "time/step",
    "throughput/tokens_per_s",
]


def mean(values):
    return sum(values) / len(values)


@pytest.mark.slow
def test_tiny_tp2_run_learns_and_logs_every_metric(tmp_path):
    run_dir = tmp_path / "tp2"
    run(train_command(run_dir, "run.steps=30", "logging.tensorboard=true", "logging.inspect_every=10", "algo.tau_p=0.05"))
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    for row in rows:
        missing = [k for k in STEP_METRICS if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
        # The engine samples with exactly the weights the trainer scores with.
        assert row["mismatch/logprob_abs_max"] < 1e-4
        # Every second of the step is in one of its phases; tokens/s is over the whole step.
        phases = sum(v for k, v in row.items() if k.startswith("time/") and k != "time/step")
        assert abs(phases - row["time/step"]) <= 0.02 * row["time/step"], row
    # From random weights the policy first learns the answer format: entropy falls, accuracy rises.
    assert mean([r["policy/entropy"] for r in rows[-5:]]) < mean([r["policy/entropy"] for r in rows[:5]]) - 0.3
    assert mean([r["reward/accuracy"] for r in rows[-5:]]) > mean([r["reward/accuracy"] for r in rows[:5]])
    assert any(r["s2t/candidates"] > 0 for r in rows)
    assert (run_dir / "tensorboard").is_dir() and any((run_dir / "tensorboard").iterdir())
    assert sorted(p.name for p in (run_dir / "spurious").glob("*.jsonl")) == [
        "step_0000010.jsonl", "step_0000020.jsonl", "step_0000030.jsonl"
    ]
    # Run-end checkpoint, and the tools that read a run directory.
    assert (run_dir / "checkpoints" / "iter_0000030" / "stapo_complete.json").is_file()
    plot = subprocess.run([sys.executable, "-m", "stapo_megatron.cli", "plot", str(run_dir)], capture_output=True, text=True)
    assert plot.returncode == 0, plot.stderr
    assert (run_dir / "curves.png").stat().st_size > 10_000
    inspect = subprocess.run([sys.executable, "-m", "stapo_megatron.cli", "inspect", str(run_dir)], capture_output=True, text=True)
    assert inspect.returncode == 0, inspect.stderr
    assert "silenced tokens in 3 dumps" in inspect.stdout or "no silenced tokens" in inspect.stdout


@pytest.mark.slow
def test_tiny_pp2_run_trains_through_the_pipeline_schedule(tmp_path):
    run_dir = tmp_path / "pp2"
    run(train_command(run_dir, "run.steps=8", "parallel.tensor_parallel=1", "parallel.pipeline_parallel=2",
                      "batch.max_tokens_per_microbatch=2560"))
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for row in rows:
        assert not [k for k in STEP_METRICS if k not in row]
        assert row["mismatch/logprob_abs_max"] < 1e-4  # weights of both stages reach the engine
        assert math.isfinite(row["optim/grad_norm"]) and row["optim/grad_norm"] > 0
    assert rows[-1]["policy/entropy"] < rows[0]["policy/entropy"]
