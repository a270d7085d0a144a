"""The parallel context and device-correct collectives, on 2 CPU ranks (gloo).

``test_context_*``: what ``init_distributed`` returns at TP2, PP2 and DP2: sizes, ranks, stage
flags, Megatron's own groups, and a gloo group for objects.

``test_collectives_where_the_default_group_refuses_cpu_*``: the strongest CPU check of the
"CPU tensor on the NCCL default group" class of bug (RolloutBatch.broadcast crashed step 1 on
GPUs with "No backend type associated with device type cpu"). The world is started with the
backend ``"cuda:gloo"``: on a CPU-only machine its default group refuses CPU tensors and objects
exactly like NCCL's, so every collective that names no group (falls back to the default group)
fails loudly. The trainer's non-model collectives run there: the rollout batch broadcast, the
rollout statistics and loss-metric reductions, the mini-batch quantile, the stop/skip
agreements, the checkpoint's progress exchange, the inspector's gather and the reporter's
metrics. Scope: the model's own collectives (Megatron's TP/PP/DP groups inherit the default
backend, and its checkpointing uses the default group for objects) cannot run under this world on
CPU, so device groups are stood in for by gloo groups; a CPU tensor sent on a group that does
serve the device cannot be told apart on a CPU-only machine and needs the GPU smoke run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stapo_megatron.runtime.launch import spawn_ranks
from tests.runtime import _workers


def _ranks(out: Path, name: str) -> list[dict]:
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}_rank*.json"))]
    assert len(ranks) == 2
    return ranks


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    spawn_ranks(_workers.contexts_of_each_layout, 2, str(out))
    return _ranks(out, "layouts")


@pytest.fixture(scope="module")
def refusing(tmp_path_factory):
    out = tmp_path_factory.mktemp("refusing")
    spawn_ranks(_workers.collectives_where_the_default_group_refuses_cpu, 2, str(out))
    return _ranks(out, "refusing")


def test_context_tp2(layouts):
    for rank, got in enumerate(by_layout["tp2"] for by_layout in layouts):
        assert got["sizes"] == [2, 2, 1, 1, 1]
        assert got["ranks"] == [rank, rank, 0, 0, 0]
        assert got["stages"] == [True, True]
        assert got["group_ranks"]["tp_group"] == [0, 1]
        assert got["group_ranks"]["model_parallel_group"] == [0, 1]
        assert got["group_ranks"]["dp_group"] == got["group_ranks"]["dp_cpu_group"] == [rank]
        assert got["group_ranks"]["pp_group"] == [rank]


def test_context_pp2(layouts):
    for rank, got in enumerate(by_layout["pp2"] for by_layout in layouts):
        assert got["sizes"] == [2, 1, 2, 1, 1]
        assert got["ranks"] == [rank, 0, rank, 0, 0]
        assert got["stages"] == [rank == 0, rank == 1]
        assert got["group_ranks"]["pp_group"] == [0, 1]
        assert got["group_ranks"]["tp_group"] == got["group_ranks"]["dp_group"] == [rank]


def test_context_dp2(layouts):
    for rank, got in enumerate(by_layout["dp2"] for by_layout in layouts):
        assert got["sizes"] == [2, 1, 1, 1, 2]
        assert got["ranks"] == [rank, 0, 0, 0, rank]
        assert got["stages"] == [True, True]
        assert got["group_ranks"]["dp_group"] == got["group_ranks"]["dp_cpu_group"] == [0, 1]


def test_context_groups_are_megatrons_and_cpu_group_is_the_gloo_world(layouts):
    for ranks in layouts:
        for name in ("tp2", "pp2", "dp2"):
            got = ranks[name]
            assert got["megatron_groups"] == [True] * 5, name
            assert got["device"] == "cpu"
            assert got["world_group_is_default"] and got["cpu_group_is_default"]  # a gloo world serves both
            assert got["cpu_backends"] == ["gloo", "gloo"]
        assert ranks["frozen"]


def test_context_under_a_default_group_that_refuses_cpu(refusing):
    for rank, ranks in enumerate(refusing):
        proxy = ranks["default_group_refuses_cpu"]
        assert proxy["backend"] == "cuda:gloo"
        assert proxy["tensor"] == "No backend type associated with device type cpu"  # the GPU crash
        assert proxy["object"] != "no error"
        for name, stages in (("pp_context", [rank == 0, rank == 1]), ("dp_context", [True, True])):
            got = ranks[name]
            assert got["stages"] == stages
            assert got["world_group_is_default"]
            # not the default group, which has no CPU backend: a gloo group of its own
            assert not got["cpu_group_is_default"]
            assert got["cpu_backends"] == ["gloo", "gloo"]


def _check(refusing, name: str) -> list[dict]:
    results = [ranks[name] for ranks in refusing]
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    assert not errors, "\n".join(errors)
    return results


def test_collectives_where_the_default_group_refuses_cpu_batch_broadcast(refusing):
    for got in _check(refusing, "batch_broadcast"):
        assert got["received"] == got["sent"]
        assert got["received"]["response_ids"][1] == [] and len(got["received"]["prompt_ids"]) == 6
        assert got["received"]["dtypes"] == [
            "torch.bool",
            "torch.float32",
            "torch.float32",
            "torch.float32",
            "torch.int64",
        ]
        assert got["received_empty"] == got["sent_empty"]


@pytest.mark.parametrize("name", ["rollout_statistics", "loss_metrics"])
def test_collectives_where_the_default_group_refuses_cpu_reductions(refusing, name):
    for got in _check(refusing, name):
        assert got["got"].keys() == got["expected"].keys()
        for key, value in got["expected"].items():
            assert got["got"][key] == pytest.approx(value, rel=1e-12), key


def test_collectives_where_the_default_group_refuses_cpu_minibatch_threshold(refusing):
    results = _check(refusing, "minibatch_threshold")
    assert results[0]["got"] == results[1]["got"] == results[0]["expected"]
    assert 0.0 < results[0]["got"] < 3.0  # a quantile of the made-up entropies, not the empty population's inf


def test_collectives_where_the_default_group_refuses_cpu_agreements_and_progress(refusing):
    for got in _check(refusing, "agreements"):
        assert got == {"one_rank": True, "no_rank": False}
    for got in _check(refusing, "progress_exchange"):
        assert got["got"] == {"step": 7, "skipped_steps": 1, "sampler": {"epoch": 2, "order": [3, 1, 2]}}


def test_collectives_where_the_default_group_refuses_cpu_inspector_gather(refusing):
    for got in _check(refusing, "inspector_gather"):
        assert got["got"] == got["expected"]
        for owned in got["owners"]:  # entries of both ranks' sequences reached the file
            assert set(owned) & set(got["got"]), (owned, got["got"])


def test_collectives_where_the_default_group_refuses_cpu_reporter_metrics(refusing):
    first, last = _check(refusing, "reporter_metrics")
    assert first["got"] == {"reward/mean": 0.5, "policy/entropy": 1.25, "policy/kept_tokens": 40.0}
    assert last["got"] == {"policy/entropy": 1.25, "policy/kept_tokens": 40.0}
