"""The step heartbeat: a watchdog thread that ends a rank which has stopped making progress.

A lost peer or a wedged NCCL ring leaves every rank waiting inside a collective, which the
collective timeout (``parallel.timeout_minutes``) ends only late, and a rollout server that stops
answering or a stuck file system leaves rank 0 waiting with no timeout at all. The trainer beats
at the start of every phase of a step and after every checkpoint; when no beat has come for
``run.hang_timeout_s``, the watchdog prints one line naming the phase and the step and ends the
process with :data:`HANG_EXIT_CODE`.

What the run keeps is its latest checkpoint on disk: a rank blocked inside a collective cannot
write one (the ranks it would need are not there to take part), so the message names the step
of that checkpoint, and the next start of the run (a requeued SLURM job, or a rerun) resumes
from it. Saving often (``checkpoint.save_every``) bounds what a hang costs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from stapo_megatron.trainer.metrics import PhaseTimer

# EX_TEMPFAIL: the run did not fail on its own and may be started again from its checkpoint.
HANG_EXIT_CODE = 75


class Heartbeat:
    """Notes progress (``beat``) and, from a daemon thread, ends the process when it stops."""

    def __init__(self, timeout_s: float, rank: int, saved_step: int, *, stream=None):
        self.timeout_s = timeout_s
        self.rank = rank
        self.saved_step = saved_step  # the latest checkpoint's step; 0: none yet
        self.stream = stream if stream is not None else sys.stderr
        self.phase, self.step = "start", 0
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stapo-heartbeat", daemon=True)

    def beat(self, phase: str, step: int) -> None:
        with self._lock:
            self.phase, self.step, self._last = phase, step, time.monotonic()

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

    def _watch(self) -> None:
        # check a few times per timeout, so the hang is reported at most ~10% late
        poll_s = min(max(self.timeout_s / 10, 0.05), 30.0)
        while not self._stopped.wait(poll_s):
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
