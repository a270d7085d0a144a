"""The contract fake (``tests/rollout/fake_sglang.py``) against a real SGLang 0.5.23 server: the same
requests, and every answer of the fake shaped as the real one (status, keys, value types; exact
values where SGLang fixes them). Where they differ the fake is wrong."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stapo_megatron.rollout.sglang_client import HttpResponse, TransportError, request
from tests.rollout.fake_sglang import FakeSGLangServer
from tests.sglang_real.conftest import VOCAB, StreamedGenerate, generate_body

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]


def shape(value: Any) -> Any:
    """A JSON value with its leaves replaced by their type names (a list by its first item's shape)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def differences(fake: Any, real: Any, where: str = "") -> list[str]:
    """Where the fake's shape is not the real one's: a key the real server does not send, or another
    type (the fake may leave out keys the project never reads)."""
    if isinstance(fake, dict) and isinstance(real, dict):
        out = [f"{where}.{key}: only in the fake" for key in fake if key not in real]
        return out + [d for key in fake if key in real for d in differences(fake[key], real[key], f"{where}.{key}")]
    if isinstance(fake, list) and isinstance(real, list):
        return differences(fake[0], real[0], f"{where}[0]") if fake and real else []
    return [] if fake == real else [f"{where}: fake {fake!r}, real {real!r}"]


def answer(resp: HttpResponse) -> tuple[int, Any]:
    try:
        return resp.status, json.loads(resp.body)
    except ValueError:
        return resp.status, resp.text()


@pytest.fixture
def fake(api_key):
    server = FakeSGLangServer(api_key=api_key).start()
    yield server
    server.stop()


def test_the_fake_answers_as_the_real_server(served, fake, api_key):
    real_url = served.urls[0]
    stops = list(range(0, VOCAB, 2))  # even tokens: both vocabularies stop on the first one drawn

    def both(method: str, path: str, body: Any = None, key: str | None = api_key) -> tuple[Any, Any]:
        return tuple(answer(request(url, method, path, body, api_key=key, timeout=120)) for url in (fake.url, real_url))

    found: list[str] = []

    def compare(what: str, pair: tuple[Any, Any], exact: bool = False) -> tuple[Any, Any]:
        (fake_status, fake_body), (real_status, real_body) = pair
        if fake_status != real_status:
            found.append(f"{what}: HTTP {fake_status} from the fake, {real_status} from SGLang")
        elif exact and fake_body != real_body:
            found.append(f"{what}: fake {fake_body!r}, real {real_body!r}")
        else:
            found.extend(f"{what}{d}" for d in differences(shape(fake_body), shape(real_body)))
        return fake_body, real_body

    compare("one prompt", both("POST", "/generate", generate_body([1, 2, 3])))
    fake_items, real_items = compare("batch n=2", both("POST", "/generate", generate_body([[1, 2], [3, 4, 5]], n=2)))
    assert len(fake_items) == len(real_items) == 4
    fake_stop, real_stop = compare(
        "stop", both("POST", "/generate", generate_body([5, 6], stop_token_ids=stops, max_new_tokens=40))
    )
    for item in (fake_stop, real_stop):  # the matched stop token is kept, in output_ids and log-probs
        assert item["output_ids"][-1] == item["meta_info"]["finish_reason"]["matched"] in stops
        assert [e[1] for e in item["meta_info"]["output_token_logprobs"]] == item["output_ids"]
    compare("no key", both("POST", "/generate", generate_body([1]), key=None), exact=True)
    compare("unknown sampling key", both("POST", "/generate", generate_body([1], seed=3)))
    compare("flush", both("POST", "/flush_cache"), exact=True)
    compare(
        "weight version",
        both("POST", "/update_weight_version", {"new_version": "parity-1", "abort_all_requests": False}),
        exact=True,
    )
    fake_info, real_info = compare("model_info", both("GET", "/model_info"))
    assert fake_info["weight_version"] == real_info["weight_version"] == "parity-1"
    versioned = compare("versions of the tokens", both("POST", "/generate", generate_body([1, 2])))
    for item in versioned:  # one segment over the output tokens (end exclusive), named as weight_version
        meta = item["meta_info"]
        assert meta["weight_versions"] == [{"version": "parity-1", "start": 0, "end": len(item["output_ids"])}]
        assert meta["weight_version"] == "parity-1"
    for path in ("/begin_weight_update", "/begin_weight_update", "/end_weight_update", "/end_weight_update"):
        compare(path, both("POST", path, {}), exact=True)
    compare("pause", both("POST", "/pause_generation", {"mode": "in_place"}), exact=True)
    compare("continue", both("POST", "/continue_generation", {}), exact=True)

    # A pause that aborts a running request: the real one mid-generation (its stream shows it generating),
    # the fake's by its knob.
    long = generate_body([1, 2], max_new_tokens=480)
    running = StreamedGenerate(real_url, long, api_key)
    running.wait_for_tokens(1)
    request(real_url, "POST", "/pause_generation", {"mode": "abort"}, api_key=api_key, timeout=60)
    real_abort = (200, running.answer())
    request(real_url, "POST", "/continue_generation", {}, api_key=api_key, timeout=60)
    fake.state.abort_next = 1
    fake_abort = answer(request(fake.url, "POST", "/generate", long, api_key=api_key, timeout=60))
    fake_aborted, real_aborted = compare("aborted", (fake_abort, real_abort))
    assert fake_aborted["meta_info"]["finish_reason"] == real_aborted["meta_info"]["finish_reason"]
    for item in (fake_aborted, real_aborted):  # the tokens generated before the abort, and their version
        assert item["meta_info"]["weight_versions"] == [
            {"version": "parity-1", "start": 0, "end": len(item["output_ids"])}
        ]
    # SGLang 0.5.23's scheduler dies (KeyError) resuming a tag it never released, and the server with it
    # (measured; not repeated here, a restart costs half a minute): the fake fails the call too.
    with pytest.raises(TransportError, match="HTTP 500"):
        request(fake.url, "POST", "/resume_memory_occupation", {"tags": ["weights"]}, api_key=api_key, timeout=10)
    assert not found, "the fake differs from SGLang 0.5.23:\n" + "\n".join(found)
