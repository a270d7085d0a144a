"""Where step metrics go: a jsonl file, TensorBoard, Weights & Biases, and a console progress bar."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections import defaultdict
from pathlib import Path

from stapo_megatron.config import MAX_STEPS
from stapo_megatron.runtime import console
from stapo_megatron.runtime.jsonl import is_number, read_rows, shown_key
from stapo_megatron.runtime.run_files import METRICS_FILE, atomic_open, reporting_no_space

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Stretch:
    """An open phase of a :class:`PhaseTimer` and when its current stretch began."""

    phase: str
    began: float


class PhaseTimer:
    """Wall-clock seconds of one step, and of each named phase in it.

    Phases may nest: an outer phase's seconds exclude those of the phases inside it, so the
    phases add up to the time they cover and no second counts twice. ``time/step`` is the wall
    time from ``started`` to :meth:`stop`, and ``time/other`` the part of it in no named phase,
    so the phases and ``time/other`` add up to ``time/step`` whatever the machine's load (a
    process descheduled between two phases loses that time to ``other``, not to the sum); a loop
    that starts each step's timer where the previous one stopped (:meth:`follow`) accounts for
    every second between its rows.
    """

    def __init__(self):
        self.started = time.perf_counter()
        self.stopped: float | None = None
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: list[_Stretch] = []  # innermost last

    def __call__(self, phase: str):
        return self.measure(phase)

    @contextlib.contextmanager
    def measure(self, phase: str):
        now = time.perf_counter()
        if self._open:
            outer = self._open[-1]
            self.seconds[outer.phase] += now - outer.began
        entry = _Stretch(phase, now)
        self._open.append(entry)
        try:
            yield
        finally:
            now = time.perf_counter()
            self._open.pop()
            self.seconds[phase] += now - entry.began
            if self._open:
                self._open[-1].began = now  # the outer phase resumes

    def follow(self, previous: PhaseTimer) -> PhaseTimer:
        """Start where ``previous`` stopped, so nothing between the two goes unaccounted."""
        if previous.stopped is None:
            raise RuntimeError("PhaseTimer.follow: the previous timer was not stopped")
        self.started = previous.stopped
        return self

    def absorb(self, earlier: PhaseTimer) -> PhaseTimer:
        """Take over ``earlier``'s start and phases: its stretch becomes the start of this one."""
        self.started = earlier.started
        for phase, seconds in earlier.seconds.items():
            self.seconds[phase] += seconds
        return self

    def stop(self) -> float:
        self.stopped = time.perf_counter()
        return self.stopped - self.started

    def metrics(self) -> dict[str, float]:
        """Each phase's seconds, ``time/other`` and ``time/step`` (the whole step's wall time), after :meth:`stop`."""
        if self.stopped is None:
            raise RuntimeError("PhaseTimer.metrics before stop(): the step has no end yet")
        step = self.stopped - self.started
        return {
            **{f"time/{phase}": seconds for phase, seconds in self.seconds.items()},
            "time/other": step - sum(self.seconds.values()),
            "time/step": step,
        }


# A metrics row is a step's numbers: kilobytes. A longer line is damage, skipped unread.
METRICS_MAX_LINE_BYTES = 1 << 20


def metrics_row_problem(row: dict) -> str | None:
    """Why ``row`` is not a metrics row (a whole-number ``step`` and numbers, or None where the
    trainer had a non-finite value), or None when it is one."""
    if "step" not in row:
        return "has no step"
    step = row["step"]
    if not is_number(step) or isinstance(step, float) or not 0 <= step <= MAX_STEPS:
        return f"has a step that is not a whole number from 0 to {MAX_STEPS:,}"
    for key, value in row.items():
        if value is not None and not is_number(value):
            return f"holds a {type(value).__name__} for {shown_key(key)}"
    return None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of ``<run_dir>/metrics.jsonl`` (none when there is no such file). A row that is cut
    off (the last line of a file cut by a full disk or a kill), malformed or too long is skipped and
    a value that is not finite dropped, with one warning counting them (see :mod:`stapo_megatron.runtime.jsonl`)."""
    path = Path(run_dir) / METRICS_FILE
    return read_rows(path, metrics_row_problem, METRICS_MAX_LINE_BYTES) if path.is_file() else []


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Rank 0's sinks. On resume from ``resume_step`` the jsonl keeps only steps <= resume_step."""

    def __init__(self, run_dir: Path, logging_cfg, run_name: str, config: dict, resume_step: int, total_steps: int):
        self.path = Path(run_dir) / METRICS_FILE
        self._truncate_after(resume_step)
        # Unbuffered appends, so that a failed one can be undone to the last whole row.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        self._tensorboard = None
        if logging_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)
        self._wandb = None
        if logging_cfg.wandb_project:
            import wandb

            self._wandb = wandb.init(
                project=logging_cfg.wandb_project,
                entity=logging_cfg.wandb_entity or None,
                name=run_name,
                id=run_name,
                resume="allow",
                config=config,
                dir=str(run_dir),
            )
        self._bar = None
        if logging_cfg.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=resume_step, desc=run_name, unit="step", dynamic_ncols=True)
            console.bar_started()  # log records now go through tqdm, around the bar

    def _truncate_after(self, step: int) -> None:
        """Keep the rows up to ``step`` (the resumed checkpoint's); a cut-off or malformed line is dropped."""
        if not self.path.is_file():
            return
        kept = [row for row in read_metrics(self.path.parent) if row["step"] <= step]
        with atomic_open(self.path) as f:
            for row in kept:
                f.write(json.dumps(row) + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _finite(float(v)) for k, v in sorted(metrics.items())}}
        data = (json.dumps(row) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            with reporting_no_space(self.path):
                written = 0
                while written < len(data):
                    written += os.write(self._fd, data[written:])
        except BaseException:
            os.ftruncate(self._fd, size)  # no half row stays behind
            raise
        if self._tensorboard is not None:
            for key, value in metrics.items():
                if math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._bar is not None:
            self._bar.set_postfix(
                {
                    k.split("/")[-1]: f"{metrics[k]:.3g}"
                    for k in ("reward/accuracy", "s2t/masked_fraction", "policy/entropy")
                    if k in metrics
                },
                refresh=False,
            )
            self._bar.update(1)

    def close(self) -> None:
        os.close(self._fd)
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()
            console.bar_ended()
