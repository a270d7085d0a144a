"""Pausing and continuing generation on a real server, as HTTP calls and through the engine, and a
server killed in the middle of a rollout step."""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from stapo_megatron.rollout.engine import SamplingParams
from stapo_megatron.rollout.sglang_client import TransportError, request
from tests.sglang_real.conftest import VOCAB, generate_body

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

PROMPTS = [[3, 14, 15], [92, 65]]
ANSWERED = re.compile(r'"POST /generate HTTP/1\.1" 200')
RESTART_HEADER = "\n=== start "  # what ServerProcess writes before each start


def in_thread(fn, *args):
    result: dict = {}

    def run():
        try:
            result["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_pause_aborts_in_flight_requests_holds_new_ones_and_continue_releases_them(served, api_key):
    """pause_generation {mode: abort}: the running request ends at once with HTTP 200, finish_reason
    abort and the tokens generated so far; a request sent while paused waits; /health waits too and
    gives up with 503 after 20 s, while /server_info answers at once; continue_generation lets the
    waiting request run to its end."""
    url = served.urls[0]

    def post(path, body, timeout=120.0):
        return request(url, "POST", path, body, api_key=api_key, timeout=timeout)

    running, aborted = in_thread(post, "/generate", generate_body(PROMPTS, max_new_tokens=400, n=2))
    time.sleep(1.0)
    assert post("/pause_generation", {"mode": "abort"}).json() == {
        "message": "Generation paused successfully.",
        "status": "ok",
    }
    running.join(60)
    items = aborted["value"].json()
    assert aborted["value"].status == 200 and len(items) == 4
    for item in items:
        meta = item["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        assert 0 < len(item["output_ids"]) < 400 and len(meta["output_token_logprobs"]) == len(item["output_ids"])
    held, answer = in_thread(post, "/generate", generate_body(PROMPTS, max_new_tokens=4, n=2))
    started = time.monotonic()
    with pytest.raises(TransportError, match="HTTP 503"):
        request(url, "GET", "/health", api_key=None, timeout=60)
    assert time.monotonic() - started > 15.0
    assert held.is_alive(), "a request sent while paused waits for continue_generation"
    assert request(url, "GET", "/server_info", api_key=api_key, timeout=5).status == 200
    assert post("/continue_generation", {}).json()["status"] == "ok"
    held.join(60)
    assert [item["meta_info"]["finish_reason"]["type"] for item in answer["value"].json()] == ["length"] * 4


def test_the_engine_retries_samples_a_pause_aborted(served, api_key, caplog):
    """A pause that aborts a rollout's requests mid-way (as a weight update does): once generation
    continues the engine resends them, and every prompt gets complete samples."""
    params = SamplingParams(n=2, max_new_tokens=480)
    with caplog.at_level(logging.WARNING, logger="stapo_megatron.rollout.sglang_engine"):
        rollout, result = in_thread(served.generate, PROMPTS * 2, params)
        time.sleep(0.3)
        for url in served.urls:
            request(url, "POST", "/pause_generation", {"mode": "abort"}, api_key=api_key, timeout=60)
        time.sleep(0.5)
        for url in served.urls:
            request(url, "POST", "/continue_generation", {}, api_key=api_key, timeout=60)
        rollout.join(300)
    assert "error" not in result, result.get("error")
    assert any("aborted a sample: Aborted" in r.getMessage() for r in caplog.records), "the pause hit the rollout"
    groups = result["value"]
    assert len(groups) == 4 and all(len(group) == 2 for group in groups)
    assert all(s.finish_reason == "length" and len(s.token_ids) == 480 for group in groups for s in group)


def answered_requests(logs: list[Path], offsets: list[int]) -> int:
    """``/generate`` answers the servers logged after ``offsets``, up to a restart: a restarted process
    appends to the same log after a header line, and its own warm-up is a /generate too."""
    total = 0
    for log, offset in zip(logs, offsets):
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
        total += len(ANSWERED.findall(text.split(RESTART_HEADER, 1)[0]))
    return total


def test_a_server_killed_mid_step_is_restarted_and_no_request_is_lost_or_repeated(
    served, api_key, reference, launch_weights, caplog
):
    """SIGKILL a server's whole process group while it generates part of a batch: its node restarts it;
    the batch comes back complete and in order (each sample's log-probs are its own prompt's), and
    the servers answered each of its requests exactly once (the killed one answered none of those it
    held)."""
    reference.load(launch_weights)
    prompts = [[7 * i + 1, 3 * i + 2, i + 5] for i in range(8)]
    chunks = len(prompts) // served.config.max_prompts_per_request
    logs = served.log_files
    offsets = [log.stat().st_size for log in logs]
    victim = served.server_status()[0]
    params = SamplingParams(n=2, max_new_tokens=300)
    with caplog.at_level(logging.WARNING, logger="stapo_megatron.rollout.sglang_engine"):
        rollout, result = in_thread(served.generate, prompts, params)
        deadline = time.monotonic() + 60
        while served.routed_tokens[0] == 0 and time.monotonic() < deadline:  # the victim holds requests
            time.sleep(0.01)
        time.sleep(0.3)
        os.killpg(victim["pid"], signal.SIGKILL)
        rollout.join(600)
    assert "error" not in result, result.get("error")
    assert any("retrying /generate" in r.getMessage() for r in caplog.records), "the kill hit requests in flight"
    groups = result["value"]
    assert len(groups) == len(prompts) and all(len(group) == 2 for group in groups)
    for prompt, group in zip(prompts, groups):
        for sample in group:
            assert len(sample.token_ids) == 300 and all(0 <= t < VOCAB for t in sample.token_ids)
            assert sample.logprobs == pytest.approx(reference.logprobs(prompt, sample.token_ids, 1.0), abs=2e-4)
    assert answered_requests(logs, offsets) == chunks
    # The node's supervisor restarted it: a new process, counted once, that serves again.
    deadline = time.monotonic() + 120
    while served.server_status()[0]["restarts"] == victim["restarts"] and time.monotonic() < deadline:
        time.sleep(0.2)
    status = served.server_status()[0]
    assert status["restarts"] == victim["restarts"] + 1 and status["pid"] != victim["pid"]
    served.load_weights(launch_weights)  # waits for it, then it holds the current weights
    assert not any(row["down"] or row["dead"] or row["stale"] for row in served.server_status())
    before = served.routed_tokens
    assert len(served.generate(prompts, SamplingParams(max_new_tokens=2))) == len(prompts)
    assert all(after > start for after, start in zip(served.routed_tokens, before))
