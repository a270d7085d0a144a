"""An engine in the controller's own process (the local engine) gets every rank's buckets over gloo."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from stapo_megatron.checkpoint.export import (
    DEFAULT_BUCKET_BYTES,
    FlatBucket,
    iter_rank_buckets,
    plan_buckets,
    stage_export_plan,
)
from stapo_megatron.rollout.weight_sync.plan import CONTROLLER

CPU = torch.device("cpu")

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
    thread_finished = object()  # each thread puts it last

    def produce_own() -> None:
        try:
            if ctx.device.type == "cuda":
                torch.cuda.set_device(ctx.device)
            for bucket in own:
                ready.put(bucket)
        except BaseException as err:  # noqa: BLE001 - handed to the consuming thread
            ready.put(err)
        ready.put(thread_finished)

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
        ready.put(thread_finished)

    threads = [threading.Thread(target=fn, daemon=True) for fn in (produce_own, receive_remote)]
    for thread in threads:
        thread.start()
    finished = 0
    while finished < len(threads):
        item = ready.get()
        if item is thread_finished:
            finished += 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield from item.named_tensors()
    for thread in threads:
        thread.join()
