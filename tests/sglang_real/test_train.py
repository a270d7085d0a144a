"""``stapo train`` end to end with ``rollout.engine=sglang``: the tiny CPU run's trainer ranks on gloo
(tensor-parallel 2), a real SGLang server launched by node 0 as a subprocess, weights synced to it
before every step (distributed over gloo), its figures next to the local engine's on the same seed.

The two runs do not sample the same tokens (different samplers), so their figures are compared as
what they must share: (1) every step's train/rollout log-prob mismatch is float32 round-off, which
holds only if the server generated with exactly the weights the trainer synced that step and reports
the log-probs of what it sampled at the rollout temperature; (2) step 1 samples the same initial
policy on the same prompts in both runs, so its accuracy agrees within binomial noise and its
entropy (the trainer's, on the sampled tokens) within a few per cent; (3) both runs learn over the
10 steps. Measured (seed 0): accuracy 0.005 / 0.006 at step 1 and 0.059 / 0.054 at step 10 (SGLang /
local), mismatch about 1.2e-7 on every step.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO_ROOT, save_tiny_qwen3
from tests.sglang_real.conftest import real_sglang_settings
from tests.trainer.runs import metrics, run, train_command

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1200)]

STEPS = 10  # the tiny run's own batch (64 prompts x 16 samples), its first 10 steps


def tiny_task_model(directory: Path) -> Path:
    """A random Hugging Face Qwen3 of the tiny run's architecture: the server starts on it and the
    trainer replaces its weights with its own initialisation before step 1."""
    model = yaml.safe_load((REPO_ROOT / "configs" / "tiny_cpu.yaml").read_text())["model"]
    fields = {k: model[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")}
    fields |= {k: model[k] for k in ("num_key_value_heads", "head_dim", "max_position_embeddings")}
    return save_tiny_qwen3(
        directory, tie=model["tie_word_embeddings"], num_hidden_layers=model["num_hidden_layers"], **fields
    )


def test_stapo_train_with_sglang_matches_the_local_engine(sglang_venv, standin_trace, tmp_path):
    model = tiny_task_model(tmp_path / "hf")
    context = yaml.safe_load((REPO_ROOT / "configs" / "tiny_cpu.yaml").read_text())["model"]["max_position_embeddings"]
    sglang = real_sglang_settings(
        sglang_venv,
        model,
        standin_trace,
        tmp_path / "sglang-logs",
        context_length=context,
        weight_sync="distributed",
        weight_sync_backend="gloo",
        weight_sync_master_address="127.0.0.1",
    )
    config = tmp_path / "rollout.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **yaml.safe_load((REPO_ROOT / "configs" / "tiny_cpu.yaml").read_text()),
                "rollout": {"engine": "sglang", "sglang": sglang},
            }
        )
    )
    run(train_command(tmp_path / "sglang", "--config", str(config), f"run.steps={STEPS}"), timeout=900)
    run(train_command(tmp_path / "local", f"run.steps={STEPS}"), timeout=600)
    served, local = metrics(tmp_path / "sglang"), metrics(tmp_path / "local")
    assert [row["step"] for row in served] == [row["step"] for row in local] == list(range(1, STEPS + 1))
    for row in served + local:
        # the trainer's log-probs of the sampled tokens (a step without reward signal runs none)
        tokens = row["mismatch/rest_tokens"] + row["mismatch/candidates_tokens"]
        assert tokens == 0 or row["mismatch/logprob_abs_max"] < 1e-5, row
    assert all(row["mismatch/rest_tokens"] > 0 for row in served[:3] + local[:3])
    first_served, first_local = served[0], local[0]
    samples = first_served["rollout/responses_sampled"]
    assert samples == first_local["rollout/responses_sampled"] == 64 * 16
    p = (first_served["reward/accuracy"] + first_local["reward/accuracy"]) / 2
    noise = math.sqrt(2 * max(p * (1 - p), 1 / samples) / samples)
    assert abs(first_served["reward/accuracy"] - first_local["reward/accuracy"]) < 4 * noise
    assert first_served["policy/entropy"] == pytest.approx(first_local["policy/entropy"], rel=0.05)
    # Both learn: the accuracy of the last 3 steps is well above that of the first 3.
    for rows in (served, local):
        accuracy = [row["reward/accuracy"] for row in rows]
        assert sum(accuracy[-3:]) > 2 * sum(accuracy[:3]), accuracy
    log = "\n".join(
        f"step {a['step']}: accuracy {a['reward/accuracy']:.3f} / {b['reward/accuracy']:.3f}, reward "
        f"{a['reward/mean']:.3f} / {b['reward/mean']:.3f}, entropy {a['policy/entropy']:.4f} / "
        f"{b['policy/entropy']:.4f}, mismatch {a['mismatch/logprob_abs_mean']:.2e} / "
        f"{b['mismatch/logprob_abs_mean']:.2e}"
        for a, b in zip(served, local)
    )
    print(f"sglang / local engine, seed 0:\n{log}")
    # The server was launched by the run, under it, and served every step.
    server_logs = list((tmp_path / "sglang-logs").rglob("server-*.log"))
    assert len(server_logs) == 1 and "update_weights_from_distributed" in server_logs[0].read_text()
