"""The contract between an update session and a transport, and what the transports share.

:class:`~stapo_megatron.rollout.weight_sync.session.WeightSync` runs one update; a :class:`Transport`
moves the buckets of one mode. The controller hooks (``begin``, ``commit``, ``abort``) run on the
controller only, around every rank's ``prepare``, ``send`` (on the pipelined worker thread, once per
bucket the rank exports) and ``finish``.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from stapo_megatron.checkpoint.export import BucketLayout, FlatBucket
from stapo_megatron.rollout.server_pool import PooledServer, ServerPool
from stapo_megatron.rollout.sglang_client import SGLangError, SGLangWeightSyncError
from stapo_megatron.rollout.sglang_weights import preview_names
from stapo_megatron.rollout.weight_sync.plan import WeightSyncPlan
from stapo_megatron.rollout.weight_sync.routes import RankPlace, Route

logger = logging.getLogger(__name__)

# rank -> its buckets for this update, each with the position in its stage's export walk at which
# it is complete (iter_rank_buckets yields them in that order); [] for a rank that exports nothing
RankLayouts = dict[int, list[tuple[int, BucketLayout]]]


@dataclasses.dataclass
class SyncLink:
    """What every transport of one :class:`WeightSync` works with."""

    plan: WeightSyncPlan
    pool: ServerPool  # HTTP to the plan's servers
    ctx: Any  # the ParallelContext; None: one process holding the whole model sends to every server
    rank: int
    places: list[RankPlace] | None  # every rank's place (None for one process)
    routes: list[Route] | None  # every route of the job (None for one process: every server, every bucket)
    device: torch.device  # where this rank's buckets are (one process: where push packs them)

    def server(self, index: int) -> PooledServer:
        return next(s for s in self.pool.servers if s.index == index)

    def targets(self) -> list[PooledServer]:
        """The servers this rank sends its own buckets to."""
        if self.routes is None:
            return list(self.pool.servers)
        mine = {r.server for r in self.routes if r.source == self.rank}
        return [s for s in self.pool.servers if s.index in mine]


class UpdateSession:
    """One weight update as this rank sees it: the version, per server the names it confirmed, and
    what failed (reported to the controller, raised on every rank)."""

    def __init__(self, version: int):
        self.version = version
        self.received: dict[int, list[str]] = {}
        self.failures: list[str] = []

    def confirm(self, server: int, names: Sequence[str]) -> None:
        self.received.setdefault(server, []).extend(names)

    def fail(self, message: str) -> None:
        self.failures.append(message)


def name_problems(expected: frozenset[str], names) -> str:
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


def check_tallies(expected: frozenset[str], tallies: Sequence[dict[int, list[str]]], servers: Sequence[Any]) -> None:
    """Every server received every expected name exactly once (over all ranks), nothing else: or one line."""
    for server in servers:
        problems = name_problems(expected, (name for tally in tallies for name in tally.get(server.index, ())))
        if problems:
            raise SGLangWeightSyncError(f"weight sync to {server.url} " + problems)


def use_device(device: torch.device) -> None:
    """Make ``device`` this thread's CUDA device (a new thread starts on cuda:0); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


# A bucket leaves on a stream of its own, after the export's event for it, never after the whole device
# or the export's stream: the main thread may by then have queued TP gathers that wait on a rank that
# waits on this very bucket (one in flight per rank).


def ready_event(bucket: FlatBucket) -> torch.cuda.Event | None:
    """Marks, on the stream that filled it (the export's), where ``bucket`` is complete; None on the CPU."""
    device = next(iter(bucket.buffers.values())).device
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def transfer_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """This thread's device and a stream of its own for the transfers (nothing on the CPU)."""
    use_device(device)
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))


def wait_for(event: torch.cuda.Event | None) -> None:
    """The transfer stream waits (on the GPU) for a bucket the export filled."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


def wait_on_host(event: torch.cuda.Event | None) -> None:
    """This thread waits until the export has completed a bucket: the TP gathers that fill it return
    at once on GPUs and finish only when every TP rank of the stage has queued its part."""
    if event is not None:
        event.synchronize()


def finish_transfers(device: torch.device) -> None:
    """Before an IPC handle leaves: what the transfer stream wrote (received copies) is done."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Transport(abc.ABC):
    """How one mode moves buckets to the servers (see the module docstring)."""

    def __init__(self, link: SyncLink):
        self.link = link
        self.update = UpdateSession(-1)
        self.ready: dict[int, torch.cuda.Event | None] = {}  # bucket index -> where the export completed it

    # ---- the controller, around every rank's part

    @abc.abstractmethod
    def begin(self, version: int) -> Any:
        """Generation is paused: open the update; the answer reaches every rank's :meth:`prepare`."""

    @abc.abstractmethod
    def commit(self, reports: list[tuple[dict[int, list[str]], Any]], version: int, opened: Any) -> None:
        """Every rank is done (``reports``: each rank's confirmed names and :meth:`report`): check what
        arrived and make ``version`` the servers' weights, or raise one line."""

    @abc.abstractmethod
    def abort(self, opened: Any) -> None:
        """The update failed: undo what :meth:`begin` opened, as far as possible."""

    # ---- every rank

    def prepare(self, update: UpdateSession, opened: Any, layouts: RankLayouts | None) -> None:
        self.update, self.ready = update, {}

    def exported(self, buckets: Iterable[FlatBucket]) -> Iterator[FlatBucket]:
        """This rank's buckets as the export makes them (on the main thread), on their way to :meth:`send`."""
        for bucket in buckets:
            self.ready[bucket.layout.index] = ready_event(bucket)
            yield bucket

    @abc.abstractmethod
    def send(self, bucket: FlatBucket) -> None:
        """One bucket this rank exports, to its servers (runs on the pipelined worker thread)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """After this rank's last bucket (also when sending failed)."""

    def report(self) -> Any:
        """What the controller's :meth:`commit` needs from this rank besides the confirmed names."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """The sync is dropped: leave what outlives an update."""


class SessionTransport(Transport):
    """Tensor and distributed updates: an SGLang update session (0.5.21+) around the buckets, and the
    version stamped once every server confirmed every name."""

    def begin(self, version: int) -> Any:
        pool = self.link.pool
        pool.run_all(self._session_servers(), pool.control, "/begin_weight_update", {})
        return True

    def commit(self, reports: list[tuple[dict[int, list[str]], Any]], version: int, opened: Any) -> None:
        pool, plan = self.link.pool, self.link.plan
        check_tallies(plan.expected_names, [received for received, _ in reports], pool.servers)
        pool.run_all(self._session_servers(), pool.control, "/end_weight_update", {})
        body = {"new_version": str(version), "abort_all_requests": False}
        pool.run_all(pool.servers, pool.control, "/update_weight_version", body)

    def abort(self, opened: Any) -> None:
        for server in self._session_servers():
            try:
                self.link.pool.control(server, "/end_weight_update", {}, 30.0)
            except SGLangError as err:
                logger.warning("weight sync: /end_weight_update on %s after a failed update: %s", server.url, err)

    def _session_servers(self) -> list[PooledServer]:
        return [s for s in self.link.pool.servers if s.index in self.link.plan.session_servers]
