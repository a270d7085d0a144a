"""Rollouts as tensors: broadcast from the rollout rank, split into mini- and micro-batches.

A sequence is prompt + response. The model reads ``tokens[:-1]`` and is scored on
``tokens[1:]``; the response tokens are the labels at positions ``P-1 .. P+R-2``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist


@dataclasses.dataclass
class RolloutBatch:
    """Every sampled response of a rollout step, identical on every rank after :meth:`broadcast`."""

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

    def broadcast(self, src: int = 0) -> "RolloutBatch":
        """Send this batch from global rank ``src`` to every rank (as a few flat tensors)."""
        return broadcast_rollouts(self if dist.get_rank() == src else None, src)


def _flat(lists: list[list], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.long)
    values = torch.tensor([v for x in lists for v in x], dtype=dtype)
    return values, lengths


def _split(values: torch.Tensor, lengths: torch.Tensor) -> list[list]:
    if lengths.numel() == 0:
        return []
    return [chunk.tolist() for chunk in torch.split(values, lengths.tolist())]


def broadcast_rollouts(batch: RolloutBatch | None, src: int = 0, device: torch.device | None = None) -> RolloutBatch:
    device = device or torch.device("cpu")
    is_src = dist.get_rank() == src
    if is_src:
        prompts, prompt_lengths = _flat(batch.prompt_ids, torch.long)
        responses, response_lengths = _flat(batch.response_ids, torch.long)
        logprobs, _ = _flat(batch.rollout_logprobs, torch.float32)
        per_sequence = torch.stack(
            [batch.truncated.float(), batch.rewards.float(), batch.correct.float(), batch.advantages.float(), batch.group_ids.float()]
        )
        sizes = torch.tensor([len(batch), prompts.numel(), responses.numel()], dtype=torch.long)
    else:
        sizes = torch.zeros(3, dtype=torch.long)
    sizes = sizes.to(device)
    dist.broadcast(sizes, src)
    count, num_prompt_tokens, num_response_tokens = sizes.tolist()
    if not is_src:
        prompt_lengths = torch.empty(count, dtype=torch.long)
        response_lengths = torch.empty(count, dtype=torch.long)
        prompts = torch.empty(num_prompt_tokens, dtype=torch.long)
        responses = torch.empty(num_response_tokens, dtype=torch.long)
        logprobs = torch.empty(num_response_tokens, dtype=torch.float32)
        per_sequence = torch.empty(5, count, dtype=torch.float32)
    tensors = [prompt_lengths, response_lengths, prompts, responses, logprobs, per_sequence]
    for i, tensor in enumerate(tensors):
        on_device = tensor.to(device)
        dist.broadcast(on_device, src)
        tensors[i] = on_device.cpu()
    prompt_lengths, response_lengths, prompts, responses, logprobs, per_sequence = tensors
    if is_src:
        return batch
    return RolloutBatch(
        prompt_ids=_split(prompts, prompt_lengths),
        response_ids=_split(responses, response_lengths),
        rollout_logprobs=_split(logprobs, response_lengths),
        truncated=per_sequence[0].bool(),
        rewards=per_sequence[1],
        correct=per_sequence[2],
        advantages=per_sequence[3],
        group_ids=per_sequence[4].long(),
    )


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
