"""The step heartbeat: a watchdog thread that ends a rank which has stopped making progress.

A lost peer or a wedged NCCL ring leaves every rank waiting inside a collective, which the
collective timeout (``parallel.timeout_minutes``) ends only late, and a stuck file system leaves a
rank waiting with no timeout at all. The trainer beats
at the start of every phase of a step and after every checkpoint; when no beat has come for
``run.hang_timeout_s``, the watchdog prints one line naming the phase and the step and ends the
process with :data:`HANG_EXIT_CODE`.

Rank 0 also works alone: it generates the step's rollouts, scores them and evaluates, which may
take longer than the timeout, while every other rank waits for it in a collective. Those stretches
are bounded by their own time limits (each ``/generate`` request by ``request_timeout_s``, each
reward by its worker's limit), so rank 0 keeps beating through them (:meth:`Heartbeat.keep_alive`),
and a rank waiting for rank 0 beats whenever rank 0 does (:meth:`Heartbeat.following_rank0`): rank
0 publishes its beats in the job's key-value store. A rank 0 that is lost or frozen stops
publishing, so the ranks waiting for it still end within the timeout. They wait in the store, not in
a collective (:meth:`Heartbeat.wait_for_rank0`), so no collective timeout cuts short a long
evaluation that rank 0 beats through.

What the run keeps is its latest checkpoint on disk: a rank blocked inside a collective cannot
write one (the ranks it would need are not there to take part), so the message names the step
of that checkpoint, and the next start of the run (a requeued SLURM job, or a rerun) resumes
from it. Saving often (``checkpoint.save_every``) bounds what a hang costs.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable

from stapo_megatron.trainer.metrics import PhaseTimer

# EX_TEMPFAIL: the run did not fail on its own and may be started again from its checkpoint.
HANG_EXIT_CODE = 75
RANK0_BEATS_KEY = "stapo/heartbeat/rank0"  # rank 0's beat count, in the store every rank reaches
RANK0_DONE_KEY = "stapo/heartbeat/rank0-done"  # /<n>: rank 0 has finished its n-th stretch alone


def job_store():
    """The key-value store of the job's default process group (torchrun's, or the one that
    ``init_process_group`` made): every rank reaches it, whatever the collective backend."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


class Heartbeat:
    """Notes progress (``beat``) and, from a daemon thread, ends the process when it stops."""

    def __init__(self, timeout_s: float, rank: int, saved_step: int, *, stream=None, store=None):
        self.timeout_s = timeout_s
        self.rank = rank
        self.saved_step = saved_step  # the latest checkpoint's step; 0: none yet
        self.stream = stream if stream is not None else sys.stderr
        # A torch.distributed Store of every rank (job_store()): rank 0 publishes its beats there.
        self.store = store
        self.phase, self.step = "start", 0
        self._last = time.monotonic()
        self._beats = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stapo-heartbeat", daemon=True)
        # check a few times per timeout, so the hang is reported at most ~10% late
        self.poll_s = min(max(self.timeout_s / 10, 0.05), 30.0)

    def beat(self, phase: str, step: int) -> None:
        with self._lock:
            self.phase, self.step = phase, step
        self._touch()

    def _touch(self) -> None:
        """Progress in the current phase."""
        with self._lock:
            self._last = time.monotonic()
            self._beats += 1
            beats = self._beats
        if self.store is not None and self.rank == 0:
            # Best effort: a store that cannot be reached leaves the waiting ranks without rank 0's
            # beats, and their own watchdogs end them, which is what a lost store calls for.
            with contextlib.suppress(RuntimeError):
                self.store.set(RANK0_BEATS_KEY, str(beats))

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` is complete on disk."""
        with self._lock:
            self.saved_step, self.phase, self._last = step, "checkpoint written", time.monotonic()

    def start(self) -> Heartbeat:
        self.beat(self.phase, self.step)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def timer(self, step: int) -> PhaseTimer:
        """A step's phase timer whose every phase start is a beat."""
        return _BeatingPhaseTimer(self, step)

    @contextlib.contextmanager
    def keep_alive(self):
        """Beat through the block, which is bounded by time limits of its own (rank 0's rollouts and
        evaluation: request timeouts, reward time limits)."""
        with self._beating(lambda: True):
            yield

    @contextlib.contextmanager
    def following_rank0(self, phase: str, step: int):
        """While the block waits for rank 0 (a collective it enters when done alone): beat whenever
        rank 0 has beaten since the last look. Rank 0 itself beats as usual."""
        if self.rank == 0 or self.store is None:
            self.beat(phase, step)
            yield
            return
        self.beat(f"{phase}, waiting for rank 0", step)
        seen = [self._rank0_beats()]

        def rank0_beat() -> bool:
            now = self._rank0_beats()
            advanced, seen[0] = now != seen[0], now
            return advanced

        with self._beating(rank0_beat):
            yield

    def wait_for_rank0(self, phase: str, step: int, stretch: int, rendezvous: Callable[[], None]) -> None:
        """After rank 0's ``stretch``-th stretch alone (every rank counts them alike), every rank meets
        in ``rendezvous`` (a collective), the others having waited for rank 0 in the job's store first:
        as long as rank 0 keeps beating, and at most run.hang_timeout_s after it stops (the watchdog
        ends the rank). A collective alone would give up after parallel.timeout_minutes however long
        rank 0's bounded work runs (evaluating six benchmarks at 20k tokens can take close to an hour)."""
        key = f"{RANK0_DONE_KEY}/{stretch}"
        with self.following_rank0(phase, step):
            if self.store is not None:
                if self.rank == 0:
                    self.store.set(key, "1")
                else:
                    self._wait_in_store(key)
            rendezvous()  # every rank is there or on its way: it returns at once
        if self.store is not None and self.rank == 0:
            with contextlib.suppress(RuntimeError):  # every rank has read it (a store without deletes keeps it)
                self.store.delete_key(key)

    def _wait_in_store(self, key: str) -> None:
        assert self.store is not None
        wait = datetime.timedelta(seconds=self.poll_s)
        while True:
            asked = time.monotonic()
            try:
                self.store.wait([key], wait)
                return
            except RuntimeError:  # not yet; or the store is unreachable, and then rank 0's beats stop too
                time.sleep(max(0.0, self.poll_s - (time.monotonic() - asked)))

    def _rank0_beats(self) -> str | None:
        assert self.store is not None  # following_rank0 reads only with a store
        try:
            return self.store.get(RANK0_BEATS_KEY).decode() if self.store.check([RANK0_BEATS_KEY]) else None
        except RuntimeError:  # the store is gone with its host (rank 0's process): no beat
            return None

    @contextlib.contextmanager
    def _beating(self, alive):
        """A thread that touches the heartbeat every poll while ``alive()`` says so, until the block ends."""
        done = threading.Event()

        def beat_while_alive() -> None:
            while not done.wait(self.poll_s):
                if alive():
                    self._touch()

        beater = threading.Thread(target=beat_while_alive, name="stapo-heartbeat-beater", daemon=True)
        beater.start()
        try:
            yield
        finally:
            done.set()
            beater.join()

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            with self._lock:
                silent = time.monotonic() - self._last
                phase, step, saved = self.phase, self.step, self.saved_step
            if silent >= self.timeout_s:
                self._end(silent, phase, step, saved)

    def _end(self, silent: float, phase: str, step: int, saved: int) -> None:
        resume = (
            f"the run resumes from the checkpoint of step {saved}"
            if saved
            else "the run has no checkpoint to resume from yet"
        )
        self.stream.write(
            f"stapo: error: rank {self.rank}: no progress for {silent:.0f} s (run.hang_timeout_s={self.timeout_s:g}) "
            f"in phase '{phase}' of step {step}; exiting with code {HANG_EXIT_CODE}, {resume}\n"
        )
        self.stream.flush()
        # The main thread may be blocked inside a collective, where no exception would reach it.
        os._exit(HANG_EXIT_CODE)


class _BeatingPhaseTimer(PhaseTimer):
    def __init__(self, heartbeat: Heartbeat, step: int):
        super().__init__()
        self._heartbeat, self._step = heartbeat, step

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._heartbeat.beat(phase, self._step)
        with super().__call__(phase):
            yield
