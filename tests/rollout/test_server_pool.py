"""Rollout servers on every node: layout, discovery, token balancing, restart (contract tests).

The servers are ``fake_sglang`` (SGLang's request and response shapes, see test_sglang_contract);
the two-node test runs four gloo ranks as two nodes of two, each node leader launching its two
servers through the real launch path.
"""

from __future__ import annotations

import pytest
import torch

from stapo_megatron.config.core import ConfigError
from stapo_megatron.rollout.balancer import TokenBalancer
from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.engine import SamplingParams
from stapo_megatron.rollout.node_servers import advertised_host, local_world_size, plan_node_servers
from stapo_megatron.rollout.sglang_engine import SGLangEngine
from stapo_megatron.runtime.launch import spawn_ranks
from tests.rollout import _pool_workers

try:
    from . import fake_sglang
except ImportError:  # tests/rollout is not a package
    import fake_sglang

KEY = "pool-test-key"


def test_balancer_sends_each_request_to_the_least_outstanding_tokens():
    balancer = TokenBalancer(3)
    assert [balancer.acquire([0, 1, 2], cost) for cost in (10, 4, 7)] == [0, 1, 2]
    assert balancer.acquire([0, 1, 2], 5) == 1  # 4 outstanding is the least
    assert balancer.outstanding == [10, 9, 7]
    balancer.release(0, 10)
    assert balancer.acquire([1, 2], 1) == 2 and balancer.acquire([0, 1, 2], 1) == 0
    # Nothing in flight: ties go to the server given the fewest tokens so far.
    for index, cost in ((0, 1), (1, 4), (1, 5), (2, 7), (2, 1)):
        balancer.release(index, cost)
    assert balancer.outstanding == [0, 0, 0] and balancer.routed == [11, 9, 8]
    assert balancer.acquire([0, 1, 2], 3) == 2
    with pytest.raises(ValueError, match="no usable server"):
        balancer.acquire([], 1)


def test_layout_is_validated_with_one_line_errors(monkeypatch):
    colocated = SGLangConfig(model_path="m", placement="colocated", tp_size=4)
    assert plan_node_servers(colocated, 8, 3) == [2, 2, 2]
    with pytest.raises(ConfigError, match=r"^rollout.sglang.tp_size: 4 does not divide the 6 GPUs per node"):
        plan_node_servers(colocated, 6, 2)
    assert plan_node_servers(SGLangConfig(model_path="m", num_servers=3, base_gpu_id=8), 8, 2) == [3, 0]
    assert plan_node_servers(SGLangConfig(urls=["http://h:1"]), 8, 2) == [0, 0]
    with pytest.raises(ConfigError, match=r"^rollout.sglang.host: 127.0.0.1 is reachable only from its own node"):
        advertised_host(colocated, 2)
    assert advertised_host(colocated, 1) == "127.0.0.1"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"^LOCAL_WORLD_SIZE: 3 does not divide the world size 8"):
        local_world_size(8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match=r"^LOCAL_WORLD_SIZE: not set"):
        local_world_size(8)


def test_contract_an_unnoticed_restart_is_caught_by_its_weight_version():
    """A server that restarted between two calls answers with its launch weights: its answers are
    thrown away, the requests go to the server holding the current version, and it stays out until
    the next weight update."""
    fresh, restarted = (fake_sglang.FakeSGLangServer(api_key=KEY).start() for _ in range(2))
    names = [name for name, _ in _pool_workers.weights(0)]
    cfg = SGLangConfig(
        urls=[fresh.url, restarted.url],
        api_key=KEY,
        placement="colocated",
        weight_sync="tensor",
        weight_bucket_bytes=_pool_workers.BUCKET,
        retry_backoff_s=0.0,
        max_prompts_per_request=1,
    )
    try:
        with SGLangEngine(cfg, expected_weight_names=names, tensor_serializer=fake_sglang.serialize_tensors) as engine:
            engine.load_weights(_pool_workers.weights(1), version=1)
            restarted.state.weight_version = "default"  # what a relaunched SGLang reports
            prompts = [[i, 3, 4] for i in range(1, 9)]
            out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=5))
            assert [g[0].token_ids for g in out] == [fake_sglang.fake_sample(p, 0, 5, set(), None)[0] for p in prompts]
            assert [row["stale"] for row in engine.server_status()] == [False, True]
            calls = restarted.state.generate_calls
            assert calls >= 1  # it was asked once, answered with the wrong version, and then left alone
            engine.generate(prompts, SamplingParams(n=1, max_new_tokens=5))
            assert restarted.state.generate_calls == calls
            engine.load_weights(_pool_workers.weights(2), version=2)
            assert [row["stale"] for row in engine.server_status()] == [False, False]
            engine.generate(prompts, SamplingParams(n=1, max_new_tokens=5))
            assert restarted.state.generate_calls > calls
            assert torch.equal(restarted.state.weights["lm_head.weight"], _pool_workers.weights(2)[-1][1])
    finally:
        fresh.stop()
        restarted.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_contract_servers_on_two_nodes_balance_restart_and_discovery(tmp_path):
    spawn_ranks(_pool_workers.check_servers_on_every_node, 4, str(tmp_path))
