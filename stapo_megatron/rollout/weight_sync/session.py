"""The weight update: every trainer rank pushes its own share, one version reaches every server.

The controller (global rank 0) pauses generation and opens the update before any rank sends; every
rank then sends the buckets it exports over the transport of the plan's mode, along the routes of
:func:`~stapo_megatron.rollout.weight_sync.routes.plan_routes`; afterwards the controller checks,
per server, that every expected tensor arrived exactly once (the per-rank tallies gathered over
``ctx.cpu_group``). Only then does it make the new version the servers' weights and let generation
continue, so no ``/generate`` runs on a mix of versions. A failed check leaves generation paused and
raises the same one-line error on every rank.

A single process holding the whole model (an engine's ``load_weights``, e.g. evaluating a checkpoint)
is the same update with one rank: :meth:`WeightSync.push` packs its stream of (name, tensor) pairs
into the same flat buckets and sends them to every server.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from stapo_megatron.checkpoint.export import (
    BucketLayout,
    FlatBucket,
    TensorSlot,
    iter_rank_buckets,
    pipelined,
    plan_buckets,
    stage_export_plan,
)
from stapo_megatron.config import ConfigError
from stapo_megatron.rollout.engine import RolloutEngine
from stapo_megatron.rollout.server_pool import ServerPool
from stapo_megatron.rollout.sglang_client import SGLangError, SGLangWeightSyncError
from stapo_megatron.rollout.sglang_weights import TensorSerializer
from stapo_megatron.rollout.weight_sync.disk import DiskTransport
from stapo_megatron.rollout.weight_sync.distributed import DistributedTransport
from stapo_megatron.rollout.weight_sync.in_process import gather_to_controller
from stapo_megatron.rollout.weight_sync.plan import CONTROLLER, WeightSyncPlan
from stapo_megatron.rollout.weight_sync.routes import RankPlace, plan_routes
from stapo_megatron.rollout.weight_sync.tensor import TensorTransport
from stapo_megatron.rollout.weight_sync.transport import (
    RankLayouts,
    SyncLink,
    Transport,
    UpdateSession,
    check_tallies,
)

CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The controller's one-line reason to stop, raised on every rank."""

    message: str


def rank_places(ctx, ranks_per_node: int) -> list[RankPlace]:
    """Every rank's place (collective over ``ctx.cpu_group``): node and GPU from the launcher's order
    (global rank // ranks per node, LOCAL_RANK = global rank % ranks per node)."""
    node, gpu = divmod(ctx.rank, ranks_per_node)
    me = RankPlace(ctx.rank, node, gpu, ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, ctx.cp_rank)
    return ctx.all_gather_object(me)


class WeightSync:
    """One trainer's weight sync to a fixed set of servers; :meth:`sync` is collective on every rank.

    Building it is collective too: every rank learns every rank's place and the routes, and the
    transport makes its process groups. ``ranks_per_node``: trainer ranks per node (torchrun's
    LOCAL_WORLD_SIZE by default). ``ctx=None``: this one process is the controller and holds the
    whole model; it sends to every server (:meth:`push`).
    """

    def __init__(
        self,
        ctx,
        plan: WeightSyncPlan,
        *,
        ranks_per_node: int | None = None,
        serializer: TensorSerializer | None = None,
    ):
        self.ctx = ctx
        self.plan = plan
        self.rank = CONTROLLER if ctx is None else ctx.rank
        places = routes = None
        self.exporting = ctx is None
        if ctx is not None:
            places = rank_places(ctx, ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)))
            routes = plan_routes(plan.mode, places, plan.endpoints)  # the same answer, or refusal, on every rank
            sources = {r.source for r in routes}
            # The export gathers over the TP group: a stage exports when any of its TP ranks is a source.
            self.exporting = any(
                (p.pp_rank, p.dp_rank, p.cp_rank) == (ctx.pp_rank, ctx.dp_rank, ctx.cp_rank)
                for p in places
                if p.rank in sources
            )
        self.pool = ServerPool(plan.config, plan.endpoints, plan.api_key)
        self.link = SyncLink(plan, self.pool, ctx, self.rank, places, routes, CPU if ctx is None else ctx.device)
        self.transport: Transport
        if plan.mode == "tensor":
            self.transport = TensorTransport(self.link, serializer)
        elif plan.mode == "distributed":
            self.transport = DistributedTransport(self.link)
        else:
            self.transport = DiskTransport(self.link)
        self.paused = False  # controller: generation was paused by an update that has not succeeded yet

    def sync(self, model: torch.nn.Module, arch, version: int) -> None:
        """Collective: push this rank's share to its servers; the controller checks and resumes them."""
        ctx = self.ctx
        own: list[tuple[int, BucketLayout]] = []
        if self.exporting:
            stage = stage_export_plan(model, arch, ctx.tp_size)
            walk = {id(entry): position for position, entry in enumerate(stage)}
            own = [
                (walk[id(entries[-1])], layout)
                for layout, entries in plan_buckets(stage, ctx.tp_rank, self.plan.bucket_bytes)
            ]
        layouts: RankLayouts = dict(enumerate(ctx.all_gather_object(own)))
        export = functools.partial(iter_rank_buckets, model, arch, ctx, bucket_bytes=self.plan.bucket_bytes)
        buckets = export if self.exporting else None
        self._update(self._planned_names(layouts), layouts, buckets, version)

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        names: Sequence[str] | None = None,
        device: torch.device = CPU,
    ) -> None:
        """One process (``ctx=None``): the whole model as a stream of (HF name, full tensor) pairs, packed
        into buckets on ``device``, to every server. ``names``, when the stream's names are known up
        front, are checked before any server is touched; otherwise they are checked as they arrived."""
        assert self.ctx is None, "push is the single-process update; trainer ranks call sync"
        planned = None if names is None else {s.index: list(names) for s in self.pool.servers}
        self.link.device = device
        self._update(planned, None, lambda: pack_stream(named_tensors, self.plan.bucket_bytes, device), version)

    def _planned_names(self, layouts: RankLayouts) -> dict[int, list[str]]:
        """Per server, the names its routes bring (known before anything is sent)."""
        planned: dict[int, list[str]] = {s.index: [] for s in self.pool.servers}
        for route in self.link.routes or ():
            planned[route.server] += [name for _, layout in layouts[route.source] for name in layout.names]
        return planned

    def _update(
        self,
        planned: dict[int, list[str]] | None,
        layouts: RankLayouts | None,
        buckets: Callable[[], Iterable[FlatBucket]] | None,
        version: int,
    ) -> None:
        session = UpdateSession(version)
        # 1. Before any request: the names each server will get; then generation pauses, the update opens.
        opened = self._decide(lambda: self._prepare(planned, version))
        if isinstance(opened, Refusal):
            raise SGLangWeightSyncError(opened.message)
        # 2. Every rank sends its own buckets, one in flight while the next is prepared.
        try:
            self.transport.prepare(session, opened, layouts)
            if buckets is not None:
                pipelined(self.transport.exported(buckets()), self.transport.send)
        except Exception as err:  # noqa: BLE001 - reported to the controller, raised on every rank below
            session.fail(str(err) if isinstance(err, SGLangError) else f"rank {self.rank}: {type(err).__name__}: {err}")
        finally:
            self.transport.finish()
        # 3. The controller checks what arrived, makes the version the servers' weights, or stops here.
        report = (session.received, session.failures, self.transport.report())
        outcome = self._collect(report, lambda reports: self._finish(reports, version, opened))
        if isinstance(outcome, Refusal):
            raise SGLangWeightSyncError(outcome.message)

    def _decide(self, decide: Callable[[], Any]) -> Any:
        """The controller decides; its answer (or its one-line refusal) is everyone's."""
        return self._collect(None, lambda _: decide())

    def _collect(self, mine, decide: Callable[[list], Any]) -> Any:
        """Gather one object per rank to the controller, which decides; its answer is everyone's."""
        ctx = self.ctx
        gathered = [mine] if ctx is None else [None] * ctx.world_size if ctx.rank == CONTROLLER else None
        if ctx is not None:
            dist.gather_object(mine, gathered, dst=CONTROLLER, group=ctx.cpu_group)
        answer = None
        if self.rank == CONTROLLER:
            assert gathered is not None  # the controller always gathers
            try:
                answer = decide(gathered)
            except (SGLangError, ConfigError) as err:
                answer = Refusal(str(err))
        return answer if ctx is None else ctx.broadcast_object(answer, src=CONTROLLER)

    def _prepare(self, planned: dict[int, list[str]] | None, version: int) -> Any:
        """Controller: check the planned names (when known), pause generation, open the update."""
        pool = self.pool
        if planned is not None:
            check_tallies(self.plan.expected_names, [planned], pool.servers)
        self.paused = True
        pool.run_all(pool.servers, pool.control, "/pause_generation", {"mode": "abort"})
        pool.run_all(pool.servers, pool.flush)
        return self.transport.begin(version)

    def _finish(self, reports: list, version: int, opened: Any) -> Refusal | None:
        """Controller: every server got every name once -> version stamped, generation resumed."""
        pool = self.pool
        failures = [message for _, rank_failures, _ in reports for message in rank_failures]
        try:
            if failures:
                raise SGLangWeightSyncError(failures[0])
            self.transport.commit([(received, extra) for received, _, extra in reports], version, opened)
        except (SGLangError, ConfigError) as err:
            self.transport.abort(opened)
            # Generation stays paused: the servers may hold a mix of old and new weights.
            return Refusal(f"{err} (generation stays paused until a weight sync succeeds)")
        pool.run_all(pool.servers, pool.flush)
        pool.run_all(pool.servers, pool.control, "/continue_generation", {})
        self.paused = False
        return None

    def close(self) -> None:
        self.transport.close()
        self.pool.shutdown()


def pack_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device
) -> Iterator[FlatBucket]:
    """A stream of (Hugging Face name, full tensor) pairs, in order, as flat buckets on ``device`` of at
    most ``bucket_bytes`` (a bigger tensor goes alone), each built as the stream reaches it."""
    pending: list[tuple[str, torch.Tensor]] = []
    filled = index = 0

    def pack() -> FlatBucket:
        slots: list[TensorSlot] = []
        offsets: dict[torch.dtype, int] = {}
        for name, tensor in pending:
            slot = TensorSlot(name, tensor.dtype, tuple(tensor.shape), offsets.get(tensor.dtype, 0))
            offsets[tensor.dtype] = slot.offset + slot.numel
            slots.append(slot)
        bucket = FlatBucket.allocate(BucketLayout(index, tuple(slots)), device)
        for slot, (_, tensor) in zip(slots, pending):
            bucket.view(slot).copy_(tensor)
        return bucket

    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise SGLangWeightSyncError(f"weight stream items must be (name, tensor) pairs, got {item!r:.80}")
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise SGLangWeightSyncError(f"weight '{name}' is a {type(tensor).__name__}, not a torch.Tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if pending and filled + nbytes > bucket_bytes:
            yield pack()
            pending, filled, index = [], 0, index + 1
        pending.append((name, tensor))
        filled += nbytes
    if pending:
        yield pack()


def sync_engine_weights(
    ctx, model: torch.nn.Module, arch, engine: RolloutEngine | None, version: int, sync: WeightSync | None
) -> WeightSync | None:
    """The trainer's weight sync, collective on every rank; ``engine`` is the controller's (None elsewhere).

    An engine with a :meth:`~stapo_megatron.rollout.engine.RolloutEngine.weight_sync_plan` (SGLang
    servers): every rank pushes its own share (:class:`WeightSync`, kept and returned for the next
    call while the plan stays the same). Without one (an in-process engine on the controller): every
    rank's buckets go to it over gloo (:func:`gather_to_controller`). Returns the sync to pass next time.
    """
    plan: WeightSyncPlan | str | None = None
    if ctx.rank == CONTROLLER:
        try:
            plan = _controller_engine(engine).weight_sync_plan()
        except (SGLangError, ConfigError) as err:
            plan = str(err)  # raised on every rank below, not only here while the others wait
    plan = ctx.broadcast_object(plan, src=CONTROLLER)
    if isinstance(plan, str):
        raise SGLangWeightSyncError(plan)
    if plan is None:
        gather_to_controller(ctx, model, arch, lambda stream: _controller_engine(engine).load_weights(stream, version))
        return None
    if sync is not None and sync.plan != plan:
        sync.close()
        sync = None
    if sync is None:
        sync = WeightSync(ctx, plan)
    sync.sync(model, arch, version)
    if ctx.rank == CONTROLLER:
        _controller_engine(engine).weights_synced(version)
    return sync


def _controller_engine(engine: RolloutEngine | None) -> RolloutEngine:
    assert engine is not None, "the controller holds the engine"
    return engine
