"""Rollouts as tensors: broadcast from the rollout rank, split into mini- and micro-batches.

A sequence is prompt + response. The model reads ``tokens[:-1]`` and is scored on
``tokens[1:]``; the response tokens are the labels at positions ``P-1 .. P+R-2``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

from stapo_megatron.runtime.distributed import ParallelContext


@dataclasses.dataclass
class RolloutBatch:
    """Every sampled response of a rollout step, identical on every rank after :func:`broadcast_rollouts`."""

    prompt_ids: list[list[int]]  # one per sequence (a prompt repeated G times)
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]  # what the engine sampled with
    truncated: torch.Tensor  # [N] bool: stopped at the length limit
    rewards: torch.Tensor  # [N] float: shaped reward used for advantages
    correct: torch.Tensor  # [N] float 0/1: the verifier's verdict
    advantages: torch.Tensor  # [N] float
    group_ids: torch.Tensor  # [N] long: which prompt of the step

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, indices: Sequence[int]) -> "RolloutBatch":
        index = torch.as_tensor(list(indices), dtype=torch.long)
        return RolloutBatch(
            prompt_ids=[self.prompt_ids[i] for i in indices],
            response_ids=[self.response_ids[i] for i in indices],
            rollout_logprobs=[self.rollout_logprobs[i] for i in indices],
            truncated=self.truncated[index],
            rewards=self.rewards[index],
            correct=self.correct[index],
            advantages=self.advantages[index],
            group_ids=self.group_ids[index],
        )


def _flat(lists: list[list], dtype) -> torch.Tensor:
    # One small tensor per sequence, then one cat: C speed for millions of tokens.
    return torch.cat([torch.tensor(x, dtype=dtype) for x in lists]) if lists else torch.empty(0, dtype=dtype)


def _split(values: torch.Tensor, lengths: torch.Tensor) -> list[list]:
    if lengths.numel() == 0:
        return []
    return [chunk.tolist() for chunk in torch.split(values, lengths.tolist())]


def pack_rollouts(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch as ``(sizes, integers, floats)``: three flat CPU tensors that :func:`unpack_rollouts` reverses.

    sizes = [N, prompt tokens, response tokens]; integers = prompt lengths, response lengths,
    prompt tokens, response tokens, group ids, truncated; floats = rollout log-probs, rewards,
    correct, advantages.
    """
    prompt_lengths = torch.tensor([len(x) for x in batch.prompt_ids], dtype=torch.long)
    response_lengths = torch.tensor([len(x) for x in batch.response_ids], dtype=torch.long)
    prompts, responses = _flat(batch.prompt_ids, torch.long), _flat(batch.response_ids, torch.long)
    logprobs = _flat(batch.rollout_logprobs, torch.float32)
    if logprobs.numel() != responses.numel():
        raise ValueError(f"rollout_logprobs: {logprobs.numel()} values for {responses.numel()} response tokens")
    integers = torch.cat([prompt_lengths, response_lengths, prompts, responses, batch.group_ids.long(), batch.truncated.long()])
    floats = torch.cat([logprobs, batch.rewards.float(), batch.correct.float(), batch.advantages.float()])
    sizes = torch.tensor([len(batch), prompts.numel(), responses.numel()], dtype=torch.long)
    return sizes, integers, floats


def unpack_rollouts(sizes: torch.Tensor, integers: torch.Tensor, floats: torch.Tensor) -> RolloutBatch:
    count, num_prompt_tokens, num_response_tokens = sizes.tolist()
    prompt_lengths, response_lengths, prompts, responses, group_ids, truncated = torch.split(
        integers, [count, count, num_prompt_tokens, num_response_tokens, count, count]
    )
    logprobs, rewards, correct, advantages = torch.split(floats, [num_response_tokens, count, count, count])
    return RolloutBatch(
        prompt_ids=_split(prompts, prompt_lengths),
        response_ids=_split(responses, response_lengths),
        rollout_logprobs=_split(logprobs, response_lengths),
        truncated=truncated.bool(),
        rewards=rewards.clone(),
        correct=correct.clone(),
        advantages=advantages.clone(),
        group_ids=group_ids.clone(),
    )


def _packed_lengths(sizes: torch.Tensor) -> tuple[int, int]:
    count, num_prompt_tokens, num_response_tokens = sizes.tolist()
    return 4 * count + num_prompt_tokens + num_response_tokens, 3 * count + num_response_tokens


def broadcast_rollouts(ctx: ParallelContext, batch: RolloutBatch | None, src: int = 0) -> RolloutBatch:
    """Global rank ``src``'s ``batch`` on every rank (the others pass None); collective over every rank.

    The three sizes go over the gloo group (CPU metadata); the tokens go as two flat tensors on
    ``ctx.device`` over the world group: at scale (2,048 responses of 16k tokens, ~400 MB) NCCL
    moves them in a fraction of a second, where pickling them over gloo's TCP would take many.
    ``src`` keeps its own batch; the others get the same values in the dtypes of :class:`RolloutBatch`.
    """
    is_src = ctx.rank == src
    if is_src:
        sizes, integers, floats = pack_rollouts(batch)
    else:
        sizes = torch.zeros(3, dtype=torch.long)
    dist.broadcast(sizes, src=src, group=ctx.cpu_group)
    num_integers, num_floats = _packed_lengths(sizes)
    if is_src:
        integers, floats = integers.to(ctx.device), floats.to(ctx.device)
    else:
        integers = torch.empty(num_integers, dtype=torch.long, device=ctx.device)
        floats = torch.empty(num_floats, dtype=torch.float32, device=ctx.device)
    for tensor in (integers, floats):
        if tensor.numel():  # every rank knows the sizes: an empty step skips alike everywhere
            dist.broadcast(tensor, src=src, group=ctx.world_group)
    if is_src:
        return batch
    return unpack_rollouts(sizes, integers.cpu(), floats.cpu())


def partition_for_rank(num_sequences: int, lengths: Sequence[int], rank: int, world: int) -> list[int]:
    """This data-parallel rank's sequences: longest first, dealt round-robin (balances tokens)."""
    order = sorted(range(num_sequences), key=lambda i: (-lengths[i], i))
    return order[rank::world]


def make_microbatches(
    batch: RolloutBatch,
    indices: Sequence[int],
    micro_batch_size: int,
    device: torch.device,
    pad_to_multiple: int = 1,
) -> list[dict]:
    """Padded micro-batch tensors for ``indices`` (in that order). An empty ``indices`` gives one
    all-padding micro-batch, so every rank runs the schedule and joins its collectives."""
    chunks = [list(indices[i : i + micro_batch_size]) for i in range(0, len(indices), micro_batch_size)] or [[]]
    microbatches = []
    for chunk in chunks:
        sequences = [batch.prompt_ids[i] + batch.response_ids[i] for i in chunk] or [[0, 0]]
        width = max(len(s) for s in sequences) - 1
        width = -(-width // pad_to_multiple) * pad_to_multiple
        rows = len(sequences)
        input_ids = torch.zeros(rows, width, dtype=torch.long)
        labels = torch.zeros(rows, width, dtype=torch.long)
        response_mask = torch.zeros(rows, width, dtype=torch.float32)
        advantages = torch.zeros(rows, width, dtype=torch.float32)
        rollout_logprobs = torch.zeros(rows, width, dtype=torch.float32)
        for row, i in enumerate(chunk):
            tokens = torch.tensor(sequences[row], dtype=torch.long)
            n = len(tokens) - 1
            input_ids[row, :n] = tokens[:-1]
            labels[row, :n] = tokens[1:]
            start, stop = len(batch.prompt_ids[i]) - 1, n
            response_mask[row, start:stop] = 1.0
            advantages[row, start:stop] = float(batch.advantages[i])
            rollout_logprobs[row, start:stop] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
        microbatches.append(
            {
                "input_ids": input_ids.to(device),
                "position_ids": torch.arange(width, device=device).unsqueeze(0).expand(rows, width).contiguous(),
                "labels": labels.to(device),
                "response_mask": response_mask.to(device),
                "advantages": advantages.to(device),
                "rollout_logprobs": rollout_logprobs.to(device),
                "sequence_index": torch.tensor(chunk, dtype=torch.long),
            }
        )
    return microbatches
