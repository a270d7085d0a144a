"""Generation beside training in real ``stapo train`` runs (the tiny task, tensor-parallel over 2 CPU
ranks, the local engine generating in rank 0's pipeline thread): the weight versions follow the
schedule, a kill and resume with partial samples in flight gives the same run as an uninterrupted
one, and the synchronous loop is untouched by the pipeline's existence."""

from __future__ import annotations

import time

import pytest
import torch

from stapo_megatron.trainer.checkpointing import PIPELINE_KEY, read_common
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

# Partial rollouts of the trained tiny policy: segments of one token, groups of two, and a pool three
# times the step's 16 groups, so the quorum is reached after the second token, when enough groups
# whose two samples answered "digit EOS" have finished, and the samples still answering with free
# words are stopped mid-answer, to go on in the next step.
ASYNC = [
    "rollout.async.max_staleness=2",
    "rollout.partial.enabled=true",
    "rollout.partial.segment_tokens=1",
    "rollout.partial.over_sampling=2",
    "batch.prompts_per_step=16",
    "batch.prompts_per_minibatch=16",
    "batch.group_size=2",
]
STEPS = ["run.steps=6", "checkpoint.save_every=1", "checkpoint.keep_last=10"]


def _overrides(trained_tiny) -> list[str]:
    return [*ASYNC, *STEPS, f"checkpoint.load_megatron={trained_tiny}"]


def _comparable(row: dict) -> dict:
    # wall-clock figures aside (the pipeline's waits are seconds too)
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/")) and not k.endswith("_s")}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, trained_tiny):
    run_dir = tmp_path_factory.mktemp("async-reference") / "run"
    run(train_command(run_dir, *_overrides(trained_tiny)))
    return run_dir


@pytest.mark.slow
def test_an_async_run_trains_each_step_on_the_scheduled_versions(reference_run):
    rows = metrics(reference_run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    for row in rows:
        step = row["step"]
        # lag 1 (max_staleness 2 less the version a partial sample gains): step s generates with
        # version max(0, s - 2); groups it takes from the pool may be older, never beyond the bound
        assert row["async/version_newest"] <= max(0, step - 2)
        assert row["async/staleness_max"] <= 2 and step - 1 - row["async/version_oldest"] <= 2
        assert row["async/staleness_0"] + row["async/staleness_1"] + row["async/staleness_2"] == pytest.approx(1.0)
        assert row["rollout/responses_sampled"] == 16 * 2  # exactly the step's groups
        assert row["rollout_correction/weight_mean"] > 0  # tis_token: on by default when pipelined
    assert rows[0]["async/staleness_0"] == 1.0 and all(r["async/staleness_0"] == 0.0 for r in rows[1:])
    assert sum(r["async/partial_aborted"] for r in rows) > 0  # samples stopped mid-answer at a quorum
    assert sum(r["async/partial_carried_over"] for r in rows) > 0  # ... trained once they finished


@pytest.mark.slow
def test_a_kill_and_resume_with_partial_samples_in_flight_is_the_same_run(reference_run, trained_tiny, tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    ranks = torchrun_command(
        default_config_path(),
        2,
        f"run.output_dir={run_dir}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        *_overrides(trained_tiny),
    )
    process = start_session(ranks)
    kill_when(process, lambda: (checkpoints / "iter_0000003" / "stapo_complete.json").is_file())
    time.sleep(2)  # nothing may go on writing once the ranks are killed
    # The checkpoint holds what was generated ahead: step 4's batch and samples stopped mid-answer.
    state = read_common(checkpoints / "iter_0000003")["progress"][PIPELINE_KEY]
    assert list(state["ready"]) == ["4"] and state["next_step"] == 5
    in_flight = [s for g in state["pool"]["groups"] for s in g["samples"] if s["finish_reason"] is None]
    assert in_flight and all(s["token_ids"] and len(s["versions"]) == len(s["token_ids"]) for s in in_flight)

    resumed = run(train_command(run_dir, *_overrides(trained_tiny)))
    assert f"[stapo] resumed from {checkpoints / 'iter_0000003'} (step 3)" in resumed.stderr
    reference, after = checkpoint_tensors(reference_run / "checkpoints" / "iter_0000006", checkpoints / "iter_0000006")
    parameters = [k for k in reference if not k.startswith("optimizer.")]
    assert len(parameters) == 10
    for key in parameters:
        assert torch.equal(reference[key], after[key]), f"{key} differs after the resume"
    ref_rows, res_rows = metrics(reference_run), metrics(run_dir)
    assert [r["step"] for r in res_rows] == list(range(1, 7))
    for step in (4, 5, 6):
        assert _comparable(res_rows[step - 1]) == _comparable(ref_rows[step - 1]), f"metrics of step {step} differ"
