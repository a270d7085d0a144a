"""The layout check (stapo_megatron/launch/layout.py) on the paper's configs at their node counts,
on a matrix of layouts, against Megatron's own groups in a real world, and through the commands."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import time
from collections import Counter

import pytest

from stapo_megatron.cli import main
from stapo_megatron.config import ConfigError, build, load_config
from stapo_megatron.launch import layout as layout_check
from stapo_megatron.launch.layout import Machines, MemoryModel, check_layout, check_routes, check_train_layout
from stapo_megatron.launch.plan_config import PlanConfig, memory_model
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.weight_sync.routes import Route
from stapo_megatron.runtime.distributed import ParallelConfig
from stapo_megatron.runtime.launch import spawn_ranks
from stapo_megatron.trainer.config import TrainConfig
from tests.helpers import REPO_ROOT

GPUS_PER_NODE = 8
# the nodes each paper config is meant for (examples/qwen3/run_qwen3_*.sh: NODES=)
PAPER_NODES = {"1.7b": 1, "8b": 2, "14b": 4, "32b": 8}


def paper_config(size: str, *overrides: str) -> TrainConfig:
    return load_config(TrainConfig, REPO_ROOT / "configs" / f"qwen3_{size}_stapo.yaml", list(overrides))


def test_example_scripts_name_the_nodes_checked_here():
    for size, nodes in PAPER_NODES.items():
        script = (REPO_ROOT / "examples" / "qwen3" / f"run_qwen3_{size}.sh").read_text()
        assert f"NODES={nodes} " in script, size
        assert paper_config(size).parallel.world_size == nodes * GPUS_PER_NODE, size


@pytest.mark.parametrize("size", list(PAPER_NODES))
def test_paper_configs_pass_at_their_node_counts(size):
    cfg = paper_config(size)
    nodes = PAPER_NODES[size]
    job = check_train_layout(cfg, Machines(nodes, GPUS_PER_NODE))
    sglang = cfg.rollout.sglang
    assert job.mode == "tensor" and len(job.ranks) == nodes * GPUS_PER_NODE
    assert [p.node for p in job.ranks] == [r // GPUS_PER_NODE for r in range(len(job.ranks))]
    servers_per_node = GPUS_PER_NODE // sglang.tp_size
    assert len(job.servers) == nodes * servers_per_node
    for server in job.servers:
        local = server.endpoint.index % servers_per_node
        assert server.endpoint.node == server.endpoint.index // servers_per_node
        assert (
            server.gpus == server.endpoint.gpu_ids == tuple(range(local * sglang.tp_size, (local + 1) * sglang.tp_size))
        )
    p = cfg.parallel
    assert len(job.routes) == len(job.servers) * p.tensor_parallel * p.pipeline_parallel
    assert {r.transport for r in job.routes} == {"cuda_ipc"}
    mem = job.memory
    assert mem is not None and max(mem.training, mem.rollout, mem.sync) <= mem.gpu_memory
    # the sync holds the rollout phase's memory plus at least one bucket on some GPU
    assert mem.sync >= mem.rollout + cfg.rollout.sglang.weight_bucket_bytes
    summary = job.summary()
    assert summary.splitlines()[0].endswith(": ok") and "weight sync tensor" in summary


def test_32b_on_8_nodes_relays_stage_1_to_the_servers_of_nodes_0_to_3():
    """TP8 PP2 DP4: a replica's stage 0 is ranks 8d..8d+7 (nodes 0-3), its stage 1 ranks 32+8d.. (nodes
    4-7). Each node's server takes its own node's stage from its own ranks and the other stage
    from the replica's ranks on the other node, through the rank of the same TP rank on its node."""
    job = check_train_layout(paper_config("32b"), Machines(8, GPUS_PER_NODE))
    groups = job.groups
    assert groups.tensor[0] == tuple(range(8)) and len(groups.tensor) == 8
    assert groups.pipeline[:2] == ((0, 32), (1, 33)) and len(groups.pipeline) == 32
    assert groups.data[:2] == ((0, 8, 16, 24), (1, 9, 17, 25))
    assert groups.model_parallel[0] == (*range(8), *range(32, 40))
    assert groups.embedding == ()  # untied: no embedding group to build
    routes = {(r.server, r.share): r for r in job.routes}
    assert len(routes) == len(job.routes) == 8 * 16
    for node in range(8):
        here, other = (0, 1) if node < 4 else (1, 0)
        replica = node % 4
        handles = tuple(range(8 * node, 8 * node + 8))
        for tp in range(8):
            own = routes[node, (here, tp)]
            assert (own.source, own.relay, own.handle_ranks) == (8 * node + tp, None, handles)
            far = routes[node, (other, tp)]
            remote_rank = 32 * other + 8 * replica + tp
            assert (far.source, far.relay, far.handle_ranks) == (remote_rank, 8 * node + tp, handles)
            assert job.ranks[far.source].node == (node + 4) % 8  # sent across nodes point to point
    relays = Counter(r.relay for r in job.routes if r.relay is not None)
    assert len(relays) == 64 and set(relays.values()) == {1}  # every rank relays one share, none relays more


def _bad_routes(job) -> dict[str, list[Route]]:
    """The 32B routes, each broken in one way the checker must see."""
    routes = list(job.routes)
    relayed = next(i for i, r in enumerate(routes) if r.relay is not None)
    direct = next(i for i, r in enumerate(routes) if r.relay is None)

    def replaced(i: int, **change) -> list[Route]:
        return routes[:i] + [dataclasses.replace(routes[i], **change)] + routes[i + 1 :]

    far_rank = routes[relayed].source
    return {
        "never reaches": routes[1:],
        "more than once": routes + routes[:1],
        "no relay": replaced(relayed, relay=None),
        "relay rank 40 is not on one of the server's GPUs": replaced(relayed, relay=40),
        "handle ranks": replaced(direct, handle_ranks=tuple(reversed(routes[direct].handle_ranks))),
        "not a context-parallel rank 0 holding it": replaced(direct, source=routes[direct].source + 1),
        "goes over nccl": replaced(direct, transport="nccl"),
        "relayed though its source is a handle rank": replaced(direct, relay=routes[direct].handle_ranks[1]),
        f"relay rank {far_rank} is not on one of": replaced(relayed, relay=far_rank),
    }


def test_the_route_checker_refuses_every_broken_route():
    job = check_train_layout(paper_config("32b"), Machines(8, GPUS_PER_NODE))
    check_routes("tensor", job.ranks, job.servers, job.routes, nccl=True)
    for reason, routes in _bad_routes(job).items():
        with pytest.raises(ConfigError, match=reason) as err:
            check_routes("tensor", job.ranks, job.servers, routes, nccl=True)
        assert "\n" not in str(err.value)
    # distributed: a source on one of the server's GPUs would put two processes on one GPU
    dist_job = check_train_layout(
        # (a colocated server joins one NCCL group per rank that feeds it: a smaller share leaves room)
        paper_config("32b", "rollout.sglang.weight_sync=distributed", "rollout.sglang.mem_fraction_static=0.7"),
        Machines(8, GPUS_PER_NODE),
    )
    bad = [dataclasses.replace(dist_job.routes[0], source=dist_job.servers[0].endpoint.gpu_ids[0])]
    bad += list(dist_job.routes[1:])
    with pytest.raises(ConfigError, match="holds two processes on GPU 0 of node 0, which NCCL refuses"):
        check_routes("distributed", dist_job.ranks, dist_job.servers, bad, nccl=True)
    check_routes("distributed", dist_job.ranks, dist_job.servers, bad, nccl=False)  # gloo on CPU: no GPUs
    disk_job = check_train_layout(paper_config("32b", "rollout.sglang.weight_sync=disk"), Machines(8, GPUS_PER_NODE))
    replica_1 = next(p.rank for p in disk_job.ranks if p.dp_rank == 1 and (p.pp_rank, p.tp_rank) == (0, 0))
    bad = [dataclasses.replace(disk_job.routes[0], source=replica_1)] + list(disk_job.routes[1:])
    with pytest.raises(ConfigError, match="not replica 0"):
        check_routes("disk", disk_job.ranks, disk_job.servers, bad, nccl=True)


# ---- the matrix -----------------------------------------------------------------------------------

TIED = build(Qwen3Config, "qwen3_1.7b")  # 28 layers: PP 3 is uneven (9/10/9)
UNTIED = build(Qwen3Config, "qwen3_14b")  # 40 layers: PP 3 is uneven (14/13/13)
MODES = ("tensor", "distributed", "disk")


def _matrix_memory(arch: Qwen3Config, colocated: bool) -> MemoryModel:
    """The 32B config's workload (18,432-token micro-batches, full recompute; offload when colocated)."""
    separate = ["rollout.sglang.placement=disaggregated", "compute.offload_while_generating=false"]
    cfg = dataclasses.replace(paper_config("32b", *([] if colocated else separate)), model=arch)
    work, options = memory_model(PlanConfig(), cfg)
    return MemoryModel(work, options, layout_check.largest_export_entry(arch, work.param_bytes))


# (placement, weight-sync mode, server TP: None = the trainer's TP) of each layout's servers;
# "misplaced": disaggregated servers launched on GPU 0, which a trainer rank uses
SERVERS = (
    *(("colocated", mode, None) for mode in MODES),
    ("colocated", "tensor", 8),
    *(("disaggregated", mode, None) for mode in ("distributed", "disk")),  # tensor: refused by SGLangConfig
    ("misplaced", "distributed", None),
)


@functools.cache
def _sglang(placement: str, mode: str, server_tp: int, per_node: int) -> SGLangConfig:
    if placement == "colocated":
        return SGLangConfig(model_path="m", placement="colocated", tp_size=server_tp, weight_sync=mode)
    if placement == "misplaced":
        return SGLangConfig(model_path="m", tp_size=server_tp, weight_sync=mode)
    free = GPUS_PER_NODE - per_node  # disaggregated: the first node's GPUs the trainer leaves
    return SGLangConfig(
        model_path="m", tp_size=server_tp, base_gpu_id=per_node, num_servers=max(1, free // server_tp), weight_sync=mode
    )


def _assert_invariants(job, mode: str) -> None:
    """What the test itself demands of an accepted layout, computed from the places alone."""
    place = {p.rank: p for p in job.ranks}
    on_gpu = {(p.node, p.gpu): p.rank for p in job.ranks}
    assert len(on_gpu) == len(job.ranks)  # one process per GPU
    shares = {(p.pp_rank, p.tp_rank) for p in job.ranks}
    used: set[tuple[int, int]] = set()
    for server in job.servers:
        gpus = {(server.endpoint.node, g) for g in server.gpus}
        assert not gpus & used, "two servers on one GPU"
        used |= gpus
        mine = [r for r in job.routes if r.server == server.endpoint.index]
        assert sorted(r.share for r in mine) == sorted(shares), "every share exactly once"
        for r in mine:
            src = place[r.source]
            assert (src.pp_rank, src.tp_rank, src.cp_rank) == (*r.share, 0)
            if r.transport == "cuda_ipc":
                e = server.endpoint
                assert [place[h].node for h in r.handle_ranks] == [e.node] * e.tp_size, "IPC across nodes"
                assert [place[h].gpu for h in r.handle_ranks] == list(e.gpu_ids)
                if r.relay is None:
                    assert r.source in r.handle_ranks
                else:
                    relay = place[r.relay]
                    assert relay.node == e.node and (relay.node, relay.gpu) != (src.node, src.gpu)
            elif r.transport == "nccl":
                group = [(src.node, src.gpu)] + [(server.endpoint.node, g) for g in server.gpus]
                assert len(set(group)) == len(group), "an NCCL group with two processes on one GPU"
            else:
                assert r.transport == "disk" and src.dp_rank == 0
    if mode == "tensor":
        assert {r.transport for r in job.routes} == {"cuda_ipc"}


def test_matrix_of_layouts(capsys):
    """TP 1-8, PP 1-4, DP 1-8 on 1-16 nodes of 8 GPUs, colocated and disaggregated, tied and untied,
    each weight-sync mode: every accepted layout meets the invariants, every refusal is one line."""
    start = time.perf_counter()
    memory = {(arch.tie_word_embeddings, colocated): _matrix_memory(arch, colocated) for arch in (TIED, UNTIED)
              for colocated in (True, False)}  # fmt: skip
    accepted: Counter = Counter()
    refused: Counter = Counter()
    uneven = relayed = 0
    grid = itertools.product((TIED, UNTIED), range(1, 9), range(1, 5), range(1, 9), range(1, 17), SERVERS)
    for arch, tp, pp, dp, nodes, (placement, mode, server_tp) in grid:
        parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp)
        sglang = _sglang(placement, mode, server_tp or tp, max(parallel.world_size // nodes, 1))
        machines = Machines(nodes, GPUS_PER_NODE)
        try:
            job = check_layout(
                arch, parallel, sglang, machines, memory[arch.tie_word_embeddings, placement == "colocated"]
            )
        except ConfigError as err:
            message = str(err)
            assert "\n" not in message and message.startswith("layout Qwen3 "), message
            refused[_reason(message)] += 1
            continue
        _assert_invariants(job, mode)
        accepted[placement, mode, server_tp or "trainer's"] += 1
        uneven += len(set(arch.layers_per_stage(pp))) > 1
        relayed += any(r.relay is not None for r in job.routes)
    elapsed = time.perf_counter() - start
    total = sum(accepted.values()) + sum(refused.values())
    with capsys.disabled():
        print(f"\nlayout matrix: {total} layouts in {elapsed:.1f} s, {sum(accepted.values())} accepted "
              f"({uneven} with uneven pipeline splits, {relayed} relaying across nodes), "
              f"{sum(refused.values())} refused")  # fmt: skip
        for (placement, mode, server_tp), n in accepted.items():
            print(f"  accepted {placement} {mode}, server TP {server_tp}: {n}")
        for reason, n in refused.most_common():
            print(f"  refused {n}: {reason}")
    # every kind of layout is represented among the accepted ones, and every reason among the refused
    assert {(placement, mode) for placement, mode, _ in accepted} == {
        *(("colocated", mode) for mode in MODES),
        ("disaggregated", "distributed"),
        ("disaggregated", "disk"),
    }
    assert uneven and relayed
    assert {
        "TP does not divide the heads",
        "ranks do not divide over the nodes",
        "more ranks per node than GPUs",
        "TP spans nodes",
        "disaggregated server on a trainer GPU",
        "server beyond the node's GPUs",
        "NCCL source on the server's GPUs",
        "over the GPU's memory",
    } <= set(refused)


_REASONS = (
    ("does not divide the", "TP does not divide the heads"),
    ("do not divide evenly", "ranks do not divide over the nodes"),
    ("ranks per node, but a node has", "more ranks per node than GPUs"),
    ("spans nodes", "TP spans nodes"),
    ("a trainer GPU", "disaggregated server on a trainer GPU"),
    ("which has 8 GPUs", "server beyond the node's GPUs"),
    ("an NCCL group cannot hold two processes", "NCCL source on the server's GPUs"),
    ("usable, leaving less than plan.headroom_gb", "over the GPU's memory"),
    ("stages is more than", "more stages than layers"),
)


def _reason(message: str) -> str:
    for text, reason in _REASONS:
        if text in message:
            return reason
    return message  # a reason the table does not know: shown whole, and the reason check above fails


# ---- against Megatron's groups in a real world -------------------------------------------------


GROUP_LAYOUTS = ((2, 2, 1), (1, 2, 2), (2, 1, 2))  # (TP, PP, DP) of a 4-rank world


def megatron_groups(out: str, layouts) -> None:
    """One rank: Megatron's coordinates and groups at each layout, re-initialised in one world."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from stapo_megatron.runtime.distributed import init_distributed

    seen = []
    for tp, pp, dp in layouts:
        ctx = init_distributed(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp))
        groups = {
            "tp": ctx.tp_group,
            "pp": ctx.pp_group,
            "dp": ctx.dp_group,
            "cp": ps.get_context_parallel_group(),
            "model parallel": ctx.model_parallel_group,
            "embedding": ps.get_embedding_group(),
        }
        seen.append(
            {
                "coordinates": [ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, ctx.cp_rank],
                "groups": {kind: dist.get_process_group_ranks(g) for kind, g in groups.items()},
            }
        )
    with open(f"{out}/{dist.get_rank()}.json", "w") as f:
        json.dump(seen, f)


def test_places_and_groups_are_megatrons(tmp_path):
    """A 4-rank gloo world builds Megatron's groups at three layouts; each rank's coordinates and
    every group it is in equal what the check computed without a world."""
    spawn_ranks(megatron_groups, 4, str(tmp_path), GROUP_LAYOUTS)
    for rank in range(4):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        for (tp, pp, dp), real in zip(GROUP_LAYOUTS, seen, strict=True):
            parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp)
            places, groups = layout_check.megatron_ranks(parallel, 4, tied_embeddings=True)
            me = places[rank]
            assert [me.tp_rank, me.pp_rank, me.dp_rank, me.cp_rank] == real["coordinates"], (tp, pp, dp)
            for kind, members in groups.by_name().items():
                mine = [list(g) for g in members if rank in g]
                if kind == "embedding" and pp == 1:
                    assert mine == []  # Megatron builds it, but only tied embeddings across stages use it
                else:
                    assert mine == [real["groups"][kind]], (tp, pp, dp, kind)


# ---- the commands ------------------------------------------------------------------------------


def test_plan_check_prints_the_summary_and_the_routes(capsys):
    config = str(REPO_ROOT / "configs" / "qwen3_32b_stapo.yaml")
    assert main(["plan", "--config", config, "--check"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "layout Qwen3 32.8B TP8 PP2 DP4 CP1 on 8 node(s) x 8 GPUs, colocated SGLang TP8, weight_sync tensor: ok"
    )
    assert any(line.startswith("weight sync tensor: 128 routes (cuda_ipc 128)") for line in out)
    # every phase with its margin on the usable memory (the fixed costs counted: contexts, communicators)
    assert (
        "memory per GPU, GiB of 79.6 usable: training 24.8 (margin 54.8), rollout 69.1 (margin 10.5), "
        "weight sync 76.1 (margin 3.5) (peak: weight sync)"
    ) in out
    assert main(["plan", "--config", config, "--check", "--verbose"]) == 0
    routes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("server ")]
    assert len(routes) == 128
    assert "server 0 <- stage 1 TP rank 3: rank 35 (node 4 GPU 3) cuda_ipc via relay rank 3, handles 0-7" in routes
    assert main(["plan", "--config", config, "--check", "--nodes", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "on 16 node(s)" in err and "the tp group 0-7 spans nodes 0-1 of 4 ranks" in err


def test_submit_refuses_a_layout_before_submitting(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = str(REPO_ROOT / "configs" / "qwen3_32b_stapo.yaml")
    argv = ["submit", "--config", config, "--account", "a", "--nodes", "2", "--gpus-per-node", "8", "--dryrun"]
    argv += ["--no-check-files", "parallel.data_parallel=1", "rollout.sglang.weight_sync=distributed"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("stapo: error: layout Qwen3 32.8B TP8 PP2 DP1 CP1 on 2 node(s)")
    assert "NCCL group cannot hold two processes on one GPU" in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_train_refuses_a_layout_before_torchrun(capsys, tmp_path):
    argv = ["train", f"run.output_dir={tmp_path / 'run'}", "parallel.tensor_parallel=2", "rollout.engine=sglang"]
    argv += ["rollout.sglang.model_path=m", "rollout.sglang.placement=colocated", "rollout.sglang.tp_size=2"]
    assert main([*argv, "rollout.sglang.weight_sync=distributed"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CPU processes, colocated SGLang TP2, weight_sync distributed" in err
    assert "NCCL group cannot hold two processes on one GPU" in err
    assert not (tmp_path / "run").exists()  # refused before the run directory, its lock and torchrun
