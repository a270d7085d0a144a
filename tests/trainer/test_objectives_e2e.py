"""The clip_cov, kl_cov and gspo presets end to end on the tiny configuration (TP=2): a few steps
each, two mini-batches per step so that the second one is off-policy, and the objective's own
metrics in every step's row. And GSPO's zero-advantage skip through ``PolicyUpdater`` on 2
data-parallel ranks: the same update with and without the left-out sequences."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from stapo_megatron.runtime.launch import spawn_ranks
from tests.trainer.runs import metrics, run, train_command

STEPS = 3
# 16 prompts a step in two mini-batches (a quarter of the default): these presets train every sequence
COMMON = [f"run.steps={STEPS}", "batch.prompts_per_step=16", "batch.prompts_per_minibatch=8"]


def _rows(tmp_path, preset, *overrides):
    run_dir = tmp_path / preset
    run(train_command(run_dir, f"algo={preset}", *COMMON, *overrides))
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("policy/pg_loss", "optim/grad_norm")), row
    return rows


@pytest.mark.slow
def test_clip_cov_and_kl_cov_presets_pick_tokens_by_covariance(tmp_path):
    for row in _rows(tmp_path, "clip_cov"):
        # detached tokens stay in the loss denominator; the picks are among the candidates
        assert row["policy/kept_tokens"] == row["policy/response_tokens"]
        assert 0 <= row["objective/cov_selected_tokens"] <= row["objective/cov_candidate_tokens"]
        # no zero-advantage skip: the covariance is centred over every token
        assert row["batch/skipped_fraction"] == 0.0
    for row in _rows(tmp_path, "kl_cov"):
        # k = max(floor(0.002 * N), 1) per loss call: at least one token per micro-batch and optimizer step
        assert row["objective/cov_selected_tokens"] >= 2
        assert row["objective/cov_selected_fraction"] <= 0.002 + 2 / row["policy/run_tokens"]
        assert row["objective/kl_cov_penalty"] >= 0.0
        assert row["batch/skipped_fraction"] == 0.0


@pytest.mark.slow
def test_gspo_preset_clips_sequences_off_policy(tmp_path):
    rows = _rows(tmp_path, "gspo")
    for row in rows:
        # one term per sequence that was run: the zero-advantage ones are left out (exactly) of the passes
        run_sequences = row["batch/sequences"] * (1 - row["batch/skipped_fraction"])
        assert row["objective/gspo_sequences"] == pytest.approx(run_sequences, abs=1e-6)
    # the second mini-batch of a step is off-policy: its sequence ratios leave GSPO's [1 - 3e-4, 1 + 4e-4]
    assert max(r["objective/gspo_clipped_fraction"] for r in rows) > 0.0


def gspo_skip_matches_full_update(out_dir: str) -> None:
    """Rank function: GSPO (off-policy in the second mini-batch) with batch.skip_zero_advantage on
    and off, from the same weights and rollouts (test_zero_advantage_skip.py's model and batch)."""
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from tests.trainer.test_zero_advantage_skip import ARCH, _cfg, _updater, rollout

    ctx = init_distributed(ParallelConfig(data_parallel=2), seed=3)
    reference = build_stage(ARCH, ctx)
    weights = {k: v.clone() if torch.is_tensor(v) else v for k, v in reference.state_dict().items()}
    start = torch.cat([p.detach().reshape(-1).clone() for p in reference.parameters()])
    algo = dict(objective="gspo", token_rule="all", aggregation="seq_mean_token_mean", eps_low=3e-4, eps_high=4e-4)
    runs = []
    for skip in (True, False):
        ddp, updater = _updater(ctx, weights, _cfg(skip, **algo))
        done = updater.update_step(rollout(False))
        grads = torch.cat([b.grad_data.clone() for b in ddp.buffers])
        params = torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])
        runs.append((grads, params, done.metrics, [r.metrics for r in done.results]))
    (g1, p1, m1, r1), (g0, p0, m0, r0) = runs
    out = {
        "grad_rel": float((g1 - g0).norm() / g0.norm()),
        "param_max_diff": float((p1 - p0).abs().max()),
        "param_moved": float((p0 - start).abs().max()),
        "skipped_fraction": [m1["batch/skipped_fraction"], m0["batch/skipped_fraction"]],
        "pg_loss": [[r["policy/pg_loss"] for r in rows] for rows in (r1, r0)],
        "clipped": [[r["objective/gspo_clipped_fraction"] for r in rows] for rows in (r1, r0)],
        "sequences": [[r["objective/gspo_sequences"] for r in rows] for rows in (r1, r0)],
    }
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(out))


@pytest.mark.slow
def test_gspo_zero_advantage_skip_gives_the_same_update(tmp_path):
    spawn_ranks(gspo_skip_matches_full_update, 2, str(tmp_path))
    for r in range(2):
        row = json.loads(Path(tmp_path, f"rank{r}.json").read_text())
        skipped, full = row["skipped_fraction"]
        assert full == 0.0 and skipped == pytest.approx(20 / 48)  # 5 of 12 groups have A = 0
        # float rounding only: the packing differs, so the sums run in another order (Adam's
        # normalisation magnifies it on near-zero gradients after the first optimizer step)
        assert row["grad_rel"] <= 1e-6 and row["param_max_diff"] <= 1e-2 * row["param_moved"], row
        assert row["pg_loss"][0] == pytest.approx(row["pg_loss"][1], rel=1e-5, abs=1e-7)
        # the left-out sequences are not run, their A = 0 terms are 0: only the count differs
        assert sum(row["sequences"][1]) - sum(row["sequences"][0]) == 20
        # the second mini-batch is off-policy: GSPO clips some of its sequences in both runs
        assert row["clipped"][0][1] > 0 and row["clipped"][1][1] > 0
