"""Rollouts as tensors: broadcast from the rollout rank, balanced over data-parallel ranks by
tokens, packed into token-budget micro-batches.

A sequence is prompt + response. The model reads ``tokens[:-1]`` and is scored on
``tokens[1:]``; the response tokens are the labels at positions ``P-1 .. P+R-2``. A sequence
therefore costs ``P + R - 1`` model tokens (:func:`model_tokens`), which is what budgets count.

A packed micro-batch is one row ``[1, T]``: its sequences concatenated, with ``cu_seqlens``
(int32, ``[n + 1]``) marking where each starts, positions restarting at 0 in each, and
``segment_ids`` giving every token its sequence's place in ``sequence_index``, and ``sample_ids``
giving every token its sequence's index in the rollout batch itself (-1 on padding): a token's
identity that no packing, micro-batch budget or data-parallel split changes (the s2t_random rule
keys its draw by it and ``position_ids``). Padding (only to make T a multiple of
``pad_to_multiple``, and the one-token filler of an empty micro-batch) is its own last segment with
a zero response mask, so it never reaches a sum.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence

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

    def select(self, indices: Sequence[int]) -> RolloutBatch:
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
    integers = torch.cat(
        [prompt_lengths, response_lengths, prompts, responses, batch.group_ids.long(), batch.truncated.long()]
    )
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
    src_batch = batch if ctx.rank == src else None
    if ctx.rank == src and src_batch is None:
        raise ValueError(f"broadcast_rollouts: rank {src}, the source, passed no batch")
    if src_batch is not None:
        sizes, integers, floats = pack_rollouts(src_batch)
    else:
        sizes = torch.zeros(3, dtype=torch.long)
    dist.broadcast(sizes, src=src, group=ctx.cpu_group)
    num_integers, num_floats = _packed_lengths(sizes)
    if src_batch is not None:
        integers, floats = integers.to(ctx.device), floats.to(ctx.device)
    else:
        integers = torch.empty(num_integers, dtype=torch.long, device=ctx.device)
        floats = torch.empty(num_floats, dtype=torch.float32, device=ctx.device)
    for tensor in (integers, floats):
        if tensor.numel():  # every rank knows the sizes: an empty step skips alike everywhere
            dist.broadcast(tensor, src=src, group=ctx.world_group)
    if src_batch is not None:
        return src_batch
    return unpack_rollouts(sizes, integers.cpu(), floats.cpu())


def model_tokens(batch: RolloutBatch, index: int) -> int:
    """Tokens the model reads for sequence ``index``: prompt + response - 1 (at least 1)."""
    return max(1, len(batch.prompt_ids[index]) + len(batch.response_ids[index]) - 1)


def balance_over_ranks(
    sequences: Sequence[int], lengths: Mapping[int, int] | Sequence[int], world: int
) -> list[list[int]]:
    """``sequences`` split over ``world`` data-parallel ranks with near-equal token sums: longest
    first, each to the rank with the fewest tokens so far (LPT; ties to the lower rank), so the
    largest sum exceeds the mean by less than one sequence. Deterministic, so every rank computes
    every rank's share without communication. Each rank's list keeps the dealing order."""
    order = sorted(sequences, key=lambda i: (-lengths[i], i))
    heap = [(0, rank) for rank in range(world)]
    parts: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        tokens, rank = heapq.heappop(heap)
        parts[rank].append(i)
        heapq.heappush(heap, (tokens + lengths[i], rank))
    return parts


def token_imbalance(parts: Sequence[Sequence[int]], lengths: Mapping[int, int] | Sequence[int]) -> float:
    """(largest rank's tokens - mean) / mean over the ranks of ``parts`` (0 when there are no tokens)."""
    sums = [sum(lengths[i] for i in part) for part in parts]
    mean = sum(sums) / len(sums) if sums else 0.0
    return (max(sums) - mean) / mean if mean > 0 else 0.0


def pack_by_budget(
    sequences: Sequence[int], lengths: Mapping[int, int] | Sequence[int], budget: int
) -> list[list[int]]:
    """``sequences`` in as few bins of at most ``budget`` tokens as first-fit decreasing finds
    (at most 11/9 of the optimum + 1). A sequence longer than the budget is an error, never cut."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(sequences, key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > budget:
            raise ValueError(f"sequence {i}: {n} tokens do not fit the micro-batch budget of {budget} tokens")
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


@dataclasses.dataclass
class TokenSlots:
    """Where each model token of a rank's sequences lives in one flat per-rank vector, so that
    statistics computed under one micro-batch layout (the forward budget) are read under another
    (the update budget) by indexing: ``values[mb["token_index"]]``. Padding maps to ``pad_slot``."""

    offsets: dict[int, int]  # sequence -> slot of its first model token
    size: int  # slots, the padding slot included

    @property
    def pad_slot(self) -> int:
        return self.size - 1


def token_slots(batch: RolloutBatch, sequences: Sequence[int]) -> TokenSlots:
    offsets, total = {}, 0
    for i in sequences:
        offsets[i] = total
        total += model_tokens(batch, i)
    return TokenSlots(offsets, total + 1)


def _sequence_tensors(batch: RolloutBatch, i: int):
    """Model inputs, labels, response mask, advantages and rollout log-probs of sequence ``i`` (1-D)."""
    tokens = torch.tensor(batch.prompt_ids[i] + batch.response_ids[i] or [0, 0], dtype=torch.long)
    if tokens.numel() == 1:
        tokens = torch.cat([tokens, tokens])
    n = tokens.numel() - 1
    mask = torch.zeros(n, dtype=torch.float32)
    rollout = torch.zeros(n, dtype=torch.float32)
    start = len(batch.prompt_ids[i]) - 1
    if batch.response_ids[i]:
        mask[start:] = 1.0
        rollout[start:] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
    advantages = mask * float(batch.advantages[i])
    return tokens[:-1], tokens[1:], mask, advantages, rollout


def make_microbatches(
    batch: RolloutBatch,
    bins: Sequence[Sequence[int]],
    device: torch.device,
    *,
    packed: bool = True,
    slots: TokenSlots | None = None,
    pad_to_multiple: int = 1,
) -> list[dict]:
    """One micro-batch per bin of sequence indices (a bin may be empty: one padding token, so a
    rank with fewer sequences still runs every micro-batch of the schedule and its collectives).

    ``packed`` (default): one row per micro-batch (see the module docstring). Otherwise one
    padded row per sequence (the layout before packing; kept as the reference the packed layout
    is tested and benchmarked against). ``slots``: adds ``token_index`` for :class:`TokenSlots`.
    Every tensor is ``[rows, T]`` on ``device`` except ``sequence_index`` (CPU, ``[n]``).
    """
    return [
        _packed(batch, list(b), device, slots, pad_to_multiple)
        if packed
        else _padded(batch, list(b), device, slots, pad_to_multiple)
        for b in (bins or [[]])
    ]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _packed(batch, chunk, device, slots, pad_to_multiple) -> dict:
    parts = [_sequence_tensors(batch, i) for i in chunk]
    lengths = [p[0].numel() for p in parts]
    total = sum(lengths)
    padding = _round_up(max(total, 1), pad_to_multiple) - total
    segments = lengths + ([padding] if padding else [])

    def row(k: int, dtype, pad_value=0) -> torch.Tensor:
        pieces = [p[k] for p in parts] + [torch.full((padding,), pad_value, dtype=dtype)]
        return torch.cat(pieces).to(dtype).unsqueeze(0)

    positions = torch.cat([torch.arange(n) for n in segments]).unsqueeze(0)
    segment_ids = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(segments)).unsqueeze(0)
    cu_seqlens = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(segments), 0)
    mb = {
        "input_ids": row(0, torch.long),
        "position_ids": positions,
        "labels": row(1, torch.long),
        "response_mask": row(2, torch.float32),
        "advantages": row(3, torch.float32),
        "rollout_logprobs": row(4, torch.float32),
        "segment_ids": segment_ids,
        "sample_ids": torch.cat([torch.tensor(chunk, dtype=torch.long), torch.tensor([-1])])[segment_ids],
        "cu_seqlens": cu_seqlens,
    }
    if slots is not None:
        index = [torch.arange(slots.offsets[i], slots.offsets[i] + n) for i, n in zip(chunk, lengths)]
        mb["token_index"] = torch.cat(index + [torch.full((padding,), slots.pad_slot)]).unsqueeze(0)
    out = {k: v.to(device) for k, v in mb.items()}
    out["max_seqlen"] = max(segments)
    out["sequence_index"] = torch.tensor(chunk, dtype=torch.long)
    return out


def _padded(batch, chunk, device, slots, pad_to_multiple) -> dict:
    parts = [_sequence_tensors(batch, i) for i in chunk] or [
        (torch.zeros(1, dtype=torch.long),) * 2 + (torch.zeros(1),) * 3
    ]
    width = _round_up(max(p[0].numel() for p in parts), pad_to_multiple)
    rows = len(parts)
    names = ("input_ids", "labels", "response_mask", "advantages", "rollout_logprobs")
    mb = {name: torch.zeros(rows, width, dtype=parts[0][k].dtype) for k, name in enumerate(names)}
    for r, p in enumerate(parts):
        for k, name in enumerate(names):
            mb[name][r, : p[k].numel()] = p[k]
    mb["position_ids"] = torch.arange(width).unsqueeze(0).expand(rows, width).contiguous()
    mb["segment_ids"] = torch.arange(rows).unsqueeze(1).expand(rows, width).contiguous()
    mb["sample_ids"] = torch.full((rows, width), -1, dtype=torch.long)
    for r, i in enumerate(chunk):
        mb["sample_ids"][r, : parts[r][0].numel()] = i
    if slots is not None:
        index = torch.full((rows, width), slots.pad_slot, dtype=torch.long)
        for r, i in enumerate(chunk):
            n = parts[r][0].numel()
            index[r, :n] = torch.arange(slots.offsets[i], slots.offsets[i] + n)
        mb["token_index"] = index
    out = {k: v.to(device) for k, v in mb.items()}
    out["sequence_index"] = torch.tensor(chunk, dtype=torch.long)
    return out
