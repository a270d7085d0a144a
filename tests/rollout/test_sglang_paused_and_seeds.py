"""Two behaviours of the real SGLang server that the engine must live with, against the contract fake
that now has them (tests/rollout/fake_sglang.py; both seen on a real 0.5.23 server, see
shared/notes/sglang-on-cpu.md):

* ``/health`` runs a generation, so while generation is paused it answers 503 after a wait: a retry of
  a failed weight sync (which leaves generation paused on purpose) must not take the server down;
* ``sampling_seed`` acts only under deterministic inference: the engine reads
  ``enable_deterministic_inference`` from ``/server_info`` at connect, says once when seeded
  reproducibility is lost, and reports it in its status.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.engine import SamplingParams
from stapo_megatron.rollout.sglang_client import TransportError, request
from stapo_megatron.rollout.sglang_engine import SGLangEngine, SGLangWeightSyncError
from tests.rollout.test_sglang_contract import attach_config

try:
    from . import fake_sglang
except ImportError:  # tests/rollout is not a package
    import fake_sglang

KEY = "paused-and-seeds-key"
# Started as production starts sglang.launch_server: through the wrapper that hands it the key.
FAKE_COMMAND = [sys.executable, "-m", "stapo_megatron.rollout.sglang_launch", str(Path(fake_sglang.__file__).resolve())]
PAUSED_HEALTH_S = 1.0  # the fake's stand-in for SGLang's 20 s health-generation wait

pytestmark = pytest.mark.timeout(60)


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (50, 8), "model.norm.weight": (8,), "lm_head.weight": (50, 8)}
    return [(name, torch.randn(shape, generator=gen)) for name, shape in shapes.items()]


NAMES = [name for name, _ in _weights(0)]


def _config(url: str, **overrides) -> SGLangConfig:
    fields = dict(
        api_key=KEY, placement="colocated", weight_sync="tensor", weight_bucket_bytes=1024, startup_timeout_s=5
    )
    return attach_config(url, **{**fields, **overrides})


def test_a_failed_sync_leaves_generation_paused_and_a_retry_succeeds_without_taking_the_server_down():
    fake = fake_sglang.FakeSGLangServer(api_key=KEY, admin_api_key=KEY, paused_health_s=PAUSED_HEALTH_S).start()
    try:
        good = _weights(1)
        with SGLangEngine(
            _config(fake.url), expected_weight_names=NAMES, tensor_serializer=fake_sglang.serialize_tensors
        ) as engine:
            # A one-pass stream found short at its end: generation stays paused on purpose.
            with pytest.raises(SGLangWeightSyncError, match=r"lacks 1 of 3 tensors: lm_head.weight .*stays paused"):
                engine.load_weights(iter(good[:-1]), version=1)
            assert fake.state.paused
            with pytest.raises(SGLangWeightSyncError, match=r"call load_weights again before generating"):
                engine.generate([[1]], SamplingParams(max_new_tokens=1))

            # What the real server's /health does now: it waits for the paused generation, then gives up.
            start = time.monotonic()
            with pytest.raises(TransportError, match=r"HTTP 503") as refused:
                request(fake.url, "GET", "/health", api_key=KEY, timeout=10)
            assert refused.value.status == 503 and time.monotonic() - start >= PAUSED_HEALTH_S

            before = len(fake.state.requests)
            engine.load_weights(iter(good), version=2)  # the retry the error asks for
            retry_paths = [r["path"] for r in fake.state.requests[before:]]
            assert "/health" not in retry_paths and "/health_generate" not in retry_paths, retry_paths
            assert retry_paths[0] == "/server_info" and retry_paths[-1] == "/continue_generation", retry_paths
            assert not fake.state.paused and fake.state.weight_version == "2"
            assert all(torch.equal(fake.state.weights[name], tensor) for name, tensor in good)
            [status] = engine.server_status()
            assert not (status["down"] or status["dead"] or status["stale"]) and status["recoveries"] == 0
            [[completion]] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))
            assert completion.token_ids == fake_sglang.fake_sample([1, 2], 0, 3, set(), None)[0]
    finally:
        fake.stop()


def test_health_answers_at_once_when_generation_continues_within_the_wait():
    fake = fake_sglang.FakeSGLangServer(paused_health_s=30).start()
    try:
        fake.state.pause_generation({"mode": "abort"})
        start = time.monotonic()
        threading.Timer(0.3, fake.state.continue_generation, args=({},)).start()  # 0.3 s into the wait
        assert request(fake.url, "GET", "/health", api_key=None, timeout=10).status == 200
        assert 0.3 <= time.monotonic() - start < 10
    finally:
        fake.stop()


def _seeded_twice(engine: SGLangEngine) -> tuple[list[list[int]], list[list[int]]]:
    params = SamplingParams(n=2, max_new_tokens=6, seed=11)
    first, second = (engine.generate([[3, 4], [5]], params) for _ in range(2))
    return [c.token_ids for g in first for c in g], [c.token_ids for g in second for c in g]


def test_seeds_act_only_on_deterministic_servers_and_the_loss_is_said_once(caplog):
    plain = fake_sglang.FakeSGLangServer(api_key=KEY).start()
    deterministic = fake_sglang.FakeSGLangServer(api_key=KEY, deterministic=True).start()
    try:
        caplog.set_level(logging.WARNING, logger="stapo_megatron")
        with SGLangEngine(_config(deterministic.url)) as engine:
            assert engine.seeds_act and engine.server_status()[0]["deterministic"] is True
            first, second = _seeded_twice(engine)
            assert first == second  # the same seeds, the same tokens
            assert first[0] == fake_sglang.fake_sample([3, 4], 0, 6, set(), (11 * 1_000_003) % (2**31 - 1))[0]
        assert not [r for r in caplog.records if "deterministic inference" in r.getMessage()]

        with SGLangEngine(_config(plain.url)) as engine:
            assert not engine.seeds_act and engine.server_status()[0]["deterministic"] is False
            first, second = _seeded_twice(engine)
            assert first != second  # SGLang ignores the seeds: each request is a fresh draw
            _seeded_twice(engine)
        warnings = [r for r in caplog.records if "deterministic inference" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING  # once, at connect
        message = warnings[0].getMessage()
        assert f"1 of 1 servers ({plain.url}) run without deterministic inference" in message
        assert "seeded rollouts are not reproducible" in message and "resumed evaluation" in message
        assert "deterministic_inference: true" in message and "\n" not in message

        # A mix: the engine's status names which server ignores seeds; still one warning per engine.
        caplog.clear()
        with SGLangEngine(_config(deterministic.url, urls=[deterministic.url, plain.url])) as engine:
            assert not engine.seeds_act
            assert [row["deterministic"] for row in engine.server_status()] == [True, False]
        [mixed] = [r.getMessage() for r in caplog.records if "deterministic inference" in r.getMessage()]
        assert f"1 of 2 servers ({plain.url}) run without" in mixed
    finally:
        plain.stop()
        deterministic.stop()


def test_launched_servers_run_with_deterministic_inference_when_the_config_asks(tmp_path):
    assert SGLangConfig.__dataclass_fields__["deterministic_inference"].default is False  # see its doc
    for asked in (True, False):
        cfg = SGLangConfig(
            model_path="fake/qwen3",
            server_command=FAKE_COMMAND,
            log_dir=str(tmp_path / f"logs-{asked}"),
            deterministic_inference=asked,
            startup_timeout_s=30,
            shutdown_grace_s=3,
        )
        with SGLangEngine(cfg) as engine:  # the launch flag, the server's /server_info, the engine's status
            assert engine.seeds_act is asked
            assert [row["deterministic"] for row in engine.server_status()] == [asked]
