"""Batch building as properties over many random inputs, in one process (plus one 2-rank gloo
spawn for the broadcast): the wire format and the receiver's buffer sizes, the data-parallel split
by tokens, first-fit-decreasing packing, token slots read across two micro-batch layouts, and
packed rows under a token budget with padding. test_batch.py holds the hand-worked cases."""

from __future__ import annotations

import json
import random

import torch

from stapo_megatron.runtime.launch import spawn_ranks
from stapo_megatron.trainer.batch import (
    _packed_lengths,
    balance_over_ranks,
    make_microbatches,
    model_tokens,
    pack_by_budget,
    pack_rollouts,
    token_imbalance,
    token_slots,
    unpack_rollouts,
)
from tests.trainer._batch_unit_workers import broadcast_random_batches, describe, random_batch

CPU = torch.device("cpu")


def test_the_wire_format_round_trips_and_the_receiver_sizes_its_buffers_from_three_numbers():
    shapes = set()
    for seed in range(150):
        batch = random_batch(seed)
        sizes, integers, floats = pack_rollouts(batch)
        assert (integers.dtype, floats.dtype, sizes.tolist()[0]) == (torch.long, torch.float32, len(batch))
        # what a receiving rank allocates from the three sizes alone must be what the sender sends
        assert _packed_lengths(sizes) == (integers.numel(), floats.numel())
        assert describe(unpack_rollouts(sizes, integers, floats)) == describe(batch)
        shapes.add((len(batch) == 0, any(not r for r in batch.response_ids)))
    assert shapes >= {(True, False), (False, True)}  # empty batches and empty responses were drawn


def test_broadcast_gives_every_rank_the_senders_batch_from_either_rank(tmp_path):
    seeds = list(range(10)) + [next(seed for seed in range(300) if len(random_batch(seed)) == 0)]
    spawn_ranks(broadcast_random_batches, 2, str(tmp_path), seeds)
    expected = [describe(random_batch(seed)) for seed in seeds]
    for rank in (0, 1):
        received = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert received == expected, f"rank {rank}"
    assert not expected[-1]["response_ids"]  # an empty batch went over the wire too, from rank 0


def test_balance_deals_every_sequence_once_within_one_sequence_of_the_mean():
    rng = random.Random(1)
    for _ in range(200):
        lengths = [rng.choice([1, 2, rng.randint(1, 50), rng.randint(100, 4000)]) for _ in range(rng.randint(0, 40))]
        world = rng.randint(1, 8)
        sequences = list(range(len(lengths)))
        parts = balance_over_ranks(sequences, lengths, world)
        assert len(parts) == world
        assert sorted(i for part in parts for i in part) == sequences
        sums = [sum(lengths[i] for i in part) for part in parts]
        if lengths:
            # LPT: the rank that ends heaviest was the lightest when it took its last sequence
            assert max(sums) - min(sums) <= max(lengths)
            mean = sum(sums) / world
            assert token_imbalance(parts, lengths) == (max(sums) - mean) / mean
        for part in parts:  # dealt longest first
            assert [lengths[i] for i in part] == sorted((lengths[i] for i in part), reverse=True)
        # the order the sequences come in does not matter: every rank computes every share alike
        assert balance_over_ranks(rng.sample(sequences, len(sequences)), lengths, world) == parts


def test_budget_packing_is_first_fit_over_random_lengths():
    rng = random.Random(2)
    for _ in range(200):
        budget = rng.randint(8, 300)
        lengths = {i: rng.randint(1, budget) for i in rng.sample(range(1000), rng.randint(0, 60))}
        bins = pack_by_budget(list(lengths), lengths, budget)
        assert sorted(i for b in bins for i in b) == sorted(lengths)
        loads = [sum(lengths[i] for i in b) for b in bins]
        assert all(0 < load <= budget for load in loads)
        assert len(bins) >= -(-sum(lengths.values()) // budget)
        for j, later in enumerate(bins):
            assert [lengths[i] for i in later] == sorted((lengths[i] for i in later), reverse=True)
            # first fit: no earlier bin had room for anything a later bin holds (room only shrinks)
            assert all(budget - loads[k] < min(lengths[i] for i in later) for k in range(j))


def _value(sequence: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    return sequence.double() * 10_000 + position.double()


def _token_values(mb: dict, lengths: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(value of each token from its sequence and position, mask of the tokens that are not padding)
    of a micro-batch, packed (padding: a last segment) or padded (padding: past a row's sequence)."""
    index, segments = mb["sequence_index"], mb["segment_ids"]
    if index.numel() == 0:
        return torch.zeros(segments.shape, dtype=torch.float64), torch.zeros(segments.shape, dtype=torch.bool)
    sequence = index[segments.clamp(max=index.numel() - 1)]
    sizes = torch.tensor([lengths[i] for i in index.tolist()])[segments.clamp(max=index.numel() - 1)]
    real = (segments < index.numel()) & (mb["position_ids"] < sizes)
    return _value(sequence, mb["position_ids"]), real


def test_token_slots_carry_values_from_one_layout_to_another():
    for seed in range(40):
        batch = random_batch(1000 + seed)
        rng = random.Random(seed)
        sequences = rng.sample(range(len(batch)), len(batch))
        lengths = {i: model_tokens(batch, i) for i in sequences}
        slots = token_slots(batch, sequences)
        assert slots.size == sum(lengths.values()) + 1
        longest = max(lengths.values(), default=1)
        forward = make_microbatches(
            batch,
            pack_by_budget(sequences, lengths, longest + rng.randint(0, 20)),
            CPU,
            slots=slots,
            pad_to_multiple=rng.choice([1, 4]),
        )
        table = torch.full((slots.size,), -1.0, dtype=torch.float64)
        for mb in forward:
            values, real = _token_values(mb, lengths)
            table[mb["token_index"][real]] = values[real]
        assert bool((table[:-1] >= 0).all()), "every slot but the padding one is written exactly by some token"
        # read back under the padded one-sequence-per-row layout, in another order
        update = make_microbatches(
            batch,
            [[i] for i in reversed(sequences)],
            CPU,
            packed=False,
            slots=slots,
            pad_to_multiple=rng.choice([1, 8]),
        )
        for mb in update:
            values, real = _token_values(mb, lengths)
            assert torch.equal(table[mb["token_index"]][real], values[real])
            assert bool((mb["token_index"][~real] == slots.pad_slot).all())


def test_packed_rows_hold_each_response_as_its_labels_and_pad_to_the_multiple():
    for seed in range(60):
        batch = random_batch(2000 + seed)
        sequences = list(range(len(batch)))
        lengths = {i: model_tokens(batch, i) for i in sequences}
        multiple = random.Random(seed).choice([1, 3, 8])
        budget = max(lengths.values(), default=1) * 2
        bins = pack_by_budget(sequences, lengths, budget)
        microbatches = make_microbatches(batch, bins, CPU, pad_to_multiple=multiple)
        seen = []
        for mb in microbatches:
            width = mb["input_ids"].shape[1]
            assert mb["input_ids"].shape[0] == 1 and width % multiple == 0
            assert mb["cu_seqlens"][-1].item() == width and mb["cu_seqlens"].dtype == torch.int32
            assert mb["max_seqlen"] == int((mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).max())
            for k, i in enumerate(mb["sequence_index"].tolist()):
                start, end = mb["cu_seqlens"][k].item(), mb["cu_seqlens"][k + 1].item()
                assert end - start == lengths[i]
                mask = mb["response_mask"][0, start:end].bool()
                assert mb["labels"][0, start:end][mask].tolist() == batch.response_ids[i]
                assert mb["rollout_logprobs"][0, start:end][mask].tolist() == batch.rollout_logprobs[i]
                assert bool((mb["advantages"][0, start:end][mask] == batch.advantages[i]).all())
                seen.append(i)
            # the padding segment, if any, scores nothing
            assert mb["response_mask"][0, mb["cu_seqlens"][mb["sequence_index"].numel()].item() :].sum() == 0
        assert sorted(seen) == sequences
        assert sum(float(mb["response_mask"].sum()) for mb in microbatches) == sum(len(r) for r in batch.response_ids)
