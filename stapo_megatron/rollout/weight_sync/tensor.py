"""CUDA IPC sync: ``/update_weights_from_tensor`` with one ``serialized_named_tensors`` entry per server
TP rank, entry j an IPC handle made on the server's TP rank j GPU by the trainer rank on it.

Per route (:func:`~stapo_megatron.rollout.weight_sync.routes.plan_routes`) and bucket: a source that
is not on the server's GPUs sends the bucket point to point to a relay that is (over the world
group, whose backend serves the device's tensors: a stage on another node arrives this way); the
source or relay broadcasts it over the server's group of handle ranks; each handle rank serializes
its own copy; the handles go over gloo to the posting rank (the first handle rank), which posts
them and tells the others when the server has answered, so every copy stays alive until then.

Each rank does its part of every transfer on one thread, in one order that every rank computes
alike (by where each bucket is complete in its stage's export walk): the collectives of a transfer
then never wait on a rank busy with a later one, and the export walks, which gather over the TP
groups on the main thread meanwhile, are never held up by a transfer they have not reached. A
server that refuses a bucket is told nothing more in this update, but every rank still moves the
remaining buckets, so no collective is left half done.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import torch
import torch.distributed as dist

from stapo_megatron.checkpoint.export import BucketLayout, FlatBucket
from stapo_megatron.rollout.server_pool import PooledServer
from stapo_megatron.rollout.sglang_client import SGLangError, SGLangWeightSyncError
from stapo_megatron.rollout.sglang_weights import TensorSerializer, serialize_for_ipc
from stapo_megatron.rollout.weight_sync.routes import Route
from stapo_megatron.rollout.weight_sync.transport import (
    RankLayouts,
    SessionTransport,
    SyncLink,
    UpdateSession,
    finish_transfers,
    transfer_stream,
    wait_for,
)


def synchronize_for_ipc(bucket: FlatBucket) -> None:
    """One process (no collective in flight): the server reads a handle on its own streams, so the copies
    into the bucket must be done, on the bucket's own GPU (a bare ``torch.cuda.synchronize()`` on a
    worker thread waits on cuda:0)."""
    for device in {buffer.device for buffer in bucket.buffers.values() if buffer.is_cuda}:
        torch.cuda.synchronize(device)


def release_ipc_memory(device: torch.device) -> None:
    """After the servers answered: free the CUDA blocks whose IPC handles they have closed, so that
    ``empty_cache`` can return the buckets' memory."""
    if device.type == "cuda":
        torch.cuda.ipc_collect()


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One bucket of one route."""

    order: tuple[int, ...]  # the same on every rank
    route: Route
    layout: BucketLayout


class _Handoff:
    """Buckets from the export (pipelined worker thread) to the transfer thread: a bucket offered stays
    with its sender until every transfer of it is done."""

    def __init__(self, uses: dict[int, int]):
        self.uses = dict(uses)  # bucket index -> transfers still to use it
        self.ready: dict[int, FlatBucket] = {}
        self.broken = False
        self.changed = threading.Condition()

    def offer(self, bucket: FlatBucket) -> None:
        index = bucket.layout.index
        with self.changed:
            if not self.uses.get(index):
                return
            self.ready[index] = bucket
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.broken or not self.uses[index])
            self.ready.pop(index, None)
            if self.broken:
                raise SGLangWeightSyncError("the weight transfer thread stopped; see its error")

    def take(self, index: int) -> FlatBucket:
        with self.changed:
            self.changed.wait_for(lambda: self.broken or index in self.ready)
            if self.broken:
                raise SGLangWeightSyncError("the export stopped before this bucket")
            return self.ready[index]

    def used(self, index: int) -> None:
        with self.changed:
            self.uses[index] -= 1
            self.changed.notify_all()

    def abandon(self) -> None:
        with self.changed:
            self.broken = True
            self.changed.notify_all()


class TensorTransport(SessionTransport):
    def __init__(self, link: SyncLink, serializer: TensorSerializer | None = None):
        super().__init__(link)
        self.serializer = serializer or serialize_for_ipc
        # server index -> (device group, gloo group) of its handle ranks, on the ranks in it: made once,
        # collectively (every rank creates every group, in server order).
        self.handle_groups: dict[int, tuple[Any, Any]] = {}
        if link.routes is not None:
            handles = {r.server: r.handle_ranks for r in link.routes}
            gloo_is_default = dist.get_backend() == "gloo"
            for server in link.pool.servers:
                ranks = list(handles[server.index])
                if len(ranks) < 2:
                    continue
                group = dist.new_group(ranks)
                cpu = group if gloo_is_default else dist.new_group(ranks, backend="gloo")
                if link.rank in ranks:
                    self.handle_groups[server.index] = (group, cpu)
        self.handoff = _Handoff({})
        self.thread: threading.Thread | None = None
        self.refused: set[int] = set()  # servers that refused a bucket of this update (posting rank)

    def prepare(self, update: UpdateSession, opened: Any, layouts: RankLayouts | None) -> None:
        super().prepare(update, opened, layouts)
        self.refused = set()
        if self.link.routes is None:
            return
        assert layouts is not None and self.link.places is not None  # a multi-rank update has both
        place = {p.rank: p for p in self.link.places}
        transfers = []
        for route in self.link.routes:
            source = place[route.source]
            for position, layout in layouts[route.source]:
                order = (position, source.pp_rank, source.dp_rank, source.tp_rank, layout.index, route.server)
                transfers.append(Transfer(order, route, layout))
        me = self.link.rank
        mine = sorted(
            (t for t in transfers if me in (t.route.source, t.route.relay, *t.route.handle_ranks)),
            key=lambda t: t.order,
        )
        self.handoff = _Handoff(collections.Counter(t.layout.index for t in mine if t.route.source == me))
        self.thread = threading.Thread(target=self._serve, args=(mine,), name="stapo-ipc-transfer", daemon=True)
        self.thread.start()

    def send(self, bucket: FlatBucket) -> None:
        if self.link.routes is not None:
            self.handoff.offer(bucket)
            return
        # One process, every server: TP rank j's handle from the server's GPU j when it is known here.
        pool = self.link.pool

        def send_one(server: PooledServer) -> None:
            gpus = server.endpoint.gpu_ids if bucket_is_cuda(bucket) else ()
            copies = [_copy_to(bucket, torch.device("cuda", gpu)) for gpu in gpus] or [bucket]
            for copy in copies:
                synchronize_for_ipc(copy)
            # An entry per TP rank, each serialized for its one receiver (serialize_for_ipc); the GPUs
            # of an attached server are unknown here, so its TP ranks share one copy.
            per_copy = 1 if len(copies) > 1 else server.tp_size
            payloads = [self.serializer(copy.named_tensors()) for copy in copies for _ in range(per_copy)]
            body = {"serialized_named_tensors": payloads, "flush_cache": False}
            pool.control(server, "/update_weights_from_tensor", body, self.link.plan.transfer_timeout_s)
            self.update.confirm(server.index, bucket.layout.names)

        pool.run_all(self.link.targets(), send_one)

    def finish(self) -> None:
        if self.thread is not None:
            self.handoff.abandon()  # only a transfer still waiting for a bucket the export never made stops here
            self.thread.join()
            self.thread = None
        release_ipc_memory(self.link.device)

    def close(self) -> None:
        for group, cpu in self.handle_groups.values():
            dist.destroy_process_group(group)
            if cpu is not group:
                dist.destroy_process_group(cpu)
        self.handle_groups.clear()

    # ---- the transfer thread

    def _serve(self, transfers: list[Transfer]) -> None:
        try:
            with transfer_stream(self.link.device):
                for transfer in transfers:
                    self._transfer(transfer)
        except BaseException as err:  # noqa: BLE001 - reported to the controller, raised on every rank
            self.update.fail(f"rank {self.link.rank}: {type(err).__name__}: {err}")
            self.handoff.abandon()

    def _transfer(self, transfer: Transfer) -> None:
        route, me, world = transfer.route, self.link.rank, self.link.ctx.world_group
        index = transfer.layout.index
        copy: FlatBucket | None = None
        if route.source == me:
            copy = self.handoff.take(index)
            wait_for(self.ready[index])
            if route.relay is not None:
                for buffer in copy.buffers.values():
                    dist.send(buffer, dst=route.relay, group=world)
                self.handoff.used(index)
                return  # a relayed source is not on the server's GPUs
        elif route.relay == me:
            copy = FlatBucket.allocate(transfer.layout, self.link.device)
            for buffer in copy.buffers.values():
                dist.recv(buffer, src=route.source, group=world)
        self._load(transfer, copy)
        if route.source == me:
            self.handoff.used(index)

    def _load(self, transfer: Transfer, copy: FlatBucket | None) -> None:
        """This handle rank's part of one bucket to one server; returns when the server answered."""
        route, me = transfer.route, self.link.rank
        handles = route.handle_ranks
        if copy is None:
            copy = FlatBucket.allocate(transfer.layout, self.link.device)
        groups = self.handle_groups.get(route.server)
        if groups is not None:
            origin = route.source if route.relay is None else route.relay
            for buffer in copy.buffers.values():
                dist.broadcast(buffer, src=origin, group=groups[0])
        finish_transfers(self.link.device)
        try:
            entry: tuple[bool, str] = (True, self.serializer(copy.named_tensors()))
        except Exception as err:  # noqa: BLE001 - the posting rank reports it
            entry = (False, f"rank {me}: serializing a weight bucket for CUDA IPC failed: {type(err).__name__}: {err}")
        poster = handles[0]
        entries = [(me, entry)]
        if groups is not None:
            gathered: list[Any] | None = [None] * len(handles) if me == poster else None
            dist.gather_object((me, entry), gathered, dst=poster, group=groups[1])
            entries = gathered or []
        answered = [me == poster and self._post(route, dict(entries), transfer.layout)]
        if groups is not None:
            # The copies are freed only after the server has answered (it reads them until then).
            dist.broadcast_object_list(answered, src=poster, group=groups[1])

    def _post(self, route: Route, entries: dict[int, tuple[bool, str]], layout: BucketLayout) -> bool:
        index = route.server
        server = self.link.server(index)
        if index in self.refused:
            return False
        ordered = [entries[rank] for rank in route.handle_ranks]  # entry j from TP rank j's GPU
        failed = [message for ok, message in ordered if not ok]
        try:
            if failed:
                raise SGLangWeightSyncError(f"weight sync to {server.url}: {failed[0]}")
            body = {"serialized_named_tensors": [payload for _, payload in ordered], "flush_cache": False}
            self.link.pool.control(server, "/update_weights_from_tensor", body, self.link.plan.transfer_timeout_s)
        except SGLangError as err:
            self.refused.add(index)
            self.update.fail(str(err))
            return False
        self.update.confirm(index, layout.names)
        return True


def bucket_is_cuda(bucket: FlatBucket) -> bool:
    return any(buffer.is_cuda for buffer in bucket.buffers.values())


def _copy_to(bucket: FlatBucket, device: torch.device) -> FlatBucket:
    if all(buffer.device == device for buffer in bucket.buffers.values()):
        return bucket
    return FlatBucket(bucket.layout, {dtype: buffer.to(device) for dtype, buffer in bucket.buffers.items()})
