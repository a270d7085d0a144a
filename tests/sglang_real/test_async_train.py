"""``stapo train`` with generation beside training against a real SGLang server on the CPU: the tiny
run's trainer ranks (tensor-parallel 2, gloo) and a server launched by node 0, with
``rollout.async.max_staleness: 2`` and partial rollouts in one-token segments.

What the real server proves that the local engine cannot: the weight versions the pipeline records
are the weights the server generated with. The trainer's own log-probs of the sampled tokens show
it: at step 1 the server's tokens come from version 0 and the trainer trains from version 0, so the
two log-probs agree to float32 round-off; from step 2 on the tokens are one or two versions older
than the trainer's weights, and the gap is that of the updates in between, orders of magnitude
larger. Were the server one version ahead of what was recorded (a sync landing early), step 2's
tokens would be version 1's and agree to round-off. Every step trains on exactly its
``prompts_per_step`` groups, none older than the bound.

SGLang on the CPU ignores sampling seeds (no deterministic inference with torch_native attention),
so this run is not reproducible token for token; the exact resume is tested with the local engine
(tests/trainer/test_async_runs.py).
"""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import REPO_ROOT
from tests.sglang_real.conftest import real_sglang_settings
from tests.sglang_real.test_train import tiny_task_model
from tests.trainer.runs import metrics, run, train_command

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1200)]

STEPS = 5


def test_stapo_train_async_with_sglang_trains_each_step_on_the_recorded_versions(sglang_venv, standin_trace, tmp_path):
    model = tiny_task_model(tmp_path / "hf")
    base = yaml.safe_load((REPO_ROOT / "configs" / "tiny_cpu.yaml").read_text())
    sglang = real_sglang_settings(
        sglang_venv,
        model,
        standin_trace,
        tmp_path / "sglang-logs",
        context_length=base["model"]["max_position_embeddings"],
        weight_sync="distributed",
        weight_sync_backend="gloo",
        weight_sync_master_address="127.0.0.1",
    )
    config = tmp_path / "async.yaml"
    config.write_text(yaml.safe_dump({**base, "rollout": {"engine": "sglang", "sglang": sglang}}))
    run(
        train_command(
            tmp_path / "run",
            "--config",
            str(config),
            f"run.steps={STEPS}",
            "rollout.async.max_staleness=2",
            "rollout.partial.enabled=true",
            "rollout.partial.segment_tokens=1",
            "rollout.partial.over_sampling=0.5",
        ),
        timeout=1000,
    )
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        step = row["step"]
        assert row["rollout/responses_sampled"] == 64 * 16  # nothing lost or duplicated
        # lag 1: step s generates with version max(0, s - 2); what it takes from the pool may be older
        assert row["async/version_newest"] <= max(0, step - 2), row
        assert row["async/staleness_max"] <= 2
        assert sum(row[f"async/staleness_{d}"] for d in range(3)) == pytest.approx(1.0)
        assert row["mismatch/rest_tokens"] + row["mismatch/candidates_tokens"] > 0
    # version 0's tokens trained from version 0: the server held exactly the synced weights
    assert rows[0]["async/staleness_0"] == 1.0
    assert rows[0]["mismatch/logprob_abs_max"] < 1e-5, rows[0]
    # from step 2 the tokens are older than the trainer's weights, and the gap shows it
    for row in rows[1:]:
        assert row["async/staleness_0"] == 0.0
        assert row["mismatch/logprob_abs_mean"] > 1e-3, row
    print(
        "\n".join(
            f"step {r['step']}: versions {r['async/version_oldest']:.0f}..{r['async/version_newest']:.0f}, "
            f"staleness 0/1/2 {r['async/staleness_0']:.3f}/{r['async/staleness_1']:.3f}/{r['async/staleness_2']:.3f}, "
            f"carried {r['async/partial_carried_over']:.0f}, aborted {r['async/partial_aborted']:.0f}, "
            f"mismatch {r['mismatch/logprob_abs_mean']:.2e}"
            for r in rows
        )
    )
