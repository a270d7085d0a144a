"""The S2T threshold is exact over the whole mini-batch: splitting it into micro-batches, or over
data-parallel ranks, silences exactly the same tokens."""

from __future__ import annotations

import json
import math

import pytest

from tests.trainer.runs import metrics, run, train_command


def silenced(run_dir) -> set[tuple[int, int, int]]:
    with open(run_dir / "spurious" / "step_0000001.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {(r["sequence"], r["position"], r["token_id"]) for r in rows}


@pytest.mark.slow
def test_silenced_tokens_do_not_depend_on_micro_batching_or_data_parallelism(trained_tiny, tmp_path):
    common = ["run.steps=1", f"checkpoint.load_megatron={trained_tiny}", "logging.inspect_every=1", "algo.tau_p=0.3"]
    one = tmp_path / "one_microbatch"
    run(train_command(one, *common, "batch.max_tokens_per_microbatch=65536", "batch.max_tokens_per_forward=65536"))
    split = tmp_path / "dp2_two_microbatches_each"
    run(
        train_command(
            split,
            *common,
            "parallel.tensor_parallel=1",
            "parallel.data_parallel=2",
            "batch.max_tokens_per_microbatch=2051",
            "batch.max_tokens_per_forward=2051",
        )
    )
    a, b = silenced(one), silenced(split)
    assert len(a) >= 3, "the check needs silenced tokens"
    assert a == b
    row_a, row_b = metrics(one)[0], metrics(split)[0]
    assert row_a["s2t/candidates"] == row_b["s2t/candidates"] > len(a)
    assert math.isclose(row_a["s2t/tau_h"], row_b["s2t/tau_h"], rel_tol=1e-5)
    assert row_a["s2t/silenced_tokens"] == row_b["s2t/silenced_tokens"] == len(a)
