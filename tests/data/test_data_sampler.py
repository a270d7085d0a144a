"""The prompt sampler: deterministic, a new permutation per epoch, exact resumption."""

import json

import pytest

from stapo_megatron.data import PromptSampler


def draw(sampler, sizes):
    return [sampler.next_indices(n) for n in sizes]


def test_same_seed_same_stream_and_each_epoch_is_a_permutation():
    a, b = PromptSampler(17, seed=3), PromptSampler(17, seed=3)
    stream = sum(draw(a, [5] * 14), [])  # 70 indices: 4 epochs and 2 more
    assert stream == sum(draw(b, [5] * 14), [])
    epochs = [stream[i : i + 17] for i in range(0, 68, 17)]
    assert all(sorted(e) == list(range(17)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4  # a new order every epoch
    assert (a.epoch, a.position) == (4, 2)
    assert stream != sum(draw(PromptSampler(17, seed=4), [5] * 14), [])


def test_batches_cross_epoch_boundaries_without_losing_indices():
    sampler = PromptSampler(10, seed=0)
    first = sampler.next_indices(7)
    second = sampler.next_indices(7)  # 3 from epoch 0, 4 from epoch 1
    assert sorted(first + second[:3]) == list(range(10))
    assert (sampler.epoch, sampler.position) == (1, 4)
    assert sampler.next_indices(0) == []


@pytest.mark.parametrize("stop_after", [0, 1, 3, 6, 9])
def test_restore_continues_exactly(stop_after):
    reference = PromptSampler(23, seed=11)
    expected = draw(reference, [4] * 15)
    original = PromptSampler(23, seed=11)
    draw(original, [4] * stop_after)
    state = json.loads(json.dumps(original.state_dict()))  # survives a round trip through a checkpoint
    restored = PromptSampler(23, seed=11)
    restored.load_state_dict(state)
    assert draw(restored, [4] * (15 - stop_after)) == expected[stop_after:]


def test_no_shuffle_is_file_order():
    assert PromptSampler(4, shuffle=False).next_indices(10) == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def test_mismatched_state_is_refused():
    state = PromptSampler(10, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_items was 10 when saved but is 11 now"):
        PromptSampler(11, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed was 1 when saved but is 2 now"):
        PromptSampler(10, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="bad epoch/position"):
        PromptSampler(10, seed=1).load_state_dict({**state, "position": 10})
    with pytest.raises(ValueError, match="version"):
        PromptSampler(10, seed=1).load_state_dict({**state, "version": 0})
    with pytest.raises(ValueError, match="num_items must be >= 1"):
        PromptSampler(0)
