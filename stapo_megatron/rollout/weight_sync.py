"""Weight sync from every trainer rank to the SGLang servers, with no gather to rank 0.

Every rank exports its own share of the Hugging Face tensors
(:func:`stapo_megatron.checkpoint.export.iter_rank_buckets`) and pushes its flat buckets straight
to the servers it is routed to, bucket k+1 being prepared while bucket k is in flight:

* ``tensor`` (colocated): CUDA IPC handles through ``/update_weights_from_tensor``, one entry per
  server TP rank, to the servers on the rank's own node (served by a replica that lives on it);
* ``distributed``: NCCL broadcasts through ``/update_weights_from_distributed``, over one small
  group per (trainer rank, server) pair, so senders never wait on each other;
* ``disk``: each rank writes its buckets as safetensors files into one shared directory; the
  controller writes the index and calls ``/update_weights_from_disk`` on every server.

A single process holding the whole model (an engine's ``load_weights``, e.g. evaluating a
checkpoint) is the same update with one rank: :meth:`WeightSync.push` packs its stream of
(name, tensor) pairs into the same flat buckets and sends them to every server.

The controller (global rank 0) pauses generation and opens the servers' update sessions before any
rank sends, and afterwards checks, per server, that every expected tensor arrived exactly once (the
per-rank tallies gathered over ``ctx.cpu_group``). Only then does it stamp the new weight version on
every server and let generation continue, so no ``/generate`` runs on a mix of versions. A failed
check leaves generation paused and raises the same one-line error on every rank.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import queue
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stapo_megatron.checkpoint.export import (
    DEFAULT_BUCKET_BYTES,
    BucketLayout,
    FlatBucket,
    TensorSlot,
    iter_rank_buckets,
    pipelined,
    plan_buckets,
    rank_export_names,
    stage_export_plan,
)
from stapo_megatron.config import ConfigError
from stapo_megatron.rollout.endpoints import ServerEndpoint
from stapo_megatron.rollout.server_pool import control_reply
from stapo_megatron.rollout.sglang_client import (
    SGLangError,
    SGLangRequestError,
    SGLangServerError,
    SGLangWeightSyncError,
    TransportError,
    request,
    split_url,
)
from stapo_megatron.rollout.sglang_weights import (
    TensorSerializer,
    WeightUpdateGroup,
    local_address_towards,
    preview_names,
    publish_checkpoint,
    sglang_tensor_serializer,
    write_bucket_file,
)

logger = logging.getLogger(__name__)
CPU = torch.device("cpu")

SYNC_MODES = ("tensor", "distributed", "disk")
CONTROLLER = 0  # global rank that pauses, checks and resumes the servers


@dataclasses.dataclass(frozen=True)
class WeightSyncPlan:
    """What every trainer rank needs to push its shards; the controller builds it and broadcasts it."""

    mode: str
    endpoints: tuple[ServerEndpoint, ...]
    expected_names: frozenset[str]
    api_key: str | None
    session_servers: frozenset[int] = frozenset()  # indices of servers with /begin_weight_update (0.5.21+)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    control_timeout_s: float = 120.0
    transfer_timeout_s: float = 600.0
    flush_timeout_s: float = 60.0
    group_backend: str = "nccl"
    master_address: str = ""  # distributed: this node's address as servers see it; "" = the route to the server
    disk_dir: str = ""  # disk: a directory every node and server can read
    config_from: str = ""  # disk: the HF directory whose *.json files go next to the weights
    server_restarts: int = 0  # a restarted server left its weight-update groups: a new count means new groups

    def __post_init__(self):
        if self.mode not in SYNC_MODES:
            raise ConfigError(f"weight_sync: must be one of {', '.join(SYNC_MODES)}, got {self.mode!r}")
        if not self.endpoints:
            raise ConfigError("weight_sync: no rollout servers to send weights to")
        if self.mode == "disk" and not self.disk_dir:
            raise ConfigError("disk_sync_dir: required for weight_sync disk across ranks (a directory all nodes share)")
        if self.bucket_bytes < 1:
            raise ConfigError(f"weight_bucket_bytes: must be >= 1, got {self.bucket_bytes}")


@dataclasses.dataclass(frozen=True)
class RankPlace:
    rank: int
    node: int
    dp_rank: int
    cp_rank: int


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The controller's one-line reason to stop, raised on every rank."""

    message: str


class UpdateSession:
    """One weight update as this rank sees it: the version and, per server, the names it confirmed."""

    def __init__(self, version: int, expected: frozenset[str]):
        self.version = version
        self.expected = expected
        self.received: dict[int, list[str]] = {}

    def confirm(self, server: int, names: Sequence[str]) -> None:
        self.received.setdefault(server, []).extend(names)


def name_problems(expected: frozenset[str], names: Iterable[str]) -> str:
    """What is wrong with one server's update: missing, repeated or unexpected names ("" = nothing).

    SGLang only logs a warning for a name it does not know, so a typo would leave the old tensor in
    place while training goes on: every name must be expected and arrive once, and all must arrive.
    """
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    unknown = set(counts) - expected
    missing = expected - set(counts)
    twice = {name for name, count in counts.items() if count > 1}
    problems = []
    if missing:
        problems.append(f"lacks {len(missing)} of {len(expected)} tensors: {preview_names(missing)}")
    if twice:
        problems.append(f"got {len(twice)} tensors more than once: {preview_names(twice)}")
    if unknown:
        problems.append(f"got {len(unknown)} unexpected tensors (SGLang ignores them): {preview_names(unknown)}")
    return "; ".join(problems)


def check_tallies(
    expected: frozenset[str], tallies: Sequence[dict[int, list[str]]], servers: Sequence[ServerEndpoint]
) -> None:
    """Every server received every expected name exactly once (over all ranks), nothing else: or one line."""
    for server in servers:
        problems = name_problems(expected, (name for tally in tallies for name in tally.get(server.index, ())))
        if problems:
            raise SGLangWeightSyncError(f"weight sync to {server.url} " + problems)


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def route(plan: WeightSyncPlan, places: Sequence[RankPlace], me: RankPlace) -> list[ServerEndpoint]:
    """The servers this rank sends its share to (the same answer on every rank for every rank).

    Each server is served by one model replica (``dp_rank``; context-parallel ranks beyond the first
    hold the same weights and send nothing). ``tensor``: a server is served by a replica all of whose
    ranks are on the server's node, spread over such replicas; ``distributed``: server i by replica
    i mod dp; ``disk``: replica 0 writes, the controller notifies the servers.
    """
    if me.cp_rank != 0:
        return []
    dp_size = 1 + max(p.dp_rank for p in places)
    if plan.mode == "disk":
        return list(plan.endpoints) if me.dp_rank == 0 else []
    if plan.mode == "distributed":
        return [s for i, s in enumerate(plan.endpoints) if i % dp_size == me.dp_rank]
    nodes_of_replica: dict[int, set[int]] = {}
    for p in places:
        nodes_of_replica.setdefault(p.dp_rank, set()).add(p.node)
    mine = []
    position: dict[int, int] = {}
    for server in plan.endpoints:
        local = sorted(d for d, nodes in nodes_of_replica.items() if nodes == {server.node})
        if not local:
            raise ConfigError(
                f"weight_sync tensor: server {server.url} on node {server.node} has no trainer replica wholly on its "
                "node (CUDA IPC cannot cross nodes); fit tensor x pipeline parallel in one node or use 'distributed'"
            )
        k = position.get(server.node, 0)
        position[server.node] = k + 1
        if local[k % len(local)] == me.dp_rank:
            mine.append(server)
    return mine


class ServerControl:
    """The HTTP calls one rank makes to the servers (POST with the plan's key, errors as one line)."""

    def __init__(self, plan: WeightSyncPlan, pool: cf.ThreadPoolExecutor):
        self.plan = plan
        self.pool = pool

    def post(self, server: ServerEndpoint, path: str, body: Any = None, timeout: float | None = None) -> Any:
        try:
            resp = request(
                server.url,
                "POST",
                path,
                {} if body is None else body,
                api_key=self.plan.api_key,
                timeout=timeout or self.plan.control_timeout_s,
            )
        except TransportError as err:
            raise SGLangServerError(f"sglang server {server.url}: {err}") from None
        return control_reply(server.url, path, resp)

    def flush(self, server: ServerEndpoint) -> None:
        """/flush_cache, retried while it answers 400 (requests still running)."""
        deadline = time.monotonic() + self.plan.flush_timeout_s
        delay = 0.02
        while True:
            try:
                self.post(server, "/flush_cache")
                return
            except SGLangRequestError as err:
                if err.status != 400 or time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def on_all(self, servers: Sequence[ServerEndpoint], fn: Callable[..., Any], *args: Any) -> None:
        """``fn(server, *args)`` on every server at once; waits for all, then raises the first error."""
        futures = [self.pool.submit(fn, s, *args) for s in servers]
        cf.wait(futures)
        for future in futures:
            future.result()


def await_transfer(futures: Sequence[cf.Future], works: Sequence[Any], timeout_s: float, what: str) -> None:
    """Wait for HTTP replies and collective works together; fail fast when a reply is an error
    (a server that refuses a bucket never posts its receives, so the broadcasts alone would hang)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while True:
        for future in futures:
            error = future.exception() if future.done() else None
            if error is not None:
                raise error
        if all(f.done() for f in futures) and all(w.is_completed() for w in works):
            break
        if time.monotonic() > deadline:
            raise SGLangWeightSyncError(f"{what} did not finish within {timeout_s:g}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    for work in works:
        work.wait()


# ---- the three ways a bucket reaches a server ------------------------------------------------------


class TensorSender:
    """CUDA IPC: one ``serialized_named_tensors`` entry per server TP rank, views into the flat buffers
    (one IPC handle per buffer); the bucket stays alive until every server answered."""

    def __init__(self, control: ServerControl, serializer: TensorSerializer | None):
        self.control = control
        self.serializer = serializer

    def send(self, servers: Sequence[ServerEndpoint], bucket: FlatBucket, session: UpdateSession) -> None:
        if self.serializer is None:
            self.serializer = sglang_tensor_serializer()
        if any(b.is_cuda for b in bucket.buffers.values()):
            # The servers read through IPC on their own streams: the copies into the bucket must be done.
            torch.cuda.synchronize()
        payload = self.serializer(bucket.named_tensors())

        def send_one(server: ServerEndpoint) -> None:
            body = {"serialized_named_tensors": [payload] * server.tp_size, "flush_cache": False}
            self.control.post(server, "/update_weights_from_tensor", body, self.control.plan.transfer_timeout_s)
            session.confirm(server.index, bucket.layout.names)

        self.control.on_all(servers, send_one)

    def close(self) -> None:
        pass


class DistributedSender:
    """Broadcasts over one group per (this rank, server): a sender never waits for another sender,
    and a server's serial request loop only ever waits for the one rank whose request it runs."""

    def __init__(self, control: ServerControl, rank: int):
        self.control = control
        self.rank = rank
        self.groups: dict[int, WeightUpdateGroup] = {}

    def connect(self, servers: Sequence[ServerEndpoint]) -> None:
        plan = self.control.plan
        for server in servers:
            if server.index in self.groups:
                continue
            address = plan.master_address or local_address_towards(split_url(server.url)[1])
            group = WeightUpdateGroup(
                master_address=address,
                port=0,
                world_size=1 + server.tp_size,
                backend=plan.group_backend,
                timeout_s=plan.transfer_timeout_s,
                name=f"stapo-weights-r{self.rank}-s{server.index}-{secrets.token_hex(4)}",
            )
            body = {
                "master_address": address,
                "master_port": group.port,
                "rank_offset": 1,
                "world_size": 1 + server.tp_size,
                "group_name": group.name,
                "backend": plan.group_backend,
            }
            # The init call blocks until every member joined: join while it is in flight.
            futures = [
                self.control.pool.submit(
                    self.control.post, server, "/init_weights_update_group", body, plan.transfer_timeout_s
                ),
                self.control.pool.submit(group.join),
            ]
            try:
                await_transfer(futures, [], plan.transfer_timeout_s, f"joining weight-update group {group.name}")
            except BaseException:
                group.destroy()
                raise
            self.groups[server.index] = group

    def send(self, servers: Sequence[ServerEndpoint], bucket: FlatBucket, session: UpdateSession) -> None:
        plan = self.control.plan
        named = (
            [(name, self.groups[servers[0].index].prepare(t)) for name, t in bucket.named_tensors()] if servers else []
        )
        body_base = {
            "names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "flush_cache": False,
        }
        futures, works = [], []
        for server in servers:
            group = self.groups[server.index]
            futures.append(
                self.control.pool.submit(
                    self.control.post,
                    server,
                    "/update_weights_from_distributed",
                    {**body_base, "group_name": group.name},
                    plan.transfer_timeout_s,
                )
            )
            # The server posts one receive per name, in order: match that order.
            works.extend(group.broadcast([t for _, t in named]))
        await_transfer(
            futures, works, plan.transfer_timeout_s, f"weight bucket {bucket.layout.index} of rank {self.rank}"
        )
        for server in servers:
            session.confirm(server.index, bucket.layout.names)

    def close(self) -> None:
        for index, group in self.groups.items():
            server = next(s for s in self.control.plan.endpoints if s.index == index)
            try:
                self.control.post(server, "/destroy_weights_update_group", {"group_name": group.name}, 30.0)
            except SGLangError as err:
                logger.warning("weight sync: destroy_weights_update_group on %s: %s", server.url, err)
            group.destroy()
        self.groups.clear()


class DiskSender:
    """Each rank writes its buckets as ``rank<r>-<k>.safetensors`` into the update's shared directory."""

    def __init__(self, rank: int):
        self.rank = rank
        self.directory: Path | None = None
        self.files: list[tuple[str, list[str], int]] = []  # (file name, tensor names, tensor bytes)

    def send(self, servers: Sequence[ServerEndpoint], bucket: FlatBucket, session: UpdateSession) -> None:
        assert self.directory is not None
        fname = f"rank{self.rank:05d}-{bucket.layout.index:05d}.safetensors"
        write_bucket_file(self.directory / fname, bucket.named_tensors())
        self.files.append((fname, bucket.layout.names, bucket.nbytes))
        for server in servers:
            session.confirm(server.index, bucket.layout.names)

    def close(self) -> None:
        pass


# ---- one process's stream -------------------------------------------------------------------------


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


# ---- the collective -------------------------------------------------------------------------------


class WeightSync:
    """One trainer's weight sync to a fixed set of servers; :meth:`sync` is collective on every rank.

    ``ranks_per_node``: trainer ranks per node (torchrun's LOCAL_WORLD_SIZE by default), which places
    each rank next to the servers of its node. ``ctx=None``: this one process is the controller and
    holds the whole model; it sends to every server (:meth:`push`).
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
        if ctx is None:
            self.targets = list(plan.endpoints)
        else:
            per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
            me = RankPlace(ctx.rank, node_of(ctx.rank, per_node), ctx.dp_rank, ctx.cp_rank)
            places = [me] * ctx.world_size  # every rank's place once gathered
            dist.all_gather_object(places, me, group=ctx.cpu_group)
            self.targets = route(plan, places, me)
        self._pool = cf.ThreadPoolExecutor(
            max_workers=2 * len(plan.endpoints) + 2, thread_name_prefix="stapo-weight-sync"
        )
        self.control = ServerControl(plan, self._pool)
        if plan.mode == "tensor":
            self.sender: TensorSender | DistributedSender | DiskSender = TensorSender(self.control, serializer)
        elif plan.mode == "distributed":
            self.sender = DistributedSender(self.control, self.rank)
        else:
            self.sender = DiskSender(self.rank)
        self.paused = False  # controller: generation was paused by an update that has not succeeded yet
        self._previous_disk: Path | None = None

    def sync(self, model: torch.nn.Module, arch, version: int) -> None:
        """Collective: push this rank's share to its servers; the controller checks and resumes them."""
        ctx = self.ctx
        names = rank_export_names(model, arch, ctx.tp_size, ctx.tp_rank)
        self._update(names, lambda: iter_rank_buckets(model, arch, ctx, bucket_bytes=self.plan.bucket_bytes), version)

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
        self._update(names, lambda: pack_stream(named_tensors, self.plan.bucket_bytes, device), version)

    def _update(self, names: Sequence[str] | None, buckets: Callable[[], Iterable[FlatBucket]], version: int) -> None:
        plan = self.plan
        session = UpdateSession(version, plan.expected_names)
        # 1. Before any request: the names each rank will send, checked per server on the controller.
        planned = None if names is None else {s.index: list(names) for s in self.targets}
        go = self._collect(planned, lambda tallies: self._prepare(tallies, version))
        if isinstance(go, Refusal):
            raise SGLangWeightSyncError(go.message)
        # 2. Every rank sends its own buckets to its servers, one bucket in flight.
        error = ""
        try:
            if isinstance(self.sender, DistributedSender):
                self.sender.connect(self.targets)
            if isinstance(self.sender, DiskSender):
                self.sender.directory, self.sender.files = Path(go), []
            if self.targets:  # a whole replica has targets or none (route), so its TP groups stay in step
                pipelined(buckets(), lambda bucket: self.sender.send(self.targets, bucket, session))
        except Exception as err:  # noqa: BLE001 - reported to the controller, raised on every rank below
            error = str(err) if isinstance(err, SGLangError) else f"rank {self.rank}: {type(err).__name__}: {err}"
        # 3. The controller checks what arrived, stamps the version and resumes, or stops here.
        files = self.sender.files if isinstance(self.sender, DiskSender) else []
        outcome = self._collect((session.received, error, files), lambda reports: self._finish(reports, version, go))
        if isinstance(outcome, Refusal):
            raise SGLangWeightSyncError(outcome.message)

    def _collect(self, mine, decide: Callable[[list], Any]):
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

    def _prepare(self, tallies: list[dict[int, list[str]] | None], version: int) -> Any:
        """Controller: check the planned names (when known), pause generation, open the sessions (disk: the
        directory)."""
        plan, control = self.plan, self.control
        known = [tally for tally in tallies if tally is not None]
        if len(known) == len(tallies):
            check_tallies(plan.expected_names, known, plan.endpoints)
        servers = list(plan.endpoints)
        self.paused = True
        control.on_all(servers, control.post, "/pause_generation", {"mode": "abort"})
        control.on_all(servers, control.flush)
        if plan.mode == "disk":
            staging = Path(plan.disk_dir) / f".weights-{version}-{secrets.token_hex(4)}.partial"
            staging.mkdir(parents=True)
            return str(staging)
        control.on_all(
            [s for s in servers if s.index in plan.session_servers], control.post, "/begin_weight_update", {}
        )
        return True

    def _finish(self, reports: list, version: int, go: Any) -> Refusal | None:
        """Controller: every server got every name once -> version stamped, generation resumed."""
        plan, control = self.plan, self.control
        servers = list(plan.endpoints)
        failures = [error for _, error, _ in reports if error]
        try:
            if failures:
                raise SGLangWeightSyncError(failures[0])
            if plan.mode == "disk":
                files = [entry for _, _, rank_files in reports for entry in rank_files]
                written = [name for _, names, _ in files for name in names]
                check_tallies(plan.expected_names, [{s.index: written for s in servers}], servers)
                weight_map = {name: fname for fname, names, _ in files for name in names}
                total = sum(nbytes for _, _, nbytes in files)
                final = publish_checkpoint(Path(go), weight_map, total, config_from=plan.config_from or None)
                body = {"model_path": str(final), "flush_cache": False, "weight_version": str(version)}
                control.on_all(servers, control.post, "/update_weights_from_disk", body, plan.transfer_timeout_s)
                if self._previous_disk is not None and self._previous_disk != final:
                    shutil.rmtree(self._previous_disk, ignore_errors=True)
                self._previous_disk = final
            else:
                check_tallies(plan.expected_names, [received for received, _, _ in reports], servers)
                self._end_sessions()
                control.on_all(
                    servers,
                    control.post,
                    "/update_weight_version",
                    {"new_version": str(version), "abort_all_requests": False},
                )
        except (SGLangError, ConfigError) as err:
            if plan.mode == "disk":
                shutil.rmtree(go, ignore_errors=True)
            else:
                self._end_sessions(best_effort=True)
            # Generation stays paused: the servers may hold a mix of old and new weights.
            return Refusal(f"{err} (generation stays paused until a weight sync succeeds)")
        control.on_all(servers, control.flush)
        control.on_all(servers, control.post, "/continue_generation", {})
        self.paused = False
        return None

    def _end_sessions(self, best_effort: bool = False) -> None:
        servers = [s for s in self.plan.endpoints if s.index in self.plan.session_servers]
        if not best_effort:
            self.control.on_all(servers, self.control.post, "/end_weight_update", {})
            return
        for server in servers:
            try:
                self.control.post(server, "/end_weight_update", {}, 30.0)
            except SGLangError as err:
                logger.warning("weight sync: /end_weight_update on %s after a failed update: %s", server.url, err)

    def close(self) -> None:
        self.sender.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---- an in-process engine on the controller (the CPU path) -----------------------------------------

_HEADER_TAG, _PAYLOAD_TAG = 1, 2


def gather_to_controller(
    ctx,
    model: torch.nn.Module,
    arch,
    consume: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Feed an engine that lives in the controller's process (the local engine) with every rank's
    buckets, over gloo. Collective on every rank; ``consume`` runs on the controller only.

    Each rank of the first replica exports its own share (as for the servers); the others send their
    buckets to the controller, which takes them in whatever order they come (a rank that waits for
    its turn while its TP peers wait for it in a gather would deadlock), next to its own.
    """
    sends = ctx.dp_rank == 0 and ctx.cp_rank == 0  # the other replicas hold the same weights
    layouts = []
    if sends:
        layouts = [
            layout for layout, _ in plan_buckets(stage_export_plan(model, arch, ctx.tp_size), ctx.tp_rank, bucket_bytes)
        ]
    gathered: list[Any] | None = [None] * ctx.world_size if ctx.rank == CONTROLLER else None  # (rank, layouts)
    dist.gather_object((ctx.rank, layouts), gathered, dst=CONTROLLER, group=ctx.cpu_group)
    if not sends:
        return
    buckets = iter_rank_buckets(model, arch, ctx, bucket_bytes=bucket_bytes)
    if ctx.rank != CONTROLLER:
        for bucket in buckets:
            dist.send(torch.tensor([bucket.layout.index]), dst=CONTROLLER, group=ctx.cpu_group, tag=_HEADER_TAG)
            for buffer in bucket.buffers.values():
                dist.send(buffer.cpu().view(torch.uint8), dst=CONTROLLER, group=ctx.cpu_group, tag=_PAYLOAD_TAG)
        return
    assert gathered is not None  # the controller's gather list
    remote = {rank: rank_layouts for rank, rank_layouts in gathered if rank != CONTROLLER}
    consume(_controller_stream(ctx, buckets, remote))


def _controller_stream(ctx, own: Iterator[FlatBucket], remote: dict[int, list]) -> Iterator[tuple[str, torch.Tensor]]:
    """The controller's own buckets and the other ranks' as one stream of (name, tensor) views."""
    ready: queue.Queue = queue.Queue(maxsize=2)
    done = object()

    def produce_own() -> None:
        try:
            if ctx.device.type == "cuda":
                torch.cuda.set_device(ctx.device)
            for bucket in own:
                ready.put(bucket)
        except BaseException as err:  # noqa: BLE001 - handed to the consuming thread
            ready.put(err)
        ready.put(done)

    def receive_remote() -> None:
        try:
            for _ in range(sum(len(layouts) for layouts in remote.values())):
                header = torch.empty(1, dtype=torch.int64)
                src = dist.recv(header, src=None, group=ctx.cpu_group, tag=_HEADER_TAG)
                layout = remote[src][int(header.item())]
                bucket = FlatBucket.allocate(layout, CPU)
                for buffer in bucket.buffers.values():
                    dist.recv(buffer.view(torch.uint8), src=src, group=ctx.cpu_group, tag=_PAYLOAD_TAG)
                ready.put(bucket)
        except BaseException as err:  # noqa: BLE001 - handed to the consuming thread
            ready.put(err)
        ready.put(done)

    threads = [threading.Thread(target=fn, daemon=True) for fn in (produce_own, receive_remote)]
    for thread in threads:
        thread.start()
    finished = 0
    while finished < len(threads):
        item = ready.get()
        if item is done:
            finished += 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield from item.named_tensors()
    for thread in threads:
        thread.join()


def sync_engine_weights(
    ctx, model: torch.nn.Module, arch, engine, version: int, sync: WeightSync | None
) -> WeightSync | None:
    """The trainer's weight sync, collective on every rank; ``engine`` is the controller's (None elsewhere).

    SGLang servers: every rank pushes its own share (:class:`WeightSync`, kept and returned for the
    next call while the plan stays the same). An in-process engine on the controller: every rank's
    buckets go to it over gloo (:func:`gather_to_controller`). Returns the sync to pass next time.
    """
    from stapo_megatron.rollout.sglang_engine import SGLangEngine

    plan: WeightSyncPlan | str | None = None
    if ctx.rank == CONTROLLER and isinstance(engine, SGLangEngine):
        try:
            plan = engine.weight_sync_plan()
        except (SGLangError, ConfigError) as err:
            plan = str(err)  # raised on every rank below, not only here while the others wait
    plan = ctx.broadcast_object(plan, src=CONTROLLER)
    if isinstance(plan, str):
        raise SGLangWeightSyncError(plan)
    if plan is None:
        gather_to_controller(ctx, model, arch, lambda stream: engine.load_weights(stream, version=version))
        return None
    if sync is not None and sync.plan != plan:
        sync.close()
        sync = None
    if sync is None:
        sync = WeightSync(ctx, plan)
    sync.sync(model, arch, version)
    if ctx.rank == CONTROLLER:
        engine.weights_synced(version)
    return sync
