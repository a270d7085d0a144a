"""The rollout engine's generate against real SGLang servers: batching, n > 1, log-probs, stop
tokens, the API key and sampling seeds."""

from __future__ import annotations

import logging

import pytest

from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.engine import SamplingParams
from stapo_megatron.rollout.sglang_client import request
from stapo_megatron.rollout.sglang_engine import SGLangEngine, SGLangError
from tests.sglang_real.conftest import VOCAB, generate_body

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

# Two chunks per server at max_prompts_per_request=2: a batch spread over both servers.
PROMPTS = [[3, 14, 15], [92, 65], [35, 89, 79, 32], [38, 46], [26, 43, 38], [327, 950, 288, 41]]


def test_batched_samples_carry_the_log_probs_of_the_served_model(served, reference, launch_weights):
    """n=2 over a batch split into chunks on both servers: every sample sits in its own prompt's group
    (its log-probs are those of its prompt's continuation), and each log-prob is the served model's
    log-softmax at the sampling temperature over the whole vocabulary, before top-p."""
    reference.load(launch_weights)
    before = served.routed_tokens
    for temperature, top_p in ((0.7, 1.0), (1.3, 0.9)):
        params = SamplingParams(n=2, temperature=temperature, top_p=top_p, max_new_tokens=6)
        groups = served.generate(PROMPTS, params)
        assert len(groups) == len(PROMPTS) and all(len(group) == 2 for group in groups)
        for prompt, group in zip(PROMPTS, groups):
            for sample in group:
                assert sample.finish_reason == "length" and len(sample.token_ids) == 6
                assert all(0 <= t < VOCAB for t in sample.token_ids)
                expected = reference.logprobs(prompt, sample.token_ids, temperature)
                assert sample.logprobs == pytest.approx(expected, abs=2e-4)
        # two samples of one prompt are drawn independently (a 1024-token near-uniform model)
        assert all(group[0].token_ids != group[1].token_ids for group in groups)
    assert all(after > start for after, start in zip(served.routed_tokens, before)), "both servers served"


def test_a_stop_token_ends_the_sample_and_is_kept(served, engine, api_key, reference, launch_weights):
    """Half the vocabulary as stop tokens: each sample ends on the first one it draws, which is the
    last token of the completion, with its log-prob (SGLang keeps a matched stop token)."""
    reference.load(launch_weights)
    stops = tuple(range(0, VOCAB, 2))
    groups = served.generate(PROMPTS[:3], SamplingParams(n=3, max_new_tokens=40, stop_token_ids=stops))
    for prompt, group in zip(PROMPTS, groups):
        for sample in group:
            *body, last = sample.token_ids
            assert sample.finish_reason == "stop" and last in stops and not set(body) & set(stops)
            assert sample.logprobs == pytest.approx(reference.logprobs(prompt, sample.token_ids, 1.0), abs=2e-4)
    # The raw answer: the matched token is in output_ids and in the log-probs, and named as matched.
    resp = request(
        engine.urls[0],
        "POST",
        "/generate",
        generate_body(PROMPTS[0], max_new_tokens=40, stop_token_ids=list(stops)),
        api_key=api_key,
        timeout=120,
    ).json()
    meta = resp["meta_info"]
    assert meta["finish_reason"]["type"] == "stop" and meta["finish_reason"]["matched"] == resp["output_ids"][-1]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == resp["output_ids"]


def test_the_api_key_guards_every_route_but_health(served, engine, api_key, tiny_model):
    url = engine.urls[0]
    routes = [
        ("POST", "/generate", generate_body(PROMPTS[0])),
        ("POST", "/update_weights_from_disk", {"model_path": str(tiny_model)}),
        ("POST", "/pause_generation", {"mode": "abort"}),
        ("POST", "/weights_checker", {"action": "checksum"}),
        ("GET", "/server_info", None),
    ]
    for key in (None, api_key + "x"):
        for method, path, body in routes:
            resp = request(url, method, path, body, api_key=key, timeout=60)
            assert resp.status == 401, (path, key, resp.status)
    assert request(url, "GET", "/health", api_key=None, timeout=60).status == 200
    # The engine with a wrong key stops at connect, naming the refusal.
    wrong = SGLangConfig(urls=engine.urls, api_key=api_key + "x", startup_timeout_s=60)
    with pytest.raises(SGLangError, match="401"):
        SGLangEngine(wrong)


def test_sampling_seeds_do_not_act_without_deterministic_inference(served, engine, api_key, caplog):
    """SGLang uses sampling_seed only under --enable-deterministic-inference, which its torch_native
    CPU attention refuses: the same seeded request gives different tokens, and the engine says once,
    when it connects, that seeded rollouts are not reproducible."""
    body = generate_body([PROMPTS[0], PROMPTS[1]], max_new_tokens=12, sampling_seed=1234)
    first, second = (
        request(engine.urls[0], "POST", "/generate", body, api_key=api_key, timeout=120).json() for _ in "ab"
    )
    assert [item["output_ids"] for item in first] != [item["output_ids"] for item in second]
    info = request(engine.urls[0], "GET", "/server_info", api_key=api_key, timeout=60).json()
    assert info["enable_deterministic_inference"] is False
    # The engine's own seeded requests: reproducible only where the servers say so.
    params = SamplingParams(n=2, max_new_tokens=12, seed=7)
    assert served.generate(PROMPTS[:2], params) != served.generate(PROMPTS[:2], params)
    if hasattr(SGLangEngine, "seeds_act"):
        with caplog.at_level(logging.WARNING, logger="stapo_megatron.rollout.sglang_engine"):
            attached = SGLangEngine(SGLangConfig(urls=engine.urls, api_key=api_key, startup_timeout_s=60))
            try:
                assert attached.seeds_act is False
                attached.generate(PROMPTS[:2], params)
                attached.generate(PROMPTS[:2], params)
            finally:
                attached.shutdown()
        warnings = [r for r in caplog.records if "deterministic inference" in r.getMessage()]
        assert len(warnings) == 1 and "not reproducible" in warnings[0].getMessage()
