"""The layout check: a training config on N nodes, rank by rank, before anything starts.

For a config and a node count, :func:`check_layout` computes what the job will be, the way
Megatron, torchrun and the node leaders will make it, without a GPU or a process group:

* each rank's node and GPU (torchrun numbers the ranks node by node: LOCAL_RANK = rank mod ranks
  per node) and its TP/PP/DP/CP coordinates, from Megatron's own ``RankGenerator`` (order
  ``tp-cp-ep-dp-pp``, as ``initialize_model_parallel`` builds it);
* each process group's members (tensor, pipeline, data, context, model parallel, and the
  embedding group that ties the first and last stage's embeddings);
* the SGLang servers of each node and their GPUs (:func:`plan_node_servers`: colocated servers on
  the trainer's GPUs, disaggregated ones on every node from ``base_gpu_id``);
* every weight-sync route (:func:`plan_routes`), checked here independently: every (stage, TP
  rank) share reaches every server exactly once, no NCCL group holds two processes on one GPU, no
  CUDA IPC crosses a node, no two servers share a GPU;
* the memory of each phase per GPU with :mod:`stapo_megatron.launch.plan`'s model: training,
  rollout (the servers' share and what the trainer keeps) and the weight sync (the rollout phase
  plus the sync's buckets: two on a rank that exports, one being filled while the other is sent,
  and one more on a rank that takes copies from another, which arrive one bucket at a time).

A layout that cannot work is refused with one line (ConfigError) naming the layout and the reason.
``stapo plan --check`` prints the result; ``stapo submit`` and ``stapo train`` run it first.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from stapo_megatron.config import ConfigError, build
from stapo_megatron.config.command import read_training_file
from stapo_megatron.launch.plan import (
    GIB,
    DeviceCosts,
    Estimate,
    Layout,
    Workload,
    check_layout_fits_model,
    estimate,
)
from stapo_megatron.launch.plan_config import PlanConfig, memory_model
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.endpoints import ServerEndpoint
from stapo_megatron.rollout.node_servers import plan_node_servers
from stapo_megatron.rollout.weight_sync.routes import TRANSPORTS, RankPlace, Route, describe_layout, plan_routes
from stapo_megatron.runtime.distributed import ParallelConfig

if TYPE_CHECKING:
    from stapo_megatron.trainer.config import TrainConfig

MEGATRON_ORDER = "tp-cp-ep-dp-pp"  # initialize_model_parallel's default, which init_distributed keeps
EXPORT_BUCKETS = 2  # an exporting rank fills bucket k+1 while bucket k is sent (checkpoint/export.pipelined)
COPY_BUCKETS = 1  # a handle rank takes another rank's buckets one at a time
# a relay receives bucket k+1 while the bucket k it broadcast stays allocated until that broadcast has
# run on the GPU (recordStream)
RELAY_BUCKETS = 2


@dataclasses.dataclass(frozen=True)
class Machines:
    """Where the job runs: ``nodes`` nodes of ``gpus_per_node`` GPUs. ``on_gpus`` False: CPU
    processes (gloo), which share no GPU and have no GPU memory to run out of."""

    nodes: int
    gpus_per_node: int
    on_gpus: bool = True


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """:func:`~stapo_megatron.launch.plan.estimate`'s inputs (``plan_config.memory_model``) and the sync's bucket
    size."""

    work: Workload
    options: dict[str, Any]
    bucket_bytes: int
    headroom: float = 0.0  # bytes every phase must leave free on a GPU (plan.headroom_gb)


@dataclasses.dataclass(frozen=True)
class ProcessGroups:
    """Every group Megatron builds for the trainer, as tuples of global ranks."""

    tensor: tuple[tuple[int, ...], ...]
    pipeline: tuple[tuple[int, ...], ...]
    data: tuple[tuple[int, ...], ...]
    context: tuple[tuple[int, ...], ...]
    model_parallel: tuple[tuple[int, ...], ...]
    embedding: tuple[tuple[int, ...], ...]  # first + last stage of each pipeline, tied embeddings and PP > 1 only

    def by_name(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        return {
            "tp": self.tensor,
            "pp": self.pipeline,
            "dp": self.data,
            "cp": self.context,
            "model parallel": self.model_parallel,
            "embedding": self.embedding,
        }


@dataclasses.dataclass(frozen=True)
class ServerPlace:
    """One server and the GPUs of its node it runs on (() for a server the run attaches to)."""

    endpoint: ServerEndpoint
    gpus: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PhaseMemory:
    """Bytes per GPU of each phase, on the GPU where the phase peaks."""

    training: float
    rollout: float
    sync: float
    gpu_memory: float  # usable

    @property
    def phases(self) -> tuple[tuple[str, float], ...]:
        return (("training", self.training), ("rollout", self.rollout), ("weight sync", self.sync))

    @property
    def peak(self) -> tuple[str, float]:
        return max(self.phases, key=lambda p: p[1])


@dataclasses.dataclass(frozen=True)
class JobLayout:
    """What :func:`check_layout` found for an accepted layout."""

    name: str
    machines: Machines
    ranks: tuple[RankPlace, ...]
    groups: ProcessGroups
    servers: tuple[ServerPlace, ...]
    mode: str | None  # the weight-sync mode; None without servers (the local engine)
    routes: tuple[Route, ...]
    memory: PhaseMemory | None  # None on CPU processes, or without a memory model

    def summary(self) -> str:
        """A few lines: ranks per node, groups, servers, routes per transport, peak memory per phase."""
        m = self.machines
        per_node = len(self.ranks) // m.nodes
        lines = [
            f"{self.name}: ok",
            f"ranks: {len(self.ranks)} on {m.nodes} node(s), {per_node} per node "
            f"(node n: ranks {per_node}n..{per_node}n+{per_node - 1} on GPUs 0-{per_node - 1})",
        ]
        node_of = {p.rank: p.node for p in self.ranks}
        parts = []
        for kind, groups in self.groups.by_name().items():
            if not groups:
                parts.append(f"{kind} none")
                continue
            spanning = sum(len({node_of[r] for r in group}) > 1 for group in groups)
            where = f", {spanning} across nodes" if spanning else ""
            parts.append(f"{kind} {len(groups)} x {len(groups[0])}{where}")
        lines.append("groups: " + "; ".join(parts))
        if self.servers:
            lines.append("servers: " + "; ".join(_server_text(s) for s in self.servers[: min(len(self.servers), 4)]))
            if len(self.servers) > 4:
                lines[-1] += f"; ... ({len(self.servers)} in all)"
            lines.append(f"weight sync {self.mode}: {_routes_text(self.routes)}")
        else:
            lines.append("servers: none (the local engine generates in the trainer's processes)")
        if m.on_gpus:
            idle = (
                m.nodes * m.gpus_per_node
                - len(self.ranks)
                - sum(len(s.gpus) for s in self.servers if not s.endpoint.colocated)
            )
            if idle:
                lines.append(f"idle: {idle} GPU(s) run neither a trainer rank nor a server")
        if self.memory is not None:
            mem = self.memory
            phase, _ = mem.peak
            each = ", ".join(
                f"{name} {used / GIB:.1f} (margin {(mem.gpu_memory - used) / GIB:.1f})" for name, used in mem.phases
            )
            lines.append(f"memory per GPU, GiB of {mem.gpu_memory / GIB:g} usable: {each} (peak: {phase})")
        return "\n".join(lines)

    def route_lines(self) -> list[str]:
        """One line per route (``stapo plan --check --verbose``)."""
        place = {p.rank: p for p in self.ranks}
        lines = []
        for r in self.routes:
            src = place[r.source]
            text = (
                f"server {r.server} <- stage {r.share[0]} TP rank {r.share[1]}: rank {r.source} "
                f"(node {src.node} GPU {src.gpu}) {r.transport}"
            )
            if r.relay is not None:
                text += f" via relay rank {r.relay}"
            if r.handle_ranks:
                text += f", handles {_span(r.handle_ranks)}"
            lines.append(text)
        return lines


def _span(values: Sequence[int]) -> str:
    """``0-7`` for consecutive values, else ``0,2,5``."""
    if len(values) > 1 and list(values) == list(range(values[0], values[0] + len(values))):
        return f"{values[0]}-{values[-1]}"
    return ",".join(str(v) for v in values)


def _server_text(server: ServerPlace) -> str:
    e = server.endpoint
    if e.node < 0:
        return f"{e.url} (attached, TP{e.tp_size})"
    kind = "colocated" if e.colocated else "disaggregated"
    return f"{e.index}: node {e.node} GPUs {_span(server.gpus)} ({kind}, TP{e.tp_size})"


def _routes_text(routes: Sequence[Route]) -> str:
    by_transport = Counter(r.transport for r in routes)
    relayed = [r.relay for r in routes if r.relay is not None]
    text = f"{len(routes)} routes (" + ", ".join(f"{t} {n}" for t, n in sorted(by_transport.items())) + ")"
    text += f" from {len({r.source for r in routes})} source ranks"
    if relayed:
        per_relay = Counter(relayed)
        text += f"; {len(relayed)} relayed by {len(per_relay)} ranks (at most {max(per_relay.values())} each)"
    return text


def describe(arch: Qwen3Config, parallel: ParallelConfig, sglang: SGLangConfig | None, machines: Machines) -> str:
    """The layout as a refusal names it: model, TP/PP/DP/CP, nodes, placement, weight sync."""
    p = parallel
    text = (
        f"layout Qwen3 {arch.num_parameters() / 1e9:.1f}B TP{p.tensor_parallel} PP{p.pipeline_parallel} "
        f"DP{p.data_parallel} CP{p.context_parallel} on {machines.nodes} node(s) x {machines.gpus_per_node} "
        f"{'GPUs' if machines.on_gpus else 'CPU processes'}"
    )
    if sglang is None:
        return text + ", local engine"
    where = "attached" if not sglang.launches else sglang.placement
    return text + f", {where} SGLang TP{sglang.tp_size}, weight_sync {sglang.resolved_weight_sync}"


def largest_export_entry(arch: Qwen3Config, param_bytes: int) -> int:
    """Bytes of the largest parameter the export moves whole (a bucket never splits one): the
    embedding or output layer, the fused gate/up projection or the fused q/k/v projection."""
    h = arch.hidden_size
    qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    return param_bytes * h * max(arch.vocab_size, 2 * arch.intermediate_size, qkv)


def plan_section(config_path: str | os.PathLike) -> PlanConfig:
    """The ``plan:`` section of a training config file (the GPUs' memory, the reserve, the kernels)."""
    return build(PlanConfig, read_training_file(config_path)[0]["plan"], "plan")


def check_train_layout(train: TrainConfig, machines: Machines, plan: PlanConfig | None = None) -> JobLayout:
    """:func:`check_layout` of a training config; memory from its ``plan:`` section (``plan``)."""
    sglang = train.rollout.sglang if train.rollout.engine == "sglang" else None
    work, options = memory_model(plan or PlanConfig(), train)
    bucket = max(sglang.weight_bucket_bytes if sglang else 0, largest_export_entry(train.model, work.param_bytes))
    headroom = (plan or PlanConfig()).headroom_gb * GIB
    return check_layout(train.model, train.parallel, sglang, machines, MemoryModel(work, options, bucket, headroom))


def check_layout(
    arch: Qwen3Config,
    parallel: ParallelConfig,
    sglang: SGLangConfig | None,
    machines: Machines,
    memory: MemoryModel | None = None,
) -> JobLayout:
    """The job's ranks, groups, servers, weight-sync routes and memory; ConfigError (one line naming
    the layout and why) for a layout that cannot work. ``sglang`` None: the local engine."""
    name = describe(arch, parallel, sglang, machines)
    try:
        return _check(name, arch, parallel, sglang, machines, memory)
    except ConfigError as err:
        raise ConfigError(f"{name}: {str(err).splitlines()[0]}") from None


def _check(
    name: str,
    arch: Qwen3Config,
    parallel: ParallelConfig,
    sglang: SGLangConfig | None,
    machines: Machines,
    memory: MemoryModel | None,
) -> JobLayout:
    reason = check_layout_fits_model(arch, parallel.tensor_parallel, parallel.pipeline_parallel)
    if reason:
        raise ConfigError(reason)
    world, nodes = parallel.world_size, machines.nodes
    if world % nodes:
        raise ConfigError(f"its {world} ranks do not divide evenly over {nodes} nodes")
    per_node = world // nodes
    # torchrun gives every rank of a node its own GPU (LOCAL_RANK): no trainer group shares one
    if per_node > machines.gpus_per_node:
        raise ConfigError(f"{per_node} ranks per node, but a node has {machines.gpus_per_node} GPUs")
    ranks, groups = megatron_ranks(parallel, per_node, arch.tie_word_embeddings)
    place = {p.rank: p for p in ranks}
    for group in groups.tensor:
        spanned = sorted({place[r].node for r in group})
        if len(spanned) > 1:
            raise ConfigError(
                f"the tp group {_span(group)} spans nodes {_span(spanned)} of {per_node} ranks each (tensor "
                "parallelism talks at every layer: keep it within a node)"
            )
    servers: tuple[ServerPlace, ...] = ()
    routes: tuple[Route, ...] = ()
    mode = None
    if sglang is not None:
        servers = tuple(server_places(sglang, per_node, machines))
        _check_servers(servers, per_node, machines)
        mode = sglang.resolved_weight_sync
        try:
            routes = tuple(plan_routes(mode, ranks, [s.endpoint for s in servers]))
        except ConfigError as err:
            # its message names the layout too, in fewer words than this one's name: said once
            raise ConfigError(str(err).removeprefix(f"weight_sync {mode}: layout {describe_layout(ranks)}: ")) from None
        check_routes(mode, ranks, servers, routes, nccl=machines.on_gpus and sglang.weight_sync_backend == "nccl")
    phases = None
    if memory is not None and machines.on_gpus:
        phases = phase_memory(arch, parallel, ranks, routes, servers, memory)
        phase, peak = phases.peak
        if peak + memory.headroom > phases.gpu_memory:
            raise ConfigError(
                f"the {phase} phase needs {peak / GIB:.1f} GiB per GPU of the {phases.gpu_memory / GIB:g} usable, "
                f"leaving less than plan.headroom_gb {memory.headroom / GIB:g} free (stapo plan --config shows each "
                "term; lower rollout.sglang.mem_fraction_static or weight_bucket_bytes)"
            )
    return JobLayout(name, machines, tuple(ranks), groups, servers, mode, routes, phases)


def megatron_ranks(
    parallel: ParallelConfig, ranks_per_node: int, tied_embeddings: bool
) -> tuple[list[RankPlace], ProcessGroups]:
    """Each rank's place and the groups, as ``initialize_model_parallel`` builds them."""
    from stapo_megatron.runtime.distributed import prepare_megatron_import

    prepare_megatron_import()
    from megatron.core.parallel_state import RankGenerator, default_embedding_ranks

    p = parallel
    generator = RankGenerator(
        tp=p.tensor_parallel, ep=1, dp=p.data_parallel, pp=p.pipeline_parallel, cp=p.context_parallel,
        order=MEGATRON_ORDER,
    )  # fmt: skip

    def groups(token: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(g) for g in generator.get_ranks(token))

    tensor, pipeline, data, context = groups("tp"), groups("pp"), groups("dp"), groups("cp")
    coordinate: dict[str, dict[int, int]] = {}
    for kind, members in (("tp", tensor), ("pp", pipeline), ("dp", data), ("cp", context)):
        coordinate[kind] = {rank: i for group in members for i, rank in enumerate(group)}
    ranks = [
        RankPlace(
            rank=r,
            node=r // ranks_per_node,
            gpu=r % ranks_per_node,
            tp_rank=coordinate["tp"][r],
            pp_rank=coordinate["pp"][r],
            dp_rank=coordinate["dp"][r],
            cp_rank=coordinate["cp"][r],
        )
        for r in range(p.world_size)
    ]
    # Megatron always builds the embedding group; only tied embeddings reduce their gradient over it
    embedding = (
        tuple(tuple(default_embedding_ranks(list(g))) for g in pipeline)
        if tied_embeddings and p.pipeline_parallel > 1
        else ()
    )
    return ranks, ProcessGroups(tensor, pipeline, data, context, groups("tp-pp"), embedding)


def server_places(sglang: SGLangConfig, ranks_per_node: int, machines: Machines) -> list[ServerPlace]:
    """The run's servers, numbered as :func:`start_job_servers` numbers them, with their GPUs."""
    if not sglang.launches:
        return [
            ServerPlace(ServerEndpoint(index=i, url=url.rstrip("/"), node=-1, tp_size=sglang.tp_size), ())
            for i, url in enumerate(sglang.urls)
        ]
    places: list[ServerPlace] = []
    for node, count in enumerate(plan_node_servers(sglang, ranks_per_node, machines.nodes)):
        for local in range(count):
            gpus = sglang.server_gpus(local)
            endpoint = ServerEndpoint(
                index=len(places),
                url=f"node{node}/server{local}",  # its address is known once its node launches it
                node=node,
                tp_size=sglang.tp_size,
                gpu_ids=gpus if sglang.colocated else (),
            )
            places.append(ServerPlace(endpoint, gpus))
    return places


def _one_process_per_gpu(what: str, gpus: Sequence[tuple[int, int]]) -> None:
    """NCCL refuses a communicator with two processes on one GPU ("Duplicate GPU detected")."""
    twice = [g for g, n in Counter(gpus).items() if n > 1]
    if twice:
        node, gpu = twice[0]
        raise ConfigError(f"{what} holds two processes on GPU {gpu} of node {node}, which NCCL refuses")


def _check_servers(servers: Sequence[ServerPlace], ranks_per_node: int, machines: Machines) -> None:
    """No two servers on one GPU; on GPUs, each server's GPUs exist and disaggregated ones are not the trainer's."""
    owner: dict[tuple[int, int], int] = {}
    for server in servers:
        e = server.endpoint
        for gpu in server.gpus:
            if machines.on_gpus and gpu >= machines.gpus_per_node:
                raise ConfigError(
                    f"server {e.index} needs GPU {gpu} of node {e.node}, which has {machines.gpus_per_node} GPUs"
                )
            if (e.node, gpu) in owner:
                raise ConfigError(f"servers {owner[e.node, gpu]} and {e.index} both run on GPU {gpu} of node {e.node}")
            owner[e.node, gpu] = e.index
            if not e.colocated and machines.on_gpus and gpu < ranks_per_node:
                raise ConfigError(
                    f"disaggregated server {e.index} runs on GPU {gpu} of node {e.node}, a trainer GPU (ranks use "
                    f"GPUs 0-{ranks_per_node - 1}; set rollout.sglang.base_gpu_id >= {ranks_per_node}, or "
                    "placement colocated)"
                )


def check_routes(
    mode: str, ranks: Sequence[RankPlace], servers: Sequence[ServerPlace], routes: Sequence[Route], *, nccl: bool
) -> None:
    """Check ``plan_routes``' answer on its own terms (ConfigError naming the route at fault): every
    share reaches every server exactly once from a cp-0 rank that holds it, over ``mode``'s
    transport; CUDA IPC stays on the server's node: handle rank j is the rank on the server's GPU j
    (so the handle group holds one process per GPU) and the relay is one of them (so the relay pair
    is two GPUs); with ``nccl``, no weight-update group holds two processes on one GPU. Disk routes
    come from replica 0."""
    place = {p.rank: p for p in ranks}
    on_gpu = {(p.node, p.gpu): p.rank for p in ranks}
    shares = {(p.pp_rank, p.tp_rank) for p in ranks}
    by_index = {s.endpoint.index: s for s in servers}
    got: dict[int, Counter] = {index: Counter() for index in by_index}
    for route in routes:
        what = f"route of stage {route.share[0]} TP rank {route.share[1]} to server {route.server}"
        if route.server not in by_index:
            raise ConfigError(f"{what}: no such server")
        server = by_index[route.server]
        e = server.endpoint
        got[route.server][route.share] += 1
        src = place.get(route.source)
        if src is None or (src.pp_rank, src.tp_rank) != route.share or src.cp_rank != 0:
            raise ConfigError(f"{what}: rank {route.source} is not a context-parallel rank 0 holding it")
        if route.transport != TRANSPORTS[mode]:
            raise ConfigError(f"{what}: goes over {route.transport}, not {TRANSPORTS[mode]} (weight_sync {mode})")
        if route.transport == "cuda_ipc":
            _check_ipc(what, route, server, place, on_gpu)
        elif route.relay is not None or route.handle_ranks:
            raise ConfigError(f"{what}: {route.transport} takes no relay or handle ranks")
        if route.transport == "nccl" and nccl:
            members = [(src.node, src.gpu)] + ([(e.node, g) for g in server.gpus] if e.node >= 0 else [])
            _one_process_per_gpu(f"{what}: its weight-update group", members)
        if route.transport == "disk" and src.dp_rank != 0:
            raise ConfigError(f"{what}: written by rank {route.source} of replica {src.dp_rank}, not replica 0")
    for index, counts in got.items():
        missing = sorted(shares - set(counts))
        twice = sorted(s for s, n in counts.items() if n > 1)
        if missing or twice:
            share = (missing or twice)[0]
            how = "never reaches" if missing else "reaches more than once"
            raise ConfigError(f"stage {share[0]} TP rank {share[1]} {how} server {index}")


def _check_ipc(
    what: str,
    route: Route,
    server: ServerPlace,
    place: dict[int, RankPlace],
    on_gpu: dict[tuple[int, int], int],
) -> None:
    e = server.endpoint
    if not e.colocated:
        raise ConfigError(f"{what}: CUDA IPC to a server that shares no GPU with the trainer")
    expected = tuple(on_gpu.get((e.node, g), -1) for g in e.gpu_ids)
    if route.handle_ranks != expected:
        raise ConfigError(
            f"{what}: handle ranks {list(route.handle_ranks)} are not the ranks on the server's GPUs "
            f"{list(e.gpu_ids)} of node {e.node} ({list(expected)}): CUDA IPC cannot cross GPUs' owners or nodes"
        )
    src = place[route.source]
    if route.source in route.handle_ranks:
        if route.relay is not None:
            raise ConfigError(f"{what}: relayed though its source is a handle rank")
        return
    if route.relay is None:
        raise ConfigError(f"{what}: its source rank {route.source} (node {src.node}) is no handle rank, and no relay")
    if route.relay not in route.handle_ranks:
        # a handle rank is on the server's node; it is not the source, so not on the source's GPU either
        raise ConfigError(f"{what}: relay rank {route.relay} is not on one of the server's GPUs")


def phase_memory(
    arch: Qwen3Config,
    parallel: ParallelConfig,
    ranks: Sequence[RankPlace],
    routes: Sequence[Route],
    servers: Sequence[ServerPlace],
    memory: MemoryModel,
) -> PhaseMemory:
    """Each phase's bytes on its worst GPU: training and rollout from the plan's estimate, the weight
    sync from the rollout phase of each rank's stage plus the buckets that rank holds and the sync's
    NCCL communicators on its GPU (:func:`sync_communicators`)."""
    layout = Layout(parallel.tensor_parallel, parallel.pipeline_parallel, parallel.data_parallel)
    est: Estimate = estimate(arch, layout, memory.work, **memory.options)
    costs: DeviceCosts = memory.options.get("costs", DeviceCosts())
    exporting = {r.source for r in routes}
    relays = {r.relay for r in routes if r.relay is not None}
    copying = {h for r in routes for h in r.handle_ranks if h != r.source} - relays
    sync = 0.0
    for p in ranks:
        buckets = (
            EXPORT_BUCKETS * (p.rank in exporting)
            + COPY_BUCKETS * (p.rank in copying)
            + RELAY_BUCKETS * (p.rank in relays)
        )
        kept = est.kept_while_generating(est.stages[p.pp_rank])
        communicators = costs.communicators(sync_communicators(p, routes, servers))
        sync = max(sync, kept + est.sglang + est.reserve + buckets * memory.bucket_bytes + communicators)
    return PhaseMemory(est.train_phase, est.rollout_phase, sync, est.gpu_memory)


def sync_communicators(place: RankPlace, routes: Sequence[Route], servers: Sequence[ServerPlace]) -> list[int]:
    """The sizes of the NCCL communicators the weight sync adds on ``place``'s GPU: the trainer rank's
    weight-update groups (one per server it feeds over NCCL), its server's handle group and a relay's
    point-to-point pair (CUDA IPC), and the weight-update groups of a colocated server on the GPU
    (one per trainer rank that feeds it over NCCL)."""
    tp_of = {s.endpoint.index: s.endpoint.tp_size for s in servers}
    sizes = [1 + tp_of[r.server] for r in routes if r.transport == "nccl" and r.source == place.rank]
    ipc = [r for r in routes if r.transport == "cuda_ipc"]
    handle_groups = {r.server: r.handle_ranks for r in ipc if len(r.handle_ranks) > 1}
    sizes += [len(ranks) for ranks in handle_groups.values() if place.rank in ranks]
    pairs = {(r.source, r.relay) for r in ipc if r.relay is not None}
    sizes += [2 for pair in pairs if place.rank in pair]
    for server in servers:
        if server.endpoint.node == place.node and place.gpu in server.gpus:
            sizes += [1 + server.endpoint.tp_size] * sum(
                r.transport == "nccl" and r.server == server.endpoint.index for r in routes
            )
    return sizes


def check_node_layout(cfg: TrainConfig, config_path: str | os.PathLike | None) -> None:
    """``stapo train``'s check of the whole layout on this one node, before torchrun starts: on its
    GPUs, or as CPU processes without CUDA; GPU memory from the config's ``plan:`` section."""
    import torch

    from stapo_megatron.trainer.launcher import default_config_path

    on_gpus = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if on_gpus else cfg.parallel.world_size
    plan = plan_section(config_path or default_config_path())
    check_train_layout(cfg, Machines(1, gpus, on_gpus=on_gpus), plan)
