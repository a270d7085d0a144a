"""The embedded rollout engine: sampling semantics, weight loading, agreement with Megatron."""

from __future__ import annotations

import pytest
import torch

from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.rollout.engine import SamplingParams
from stapo_megatron.rollout.local_engine import LocalEngine
from stapo_megatron.runtime.launch import spawn_ranks
from tests.helpers import TINY_QWEN3, save_tiny_qwen3
from tests.rollout import _workers


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    directory = save_tiny_qwen3(tmp_path_factory.mktemp("engine") / "hf", tie=True, seed=4)
    return directory, Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture()
def engine(hf_model):
    directory, reference = hf_model
    engine = LocalEngine(Qwen3Config.from_hf(directory))
    engine.load_weights(reference.named_parameters(), version=0)
    return engine


def test_logprobs_are_the_full_distribution_at_the_temperature(engine, hf_model):
    _, reference = hf_model
    prompts = [[3, 4, 5], [7, 8]]
    groups = engine.generate(prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=6, seed=1))
    assert [len(g) for g in groups] == [3, 3]
    for prompt, group in zip(prompts, groups):
        for completion in group:
            ids = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(reference(ids).logits[0].float() / 0.7, dim=-1)
            expected = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion.token_ids)]
            assert completion.logprobs == pytest.approx(expected, abs=1e-5)
            assert completion.finish_reason == "length" and len(completion.token_ids) == 6


def test_top_k_one_is_greedy_and_stop_tokens_end_responses(engine, hf_model):
    _, reference = hf_model
    groups = engine.generate([[3, 4, 5]], SamplingParams(n=4, top_k=1, max_new_tokens=5, seed=2))
    sequences = {tuple(c.token_ids) for c in groups[0]}
    assert len(sequences) == 1  # every sample takes the argmax
    greedy = list(next(iter(sequences)))
    ids = [3, 4, 5]
    for token in greedy:
        with torch.no_grad():
            assert reference(torch.tensor([ids])).logits[0, -1].argmax().item() == token
        ids.append(token)
    # Stopping on the second greedy token: the response ends at its first occurrence, reason "stop".
    stop = greedy[1]
    stopped = engine.generate(
        [[3, 4, 5]], SamplingParams(n=2, top_k=1, max_new_tokens=5, stop_token_ids=(stop,), seed=2)
    )
    for completion in stopped[0]:
        assert completion.token_ids == greedy[: greedy.index(stop) + 1] and completion.finish_reason == "stop"


def test_same_seed_same_samples_and_top_p_restricts_the_support(engine):
    params = SamplingParams(n=8, max_new_tokens=4, seed=11)
    a = engine.generate([[1, 2, 3]], params)
    b = engine.generate([[1, 2, 3]], params)
    assert [c.token_ids for c in a[0]] == [c.token_ids for c in b[0]]
    nucleus = engine.generate([[1, 2, 3]], SamplingParams(n=16, max_new_tokens=1, top_p=1e-6, seed=5))
    assert len({c.token_ids[0] for c in nucleus[0]}) == 1  # a tiny nucleus holds only the top token


def test_every_token_carries_the_version_of_the_weights_that_sampled_it(hf_model):
    """Each token gets load_weights' version (stopped samples: as many versions as tokens); weights
    loaded without one carry none."""
    directory, reference = hf_model
    engine = LocalEngine(Qwen3Config.from_hf(directory))
    engine.load_weights(reference.named_parameters())
    [group] = engine.generate([[3, 4, 5]], SamplingParams(n=2, max_new_tokens=3, seed=1))
    assert [c.versions for c in group] == [None, None]
    for version in (7, 8):
        engine.load_weights(reference.named_parameters(), version=version)
        stops = tuple(range(0, Qwen3Config.from_hf(directory).vocab_size, 2))
        params = SamplingParams(n=6, max_new_tokens=6, stop_token_ids=stops, seed=version)
        for group in engine.generate([[3, 4, 5], [7, 8]], params):
            assert {c.finish_reason for c in group} <= {"stop", "length"}
            assert all(c.versions == [version] * len(c.token_ids) for c in group)
        assert any(len(c.token_ids) < 6 for c in group)  # some stopped early: versions follow their length


def test_load_weights_rejects_unknown_missing_and_misshapen_tensors(hf_model):
    directory, reference = hf_model
    engine = LocalEngine(Qwen3Config.from_hf(directory))
    with pytest.raises(RuntimeError, match="before load_weights"):
        engine.generate([[1]], SamplingParams())
    named = dict(reference.named_parameters())
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.bias is not a parameter"):
        engine.load_weights([("model.layers.0.self_attn.q_proj.bias", torch.zeros(64))])
    partial = [(k, v) for k, v in named.items() if k != "model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight was not sent"):
        engine.load_weights(partial)
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \[3\]"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])
    assert TINY_QWEN3["vocab_size"] == engine.model.config.vocab_size


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["TP2", "PP2"])
def test_engine_logprobs_equal_megatron_after_streaming_its_weights(hf_model, tp, pp):
    directory, _ = hf_model
    spawn_ranks(_workers.check_local_engine_matches_megatron, tp * pp, str(directory), tp, pp)
