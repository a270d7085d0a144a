"""Contract tests: per-rank weight sync into SGLang-shaped servers (tests/rollout/fake_sglang.py).

The fake servers run in this process; the trainer ranks are spawned (gloo), build their stage from
a HF checkpoint and push their own shares. After each sync every server must hold every HF tensor,
bit for bit, received exactly once, at the one new version, with generation paused throughout and
resumed only at the end; a missing tensor is a one-line error on every rank.
"""

from __future__ import annotations

import base64
import io
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file

from stapo_megatron.checkpoint.export import BucketLayout, FlatBucket, TensorSlot
from stapo_megatron.rollout.endpoints import ServerEndpoint
from stapo_megatron.rollout.sglang_client import SGLangWeightSyncError, request
from stapo_megatron.rollout.weight_sync.transport import check_tallies
from stapo_megatron.runtime.launch import spawn_ranks
from tests.helpers import save_tiny_qwen3
from tests.rollout.fake_sglang import FakeSGLangServer, deserialize_tensors, serialize_tensors

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
    import os

    import torch.distributed as dist

    from stapo_megatron.checkpoint.convert import fill_from_hf
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.rollout.config import SGLangConfig
    from stapo_megatron.rollout.sglang_weights import expected_names_from_hf_checkpoint
    from stapo_megatron.rollout.weight_sync.plan import WeightSyncPlan
    from stapo_megatron.rollout.weight_sync.session import WeightSync
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from tests.rollout import nccl_like

    nccl_like.install(int(os.environ["RANK"]))
    reference = load_file(f"{hf_dir}/model.safetensors")
    expected = expected_names_from_hf_checkpoint(hf_dir)
    assert "lm_head.weight" in expected  # untied: the last stage exports the output layer
    version = 0
    config = SGLangConfig(
        weight_bucket_bytes=96 * 1024,
        weight_sync_backend="gloo",
        weight_sync_master_address="127.0.0.1",
        model_path=hf_dir,
    )
    for tp, pp, dp, per_node, nodes in layouts:
        # Colocated: server i runs on the next GPU of its node. The in-test servers use no GPU, so for NCCL
        # (which never shares a GPU with a trainer rank) they stand for disaggregated ones.
        endpoints = tuple(
            ServerEndpoint(**{**s, "node": node, "gpu_ids": (nodes[:i].count(node),)})
            for i, (s, node) in enumerate(zip(servers, nodes))
        )
        disaggregated = tuple(dataclass_replace(s, gpu_ids=()) for s in endpoints)
        ctx = init_distributed(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp))
        arch = Qwen3Config.from_hf(hf_dir)
        model = build_stage(arch, ctx, perform_initialization=False)
        fill_from_hf(model, arch, HFCheckpoint(hf_dir), ctx)
        for mode, path in (
            ("tensor", "/update_weights_from_tensor"),
            ("disk", "/update_weights_from_disk"),
            ("distributed", "/update_weights_from_distributed"),
        ):
            version += 1
            plan = WeightSyncPlan(
                mode=mode,
                endpoints=disaggregated if mode == "distributed" else endpoints,
                expected_names=expected,
                api_key=API_KEY,
                config=config,
                session_servers=frozenset(s.index for s in endpoints),
                disk_dir=disk_dir,
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
            config=config,
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

        # A server that refuses the buckets (it runs TP 1, the plan says 2 GPUs): the same one-line error on
        # every rank, and generation stays paused, so nothing is served on a mix of weights.
        wrong = tuple(dataclass_replace(s, tp_size=2, gpu_ids=(0, 1)) if s.index == 0 else s for s in endpoints)
        plan = WeightSyncPlan(
            mode="tensor",
            endpoints=wrong,
            expected_names=expected,
            api_key=API_KEY,
            config=config,
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
    from stapo_megatron.rollout.weight_sync.session import sync_engine_weights
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    ctx = init_distributed(ParallelConfig(tensor_parallel=tp, data_parallel=dp))
    arch = Qwen3Config.from_hf(hf_dir)
    model = build_stage(arch, ctx, perform_initialization=False)
    fill_from_hf(model, arch, HFCheckpoint(hf_dir), ctx)
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


# ---- a replica whose stages are on two nodes: CUDA IPC through relays on each server's node -----------


def tag_with_rank(named_tensors) -> str:
    """The contract serializer, each tensor moved ``rank + 1`` elements into a larger storage: the server
    side reads which trainer rank made an entry from its storage offset (the values stay the same)."""
    import torch.distributed as dist

    tag = dist.get_rank() + 1
    moved = []
    for name, tensor in named_tensors:
        storage = torch.empty(tag + tensor.numel(), dtype=tensor.dtype)
        moved.append((name, storage[tag:].view(tensor.shape).copy_(tensor)))
    return serialize_tensors(moved)


def sync_across_nodes(hf_dir: str, layouts: list[tuple[int, int, int]], server_sets: list[list[dict]]) -> None:
    """Two "nodes" of two ranks; for each (tp, pp, dp) and each set of colocated servers: one tensor sync,
    every server holding every tensor once, bit-exact, at the new version."""
    import os

    import torch.distributed as dist

    from stapo_megatron.checkpoint.convert import fill_from_hf
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.rollout.config import SGLangConfig
    from stapo_megatron.rollout.sglang_weights import expected_names_from_hf_checkpoint
    from stapo_megatron.rollout.weight_sync.plan import WeightSyncPlan
    from stapo_megatron.rollout.weight_sync.session import WeightSync
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from tests.rollout import nccl_like

    rank = int(os.environ["RANK"])
    nccl_like.install(rank)
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))  # what WeightSync reads the nodes from
    reference = load_file(f"{hf_dir}/model.safetensors")
    expected = expected_names_from_hf_checkpoint(hf_dir)
    version = 0
    for tp, pp, dp in layouts:
        ctx = init_distributed(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp))
        arch = Qwen3Config.from_hf(hf_dir)
        model = build_stage(arch, ctx, perform_initialization=False)
        fill_from_hf(model, arch, HFCheckpoint(hf_dir), ctx)
        for servers in server_sets:
            version += 1
            endpoints = tuple(ServerEndpoint(**s) for s in servers)
            plan = WeightSyncPlan(
                mode="tensor",
                endpoints=endpoints,
                expected_names=expected,
                api_key=API_KEY,
                config=SGLangConfig(weight_bucket_bytes=48 * 1024),
                session_servers=frozenset(s.index for s in endpoints),
            )
            before = {s.url: len(_requests(s.url)) for s in endpoints} if rank == 0 else {}
            sync = WeightSync(ctx, plan, serializer=tag_with_rank)
            sync.sync(model, arch, version)
            dist.barrier(group=ctx.cpu_group)
            if rank == 0:
                check_sync(list(endpoints), reference, str(version), before, "/update_weights_from_tensor")
            sync.close()
            dist.barrier(group=ctx.cpu_group)


def test_contract_ipc_reaches_every_server_when_a_replica_spans_two_nodes(tmp_path):
    hf_dir = save_tiny_qwen3(tmp_path / "hf", tie=False, seed=3, vocab_size=256)
    per_node = 2
    # One TP2 server per node, then one TP1 server per GPU.
    wide = [FakeSGLangServer(api_key=API_KEY, tp_size=2).start() for _ in range(2)]
    narrow = [FakeSGLangServer(api_key=API_KEY).start() for _ in range(4)]
    server_sets = [
        [dict(index=i, url=f.url, node=i, tp_size=2, gpu_ids=(0, 1)) for i, f in enumerate(wide)],
        [dict(index=i, url=f.url, node=i // 2, tp_size=1, gpu_ids=(i % 2,)) for i, f in enumerate(narrow)],
    ]
    try:
        # Megatron's order puts a replica's pipeline stages on different nodes in both: TP1 PP2 DP2 (stage 0 on
        # node 0, stage 1 on node 1, both replicas) and TP2 PP2 (one replica, one stage per node).
        spawn_ranks(sync_across_nodes, 4, str(hf_dir), [(1, 2, 2), (2, 2, 1)], server_sets)
        posted = 0
        for fake, server in zip(wide + narrow, server_sets[0] + server_sets[1]):
            for entry in fake.state.requests:
                if entry["path"] != "/update_weights_from_tensor":
                    continue
                for j, payload in enumerate(entry["body"]["serialized_named_tensors"]):
                    origins = {divmod(t.storage_offset() - 1, per_node) for _, t in deserialize_tensors(payload)}
                    # Entry j was made on the server's TP rank j GPU: never by a rank of another node or GPU.
                    assert origins == {(server["node"], server["gpu_ids"][j])}, (fake.url, j, origins)
                    posted += 1
            # lm_head is exported by the last stage only, which is on node 1: node 0 got it through a relay.
            assert "lm_head.weight" in fake.state.weights
        assert posted > 0
    finally:
        for fake in wide + narrow:
            fake.stop()


# ---- the GPU path's device handling, and the IPC serializer ------------------------------------------------


def test_ipc_waits_on_the_buckets_own_gpu_and_frees_its_handles_after(monkeypatch):
    """A worker thread starts on cuda:0: every CUDA call names the bucket's own device. A bucket in flight
    never waits for the whole device (the export's TP gathers run on it meanwhile): only for the
    export's event for it and for the transfer's own stream."""
    import types

    from stapo_megatron.rollout.weight_sync import tensor, transport

    calls = []

    class Stream:
        def __init__(self, device=None):
            self.device = device

        def synchronize(self):
            calls.append(("stream.synchronize", self.device))

        def wait_event(self, event):
            calls.append(("stream.wait_event", self.device, event.stream.device))

    class Event:
        def record(self, stream):
            self.stream = stream
            calls.append(("event.record", stream.device))

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: calls.append(("ipc_collect",)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: calls.append(("stream", stream.device)) or nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    layout = BucketLayout(0, (TensorSlot("w", torch.float32, (2,), 0),))
    gpu3 = torch.device("cuda", 3)
    on_gpu3 = FlatBucket(layout, {torch.float32: types.SimpleNamespace(is_cuda=True, device=gpu3)})

    tensor.synchronize_for_ipc(on_gpu3)  # one process: no collective in flight
    assert calls == [("synchronize", gpu3)]
    calls.clear()
    ready = transport.ready_event(on_gpu3)  # on the export's thread
    with transport.transfer_stream(gpu3):
        transport.wait_for(ready)
        transport.finish_transfers(gpu3)
    tensor.release_ipc_memory(gpu3)
    assert calls == [
        ("event.record", gpu3),
        ("set_device", gpu3),
        ("stream", gpu3),
        ("stream.wait_event", None, gpu3),  # the thread's current stream: its own, on cuda:3
        ("stream.synchronize", gpu3),
        ("ipc_collect",),
    ]
    calls.clear()
    cpu = torch.device("cpu")
    on_cpu = FlatBucket.allocate(layout, cpu)
    with transport.transfer_stream(cpu):
        transport.wait_for(transport.ready_event(on_cpu))
        transport.finish_transfers(cpu)
    tensor.synchronize_for_ipc(on_cpu)
    tensor.release_ipc_memory(cpu)
    assert calls == []


def mixed_cpu_bucket() -> FlatBucket:
    """A CPU bucket of two dtypes (two flat buffers), random values."""
    slots = (
        TensorSlot("model.layers.0.mlp.up_proj.weight", torch.bfloat16, (3, 4), 0),
        TensorSlot("model.norm.weight", torch.bfloat16, (5,), 12),
        TensorSlot("lm_head.weight", torch.float32, (2, 2), 0),
    )
    bucket = FlatBucket.allocate(BucketLayout(0, slots), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for dtype, buffer in bucket.buffers.items():
        buffer.copy_(torch.randn(buffer.shape, generator=gen).to(dtype))
    return bucket


def printed(bucket: FlatBucket) -> list[str]:
    """The bucket's tensors as the receivers print them."""
    return [f"{name} {t.dtype} {list(t.shape)} {t.float().flatten().tolist()}" for name, t in bucket.named_tensors()]


RECEIVER = """
import base64, gc, pickle, sys, torch
named = pickle.loads(base64.b64decode(sys.stdin.read()))
for name, tensor in named:
    print(name, str(tensor.dtype), list(tensor.shape), tensor.float().flatten().tolist())
del named, tensor  # as a server does once the weights are loaded: its mappings close
gc.collect()
"""


def share_cpu_bucket_with_another_process() -> None:
    """A CPU bucket serialized for IPC loads bit-exact in processes that are not our children, one
    payload each (the TP ranks of a server, or several servers, one after another: the first to close
    its mapping once removed the file the next was still to open), and no reducer of this process
    changes: a CPU tensor still pickles the ordinary way afterwards."""
    import gc
    import os
    import subprocess
    import sys
    from multiprocessing.reduction import ForkingPickler
    from pathlib import Path

    from torch.multiprocessing import reductions

    from stapo_megatron.rollout.sglang_weights import serialize_for_ipc

    reducers = (reductions.reduce_tensor, dict(ForkingPickler._extra_reducers))
    bucket = mixed_cpu_bucket()
    payloads = [serialize_for_ipc(bucket.named_tensors()) for _ in range(3)]
    for payload in payloads:
        loaded = subprocess.run(
            [sys.executable, "-c", RECEIVER], input=payload, capture_output=True, text=True, timeout=120
        )
        assert loaded.returncode == 0 and loaded.stdout.splitlines() == printed(bucket), loaded.stderr[-2000:]
    assert (reductions.reduce_tensor, dict(ForkingPickler._extra_reducers)) == reducers
    ForkingPickler.dumps(torch.ones(3))  # what broke after SGLang's process-wide patch
    assert list(Path("/dev/shm").glob(f"torch_{os.getpid()}_*"))  # the bucket's files, until it is freed
    del bucket, payloads, payload
    gc.collect()
    assert not list(Path("/dev/shm").glob(f"torch_{os.getpid()}_*"))  # the last close removed them


def test_ipc_serializer_shares_cpu_buckets_without_patching_the_process():
    spawn_ranks(share_cpu_bucket_with_another_process, 1)


def test_ipc_serializer_names_a_cuda_tensors_device_by_uuid(monkeypatch):
    """As SGLang's patched reducer does (each server process maps the UUID to its own device index),
    through a table of its own: torch's reducers are not replaced."""
    import types

    from torch.multiprocessing import reductions

    from stapo_megatron.rollout import sglang_weights

    cuda_args = ("cls", (2, 2), (2, 1), 0, "storage", torch.bfloat16, 3, b"handle", 8, 0, False)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, cuda_args))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid=f"GPU-{d}-uuid"))
    rebuild, args = sglang_weights._IPC_REDUCERS[torch.Tensor](types.SimpleNamespace(is_cuda=True))
    assert rebuild is reductions.rebuild_cuda_tensor
    assert args == (*cuda_args[:6], "GPU-3-uuid", *cuda_args[7:])


# ---- ranks that run ahead of each other, as on GPUs (tests/rollout/nccl_like.py) ------------------------


def sync_tp4_to_one_in_order_server(hf_dir: str, url: str, bucket_bytes: int, timeout_s: float) -> None:
    """The async 32B layout's sync at reduced sizes: the four TP ranks of one replica each broadcast their
    own buckets to one disaggregated server, which serves the requests one at a time in arrival order,
    while each rank's export gathers run behind its host thread. Two updates; every tensor bit-exact."""
    import os

    import torch.distributed as dist

    from stapo_megatron.checkpoint.convert import fill_from_hf
    from stapo_megatron.checkpoint.export import plan_buckets, stage_export_plan
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.rollout.config import SGLangConfig
    from stapo_megatron.rollout.sglang_weights import expected_names_from_hf_checkpoint
    from stapo_megatron.rollout.weight_sync.plan import WeightSyncPlan
    from stapo_megatron.rollout.weight_sync.session import WeightSync
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from tests.rollout import nccl_like

    nccl_like.install(int(os.environ["RANK"]))
    reference = load_file(f"{hf_dir}/model.safetensors")
    ctx = init_distributed(ParallelConfig(tensor_parallel=4))
    arch = Qwen3Config.from_hf(hf_dir)
    model = build_stage(arch, ctx, perform_initialization=False)
    fill_from_hf(model, arch, HFCheckpoint(hf_dir), ctx)
    # As for Qwen3-32B at TP4: the last TP rank owns the embedding, and the ranks' buckets complete at
    # interleaved points of the walk, so a rank's next bucket waits on gathers the others reach later.
    stage = stage_export_plan(model, arch, ctx.tp_size)
    assert stage[0].mapping.hf_names == ("model.embed_tokens.weight",) and stage[0].owner == 3
    assert all(len(plan_buckets(stage, tp_rank, bucket_bytes)) >= 3 for tp_rank in range(4))
    endpoint = ServerEndpoint(index=0, url=url, node=0, tp_size=1, gpu_ids=())
    plan = WeightSyncPlan(
        mode="distributed",
        endpoints=(endpoint,),
        expected_names=expected_names_from_hf_checkpoint(hf_dir),
        api_key=API_KEY,
        config=SGLangConfig(
            weight_bucket_bytes=bucket_bytes,
            weight_sync_backend="gloo",
            weight_sync_master_address="127.0.0.1",
            weight_sync_timeout_s=timeout_s,
            model_path=hf_dir,
        ),
        session_servers=frozenset({0}),
    )
    sync = WeightSync(ctx, plan, ranks_per_node=4)
    for version in (1, 2):
        before = {url: len(_requests(url))} if ctx.rank == 0 else {}
        sync.sync(model, arch, version)
        dist.barrier(group=ctx.cpu_group)
        if ctx.rank == 0:
            check_sync([endpoint], reference, str(version), before, "/update_weights_from_distributed")
    sync.close()
    dist.barrier(group=ctx.cpu_group)


def test_ranks_that_run_ahead_post_only_complete_buckets_so_an_in_order_server_never_blocks(tmp_path):
    hf_dir = save_tiny_qwen3(
        tmp_path / "hf", tie=False, seed=7, vocab_size=512, num_hidden_layers=3, num_key_value_heads=4
    )
    server = FakeSGLangServer(api_key=API_KEY).start()
    try:
        spawn_ranks(sync_tp4_to_one_in_order_server, 4, str(hf_dir), server.url, 24 * 1024, 30.0)
        paths = [entry["path"] for entry in server.state.requests]
        # Each rank's buckets, one request each per update, all served by the one in-order queue.
        assert paths.count("/update_weights_from_distributed") >= 2 * 12
        assert server.state.update_order.served == server.state.update_order.arrived
    finally:
        server.stop()
