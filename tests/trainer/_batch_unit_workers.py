"""Rank function for test_batch_units.py (2 ranks on CPU, gloo): random rollout batches broadcast
from alternating ranks, recorded on every rank for the test to compare with what was sent."""

from __future__ import annotations

import datetime
import json
import random
import struct
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist


def random_batch(seed: int) -> RolloutBatch:  # noqa: F821 - imported lazily, as in the ranks
    """A batch of 0-6 sequences: prompts of 1-9 tokens (a prompt is never empty), responses of 0-9."""
    from stapo_megatron.trainer.batch import RolloutBatch

    rng = random.Random(seed)
    n = rng.randint(0, 6)
    prompts = [[rng.randint(0, 151_935) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    responses = [[rng.randint(0, 151_935) for _ in range(rng.randint(0, 9))] for _ in range(n)]
    # float32 values, so that the wire's float32 carries them exactly
    logprobs = [[struct.unpack("f", struct.pack("f", -rng.random() * 20))[0] for _ in r] for r in responses]
    return RolloutBatch(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=logprobs,
        truncated=torch.tensor([rng.random() < 0.3 for _ in range(n)], dtype=torch.bool),
        rewards=torch.tensor([rng.choice([-1.5, 0.0, 0.25, 1.0]) for _ in range(n)], dtype=torch.float32),
        correct=torch.tensor([float(rng.random() < 0.5) for _ in range(n)], dtype=torch.float32),
        advantages=torch.randn(n, generator=torch.Generator().manual_seed(seed)),
        group_ids=torch.tensor([i // 2 for i in range(n)], dtype=torch.long),
    )


def describe(batch) -> dict:
    """Every field of ``batch`` as JSON values, the dtypes of its tensors included."""
    out = {name: getattr(batch, name) for name in ("prompt_ids", "response_ids", "rollout_logprobs")}
    for name in ("truncated", "rewards", "correct", "advantages", "group_ids"):
        tensor = getattr(batch, name)
        out[name] = [str(tensor.dtype), tensor.tolist()]
    return out


def broadcast_random_batches(out_dir: str, seeds: list[int]) -> None:
    from stapo_megatron.trainer.batch import broadcast_rollouts

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=1))
    try:
        # broadcast_rollouts reads these four fields of a ParallelContext; on gloo both groups are the world
        ctx = SimpleNamespace(
            rank=dist.get_rank(), device=torch.device("cpu"), cpu_group=dist.group.WORLD, world_group=dist.group.WORLD
        )
        received = []
        for k, seed in enumerate(seeds):
            src = k % 2
            received.append(describe(broadcast_rollouts(ctx, random_batch(seed) if ctx.rank == src else None, src=src)))
        Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(received))
    finally:
        dist.destroy_process_group()
