"""Batch building without processes: the rollout batch's wire format, micro-batches, the
data-parallel split. The transport itself (gloo and the device group) is in
tests/runtime/test_parallel_context.py."""

from __future__ import annotations

import pytest
import torch

from stapo_megatron.trainer.batch import (
    RolloutBatch,
    make_microbatches,
    pack_rollouts,
    partition_for_rank,
    unpack_rollouts,
)


def _batch() -> RolloutBatch:
    return RolloutBatch(
        prompt_ids=[[1, 2, 3], [1, 2, 3], [7, 8]],
        response_ids=[[4, 5], [], [9, 10, 11, 12]],
        rollout_logprobs=[[-0.5, -1.25], [], [-0.125, -2.0, -3.5, -0.75]],
        truncated=torch.tensor([False, False, True]),
        rewards=torch.tensor([1.0, 0.0, 0.25]),
        correct=torch.tensor([1.0, 0.0, 0.0]),
        advantages=torch.tensor([0.75, -0.75, 0.0]),
        group_ids=torch.tensor([0, 0, 1]),
    )


def _assert_same(a: RolloutBatch, b: RolloutBatch) -> None:
    assert (a.prompt_ids, a.response_ids, a.rollout_logprobs) == (b.prompt_ids, b.response_ids, b.rollout_logprobs)
    for name in ("truncated", "rewards", "correct", "advantages", "group_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def test_pack_round_trip_is_exact_with_an_empty_response():
    batch = _batch()
    sizes, integers, floats = pack_rollouts(batch)
    assert sizes.tolist() == [3, 8, 6]
    # 3 prompt lengths + 3 response lengths + 8 + 6 tokens + 3 group ids + 3 truncated flags
    assert integers.dtype == torch.long and integers.numel() == 26
    assert floats.dtype == torch.float32 and floats.numel() == 6 + 3 * 3
    _assert_same(unpack_rollouts(sizes, integers, floats), batch)


def test_pack_round_trip_of_an_empty_batch():
    empty = RolloutBatch([], [], [], torch.zeros(0, dtype=torch.bool), torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.long))
    sizes, integers, floats = pack_rollouts(empty)
    assert sizes.tolist() == [0, 0, 0] and integers.numel() == floats.numel() == 0
    back = unpack_rollouts(sizes, integers, floats)
    assert len(back) == 0
    _assert_same(back, empty)


def test_pack_refuses_log_probs_that_do_not_match_the_response():
    batch = _batch()
    batch.rollout_logprobs[2] = batch.rollout_logprobs[2][:-1]
    with pytest.raises(ValueError, match="rollout_logprobs: 5 values for 6 response tokens"):
        pack_rollouts(batch)


def test_select_keeps_the_chosen_sequences_in_order():
    picked = _batch().select([2, 0])
    assert picked.response_ids == [[9, 10, 11, 12], [4, 5]]
    assert picked.group_ids.tolist() == [1, 0] and picked.truncated.tolist() == [True, False]


def test_microbatch_labels_masks_and_padding():
    batch = _batch()
    first, second = make_microbatches(batch, [2, 0, 1], 2, torch.device("cpu"), pad_to_multiple=4)
    # micro-batch 1: sequences 2 (6 tokens) and 0 (5 tokens); width 5 padded to 8
    assert first["input_ids"].shape == (2, 8)
    assert first["input_ids"][0].tolist() == [7, 8, 9, 10, 11, 0, 0, 0]
    assert first["labels"][0].tolist() == [8, 9, 10, 11, 12, 0, 0, 0]
    # the response tokens are the labels at P-1 .. P+R-2
    assert first["response_mask"][0].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    assert first["response_mask"][1].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert first["rollout_logprobs"][0].tolist() == [0, -0.125, -2.0, -3.5, -0.75, 0, 0, 0]
    assert first["advantages"][1].tolist() == [0, 0, 0.75, 0.75, 0, 0, 0, 0]
    assert first["position_ids"].tolist() == [list(range(8))] * 2
    assert first["sequence_index"].tolist() == [2, 0]
    # micro-batch 2: sequence 1 has no response token: nothing is scored
    assert second["input_ids"].shape == (1, 4)
    assert second["response_mask"].sum() == 0
    assert second["sequence_index"].tolist() == [1]


def test_no_sequences_give_one_all_padding_microbatch():
    (only,) = make_microbatches(_batch(), [], 4, torch.device("cpu"))
    assert only["input_ids"].shape == (1, 1) and only["response_mask"].sum() == 0
    assert only["sequence_index"].numel() == 0


def test_partition_deals_longest_first_and_covers_every_sequence_once():
    lengths = [5, 40, 7, 40, 12, 3, 30]
    parts = [partition_for_rank(len(lengths), lengths, rank, 3) for rank in range(3)]
    assert parts == [[1, 4, 5], [3, 2], [6, 0]]
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    tokens = [sum(lengths[i] for i in part) for part in parts]
    assert max(tokens) - min(tokens) <= max(lengths)
