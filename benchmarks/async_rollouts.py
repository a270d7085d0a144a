"""Generation beside training against the synchronous loop: the same tiny run (configs/tiny_cpu.yaml,
tensor-parallel over 2 CPU ranks) with ``rollout.async.max_staleness`` 0 (synchronous), 1 and 2, its
rollouts from an SGLang server in processes of its own, launched by the run.

Two servers:

* ``scripted``: the contract server of the tests (tests/rollout/fake_sglang.py), whose /generate
  sleeps ``--token-s`` seconds per token it may generate (n x max_new_tokens per request) and
  answers tokens that are a function of the prompt: its generation time is set, and it uses no CPU
  while it "generates", so the overlap is visible on 2 cores. Its log-probs are not a model's, so
  the runs' learning figures mean nothing; only their times are read.
* ``sglang``: a real SGLang 0.5.23 server on the CPU (its venv is built by
  ``python -m tests.sglang_real.sglang_venv``; skipped with a note when it is not there). On 2 cores
  the server and the two trainer ranks compete for the same cores, so the overlap can only show
  where one of them waits.

Printed per run: wall time per step (mean over the steps after the first two), the trainer's idle
fraction (``time/rollout`` + ``time/reward`` over ``time/step``: the synchronous loop's generation
and scoring; pipelined, the wait for a batch and the weight sync's wait for the generation thread),
the generation thread's
wait for weights, and each run's step time over the synchronous run's. Last, the planner's
modelled step times for the Qwen3-32B paper config.

    python benchmarks/async_rollouts.py                       # scripted server, then real SGLang
    python benchmarks/async_rollouts.py --servers scripted --steps 12 --token-s 0.002
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAKE_SERVER = REPO / "tests" / "rollout" / "fake_sglang.py"


def _tiny_model(directory: Path) -> Path:
    from tests.sglang_real.test_train import tiny_task_model

    return tiny_task_model(directory)


def scripted_settings(work: Path, token_s: float) -> dict:
    return {
        "model_path": str(_tiny_model(work / "hf")),
        "server_command": [sys.executable, str(FAKE_SERVER)],
        # the tiny task's 24-token vocabulary: the contract server samples from it
        "env": {"FAKE_SGLANG_TOKEN_S": str(token_s), "FAKE_SGLANG_VOCAB": "24"},
        "weight_sync": "distributed",
        "weight_sync_backend": "gloo",
        "weight_sync_master_address": "127.0.0.1",
        "log_dir": str(work / "logs"),
    }


def sglang_settings(work: Path) -> dict | None:
    from tests.sglang_real.conftest import real_sglang_settings
    from tests.sglang_real.sglang_venv import ensure_sglang_venv

    try:
        venv = ensure_sglang_venv(log=lambda *_: None)
    except Exception as error:  # noqa: BLE001 - reported, the scripted server still runs
        print(f"real SGLang skipped: its venv could not be built ({error})")
        return None
    context = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())["model"]["max_position_embeddings"]
    return real_sglang_settings(
        venv,
        _tiny_model(work / "hf"),
        work / "standin-trace",
        work / "logs",
        context_length=context,
        weight_sync="distributed",
        weight_sync_backend="gloo",
        weight_sync_master_address="127.0.0.1",
    )


def run(work: Path, sglang: dict, staleness: int, steps: int) -> list[dict]:
    run_dir = work / f"k{staleness}"
    config = work / f"k{staleness}.yaml"
    base = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    config.write_text(yaml.safe_dump({**base, "rollout": {"engine": "sglang", "sglang": sglang}}))
    command = [
        sys.executable,
        "-m",
        "stapo_megatron.cli",
        "train",
        "--config",
        str(config),
        f"run.output_dir={run_dir}",
        f"run.steps={steps}",
        f"rollout.async.max_staleness={staleness}",
        "checkpoint.save_every=0",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.inspect_every=0",
    ]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"k={staleness} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(rows: list[dict]) -> dict[str, float]:
    """Means over the steps after the first two (start-up: the first sync, the pipeline filling)."""
    steady = rows[2:]
    # the trainer's wait for rank 0's rollouts: the synchronous loop's generation and scoring
    # (time/rollout, time/reward); pipelined, the wait for a batch and the weight sync's wait for the
    # generation thread (time/rollout; scoring runs in the thread)
    return {
        "step_s": statistics.mean(r["time/step"] for r in steady),
        "trainer_idle": statistics.mean(
            (r.get("time/rollout", 0.0) + r.get("time/reward", 0.0)) / r["time/step"] for r in steady
        ),
        "generator_wait_s": statistics.mean(r.get("async/generator_wait_s", 0.0) for r in steady),
    }


def report(name: str, results: dict[int, dict[str, float]]) -> None:
    base = results[0]["step_s"]
    print(f"\n{name} server: wall time per step, trainer idle fraction, ratio to synchronous")
    print(f"{'k':>3} {'s/step':>8} {'idle':>6} {'gen wait s':>10} {'ratio':>6}")
    for k, r in results.items():
        print(
            f"{k:>3} {r['step_s']:8.3f} {r['trainer_idle']:6.2f} {r['generator_wait_s']:10.3f} "
            f"{r['step_s'] / base:6.2f}"
        )


def modelled_32b() -> None:
    """The planner's step-time model for the paper's Qwen3-32B config (stapo plan --async)."""
    from stapo_megatron.launch.split_plan import async_step_times

    print("\nthe planner's model, configs/qwen3_32b_stapo_async.yaml:")
    print(async_step_times(str(REPO / "configs" / "qwen3_32b_stapo_async.yaml")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", default=["scripted", "sglang"], choices=["scripted", "sglang"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--token-s", type=float, default=0.0025, help="the scripted server's seconds per token")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stapo-async-bench-") as tmp:
        for server in args.servers:
            work = Path(tmp) / server
            work.mkdir()
            settings = scripted_settings(work, args.token_s) if server == "scripted" else sglang_settings(work)
            if settings is None:
                continue
            results = {k: summary(run(work, settings, k, args.steps)) for k in args.staleness}
            report(server, results)
    modelled_32b()


if __name__ == "__main__":
    main()
