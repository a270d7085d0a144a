"""Where step metrics go: a jsonl file, TensorBoard, Weights & Biases, and a console progress bar."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class PhaseTimer:
    """Wall-clock seconds per named phase of a step."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{phase}": seconds for phase, seconds in self.seconds.items()}


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Rank 0's sinks. On resume from ``resume_step`` the jsonl keeps only steps <= resume_step."""

    def __init__(self, run_dir: Path, logging_cfg, run_name: str, config: dict, resume_step: int, total_steps: int):
        self.path = Path(run_dir) / METRICS_FILE
        self._truncate_after(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
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

    def _truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = [row for row in read_metrics(self.path.parent) if row.get("step", 0) <= step]
        temporary = self.path.with_suffix(".jsonl.tmp")
        with open(temporary, "w", encoding="utf-8") as f:
            for row in kept:
                f.write(json.dumps(row) + "\n")
        os.replace(temporary, self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _finite(float(v)) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for key, value in metrics.items():
                if math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._bar is not None:
            self._bar.set_postfix(
                {k.split("/")[-1]: f"{metrics[k]:.3g}" for k in ("reward/accuracy", "s2t/masked_fraction", "policy/entropy") if k in metrics},
                refresh=False,
            )
            self._bar.update(1)

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()
