"""`stapo experiment entropy` end to end: two algorithms, a few steps, then the same command again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stapo_megatron.trainer.launcher import load_train_config
from stapo_megatron.trainer.metrics import read_metrics

STEPS = 3


@pytest.mark.slow
def test_two_algorithms_then_resume(tmp_path):
    out = tmp_path / "experiment"
    command = [
        sys.executable,
        "-m",
        "stapo_megatron.cli",
        "experiment",
        "entropy",
        "--steps",
        str(STEPS),
        "--algos",
        "dapo,stapo",
        "--out",
        str(out),
        "--parallel",
        "2",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
    ]
    first = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "[stapo] experiment dapo: started" in first.stderr and "[stapo] experiment stapo: started" in first.stderr
    for algo in ("dapo", "stapo"):
        rows = read_metrics(out / algo)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        resolved = (out / algo / "config.yaml").read_text()
        assert f"name: {algo}" in resolved and "seed: 0" in resolved
    # dapo ran on the packaged free-words task, with DAPO's overlong shaping and a buffer of a fifth of its responses.
    assert "kind: free_words\n" in (out / "dapo" / "config.yaml").read_text()
    buffer = max(1, round(load_train_config(None, []).batch.max_new_tokens / 5))
    assert f"overlong_buffer: {buffer}\n" in (out / "dapo" / "config.yaml").read_text()
    table = (out / "comparison.md").read_text()
    assert "| dapo | 3 |" in table and "| stapo | 3 |" in table
    for name in ("entropy.png", "accuracy.png", "masked_fraction.png", "response_length.png"):
        assert (out / name).stat().st_size > 10_000
    walls = json.loads((out / "experiment.json").read_text())["wall_seconds"]
    assert set(walls) == {"dapo", "stapo"} and all(seconds > 0 for seconds in walls.values())

    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("finished earlier") == 2 and "started" not in again.stderr
    assert json.loads((out / "experiment.json").read_text())["wall_seconds"] == walls
