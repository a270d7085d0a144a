"""Which trainer rank's Hugging Face tensors reach which server, and how: pure (no torch, no I/O).

A *share* is what one (pipeline stage, TP rank) exports (:mod:`stapo_megatron.checkpoint.export`:
the TP ranks of a stage own disjoint subsets of its names; data- and context-parallel copies hold the
same tensors). :func:`plan_routes` gives every share to every server exactly once, from one source
rank (``cp_rank`` 0), over the transport of the mode, and refuses a layout that cannot be served.
Every rank computes the same list from the same places: the choices are deterministic.

Each server takes a stage from one replica where it can, so the TP ranks of a stage export in step
(the export gathers over the TP group) and no stage is exported only to be dropped; the load (routes
per source rank, relays per handle rank) decides between equal candidates, which spreads the work
over replicas and ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

from stapo_megatron.config import ConfigError
from stapo_megatron.rollout.endpoints import ServerEndpoint

SYNC_MODES = ("tensor", "distributed", "disk")
TRANSPORTS = {"tensor": "cuda_ipc", "distributed": "nccl", "disk": "disk"}


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """One trainer rank, from Megatron's rank order (tp-cp-ep-dp-pp)."""

    rank: int  # global rank
    node: int
    gpu: int  # local GPU index on its node (LOCAL_RANK)
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int


@dataclasses.dataclass(frozen=True)
class Route:
    """One share of the HF tensors to one server.

    ``cuda_ipc``: ``relay`` (when the source is not a handle rank) receives the share's buckets from
    the source point to point and copies them to the other handle ranks; handle rank j (the trainer
    rank on the server's TP rank j GPU) makes the IPC handle of its own copy for TP rank j.
    ``nccl``: the weight-update group is ``(source,)`` plus the server's ``tp_size`` processes.
    ``disk``: the source writes files into the shared directory; the controller tells the server.
    """

    share: tuple[int, int]  # (pp_rank, tp_rank)
    server: int  # ServerEndpoint.index
    source: int  # global rank that exports the share for this server (cp_rank 0)
    transport: str  # "cuda_ipc" | "nccl" | "disk"
    relay: int | None = None
    handle_ranks: tuple[int, ...] = ()


def describe_layout(ranks: Sequence[RankPlace]) -> str:
    """``TP2 PP2 DP1 CP1 on 2 nodes``: the layout as an error message names it."""

    def size(field: str) -> int:
        return 1 + max(getattr(p, field) for p in ranks)

    nodes = len({p.node for p in ranks})
    return (
        f"TP{size('tp_rank')} PP{size('pp_rank')} DP{size('dp_rank')} CP{size('cp_rank')} "
        f"on {nodes} node{'s' if nodes != 1 else ''}"
    )


def plan_routes(mode: str, ranks: Sequence[RankPlace], servers: Sequence[ServerEndpoint]) -> list[Route]:
    """Every share reaches every server exactly once. Raises ConfigError (one line naming the
    layout and why) when the layout cannot be served in ``mode`` ("tensor"|"distributed"|"disk")."""
    if mode not in SYNC_MODES:
        raise ConfigError(f"weight_sync: must be one of {', '.join(SYNC_MODES)}, got {mode!r}")
    if not ranks:
        raise ConfigError(f"weight_sync {mode}: no trainer ranks to send weights from")
    if not servers:
        raise ConfigError(f"weight_sync {mode}: no rollout servers to send weights to")
    return _Planner(mode, ranks).routes(servers)


class _Planner:
    def __init__(self, mode: str, ranks: Sequence[RankPlace]):
        self.mode = mode
        self.layout = describe_layout(ranks)
        self.place = {p.rank: p for p in ranks}
        # (pp, tp) -> the cp 0 rank of each replica, by dp rank
        self.candidates: dict[tuple[int, int], dict[int, int]] = {}
        for p in sorted(ranks, key=lambda p: p.rank):
            if p.cp_rank == 0:
                self.candidates.setdefault((p.pp_rank, p.tp_rank), {})[p.dp_rank] = p.rank
        self.stages = sorted({pp for pp, _ in self.candidates})
        self.tp_ranks = sorted({tp for _, tp in self.candidates})
        self.replicas = sorted({dp for by_dp in self.candidates.values() for dp in by_dp})
        self.on_gpu: dict[tuple[int, int], int] = {}
        for p in ranks:
            other = self.on_gpu.setdefault((p.node, p.gpu), p.rank)
            if other != p.rank:
                raise self.refuse(f"ranks {other} and {p.rank} share GPU {p.gpu} of node {p.node}")
        self.load = dict.fromkeys(self.place, 0)  # routes each rank is the source of
        self.relay_load = dict.fromkeys(self.place, 0)  # shares each rank relays

    def refuse(self, why: str) -> ConfigError:
        return ConfigError(f"weight_sync {self.mode}: layout {self.layout}: {why}")

    def routes(self, servers: Sequence[ServerEndpoint]) -> list[Route]:
        routes: list[Route] = []
        for server in servers:
            if self.mode == "disk":
                routes += [
                    Route(share, server.index, self.candidates[share][min(self.candidates[share])], "disk")
                    for share in sorted(self.candidates)
                ]
            elif self.mode == "tensor":
                routes += self._ipc_routes(server)
            else:
                routes += self._nccl_routes(server)
        return routes

    def _source(self, share: tuple[int, int], dp: int) -> int | None:
        return self.candidates[share].get(dp)

    def _pick_replica(self, pp: int, score) -> int:
        """The replica that serves stage ``pp`` of a server: the best ``score`` (a tuple per source rank of
        the stage, summed), then the least loaded, then the lowest dp rank."""

        def key(dp: int) -> tuple:
            sources = [s for tp in self.tp_ranks if (s := self._source((pp, tp), dp)) is not None]
            return (*score(sources), sum(self.load[s] for s in sources), dp)

        return min(self.replicas, key=key)

    def _sources(
        self,
        score: Callable[[list[int]], tuple[int, ...]],
        usable: Callable[[int], bool] = lambda rank: True,
        refusal: Callable[[tuple[int, int]], ConfigError] | None = None,
    ) -> Iterator[tuple[tuple[int, int], int]]:
        """(share, source) of every share for one server: each stage from the replica :meth:`_pick_replica`
        gives, a share that replica cannot serve (absent, or not ``usable``) from the least loaded rank
        that can; ``refusal(share)`` when none can."""
        for pp in self.stages:
            dp = self._pick_replica(pp, score)
            for tp in self.tp_ranks:
                share = (pp, tp)
                source = self._source(share, dp)
                if source is None or not usable(source):
                    others = [r for r in self.candidates[share].values() if usable(r)]
                    if not others:
                        assert refusal is not None, "every share has a source where every rank is usable"
                        raise refusal(share)
                    source = min(others, key=lambda r: (self.load[r], r))
                self.load[source] += 1
                yield share, source

    def _ipc_routes(self, server: ServerEndpoint) -> list[Route]:
        if not server.colocated:
            raise self.refuse(
                f"server {server.url} does not share GPUs with the trainer, and CUDA IPC needs colocated servers "
                "(use weight_sync distributed or disk)"
            )
        if len(server.gpu_ids) != server.tp_size:
            raise self.refuse(f"server {server.url} runs TP {server.tp_size} on {len(server.gpu_ids)} GPUs")
        handles = []
        for gpu in server.gpu_ids:
            rank = self.on_gpu.get((server.node, gpu))
            if rank is None:
                raise self.refuse(
                    f"server {server.url} runs on GPU {gpu} of node {server.node}, where no trainer rank runs "
                    "(CUDA IPC handles come from the trainer rank on each server GPU)"
                )
            handles.append(rank)
        handle_set = set(handles)

        def score(sources: list[int]) -> tuple[int, int]:
            # Prefer a replica whose stage sits on the server's GPUs (no relay), then on its node.
            return (
                -sum(s in handle_set for s in sources),
                -sum(self.place[s].node == server.node for s in sources),
            )

        routes = []
        for share, source in self._sources(score):
            relay = None
            if source not in handle_set:
                # The handle rank relaying the fewest shares; ties go round the server's GPUs by TP rank.
                position = {rank: (j - share[1]) % len(handles) for j, rank in enumerate(handles)}
                relay = min(handles, key=lambda r: (self.relay_load[r], position[r]))
                self.relay_load[relay] += 1
            routes.append(Route(share, server.index, source, "cuda_ipc", relay, tuple(handles)))
        return routes

    def _nccl_routes(self, server: ServerEndpoint) -> list[Route]:
        # NCCL refuses a communicator with two processes on one GPU: no source on the server's GPUs.
        taken = {(server.node, gpu) for gpu in server.gpu_ids} if server.colocated else set()

        def usable(rank: int) -> bool:
            return (self.place[rank].node, self.place[rank].gpu) not in taken

        def score(sources: list[int]) -> tuple[int]:
            return (sum(not usable(s) for s in sources),)

        def refusal(share: tuple[int, int]) -> ConfigError:
            return self.refuse(
                f"every rank exporting stage {share[0]} TP rank {share[1]} runs on a GPU of server {server.url} "
                f"(node {server.node}), and an NCCL group cannot hold two processes on one GPU "
                "(use weight_sync tensor or disk)"
            )

        return [Route(share, server.index, source, "nccl") for share, source in self._sources(score, usable, refusal)]
