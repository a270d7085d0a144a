"""Rank functions for test_parallel_context.py (2 ranks on CPU, gloo).

:func:`contexts_of_each_layout`: the context ``init_distributed`` returns at TP2, PP2 and DP2 on a
gloo world. :func:`collectives_where_the_default_group_refuses_cpu`: a world whose default group
has no backend for CPU tensors (``"cuda:gloo"`` on a CPU-only machine), which is what the NCCL
default group is to CPU tensors and objects on a GPU machine; the trainer's non-model collectives
run there, each recording what it got and what a single process computes from every rank's data.
Every check runs the same collectives on every rank and records instead of raising, so that a
failing check does not desynchronise the ones after it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

TIMEOUT_MINUTES = 1  # a desynchronised collective fails the test instead of hanging it


def _describe(ctx) -> dict:
    from megatron.core import parallel_state as ps

    return {
        "sizes": [ctx.world_size, ctx.tp_size, ctx.pp_size, ctx.cp_size, ctx.dp_size],
        "ranks": [ctx.rank, ctx.tp_rank, ctx.pp_rank, ctx.cp_rank, ctx.dp_rank],
        "stages": [ctx.is_first_stage, ctx.is_last_stage],
        "device": str(ctx.device),
        "group_ranks": {
            name: dist.get_process_group_ranks(getattr(ctx, name))
            for name in ("tp_group", "pp_group", "dp_group", "dp_cpu_group", "model_parallel_group")
        },
        "megatron_groups": [
            ctx.tp_group is ps.get_tensor_model_parallel_group(),
            ctx.pp_group is ps.get_pipeline_model_parallel_group(),
            ctx.dp_group is ps.get_data_parallel_group(),
            ctx.dp_cpu_group is ps.get_data_parallel_group_gloo(),
            ctx.model_parallel_group is ps.get_model_parallel_group(),
        ],
        "world_group_is_default": ctx.world_group is dist.group.WORLD,
        "cpu_group_is_default": ctx.cpu_group is dist.group.WORLD,
        "cpu_backends": [dist.get_backend(ctx.cpu_group), dist.get_backend(ctx.dp_cpu_group)],
    }


def _write(out_dir: str, name: str, results: dict) -> None:
    Path(out_dir, f"{name}_rank{dist.get_rank()}.json").write_text(json.dumps(results))


def contexts_of_each_layout(out_dir: str) -> None:
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed, shutdown_distributed

    results = {}
    for name, layout in {
        "tp2": {"tensor_parallel": 2},
        "pp2": {"pipeline_parallel": 2},
        "dp2": {"data_parallel": 2},
    }.items():
        ctx = init_distributed(ParallelConfig(**layout, timeout_minutes=TIMEOUT_MINUTES))
        results[name] = _describe(ctx)
    # the context is a value: nothing may rebind a group under a running trainer
    try:
        ctx.rank = 5
        results["frozen"] = False
    except dataclasses.FrozenInstanceError:
        results["frozen"] = True
    _write(out_dir, "layouts", results)
    shutdown_distributed()


# ---- the trainer's collectives under a default group that refuses CPU tensors ----------------


def _rollouts():
    """Six sequences of unequal lengths (one empty response); values exact in fp32."""
    from stapo_megatron.trainer.batch import RolloutBatch

    prompts = [[1, 5, 7], [1, 5, 7], [2, 3], [2, 3], [11, 12, 13, 14, 15], [11, 12, 13, 14, 15]]
    responses = [[9, 8, 7, 6], [], [4, 4, 4, 4, 4, 4, 4], [5], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [22, 23, 24]]
    logprobs = [[-0.5 * (i + 1) - 0.25 * j for j in range(len(r))] for i, r in enumerate(responses)]
    return RolloutBatch(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=logprobs,
        truncated=torch.tensor([False, False, True, False, False, True]),
        rewards=torch.tensor([1.0, 0.0, 0.75, 0.0, 1.0, 0.5]),
        correct=torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0]),
        advantages=torch.tensor([0.875, -0.875, 1.5, -1.5, 0.25, -0.25]),
        group_ids=torch.tensor([0, 0, 1, 1, 2, 2]),
    )


def _as_lists(batch) -> dict:
    return {
        field.name: (value.tolist() if isinstance(value, torch.Tensor) else value)
        for field in dataclasses.fields(batch)
        for value in [getattr(batch, field.name)]
    } | {
        "dtypes": [
            str(t.dtype) for t in (batch.truncated, batch.rewards, batch.correct, batch.advantages, batch.group_ids)
        ]
    }


def _rank_data(batch, rank: int, world: int):
    """Rank ``rank``'s micro-batches of ``batch`` and made-up statistics with S2T candidates in them."""
    from stapo_megatron.loss import TokenStats
    from stapo_megatron.trainer.batch import balance_over_ranks, make_microbatches

    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    mine = balance_over_ranks(range(len(batch)), lengths, world)[rank]
    microbatches = make_microbatches(batch, [mine[i : i + 2] for i in range(0, len(mine), 2)], torch.device("cpu"))
    generator = torch.Generator().manual_seed(100 + rank)
    stats = []
    for mb in microbatches:
        shape = mb["labels"].shape
        logprob = -9.0 * torch.rand(shape, generator=generator)  # many below log(tau_p) = -6.2
        entropy = 3.0 * torch.rand(shape, generator=generator)
        stats.append(TokenStats(logprob, entropy, mb["advantages"], mb["response_mask"]))
    return microbatches, stats


def _expected_rollout_statistics(data) -> dict:
    tokens = entropy = mismatch = 0.0
    largest = 0.0
    entropies = []
    for microbatches, stats in data:
        for mb, s in zip(microbatches, stats):
            mask = mb["response_mask"] > 0
            difference = (s.logprob - mb["rollout_logprobs"])[mask].double().abs()
            tokens += float(mask.sum())
            entropy += float(s.entropy[mask].double().sum())
            entropies.append(s.entropy[mask].double())
            mismatch += float(difference.sum())
            largest = max([largest, *difference.tolist()])
    ordered = torch.sort(torch.cat(entropies)).values
    return {
        "policy/statistics_tokens": tokens,
        "policy/entropy": entropy / tokens,
        # the (floor(q n) + 1)-th smallest over both ranks' tokens
        **{f"policy/entropy_p{n}": float(ordered[n * len(ordered) // 100]) for n in (50, 80, 90, 99)},
        "mismatch/logprob_abs_mean": mismatch / tokens,
        "mismatch/logprob_abs_max": largest,
    }


def _check_default_group_refuses_cpu(ctx, shared) -> dict:
    """The proxy itself: the old code's calls (no group named) fail here as they do under NCCL."""
    out = {}
    for name, call in {
        "tensor": lambda: dist.broadcast(torch.zeros(3, dtype=torch.long), src=0),
        "object": lambda: dist.broadcast_object_list([{"step": 1}], src=0),
    }.items():
        try:
            call()
            out[name] = "no error"
        except (RuntimeError, AssertionError) as error:
            out[name] = str(error).splitlines()[0]
    out["backend"] = dist.get_backend()
    return out


def _check_batch_broadcast(ctx, shared) -> dict:
    from stapo_megatron.trainer.batch import RolloutBatch, broadcast_rollouts

    sent = _rollouts()
    received = broadcast_rollouts(ctx, sent if ctx.rank == 0 else None)
    empty = RolloutBatch(
        [],
        [],
        [],
        torch.zeros(0, dtype=torch.bool),
        torch.zeros(0),
        torch.zeros(0),
        torch.zeros(0),
        torch.zeros(0, dtype=torch.long),
    )
    received_empty = broadcast_rollouts(ctx, empty if ctx.rank == 1 else None, src=1)
    return {
        "sent": _as_lists(sent),
        "received": _as_lists(received),
        "sent_empty": _as_lists(empty),
        "received_empty": _as_lists(received_empty),
    }


def _check_rollout_statistics(ctx, shared) -> dict:
    from stapo_megatron.trainer.step_statistics import rollout_statistics

    microbatches, stats = shared["data"][ctx.dp_rank]
    return {
        "got": rollout_statistics(ctx, stats, microbatches).metrics,
        "expected": _expected_rollout_statistics(shared["data"]),
    }


def _check_loss_metrics(ctx, shared) -> dict:
    from stapo_megatron.loss import all_reduce_metrics

    def local(rank):
        return {
            "kept_tokens": torch.tensor(10.0 + rank),
            "ratio_max": torch.tensor(1.5 - rank),
            "ratio_min": torch.tensor(0.5 + rank),
        }

    reduced = all_reduce_metrics({k: v.to(ctx.device) for k, v in local(ctx.dp_rank).items()}, ctx.dp_group)
    return {
        "got": {k: float(v) for k, v in reduced.items()},
        "expected": {"kept_tokens": 21.0, "ratio_max": 1.5, "ratio_min": 0.5},
    }


def _check_minibatch_threshold(ctx, shared) -> dict:
    from stapo_megatron.loss import minibatch_threshold

    algo = shared["algo"]
    _, stats = shared["data"][ctx.dp_rank]
    everything = [s for _, rank_stats in shared["data"] for s in rank_stats]
    return {
        "got": float(minibatch_threshold(algo, stats, ctx.dp_group)),
        "expected": float(minibatch_threshold(algo, everything, None)),
    }


def _check_agreements(ctx, shared) -> dict:
    # stop request (Trainer._agree_to_stop) and non-finite skip (PolicyUpdater): one rank decides
    return {"one_rank": ctx.any_rank(ctx.rank == 1), "no_rank": ctx.any_rank(False)}


def _check_progress_exchange(ctx, shared) -> dict:
    # Trainer.save: rank 0's progress (with the sampler's state) becomes every rank's common state
    progress = {"step": 7, "skipped_steps": 1, "sampler": {"epoch": 2, "order": [3, 1, 2]}} if ctx.rank == 0 else None
    return {"got": ctx.broadcast_object(progress, src=0)}


class _IdTokenizer:
    """The one tokenizer method the inspector calls."""

    def decode(self, ids, skip_special_tokens=False) -> str:
        return " ".join(str(i) for i in ids)


def _check_inspector_gather(ctx, shared) -> dict:
    from stapo_megatron.loss import select_tokens
    from stapo_megatron.trainer.inspector import SpuriousTokenDump, read_dumps

    algo, threshold = shared["algo"], shared["threshold"]
    microbatches, stats = shared["data"][ctx.dp_rank]
    selections = [select_tokens(algo, s, threshold) for s in stats]
    run_dir = Path(shared["out_dir"], "inspect")
    SpuriousTokenDump(run_dir, _IdTokenizer(), 2, ctx).dump(7, [microbatches], [stats], [selections], shared["batch"])
    expected = []
    for rank_microbatches, rank_stats in shared["data"]:
        for mb, s in zip(rank_microbatches, rank_stats):
            selection = select_tokens(algo, s, threshold)
            silenced = (mb["response_mask"] > 0) & (selection.keep == 0) & selection.candidates.bool()
            expected.extend(
                sorted(
                    int(mb["sequence_index"][mb["segment_ids"][row, position]])
                    for row, position in silenced.nonzero().tolist()
                )
            )
    dist.barrier(group=ctx.cpu_group)  # rank 0 has written the file
    owners = [
        sorted({int(i) for mb in rank_microbatches for i in mb["sequence_index"]})
        for rank_microbatches, _ in shared["data"]
    ]
    return {"got": sorted(e["sequence"] for e in read_dumps(run_dir)), "expected": sorted(expected), "owners": owners}


def _check_reporter_metrics(ctx, shared) -> dict:
    from stapo_megatron.trainer.update import merge_reporter_metrics

    pp_ctx = shared["pp_ctx"]  # rank 1 is the last stage: the update's metrics are there
    mine = {"reward/mean": 0.5} if pp_ctx.is_first_stage else {"policy/entropy": 1.25, "policy/kept_tokens": 40.0}
    return {"got": merge_reporter_metrics(pp_ctx, mine)}


CHECKS = {
    "default_group_refuses_cpu": _check_default_group_refuses_cpu,
    "batch_broadcast": _check_batch_broadcast,
    "rollout_statistics": _check_rollout_statistics,
    "loss_metrics": _check_loss_metrics,
    "minibatch_threshold": _check_minibatch_threshold,
    "agreements": _check_agreements,
    "progress_exchange": _check_progress_exchange,
    "inspector_gather": _check_inspector_gather,
    "reporter_metrics": _check_reporter_metrics,
}


def collectives_where_the_default_group_refuses_cpu(out_dir: str) -> None:
    from stapo_megatron.loss import minibatch_threshold
    from stapo_megatron.loss.config import AlgoConfig
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    timeout = datetime.timedelta(minutes=TIMEOUT_MINUTES)
    dist.init_process_group(backend="cuda:gloo", timeout=timeout)
    results = {}
    pp_ctx = init_distributed(ParallelConfig(pipeline_parallel=2, timeout_minutes=TIMEOUT_MINUTES))
    results["pp_context"] = _describe(pp_ctx)
    dp_ctx = init_distributed(ParallelConfig(data_parallel=2, timeout_minutes=TIMEOUT_MINUTES))
    results["dp_context"] = _describe(dp_ctx)
    # Megatron's groups inherit the default backend, so here they refuse CPU tensors as well; on a
    # GPU they serve the device's tensors. Stand-ins that serve this machine's device (the CPU)
    # take their place, so that only a collective that names no group, or names the default group
    # with CPU tensors or objects, can fail.
    device_world = dist.new_group(backend="gloo", timeout=timeout)
    ctx = dataclasses.replace(dp_ctx, world_group=device_world, dp_group=device_world)
    batch = _rollouts()
    algo = AlgoConfig()
    data = [_rank_data(batch, rank, 2) for rank in range(2)]
    shared = {
        "out_dir": out_dir,
        "batch": batch,
        "algo": algo,
        "data": data,
        "pp_ctx": pp_ctx,
        "threshold": minibatch_threshold(algo, [s for _, stats in data for s in stats], None),
    }
    for name, check in CHECKS.items():
        try:
            results[name] = check(ctx, shared)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier(group=ctx.cpu_group)
    _write(out_dir, "refusing", results)
    shutdown_distributed()


def what_a_rank_starts_with(out_dir: str) -> None:
    """What :func:`~stapo_megatron.runtime.launch.spawn_ranks` gave this rank: its environment, working
    directory, parent, and what it had imported before its function ran."""
    import os
    import sys

    from stapo_megatron.runtime import cpu_compat

    rank = os.environ["RANK"]
    state = {
        "env": {
            k: os.environ.get(k)
            for k in (
                "STAPO_TEST_CALLER_VAR",
                "STAPO_TEST_REMOVED_VAR",
                "WORLD_SIZE",
                "NCCL_CUMEM_ENABLE",
                "NCCL_NVLS_ENABLE",
            )
        },
        "cwd": os.getcwd(),
        "parent": os.getppid(),
        "megatron_loaded": "megatron.core.models.gpt" in sys.modules,
        "cpu_layer_installed": cpu_compat.installed(),
    }
    Path(out_dir, f"start_rank{rank}.json").write_text(json.dumps(state))
