"""Each metric's reduction comes from its declaration (stapo_megatron.loss.metrics): over
micro-batches and ranks for the raw metrics, over a step's optimizer steps for the logged ones."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import stapo_megatron.trainer.rollout_collector  # noqa: F401  (declares the rollout metrics)
import stapo_megatron.trainer.step_statistics  # noqa: F401  (declares the step's entropy metrics)
from stapo_megatron.loss import metrics as M
from stapo_megatron.loss.metrics import Reduction, all_reduce_metrics, combine_steps, declare, reduce_metrics
from stapo_megatron.loss.policy_metrics import summarize_loss_metrics
from tests.loss._loss_call import loss_of

declare(Reduction.SUM, {"test/count": "a count", "test_raw_sum": "a raw sum"})
declare(Reduction.MAX, {"test/largest": "a maximum", "test_raw_max": "a raw maximum"})
declare(Reduction.MIN, {"test/smallest": "a minimum", "test_raw_min": "a raw minimum"})
declare(Reduction.MEAN, {"test/plain": "a plain mean", "test_raw_mean": "a mean (not a raw metric)"})
declare(Reduction.WEIGHTED_MEAN, {"test/fraction": "a fraction of test/count"}, weight="test/count")


def _t(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def test_each_reduction_over_micro_batches():
    items = [
        {"test_raw_sum": _t(2.0), "test_raw_max": _t(-1.0), "test_raw_min": _t(4.0)},
        {"test_raw_sum": _t(5.5), "test_raw_max": _t(3.0), "test_raw_min": _t(-2.0)},
        {"test_raw_sum": _t(0.5)},  # a key missing from an item is reduced over the others
    ]
    out = reduce_metrics(items)
    assert {k: float(v) for k, v in out.items()} == {"test_raw_sum": 8.0, "test_raw_max": 3.0, "test_raw_min": -2.0}
    assert float(items[0]["test_raw_sum"]) == 2.0  # the first item is copied, not added into
    with pytest.raises(ValueError, match="'test_raw_mean': a raw metric must be a sum, max or min"):
        reduce_metrics([{"test_raw_mean": _t(1.0)}])


def test_each_reduction_over_optimizer_steps():
    rows = [
        {"test/count": 30.0, "test/largest": 2.0, "test/smallest": 0.5, "test/plain": 1.0, "test/fraction": 0.1},
        {"test/count": 10.0, "test/largest": 7.0, "test/smallest": 0.25, "test/plain": 4.0, "test/fraction": 0.5},
        {
            "test/count": 5.0,
            "test/plain": float("nan"),
            "test/fraction": float("nan"),
        },  # null: left out, with its weight
    ]
    out = combine_steps(rows)
    assert out["test/count"] == 45.0
    assert out["test/largest"] == 7.0 and out["test/smallest"] == 0.25
    assert out["test/plain"] == 2.5
    # (0.1 * 30 + 0.5 * 10) / 40, not the mean of the two fractions (0.3)
    assert out["test/fraction"] == pytest.approx(0.2, rel=1e-15)
    assert math.isnan(combine_steps([{"test/plain": float("nan")}])["test/plain"])
    # all weights 0: the plain mean
    assert combine_steps([{"test/count": 0.0, "test/fraction": 0.0}] * 2)["test/fraction"] == 0.0
    with pytest.raises(KeyError, match="'test/fraction': its weight 'test/count' is missing"):
        combine_steps([{"test/fraction": 0.5}])


def test_a_metric_without_a_declaration_is_an_error_naming_it():
    with pytest.raises(KeyError, match="metric 'nobody_declared_me' has no declared reduction"):
        reduce_metrics([{"nobody_declared_me": _t(1.0)}])
    with pytest.raises(KeyError, match="metric 'nobody_declared_me' has no declared reduction"):
        all_reduce_metrics({"nobody_declared_me": _t(1.0)}, None)
    with pytest.raises(KeyError, match="metric 'policy/nobody' has no declared reduction"):
        combine_steps([{"test/count": 1.0, "policy/nobody": 1.0}])
    with pytest.raises(ValueError, match="'test/count': declared twice"):
        declare(Reduction.MAX, {"test/count": "a count"})
    with pytest.raises(ValueError, match="weight is needed by WEIGHTED_MEAN and only by it"):
        declare(Reduction.WEIGHTED_MEAN, {"test/unweighted": "no weight"})


def test_all_reduce_sends_one_fp64_vector_per_kind(monkeypatch):
    """The wire format, without a process group: one all-reduce per kind present, of one fp64
    vector on the given device, the reduced values read back by name."""
    calls = []

    def fake_all_reduce(tensor, op, group):
        calls.append((op, tensor.dtype, tensor.device, tensor.tolist()))
        tensor.mul_(2.0)  # as if a second rank held the same values and the op were a sum

    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    metrics = {
        "test_raw_sum": _t(3.0),
        "response_tokens": _t(7.0),
        "test_raw_max": torch.tensor(1.5),
        "test_raw_min": _t(0.5),
    }
    out = all_reduce_metrics(metrics, group=object(), device=torch.device("cpu"))
    assert [(op, dtype) for op, dtype, _, _ in calls] == [
        (dist.ReduceOp.SUM, torch.float64),
        (dist.ReduceOp.MAX, torch.float64),
        (dist.ReduceOp.MIN, torch.float64),
    ]
    assert calls[0][3] == [7.0, 3.0]  # sorted by name: response_tokens, test_raw_sum
    assert {k: float(v) for k, v in out.items()} == {
        "test_raw_sum": 6.0,
        "response_tokens": 14.0,
        "test_raw_max": 3.0,
        "test_raw_min": 1.0,
    }


def _step(silenced_per_row: list[int], tokens_per_row: int, ratio: float):
    """One optimizer step's logged metrics through the real path: PolicyLoss per micro-batch
    (one row each), reduced, summarized. Row r silences its first ``silenced_per_row[r]`` tokens."""
    rows = len(silenced_per_row)
    keep = torch.ones(rows, tokens_per_row)
    for r, n in enumerate(silenced_per_row):
        keep[r, :n] = 0
    old = torch.full((rows, tokens_per_row), -1.0)
    logprob = old + math.log(ratio)
    advantages = torch.tensor([1.0 if r % 2 == 0 else -1.0 for r in range(rows)])
    raw = [
        loss_of(
            logprob[r : r + 1],
            old[r : r + 1],
            advantages[r : r + 1],
            keep[r : r + 1],
            response_mask=torch.ones(1, tokens_per_row),
            entropy=torch.full((1, tokens_per_row), 0.5 + r),
        )[2]
        for r in range(rows)
    ]
    return summarize_loss_metrics(reduce_metrics(raw))


def test_two_optimizer_steps_with_different_token_counts_combine_token_weighted():
    # step 1: 2 rows x 10 tokens, 1 + 3 silenced (4 / 20); step 2: 1 row x 4 tokens, 3 silenced (3 / 4)
    first = _step([1, 3], 10, ratio=1.5)  # A > 0 row: clip-high (1.5 > 1.28); A < 0 row: not clipped
    second = _step([3], 4, ratio=1.5)
    assert first["s2t/masked_fraction"] == pytest.approx(4 / 20) and second["s2t/masked_fraction"] == pytest.approx(
        3 / 4
    )
    step = combine_steps([first, second])
    # by hand: every response token of the step (24), every silenced one (7)
    assert step["s2t/masked_fraction"] == pytest.approx(7 / 24, rel=1e-12)
    assert step["s2t/masked_fraction"] != pytest.approx((4 / 20 + 3 / 4) / 2)  # not a mean of means
    assert step["policy/response_tokens"] == 24 and step["s2t/silenced_tokens"] == 7
    assert step["policy/kept_tokens"] == 17 and step["policy/run_tokens"] == 17
    # clip-high: the A > 0 rows' kept tokens (9 in step 1, 1 in step 2) out of all 17 kept
    assert first["policy/clip_high_fraction"] == pytest.approx(9 / 16)
    assert step["policy/clip_high_fraction"] == pytest.approx(10 / 17, rel=1e-12)
    # entropy over the silenced tokens: row entropies 0.5 (1 + 3 tokens) and 1.5 (3 tokens in step 1)
    assert step["s2t/entropy_silenced"] == pytest.approx((0.5 * 1 + 1.5 * 3 + 0.5 * 3) / 7, rel=1e-6)
    assert step["policy/ratio_max"] == pytest.approx(1.5) and step["policy/ratio_min"] == pytest.approx(1.5)
    assert math.isnan(step["s2t/tau_h"])  # no step had a threshold


def test_every_metric_of_the_loss_and_the_update_is_declared():
    logprob = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    raw = loss_of(
        logprob,
        logprob - 0.1,
        torch.tensor([1.0]),
        torch.tensor([[1.0, 0.0, 1.0, 1.0]]),
        ref_logprob=logprob + 0.2,
        entropy=torch.rand(1, 4),
        aggregation="seq_mean_token_mean",
        response_mask=torch.ones(1, 4),
        candidates=torch.tensor([[0, 1, 0, 0]]),
        tau_h=torch.tensor(0.3),
        rollout_logprob=logprob - 0.05,
        rollout_correction="tis_token",
    )[2]
    raw["skipped_tokens"] = _t(0.0)
    kinds = {k: M.spec_of(k).reduction for k in raw}  # an undeclared key raises here
    assert kinds.pop("ratio_max") is Reduction.MAX and kinds.pop("ratio_min") is Reduction.MIN
    assert set(kinds.values()) == {Reduction.SUM} and {"ref_kl_sum", "rollout_weight_sum", "sequences"} <= kinds.keys()
    logged = summarize_loss_metrics(reduce_metrics([raw]))
    for key in logged:
        spec = M.spec_of(key)
        if spec.weight is not None:
            assert spec.weight in logged, (key, spec.weight)
    # every weight is itself a declared count (a summed metric)
    for spec in M.declared().values():
        if spec.weight is not None:
            assert M.spec_of(spec.weight).reduction is Reduction.SUM, spec
    assert M.spec_of("s2t/masked_fraction").weight == "policy/response_tokens"
    assert M.spec_of("policy/entropy").weight == "policy/statistics_tokens"
    # the entropy covers every response token, also those the update leaves out; the candidates' mismatch does not
    assert "every response token of the step, zero-advantage sequences included" in M.spec_of("policy/entropy").doc
    assert (
        M.spec_of("policy/entropy_p90").weight is None and "every response token" in M.spec_of("policy/entropy_p90").doc
    )
    assert "skipped zero-advantage" in M.spec_of("mismatch/candidates_abs_mean").doc
