"""A CPU harness that behaves like NCCL where it matters: each rank's "GPU work" runs behind its host thread.

On GPUs the export's TP gathers are queued on a stream and return at once, so a rank's host thread
hands out a bucket (and may post it to a server) while its data is still being gathered; the data is
complete only when every TP rank of the stage has queued its part, and a rank queues its part only
as far as its own host thread has got. Gloo blocks instead: on one CPU host a bucket is complete when
it is handed out and ranks never run ahead of each other. :func:`install`, called in a rank process,
makes the weight sync's export and transfers behave as on GPUs:

- the export walk (the real ``iter_rank_buckets`` with its real gloo collectives) runs on a "device"
  thread of the rank, never past the bucket the host thread has handed out last (the host has
  queued no more than that), after a delay that differs by rank;
- the host hands out buckets allocated up front, which the device fills when it gets there; their
  ready event (``transport.ready_event``) completes then, and ``synchronize()`` waits for that;
- a stream wait (``transport.wait_for``) holds the thread's next collective (``broadcast``, ``send``)
  and its ``finish_transfers`` until the bucket is complete, as the transfer stream would, while the
  host thread itself is not held until it issues one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist

# A wait longer than this is a deadlock the test reports, not a slow machine.
STUCK_S = 120.0

_pending = threading.local()  # the stream wait each thread's next collective is behind


class StreamEvent:
    """A ready event of the harness: done when the device has filled its bucket."""

    def __init__(self):
        self.done = threading.Event()
        self.error: BaseException | None = None

    def complete(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done.set()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        if not self.done.wait(STUCK_S):
            raise TimeoutError(f"a bucket's data was not complete after {STUCK_S:g} s (the export is stuck)")
        if self.error is not None:
            raise RuntimeError(f"the export failed on the device thread: {self.error}")


def _settle() -> None:
    """The calling thread's stream wait, if any, is over before its next collective starts."""
    event = getattr(_pending, "event", None)
    if event is not None:
        _pending.event = None
        event.synchronize()


def _behind_stream_wait(collective):
    def call(*args, **kwargs):
        _settle()
        return collective(*args, **kwargs)

    return call


def install(rank: int, delay_s: float = 0.01) -> None:
    """Make this rank process's weight sync run as on GPUs (see the module docstring); ``rank``'s
    device runs ``delay_s * (rank % 4 + 1)`` behind each bucket its host hands out."""
    from stapo_megatron.checkpoint.export import FlatBucket, plan_buckets, stage_export_plan
    from stapo_megatron.rollout.weight_sync import distributed, session, tensor, transport

    events: dict[int, StreamEvent] = {}  # id(bucket handed out) -> its ready event
    real_export = session.iter_rank_buckets
    device_delay_s = delay_s * (rank % 4 + 1)

    def run_ahead_export(model, arch, ctx, *, bucket_bytes: int, **kwargs: Any):
        stage = stage_export_plan(model, arch, ctx.tp_size)
        layouts = [layout for layout, _ in plan_buckets(stage, ctx.tp_rank, bucket_bytes)]
        handed = [FlatBucket.allocate(layout, ctx.device) for layout in layouts]
        ready = [StreamEvent() for _ in layouts]
        queued = threading.Semaphore(0)  # one release per bucket the host hands out, one for the rest

        def device() -> None:
            error: BaseException | None = None
            try:
                walk = real_export(model, arch, ctx, bucket_bytes=bucket_bytes, **kwargs)
                for bucket, event in zip(handed, ready):
                    if not queued.acquire(timeout=STUCK_S):
                        raise TimeoutError("the host queued no more of the export")
                    time.sleep(device_delay_s)
                    made = next(walk)
                    for dtype, buffer in made.buffers.items():
                        bucket.buffers[dtype].copy_(buffer)
                    event.complete()
                if not queued.acquire(timeout=STUCK_S):
                    raise TimeoutError("the host did not queue the end of the export")
                assert next(walk, None) is None, "the export made more buckets than plan_buckets planned"
            except BaseException as err:  # noqa: BLE001 - every bucket still waited on learns of it
                error = err
            for event in ready:
                if not event.query():
                    event.complete(error or RuntimeError("the export ended early"))
            failures.extend([error] if error is not None else [])

        failures: list[BaseException] = []
        thread = threading.Thread(target=device, name=f"device-of-rank-{ctx.rank}", daemon=True)
        thread.start()
        try:
            for bucket, event in zip(handed, ready):
                events[id(bucket)] = event
                queued.release()
                yield bucket
            queued.release()
        finally:
            thread.join(STUCK_S)
            for bucket in handed:
                events.pop(id(bucket), None)
        if failures:
            raise failures[0]

    def ready_event(bucket):
        return events.get(id(bucket))

    def stream_waits_for(event) -> None:
        if event is not None:
            _pending.event = event

    def settled_finish(device) -> None:
        _settle()

    session.iter_rank_buckets = run_ahead_export
    transport.ready_event = ready_event
    for module in (transport, distributed, tensor):
        if hasattr(module, "wait_for"):
            module.wait_for = stream_waits_for
    tensor.finish_transfers = settled_finish
    dist.broadcast = _behind_stream_wait(dist.broadcast)
    dist.send = _behind_stream_wait(dist.send)
