"""NCCL sync: each source rank broadcasts its buckets through ``/update_weights_from_distributed`` over
one small group per (source rank, server). :func:`plan_routes` never puts a source on a GPU of the
server: NCCL refuses a communicator with two processes on one GPU.

A server runs update requests one at a time, in the order they arrive, whichever rank sent them, and
each waits for its broadcast. So a rank posts a bucket only once the export has completed it on the
GPU (the TP gathers that fill it return at once and finish only when every TP rank of the stage has
queued its part): a request whose data still waited on gathers that other ranks queue only after
their own requests were served would hold the server's queue, and every rank behind it, forever.
With only complete buckets posted, whatever order the requests of several ranks reach a server in,
each is served as soon as it is at the head: none waits on a request behind it.

A colocated server's group is left after every update: its communicator buffers would sit in the
memory that generation (KV cache) and training take turns on. A disaggregated server's groups stay
for the next update (its GPUs serve nothing else)."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

from stapo_megatron.checkpoint.export import FlatBucket
from stapo_megatron.rollout.server_pool import PooledServer
from stapo_megatron.rollout.sglang_client import SGLangError, SGLangWeightSyncError, split_url
from stapo_megatron.rollout.sglang_weights import WeightUpdateGroup, local_address_towards
from stapo_megatron.rollout.weight_sync.transport import (
    RankLayouts,
    SessionTransport,
    UpdateSession,
    transfer_stream,
    wait_on_host,
)

logger = logging.getLogger(__name__)


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


class DistributedTransport(SessionTransport):
    def __init__(self, link):
        super().__init__(link)
        self.targets = link.targets()
        self.groups: dict[int, WeightUpdateGroup] = {}

    def prepare(self, update: UpdateSession, opened: Any, layouts: RankLayouts | None) -> None:
        super().prepare(update, opened, layouts)
        for server in self.targets:
            if server.index not in self.groups:
                self.groups[server.index] = self._join(server)

    def _join(self, server: PooledServer) -> WeightUpdateGroup:
        plan, pool = self.link.plan, self.link.pool
        backend = plan.config.weight_sync_backend
        address = plan.config.weight_sync_master_address or local_address_towards(split_url(server.url)[1])
        group = WeightUpdateGroup(
            master_address=address,
            # Each sender hosts one store per target server (a colocated one anew at every update), so no
            # one configured port could serve them: the OS picks a free one, sent to the server below.
            port=0,
            world_size=1 + server.tp_size,
            backend=backend,
            timeout_s=plan.transfer_timeout_s,
            name=f"stapo-weights-r{self.link.rank}-s{server.index}-{secrets.token_hex(4)}",
        )
        body = {
            "master_address": address,
            "master_port": group.port,
            "rank_offset": 1,
            "world_size": 1 + server.tp_size,
            "group_name": group.name,
            "backend": backend,
        }
        # The init call blocks until every member joined: join while it is in flight.
        futures = [
            pool.submit(pool.control, server, "/init_weights_update_group", body, plan.transfer_timeout_s),
            pool.submit(group.join),
        ]
        try:
            await_transfer(futures, [], plan.transfer_timeout_s, f"joining weight-update group {group.name}")
        except BaseException:
            group.destroy()
            raise
        return group

    def send(self, bucket: FlatBucket) -> None:
        if not self.targets:
            return
        with transfer_stream(self.link.device):
            wait_on_host(self.ready.get(bucket.layout.index))  # complete before any server sees it
            self._broadcast(bucket)

    def _broadcast(self, bucket: FlatBucket) -> None:
        plan, pool = self.link.plan, self.link.pool
        first = self.groups[self.targets[0].index]
        named = [(name, first.prepare(t)) for name, t in bucket.named_tensors()]
        body = {
            "names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "flush_cache": False,
        }
        futures, works = [], []
        for server in self.targets:
            group = self.groups[server.index]
            futures.append(
                pool.submit(
                    pool.control,
                    server,
                    "/update_weights_from_distributed",
                    {**body, "group_name": group.name},
                    plan.transfer_timeout_s,
                )
            )
            # The server posts one receive per name, in order: match that order.
            works.extend(group.broadcast([t for _, t in named]))
        what = f"weight bucket {bucket.layout.index} of rank {self.link.rank}"
        await_transfer(futures, works, plan.transfer_timeout_s, what)
        for server in self.targets:
            self.update.confirm(server.index, bucket.layout.names)

    def finish(self) -> None:
        self._leave([s for s in self.targets if s.endpoint.colocated])

    def close(self) -> None:
        self._leave(self.targets)

    def _leave(self, servers: Sequence[PooledServer]) -> None:
        for server in servers:
            group = self.groups.pop(server.index, None)
            if group is None:
                continue
            try:
                self.link.pool.control(server, "/destroy_weights_update_group", {"group_name": group.name}, 30.0)
            except SGLangError as err:
                logger.warning("weight sync: destroy_weights_update_group on %s: %s", server.url, err)
            group.destroy()
