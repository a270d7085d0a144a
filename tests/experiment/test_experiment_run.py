"""`stapo experiment study` end to end: two methods, a few steps, then the same command again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stapo_megatron.trainer.launcher import load_train_config
from stapo_megatron.trainer.metrics import read_metrics

STEPS = 3


@pytest.mark.slow
def test_two_methods_then_resume(tmp_path):
    out = tmp_path / "study"
    command = [
        sys.executable,
        "-m",
        "stapo_megatron.cli",
        "experiment",
        "study",
        "--methods",
        "dapo,stapo:q=0.5",
        "--seeds",
        "0",
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        "--parallel",
        "2",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
    ]
    first = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for name in ("dapo", "stapo+q=0.5"):
        assert f"[stapo] experiment {name}/seed_0: started" in first.stderr
        run_dir = out / name / "seed_0"
        rows = read_metrics(run_dir)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        resolved = (run_dir / "config.yaml").read_text()
        assert f"name: {name}-seed0" in resolved and "seed: 0" in resolved
        # four mini-batches per rollout step: the later ones update a policy that has moved (ratio != 1)
        assert "prompts_per_minibatch: 16\n" in resolved
        assert any(row["policy/ratio_max"] > 1 for row in rows)
        # the entropy over every response token, with its quantiles, on every step
        assert all(row["policy/entropy_p50"] <= row["policy/entropy_p90"] for row in rows)
    # stapo:q=0.5 is the tiny task's stapo section (its tau_p) with q on top
    assert "q: 0.5\n" in (out / "stapo+q=0.5" / "seed_0" / "config.yaml").read_text()
    assert "tau_p: 0.006\n" in (out / "stapo+q=0.5" / "seed_0" / "config.yaml").read_text()
    # dapo ran on the packaged free-words task, with DAPO's overlong shaping and a buffer of a fifth of its responses.
    assert "kind: free_words\n" in (out / "dapo" / "seed_0" / "config.yaml").read_text()
    buffer = max(1, round(load_train_config(None, []).batch.max_new_tokens / 5))
    assert f"overlong_buffer: {buffer}\n" in (out / "dapo" / "seed_0" / "config.yaml").read_text()
    table = (out / "comparison.md").read_text()
    assert "| dapo | 1 | 3 |" in table and "| stapo:q=0.5 | 1 | 3 |" in table
    for name in ("entropy.png", "accuracy.png", "masked_fraction.png"):
        assert (out / name).stat().st_size > 10_000
    walls = json.loads((out / "experiment.json").read_text())["wall_seconds"]
    assert set(walls) == {"dapo/seed_0", "stapo+q=0.5/seed_0"} and all(seconds > 0 for seconds in walls.values())

    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("finished earlier") == 2 and "started" not in again.stderr
    assert json.loads((out / "experiment.json").read_text())["wall_seconds"] == walls
