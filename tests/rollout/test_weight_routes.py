"""Weight-sync routes (rollout/weight_sync/routes.py): which rank sends which share to which server, how.

Layouts are laid out as Megatron orders ranks (tp fastest, then cp, dp, pp), one rank per GPU, and
colocated servers as the node leaders launch them (server i of a node on GPUs i*tp_size ..).
"""

from __future__ import annotations

import collections
import itertools

import pytest

from stapo_megatron.config import ConfigError
from stapo_megatron.rollout.endpoints import ServerEndpoint
from stapo_megatron.rollout.weight_sync.routes import RankPlace, Route, plan_routes


def places(tp: int, pp: int, dp: int, per_node: int, cp: int = 1) -> list[RankPlace]:
    out = []
    for rank in range(tp * cp * dp * pp):
        tp_rank, rest = rank % tp, rank // tp
        cp_rank, rest = rest % cp, rest // cp
        dp_rank, pp_rank = rest % dp, rest // dp
        out.append(RankPlace(rank, rank // per_node, rank % per_node, tp_rank, pp_rank, dp_rank, cp_rank))
    return out


def colocated(nodes: int, per_node: int, tp_size: int) -> list[ServerEndpoint]:
    servers = []
    for node, first in itertools.product(range(nodes), range(0, per_node, tp_size)):
        gpus = tuple(range(first, first + tp_size))
        servers.append(ServerEndpoint(len(servers), f"http://n{node}:{30000 + first}", node, tp_size, gpus))
    return servers


def check_invariants(routes: list[Route], ranks: list[RankPlace], servers: list[ServerEndpoint]) -> None:
    """Every share once per server from a cp 0 rank holding it; IPC within the server's node, from its GPUs."""
    place = {p.rank: p for p in ranks}
    shares = {(p.pp_rank, p.tp_rank) for p in ranks}
    per_server = collections.Counter((r.server, r.share) for r in routes)
    assert per_server == {(s.index, share): 1 for s in servers for share in shares}
    by_index = {s.index: s for s in servers}
    for route in routes:
        source = place[route.source]
        assert source.cp_rank == 0 and (source.pp_rank, source.tp_rank) == route.share
        server = by_index[route.server]
        if route.transport == "cuda_ipc":
            assert [(place[r].node, place[r].gpu) for r in route.handle_ranks] == [
                (server.node, g) for g in server.gpu_ids
            ]
            if route.relay is None:
                assert route.source in route.handle_ranks
            else:
                assert route.source not in route.handle_ranks and route.relay in route.handle_ranks
        else:
            assert route.relay is None and route.handle_ranks == ()
        if route.transport == "nccl":  # no NCCL group with two processes on one GPU
            assert not (server.colocated and source.node == server.node and source.gpu in server.gpu_ids)


def test_tensor_mode_relays_a_stage_on_another_node_to_the_servers_gpus():
    # TP2 PP2 on 2 nodes of 2 GPUs: stage 0 on node 0, stage 1 on node 1; one TP2 server per node.
    ranks, servers = places(2, 2, 1, per_node=2), colocated(2, 2, 2)
    routes = plan_routes("tensor", ranks, servers)
    check_invariants(routes, ranks, servers)
    assert [(r.server, r.share, r.source, r.relay, r.handle_ranks) for r in routes] == [
        (0, (0, 0), 0, None, (0, 1)),
        (0, (0, 1), 1, None, (0, 1)),
        (0, (1, 0), 2, 0, (0, 1)),  # stage 1 comes point to point to the server's own GPUs, one relay per TP rank
        (0, (1, 1), 3, 1, (0, 1)),
        (1, (0, 0), 0, 2, (2, 3)),
        (1, (0, 1), 1, 3, (2, 3)),
        (1, (1, 0), 2, None, (2, 3)),
        (1, (1, 1), 3, None, (2, 3)),
    ]
    assert all(r.transport == "cuda_ipc" for r in routes)
    # One TP1 server per GPU: the relays are the servers' own ranks.
    servers = colocated(2, 2, 1)
    routes = plan_routes("tensor", ranks, servers)
    check_invariants(routes, ranks, servers)
    assert [(r.source, r.relay) for r in routes if r.server == 1] == [(0, 1), (1, None), (2, 1), (3, 1)]


def test_tensor_mode_at_the_32b_layout_spreads_sources_and_relays():
    # configs/qwen3_32b_stapo.yaml: TP8 PP2 DP4 on 8 nodes, one TP8 server per node; a replica's
    # stages are on nodes d and d + 4.
    ranks, servers = places(8, 2, 4, per_node=8), colocated(8, 8, 8)
    routes = plan_routes("tensor", ranks, servers)
    check_invariants(routes, ranks, servers)
    relayed = [r for r in routes if r.relay is not None]
    assert len(relayed) == 8 * 8  # every server gets the other stage through a relay
    assert collections.Counter(r.source for r in routes) == {rank: 2 for rank in range(64)}
    assert max(collections.Counter(r.relay for r in relayed).values()) == 1
    assert plan_routes("tensor", ranks, servers) == routes  # deterministic


def test_tensor_mode_refuses_servers_it_cannot_reach_by_ipc():
    ranks = places(1, 1, 2, per_node=2)
    remote = [ServerEndpoint(0, "http://h:1", -1, 1)]
    with pytest.raises(ConfigError, match=r"^weight_sync tensor: layout TP1 PP1 DP2 CP1 on 1 node: server http://h:1 "):
        plan_routes("tensor", ranks, remote)
    beyond = [ServerEndpoint(0, "http://n0:1", 0, 2, (1, 2))]  # GPU 2 holds no trainer rank
    with pytest.raises(ConfigError, match=r"runs on GPU 2 of node 0, where no trainer rank runs"):
        plan_routes("tensor", ranks, beyond)


def test_distributed_mode_never_puts_two_processes_on_one_gpu():
    # Colocated on 1 node: every rank holding the weights sits on a GPU of the server.
    ranks = places(1, 1, 2, per_node=2)
    with pytest.raises(ConfigError) as failure:
        plan_routes("distributed", ranks, colocated(1, 2, 2))
    message = str(failure.value)
    assert "\n" not in message and message.startswith("weight_sync distributed: layout TP1 PP1 DP2 CP1 on 1 node:")
    assert "http://n0:30000" in message and "two processes on one GPU" in message
    # Two nodes: each node's server gets the weights from the other node's replica.
    ranks, servers = places(1, 1, 2, per_node=1), colocated(2, 1, 1)
    routes = plan_routes("distributed", ranks, servers)
    check_invariants(routes, ranks, servers)
    assert [(r.server, r.source, r.transport) for r in routes] == [(0, 1, "nccl"), (1, 0, "nccl")]
    # Disaggregated servers: the replicas take turns.
    ranks = places(2, 2, 2, per_node=8)
    servers = [ServerEndpoint(i, f"http://g:{i}", -1, 2) for i in range(2)]
    routes = plan_routes("distributed", ranks, servers)
    check_invariants(routes, ranks, servers)
    assert {(r.server, ranks[r.source].dp_rank) for r in routes} == {(0, 0), (1, 1)}


def test_disk_mode_replica_zero_writes_every_share_once_for_every_server():
    ranks = places(2, 2, 2, per_node=4, cp=2)
    servers = colocated(4, 4, 2)
    routes = plan_routes("disk", ranks, servers)
    check_invariants(routes, ranks, servers)
    assert {r.source for r in routes} == {p.rank for p in ranks if p.dp_rank == 0 and p.cp_rank == 0}
    assert all(r.transport == "disk" for r in routes)
    with pytest.raises(ConfigError, match=r"^weight_sync: must be one of tensor, distributed, disk, got 'ipc'$"):
        plan_routes("ipc", ranks, servers)


def test_config_refuses_cuda_ipc_to_disaggregated_servers_before_any_launch():
    from stapo_megatron.rollout.config import SGLangConfig

    for fields in (dict(model_path="m"), dict(urls=["http://h:1"])):  # launched or attached
        with pytest.raises(ConfigError) as failure:
            SGLangConfig(placement="disaggregated", weight_sync="tensor", **fields)
        assert str(failure.value) == (
            "weight_sync: tensor (CUDA IPC) needs servers on the trainer's GPUs (placement: colocated); "
            "disaggregated servers take weights over distributed or disk"
        )
    assert SGLangConfig(placement="colocated", weight_sync="tensor", model_path="m").resolved_weight_sync == "tensor"
