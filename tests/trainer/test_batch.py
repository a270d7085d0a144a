"""Batch building without processes: the rollout batch's wire format, micro-batches, the
data-parallel split by tokens, token-budget packing and the step plan. The transport itself
(gloo and the device group) is in tests/runtime/test_parallel_context.py; packed vs padded
model numbers in tests/trainer/test_packing.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from stapo_megatron.loss import AlgoConfig, TokenStats, minibatch_threshold, select_tokens
from stapo_megatron.trainer.batch import (
    RolloutBatch,
    balance_over_ranks,
    make_microbatches,
    model_tokens,
    pack_by_budget,
    pack_rollouts,
    token_imbalance,
    token_slots,
    unpack_rollouts,
)
from stapo_megatron.trainer.step_plan import plan_step


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


def test_padded_microbatch_labels_masks_and_padding():
    batch = _batch()
    first, second = make_microbatches(batch, [[2, 0], [1]], torch.device("cpu"), packed=False, pad_to_multiple=4)
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
    assert first["segment_ids"][:, 0].tolist() == [0, 1]
    assert first["sequence_index"].tolist() == [2, 0]
    # micro-batch 2: sequence 1 has no response token: nothing is scored
    assert second["input_ids"].shape == (1, 4)
    assert second["response_mask"].sum() == 0
    assert second["sequence_index"].tolist() == [1]


def test_packed_microbatch_is_one_row_with_boundaries():
    batch = _batch()
    (mb,) = make_microbatches(batch, [[2, 0, 1]], torch.device("cpu"))
    # 5 + 4 + 2 model tokens back to back; positions restart in each sequence
    assert mb["input_ids"].tolist() == [[7, 8, 9, 10, 11, 1, 2, 3, 4, 1, 2]]
    assert mb["labels"].tolist() == [[8, 9, 10, 11, 12, 2, 3, 4, 5, 2, 3]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1]]
    assert mb["cu_seqlens"].tolist() == [0, 5, 9, 11] and mb["max_seqlen"] == 5
    assert mb["segment_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2]]
    assert mb["response_mask"].tolist() == [[0, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0]]
    assert mb["advantages"][0, 7:9].tolist() == [0.75, 0.75]


def test_empty_bins_give_one_padding_token_that_scores_nothing():
    for packed in (True, False):
        (only,) = make_microbatches(_batch(), [[]], torch.device("cpu"), packed=packed)
        assert only["input_ids"].shape == (1, 1) and only["response_mask"].sum() == 0
        assert only["sequence_index"].numel() == 0
    (padded,) = make_microbatches(_batch(), [[]], torch.device("cpu"), pad_to_multiple=4)
    assert padded["cu_seqlens"].tolist() == [0, 4]


def test_ranks_get_equal_token_sums_longest_first():
    lengths = [5, 40, 7, 40, 12, 3, 30]
    parts = balance_over_ranks(range(len(lengths)), lengths, 3)
    assert parts == [[1, 2], [3, 0], [6, 4, 5]]  # LPT: each to the lightest rank so far
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    assert [sum(lengths[i] for i in p) for p in parts] == [47, 45, 45]
    assert token_imbalance(parts, lengths) == pytest.approx(47 / (137 / 3) - 1)


def test_long_tailed_lengths_balance_within_two_percent():
    rng = random.Random(0)
    lengths = [min(16384, int(rng.lognormvariate(7.0, 0.9))) + 100 for _ in range(512)]
    parts = balance_over_ranks(range(len(lengths)), lengths, 8)
    assert token_imbalance(parts, lengths) <= 0.02
    # the round-robin deal it replaces is far worse on the same lengths
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    assert token_imbalance([order[r::8] for r in range(8)], lengths) > 2 * token_imbalance(parts, lengths)


def test_budget_packing_is_first_fit_decreasing_and_never_cuts():
    lengths = {0: 70, 1: 50, 2: 40, 3: 30, 4: 30, 5: 20, 6: 10}
    bins = pack_by_budget(list(lengths), lengths, 100)
    assert bins == [[0, 3], [1, 2, 6], [4, 5]]
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert len(bins) == -(-sum(lengths.values()) // 100)  # 250 tokens: 3 bins, the fewest possible
    with pytest.raises(ValueError, match="sequence 0: 70 tokens do not fit the micro-batch budget of 60 tokens"):
        pack_by_budget(list(lengths), lengths, 60)


def _long_tailed_batch(groups: int, group_size: int, seed: int = 0, zero_groups: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    prompts, responses, logprobs = [], [], []
    for _ in range(groups * group_size):
        p, r = rng.randint(3, 12), min(200, int(rng.expovariate(1 / 30)) + 1)
        prompts.append([rng.randint(1, 99) for _ in range(p)])
        responses.append([rng.randint(1, 99) for _ in range(r)])
        logprobs.append([-rng.random() for _ in range(r)])
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in range(groups * group_size)])
    rewards[: zero_groups * group_size] = 1.0  # all-correct groups: advantage 0
    grouped = rewards.view(groups, group_size)
    advantages = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    n = groups * group_size
    return RolloutBatch(
        prompts,
        responses,
        logprobs,
        torch.zeros(n, dtype=torch.bool),
        rewards,
        rewards.clone(),
        advantages,
        torch.arange(groups).repeat_interleave(group_size),
    )


def _cfg(minibatches: int, update: int, forward: int, **algo) -> SimpleNamespace:
    batch = SimpleNamespace(
        minibatches_per_step=minibatches,
        max_tokens_per_microbatch=update,
        max_tokens_per_forward=forward,
        skip_zero_advantage=True,
        entropy_over_skipped=True,
    )
    return SimpleNamespace(batch=batch, algo=AlgoConfig(**algo))


def _plans(batch, cfg, dp: int):
    return [
        plan_step(batch, cfg, SimpleNamespace(dp_size=dp, dp_rank=r, device=torch.device("cpu"))) for r in range(dp)
    ]


def test_plan_covers_each_sequence_once_per_minibatch_within_budget_with_equal_counts():
    batch = _long_tailed_batch(groups=24, group_size=4, zero_groups=2)
    plans = _plans(batch, _cfg(3, 220, 600), dp=2)
    zero = [i for i in range(len(batch)) if float(batch.advantages[i]) == 0]
    assert len(zero) >= 8  # the two all-correct groups, and any that came out equal
    for j in range(3):
        groups = set(range(8 * j, 8 * j + 8))
        mine = [i for i in range(len(batch)) if int(batch.group_ids[i]) in groups]
        expected = [i for i in mine if i not in zero]  # zero-advantage ones are left out (S2T, no entropy/KL term)
        skipped = [i for i in mine if i in zero]
        assert all(p.minibatches[j].skipped_tokens == sum(len(batch.response_ids[i]) for i in skipped) for p in plans)
        for kind in ("update", "forward"):
            seen = [int(i) for p in plans for mb in getattr(p.minibatches[j], kind) for i in mb["sequence_index"]]
            assert sorted(seen) == expected, (j, kind)
            counts = {len(getattr(p.minibatches[j], kind)) for p in plans}
            assert len(counts) == 1, "every data-parallel rank runs the same number of micro-batches"
        for p in plans:
            assert all(mb["input_ids"].numel() <= 220 for mb in p.minibatches[j].update)
            assert all(mb["input_ids"].numel() <= 600 for mb in p.minibatches[j].forward)
        assert len(plans[0].minibatches[j].forward) <= len(plans[0].minibatches[j].update)
    assert sum(len(m.forward) for m in plans[0].minibatches) < sum(len(m.update) for m in plans[0].minibatches)
    assert plans[0].metrics == plans[1].metrics
    assert plans[0].metrics["batch/dp_token_imbalance"] <= 0.05
    assert plans[0].metrics["batch/padding_fraction"] == 0.0
    assert plans[0].metrics["batch/skipped_fraction"] == len(zero) / len(batch)
    # a term that reads zero-advantage tokens (the entropy bonus) runs them all
    plans = _plans(batch, _cfg(3, 220, 600, entropy_coef=0.01), dp=2)
    seen = [int(i) for p in plans for m in p.minibatches for mb in m.update for i in mb["sequence_index"]]
    assert sorted(seen) == list(range(len(batch))) and plans[0].metrics["batch/skipped_fraction"] == 0.0


def _made_up_stats(batch, microbatches, slots) -> list[TokenStats]:
    """Statistics that depend only on (sequence, position): the same token gets the same values in any layout."""
    generator = torch.Generator().manual_seed(5)
    logprob_table = -9.0 * torch.rand(slots.size, generator=generator)
    entropy_table = 3.0 * torch.rand(slots.size, generator=generator)
    return [
        TokenStats(
            logprob_table[mb["token_index"]], entropy_table[mb["token_index"]], mb["advantages"], mb["response_mask"]
        )
        for mb in microbatches
    ]


def test_s2t_threshold_and_kept_tokens_equal_the_padded_path():
    batch = _long_tailed_batch(groups=8, group_size=4, seed=3)
    algo = AlgoConfig(tau_p=0.3)
    everything = list(range(len(batch)))
    slots = token_slots(batch, everything)
    lengths = [model_tokens(batch, i) for i in everything]
    cpu = torch.device("cpu")
    # the padded path: one sequence per micro-batch, on one rank
    padded = make_microbatches(batch, [[i] for i in everything], cpu, packed=False, slots=slots)
    # the packed path: two data-parallel ranks, 300-token micro-batches (one list per rank concatenated:
    # the quantile over a group is the quantile over the concatenation of its ranks' values)
    parts = balance_over_ranks(everything, lengths, 2)
    packed = [
        mb for part in parts for mb in make_microbatches(batch, pack_by_budget(part, lengths, 300), cpu, slots=slots)
    ]
    assert len(packed) < len(padded) / 4
    results = []
    for microbatches in (padded, packed):
        stats = _made_up_stats(batch, microbatches, slots)
        threshold = minibatch_threshold(algo, stats)
        kept = sum(float(select_tokens(algo, s, threshold).keep.sum()) for s in stats)
        candidates = sum(int(select_tokens(algo, s, threshold).candidates.sum()) for s in stats)
        results.append((float(threshold), kept, candidates))
    assert results[0] == results[1]
    threshold, kept, candidates = results[0]
    response_tokens = sum(len(r) for r in batch.response_ids)
    assert candidates > 20 and response_tokens - 0.8 * candidates - 1 <= kept < response_tokens


def test_budget_config_errors_are_one_line_and_name_the_field():
    from pathlib import Path

    from stapo_megatron.config import ConfigError, load_config
    from stapo_megatron.trainer.config import TrainConfig

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError) as old:
        load_config(TrainConfig, tiny, ["batch.micro_batch_size=4"])
    assert str(old.value).startswith("batch.micro_batch_size: removed") and "\n" not in str(old.value)
    assert "batch.max_tokens_per_microbatch" in str(old.value) and "batch.max_tokens_per_forward" in str(old.value)
    with pytest.raises(
        ConfigError,
        match=r"^batch.max_tokens_per_forward: 2000 tokens is less than the longest sequence, "
        r"data.max_prompt_tokens \+ batch.max_new_tokens = 2051$",
    ):
        load_config(TrainConfig, tiny, ["batch.max_tokens_per_forward=2000"])
    # the longest sequence itself fits; under sequence parallelism the row is also a multiple of TP
    assert (
        load_config(TrainConfig, tiny, ["batch.max_tokens_per_microbatch=2051"]).batch.max_tokens_per_microbatch == 2051
    )
    with pytest.raises(ConfigError, match="in whole multiples of tensor_parallel=2"):
        load_config(
            TrainConfig,
            tiny,
            ["batch.max_tokens_per_microbatch=2051", "parallel.tensor_parallel=2", "parallel.sequence_parallel=true"],
        )
