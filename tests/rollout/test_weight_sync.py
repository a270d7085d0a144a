"""Contract tests: per-rank weight sync into SGLang-shaped servers (tests/rollout/fake_sglang.py).

The fake servers run in this process; the trainer ranks are spawned (gloo), build their stage from
a HF checkpoint and push their own shares. After each sync every server must hold every HF tensor,
bit for bit, received exactly once, at the one new version, with generation paused throughout and
resumed only at the end; a missing tensor is a one-line error on every rank.
"""

from __future__ import annotations

import base64
import io

import pytest
import torch
from safetensors.torch import load_file

from stapo_megatron.rollout.endpoints import ServerEndpoint
from stapo_megatron.rollout.sglang_client import SGLangWeightSyncError, request
from stapo_megatron.rollout.weight_sync import check_tallies
from stapo_megatron.runtime.launch import spawn_ranks
from tests.helpers import save_tiny_qwen3
from tests.rollout.fake_sglang import FakeSGLangServer

API_KEY = "sync-key"


def _state(url: str) -> dict:
    data = request(url, "GET", "/fake/state", api_key=None, timeout=30).json()
    data["weights"] = torch.load(io.BytesIO(base64.b64decode(data["weights"])), weights_only=True)
    return data


def _requests(url: str) -> list[str]:
    return [r["path"] for r in request(url, "GET", "/fake/state", api_key=None, timeout=30).json()["updates"]]


def check_sync(
    endpoints: list[ServerEndpoint], reference: dict, version: str, before: dict[str, int], path: str
) -> None:
    """Every server: every tensor once (through ``path``) since ``before``, bit-exact, at ``version``."""
    for server in endpoints:
        state = _state(server.url)
        updates = state["updates"][before[server.url] :]
        names = [n for u in updates if u["path"] == path for n in u["names"]]
        assert sorted(names) == sorted(reference), f"{server.url}: {len(names)} names for {len(reference)} tensors"
        # The version is stamped once, after every part arrived (disk: with the complete checkpoint).
        stamps = [u["weight_version"] for u in updates if u["weight_version"] is not None]
        assert stamps == [version], (server.url, stamps)
        assert updates[-1]["weight_version"] == version and state["weight_version"] == version
        if path != "/update_weights_from_disk":
            assert all(u["session"] for u in updates if u["path"] == path)
        for name, tensor in reference.items():
            assert torch.equal(state["weights"][name], tensor), f"{server.url}: {name} differs"


def sync_on_every_rank(
    hf_dir: str, layouts: list[tuple[int, int, int, int, tuple[int, ...]]], servers: list[dict], disk_dir: str
) -> None:
    """For each (tp, pp, dp, ranks per node, node of each server): tensor, disk and distributed syncs, then
    two failures."""
    import torch.distributed as dist

    from stapo_megatron.checkpoint.convert import fill_from_hf
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.rollout.sglang_weights import expected_names_from_hf_checkpoint
    from stapo_megatron.rollout.weight_sync import WeightSync, WeightSyncPlan
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from tests.rollout.fake_sglang import serialize_tensors

    reference = load_file(f"{hf_dir}/model.safetensors")
    expected = expected_names_from_hf_checkpoint(hf_dir)
    assert "lm_head.weight" in expected  # untied: the last stage exports the output layer
    version = 0
    for tp, pp, dp, per_node, nodes in layouts:
        endpoints = tuple(ServerEndpoint(**{**s, "node": node}) for s, node in zip(servers, nodes))
        ctx = init_distributed(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp))
        arch = Qwen3Config.from_hf(hf_dir)
        model = build_stage(arch, perform_initialization=False)
        fill_from_hf(model, arch, HFCheckpoint(hf_dir))
        for mode, path in (
            ("tensor", "/update_weights_from_tensor"),
            ("disk", "/update_weights_from_disk"),
            ("distributed", "/update_weights_from_distributed"),
        ):
            version += 1
            plan = WeightSyncPlan(
                mode=mode,
                endpoints=endpoints,
                expected_names=expected,
                api_key=API_KEY,
                session_servers=frozenset(s.index for s in endpoints),
                bucket_bytes=96 * 1024,
                group_backend="gloo",
                master_address="127.0.0.1",
                disk_dir=disk_dir,
                config_from=hf_dir,
            )
            before = {s.url: len(_requests(s.url)) for s in endpoints} if ctx.rank == 0 else {}
            sync = WeightSync(ctx, plan, ranks_per_node=per_node, serializer=serialize_tensors)
            sync.sync(model, arch, version)
            dist.barrier(group=ctx.cpu_group)
            if ctx.rank == 0:
                check_sync(list(endpoints), reference, str(version), before, path)
            sync.close()
            dist.barrier(group=ctx.cpu_group)

        # A tensor the servers expect but no rank holds: refused before anything is sent or paused.
        plan = WeightSyncPlan(
            mode="tensor",
            endpoints=endpoints,
            expected_names=expected | {"model.layers.9.mlp.up_proj.weight"},
            api_key=API_KEY,
            session_servers=frozenset(s.index for s in endpoints),
        )
        before = {s.url: len(_requests(s.url)) for s in endpoints}
        sync = WeightSync(ctx, plan, ranks_per_node=per_node, serializer=serialize_tensors)
        with pytest.raises(SGLangWeightSyncError) as failure:
            sync.sync(model, arch, 99)
        message = str(failure.value)
        assert "\n" not in message and "lacks 1 of" in message and "model.layers.9.mlp.up_proj.weight" in message, (
            message
        )
        dist.barrier(group=ctx.cpu_group)
        if ctx.rank == 0:
            for server in endpoints:
                state = _state(server.url)
                assert len(state["updates"]) == before[server.url] and state["weight_version"] == str(version)
        sync.close()
        dist.barrier(group=ctx.cpu_group)

        # A server that refuses the buckets (it runs TP 1, the plan says 2): the same one-line error on
        # every rank, and generation stays paused, so nothing is served on a mix of weights.
        wrong = tuple(dataclass_replace(s, tp_size=2) if s.index == 0 else s for s in endpoints)
        plan = WeightSyncPlan(
            mode="tensor",
            endpoints=wrong,
            expected_names=expected,
            api_key=API_KEY,
            session_servers=frozenset(s.index for s in endpoints),
        )
        sync = WeightSync(ctx, plan, ranks_per_node=per_node, serializer=serialize_tensors)
        with pytest.raises(SGLangWeightSyncError) as failure:
            sync.sync(model, arch, 100)
        message = str(failure.value)
        assert "\n" not in message and endpoints[0].url in message and "stays paused" in message, message
        dist.barrier(group=ctx.cpu_group)
        if ctx.rank == 0:
            assert all(_state(s.url)["weight_version"] == str(version) for s in endpoints)
        sync.close()
        dist.barrier(group=ctx.cpu_group)


def dataclass_replace(endpoint: ServerEndpoint, **changes) -> ServerEndpoint:
    import dataclasses

    return dataclasses.replace(endpoint, **changes)


@pytest.fixture
def fakes():
    servers = [FakeSGLangServer(api_key=API_KEY).start() for _ in range(3)]
    yield servers
    for server in servers:
        server.stop()


def test_contract_weight_sync_from_every_rank_lands_on_every_server_at_one_version(fakes, tmp_path):
    hf_dir = save_tiny_qwen3(tmp_path / "hf", tie=False, seed=11, vocab_size=256)
    # Two servers on node 0, one on node 1; with 2 ranks per node, TP2 x DP2 puts one replica on each
    # node (each pushes to its own node's servers), TP2 x PP2 one replica on both nodes.
    servers = [dict(index=i, url=f.url, node=0, tp_size=1, gpu_ids=(i,)) for i, f in enumerate(fakes)]
    layouts = [(2, 1, 2, 2, (0, 0, 1)), (2, 2, 1, 4, (0, 0, 0))]
    spawn_ranks(sync_on_every_rank, 4, str(hf_dir), layouts, servers, str(tmp_path / "disk"))
    for fake in fakes:
        assert not fake.state.session_open
        # Generation was paused whenever weights were arriving, and resumed only after the version stamp.
        paused, stamped, syncs = False, False, 0
        for entry in fake.state.requests:
            path = entry["path"]
            if path == "/pause_generation":
                paused, stamped = True, False
            elif path.startswith("/update_weights_from_"):
                assert paused and not stamped, f"{path} reached {fake.url} while generation could run"
                stamped = stamped or path == "/update_weights_from_disk"
            elif path == "/update_weight_version":
                assert paused
                stamped = True
            elif path == "/continue_generation":
                assert paused and stamped, f"{fake.url} resumed before every part and the version arrived"
                paused, syncs = False, syncs + 1
        assert syncs == 6  # 3 modes x 2 layouts; the failed ones left it paused
        assert fake.state.paused


def test_tally_check_names_the_missing_and_the_duplicated_tensor_in_one_line():
    servers = [
        ServerEndpoint(index=0, url="http://a:1", node=0, tp_size=1),
        ServerEndpoint(index=1, url="http://b:1", node=0, tp_size=1),
    ]
    expected = frozenset({"x", "y", "z"})
    check_tallies(expected, [{0: ["x", "y"], 1: ["x"]}, {0: ["z"], 1: ["y", "z"]}], servers)
    with pytest.raises(SGLangWeightSyncError) as failure:
        check_tallies(expected, [{0: ["x", "y"], 1: ["x", "y"]}, {0: ["z"], 1: ["y"]}], servers)
    assert str(failure.value) == ("weight sync to http://b:1 lacks 1 of 3 tensors: z; got 1 tensors more than once: y")


def load_local_engine_from_every_rank(hf_dir: str, tp: int, dp: int) -> None:
    """TP x DP ranks; the first replica's ranks feed rank 0's in-process engine, which must hold the HF
    checkpoint bit for bit at the synced version."""
    from stapo_megatron.checkpoint.convert import fill_from_hf
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.rollout.local_engine import LocalEngine
    from stapo_megatron.rollout.weight_sync import sync_engine_weights
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    ctx = init_distributed(ParallelConfig(tensor_parallel=tp, data_parallel=dp))
    arch = Qwen3Config.from_hf(hf_dir)
    model = build_stage(arch, perform_initialization=False)
    fill_from_hf(model, arch, HFCheckpoint(hf_dir))
    engine = LocalEngine(arch) if ctx.rank == 0 else None
    assert sync_engine_weights(ctx, model, arch, engine, 5, None) is None
    if engine is not None:
        reference = load_file(f"{hf_dir}/model.safetensors")
        params = dict(engine.model.named_parameters())
        assert set(params) == set(reference)
        for name, tensor in reference.items():
            assert torch.equal(params[name], tensor), name
        assert engine.weight_version == 5


def test_in_process_engine_gets_every_rank_share_bit_exact_at_tp2_dp2(tmp_path):
    hf_dir = save_tiny_qwen3(tmp_path / "hf", tie=False, seed=5)
    spawn_ranks(load_local_engine_from_every_rank, 4, str(hf_dir), 2, 2)
