"""End-to-end runs of `stapo train` on the tiny configuration (TP=2, PP=2), and their outputs."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from tests.trainer.runs import metrics, run, train_command

# Every metric the trainer logs each step (the list, by the names it is logged under).
STEP_METRICS = [
    "reward/mean",
    "reward/accuracy",
    "response/length_mean",
    "response/length_max",
    "response/clipped_fraction",
    "policy/entropy",
    "s2t/masked_fraction",
    "s2t/candidates",
    "s2t/tau_h",
    "policy/clip_low_fraction",
    "policy/clip_high_fraction",
    "optim/grad_norm",
    "optim/lr",
    "mismatch/logprob_abs_mean",
    "mismatch/logprob_abs_max",
    "time/rollout",
    "time/reward",
    "time/statistics",
    "time/update",
    "time/sync",
    "time/broadcast",
    "time/logging",
    "time/other",
    "time/step",
    "throughput/tokens_per_s",
]


def mean(values):
    return sum(values) / len(values)


@pytest.mark.slow
def test_tiny_tp2_run_learns_and_logs_every_metric(tiny_tp2_run):
    run_dir = tiny_tp2_run
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    for row in rows:
        missing = [k for k in STEP_METRICS if k not in row]
        assert not missing, f"step {row['step']} lacks {missing}"
        # The engine samples with exactly the weights the trainer scores with.
        assert row["mismatch/logprob_abs_max"] < 1e-4
        # Every second of the step is in one of its phases or in time/other; tokens/s is over the whole step.
        phases = sum(v for k, v in row.items() if k.startswith("time/") and k != "time/step")
        assert abs(phases - row["time/step"]) <= 1e-9 * row["time/step"], row
    # From random weights the policy first learns the answer format: entropy falls, accuracy rises.
    assert mean([r["policy/entropy"] for r in rows[-5:]]) < mean([r["policy/entropy"] for r in rows[:5]]) - 0.3
    assert mean([r["reward/accuracy"] for r in rows[-5:]]) > mean([r["reward/accuracy"] for r in rows[:5]])
    assert any(r["s2t/candidates"] > 0 for r in rows)
    assert (run_dir / "tensorboard").is_dir() and any((run_dir / "tensorboard").iterdir())
    assert sorted(p.name for p in (run_dir / "spurious").glob("*.jsonl")) == [
        "step_0000010.jsonl",
        "step_0000020.jsonl",
        "step_0000030.jsonl",
    ]
    # Run-end checkpoint, and the tools that read a run directory.
    assert (run_dir / "checkpoints" / "iter_0000030" / "stapo_complete.json").is_file()
    plot = subprocess.run(
        [sys.executable, "-m", "stapo_megatron.cli", "plot", str(run_dir)], capture_output=True, text=True
    )
    assert plot.returncode == 0, plot.stderr
    assert (run_dir / "curves.png").stat().st_size > 10_000
    inspect = subprocess.run(
        [sys.executable, "-m", "stapo_megatron.cli", "inspect", str(run_dir)], capture_output=True, text=True
    )
    assert inspect.returncode == 0, inspect.stderr
    # The dumps hold exactly the tokens the update silenced at those steps, and there are some.
    dumped = [
        json.loads(line)
        for step in (10, 20, 30)
        for line in (run_dir / "spurious" / f"step_{step:07d}.jsonl").read_text().splitlines()
    ]
    assert len(dumped) == sum(rows[step - 1]["s2t/silenced_tokens"] for step in (10, 20, 30)) > 0
    steps = sorted({entry["step"] for entry in dumped})
    assert inspect.stdout.startswith(
        f"{len(dumped)} silenced tokens in {len(steps)} dumps (steps {steps[0]}..{steps[-1]}), "
    )


@pytest.mark.slow
def test_tiny_pp2_run_trains_through_the_pipeline_schedule(tmp_path):
    run_dir = tmp_path / "pp2"
    run(
        train_command(
            run_dir,
            "run.steps=8",
            "parallel.tensor_parallel=1",
            "parallel.pipeline_parallel=2",
            "batch.max_tokens_per_microbatch=2560",
        )
    )
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for row in rows:
        assert not [k for k in STEP_METRICS if k not in row]
        assert row["mismatch/logprob_abs_max"] < 1e-4  # weights of both stages reach the engine
        assert math.isfinite(row["optim/grad_norm"]) and row["optim/grad_norm"] > 0
    assert rows[-1]["policy/entropy"] < rows[0]["policy/entropy"]


# The default task with 241 free words (a 256-token vocabulary) and the paper's tau_p = 0.002: the
# free words start near or below it, so S2T has rare tokens of correct responses to silence from
# the first steps.
FREE_WORDS = ["data.synthetic_distractors=241", "model.vocab_size=256", "algo.tau_p=0.002"]


@pytest.mark.slow
def test_free_words_run_exercises_s2t_and_its_checkpoint_loads_with_its_tokenizer(tmp_path):
    """A shortened run of the 256-token free-words task: the free words after the answer give S2T rare
    tokens of correct responses to silence, and the run-end checkpoint carries Hugging Face
    tokenizer files that `stapo eval` and transformers load."""
    from transformers import AutoTokenizer

    from stapo_megatron.data.synthetic import synthetic_vocab

    run_dir = tmp_path / "free_words"
    run(train_command(run_dir, "run.steps=40", "logging.inspect_every=5", *FREE_WORDS))
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert sum(r["s2t/candidates"] for r in rows) > 0
    assert sum(r["s2t/silenced_candidates"] for r in rows) > 0
    assert max(r["s2t/masked_fraction"] for r in rows) < 0.01  # the paper's regime: few tokens masked
    inspect = subprocess.run(
        [sys.executable, "-m", "stapo_megatron.cli", "inspect", str(run_dir)], capture_output=True, text=True
    )
    assert inspect.returncode == 0, inspect.stderr
    assert re.search(r"^\d+ silenced tokens in [1-8] dumps \(steps \d+\.\.\d+\)", inspect.stdout, re.M), inspect.stdout
    assert "]]" in inspect.stdout.split("example contexts")[1]  # contexts around the silenced tokens
    dumped = [
        json.loads(line)
        for path in sorted((run_dir / "spurious").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert dumped and all(e["correct"] and e["advantage"] > 0 and e["probability"] < 0.002 for e in dumped)
    # the context before a silenced free word: the whole prompt (16 tokens reach past it) and the answer
    assert all(re.fullmatch(r"\d \+ \d = \d( w\d+)*", e["before"]) for e in dumped), dumped[:3]

    checkpoint = run_dir / "checkpoints" / "iter_0000040"
    assert (checkpoint / "hf_assets" / "tokenizer.json").is_file()
    assert (checkpoint / "hf_assets" / "tokenizer_config.json").is_file()
    data_dir = tmp_path / "bench"
    data_dir.mkdir()
    problems = [("3 + 4 =", "7"), ("9 + 9 =", "8")]
    (data_dir / "math500.jsonl").write_text(
        "".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in problems)
    )
    export, out = tmp_path / "export", tmp_path / "eval"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stapo_megatron.cli",
            "eval",
            "--model",
            str(checkpoint),
            "--export-dir",
            str(export),
            "--data-dir",
            str(data_dir),
            "--benchmarks",
            "math500",
            "--template",
            "raw",
            "--k",
            "2",
            "--max-new-tokens",
            "3",
            "--reward-workers",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    score = json.loads((out / "results.json").read_text())["benchmarks"]["math500"]
    assert (score["problems"], score["samples"]) == (2, 4)
    responses = [json.loads(line)["response"] for line in (out / "responses.jsonl").read_text().splitlines()]
    assert len(responses) == 4 and all(set(r.split()) <= set(synthetic_vocab(241)) for r in responses), responses
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) == synthetic_vocab(241)
    assert tokenizer("3 + 4 =")["input_ids"] == [1, 6, 13, 7, 14]
