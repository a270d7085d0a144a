"""Per-token weight versions against real SGLang 0.5.23 servers: a sync that lands while a request
is generating splits its tokens between the two versions, as the engine's parser reports them; and
a partial sample sent again after a sync continues under the new weights, token for token."""

from __future__ import annotations

import pytest
import torch

from stapo_megatron.rollout.engine import RolloutEngine, SamplingParams
from stapo_megatron.rollout.sglang_client import request
from stapo_megatron.rollout.sglang_generate import StaleAnswer, VersionWindow, generate_requests, parse_generate
from stapo_megatron.rollout.weight_sync.session import WeightSync, pack_stream
from stapo_megatron.rollout.weight_sync.transport import UpdateSession
from tests.sglang_real.conftest import StreamedGenerate, perturbed

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

LONG = 96  # tokens of the request a sync lands in: seconds on these CPUs, so the pause lands well before its end
TEMPERATURE = 0.8


def sync_while_paused_in_place(engine, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
    """The engine's own disk weight sync (its plan, WeightSync's disk transport: checkpoint, index,
    ``/update_weights_from_disk`` with the version) while the caller holds generation paused in place.
    ``load_weights`` would pause with mode abort first, which ends the request in flight."""
    plan = engine.weight_sync_plan()  # the engine now knows a sync is under way
    sync = WeightSync(None, plan)
    try:
        transport, session = sync.transport, UpdateSession(version)
        opened = transport.begin(version)
        transport.prepare(session, opened, None)
        for bucket in pack_stream(weights, plan.bucket_bytes, torch.device("cpu")):
            transport.send(bucket)
        transport.finish()
        transport.commit([(session.received, transport.report())], version, opened)
    finally:
        sync.close()
    engine.weights_synced(version)


def test_a_sync_mid_generation_splits_the_tokens_between_the_versions(served, api_key, launch_weights, reference):
    """A long request is generating on a server (its stream shows its first tokens); the server is paused
    in place, the weights move to version v+1, generation continues: the answer's tokens are v for a
    non-empty prefix and v+1 for the non-empty rest, as SGLang's segments say and the engine's parser
    reports. The same answer is stale to an engine that knows of no sync. The prefix's log-probs are
    the v weights' (the rest come from the v+1 weights over the KV cache the v weights computed:
    in-place pausing keeps it, so no reference model reproduces them)."""
    url = served.urls[0]
    version = 7
    old = perturbed(launch_weights, seed=70)
    served.load_weights(old, version=version)
    for attempt in range(3):  # a request that ends before its pause lands is not split: another one is
        prompt = [11, 12, 13 + attempt]  # a new prompt: no cache entry of earlier weights is reused
        [(_, _, body)] = generate_requests([prompt], SamplingParams(temperature=TEMPERATURE, max_new_tokens=LONG), 1)
        stream = StreamedGenerate(url, {**body, "input_ids": prompt}, api_key)
        stream.wait_for_tokens(1)  # generating, with a token of the current weights
        assert (
            request(url, "POST", "/pause_generation", {"mode": "in_place"}, api_key=api_key, timeout=60).status == 200
        )
        new = perturbed(launch_weights, seed=71 + attempt)
        sync_while_paused_in_place(served, new, version + 1)
        assert request(url, "POST", "/continue_generation", {}, api_key=api_key, timeout=60).status == 200
        answer = stream.answer()
        segments = answer["meta_info"]["weight_versions"]
        if len(segments) == 2:
            break
        assert segments == [{"version": str(version), "start": 0, "end": LONG}], segments
        old, version = new, version + 1
    else:
        pytest.fail("three requests in a row ended before the pause reached the server")
    split = segments[0]["end"]
    assert segments == [
        {"version": str(version), "start": 0, "end": split},
        {"version": str(version + 1), "start": split, "end": LONG},
    ]
    assert answer["meta_info"]["weight_version"] == str(version + 1)
    [[completion]] = parse_generate(answer, 1, 1, url, VersionWindow(sent=version, synced=(version + 1,)))
    assert completion.finish_reason == "length" and completion.token_ids == answer["output_ids"]
    assert 0 < split < LONG and completion.versions == [version] * split + [version + 1] * (LONG - split)
    with pytest.raises(StaleAnswer, match=rf"weight version '{version + 1}'; the engine sent {version} while it ran"):
        parse_generate(answer, 1, 1, url, VersionWindow(sent=version))
    prefix = completion.token_ids[:split]
    expected = reference.load(old).logprobs(prompt, prefix, TEMPERATURE)
    assert completion.logprobs[:split] == pytest.approx(expected, abs=2e-4)


def test_a_partial_sample_continues_under_the_new_weights(served, reference, launch_weights):
    """S tokens under version v; the weights change (v+1, other values) through the engine's sync; the
    sample's prompt and its S tokens, sent as a new request, continue it: every new token is v+1, and
    its log-probs are the v+1 model's over prompt + prefix + continuation, as the prefix's were the
    v model's. The continuation is the new policy's, from where the sample stopped."""
    prompt, segment, rest = [21, 22, 23], 6, 8
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=segment)  # no stop tokens: S tokens
    before, after = perturbed(launch_weights, seed=80), perturbed(launch_weights, seed=81)
    engine: RolloutEngine = served
    engine.load_weights(before, version=11)
    [[head]] = engine.generate([prompt], params)
    assert head.finish_reason == "length" and head.versions == [11] * segment
    assert head.logprobs == pytest.approx(
        reference.load(before).logprobs(prompt, head.token_ids, TEMPERATURE), abs=2e-4
    )
    engine.load_weights(after, version=12)
    [[tail]] = engine.generate([prompt + head.token_ids], SamplingParams(temperature=TEMPERATURE, max_new_tokens=rest))
    assert tail.finish_reason == "length" and tail.versions == [12] * rest
    whole = reference.load(after).logprobs(prompt, head.token_ids + tail.token_ids, TEMPERATURE)
    assert tail.logprobs == pytest.approx(whole[segment:], abs=2e-4)
    # The weights did change: under v the continuation has other log-probs.
    stale = reference.load(before).logprobs(prompt + head.token_ids, tail.token_ids, TEMPERATURE)
    assert max(abs(a - b) for a, b in zip(tail.logprobs, stale)) > 1e-2
