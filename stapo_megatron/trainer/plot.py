"""``stapo plot RUN_DIR``: PNG curves of a run (or several runs on the same axes)."""

from __future__ import annotations

import os
from pathlib import Path

from stapo_megatron.config import ConfigError
from stapo_megatron.trainer.metrics import read_metrics

# (metric, panel title) in the order of the panels.
PANELS = (
    ("reward/accuracy", "accuracy of sampled responses"),
    ("reward/mean", "reward (shaped)"),
    ("policy/entropy", "policy entropy (response tokens)"),
    ("s2t/masked_fraction", "S2T masked fraction"),
    ("response/length_mean", "response length (tokens)"),
    ("response/clipped_fraction", "responses cut at the length limit"),
    ("optim/grad_norm", "gradient norm"),
    ("mismatch/logprob_abs_mean", "train/rollout |log-prob difference|"),
)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (window 1: unchanged)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(run_dirs: list[str | os.PathLike], out: str | os.PathLike | None = None, window: int = 10) -> Path:
    """One PNG with a panel per metric; one line per run. Returns the file written."""
    runs = []
    for run_dir in run_dirs:
        rows = read_metrics(run_dir)
        if not rows:
            raise ConfigError(f"{run_dir}: no metrics.jsonl rows to plot")
        runs.append((Path(run_dir).name, rows))
    out = Path(out) if out else Path(run_dirs[0]) / "curves.png"
    title = f"{', '.join(name for name, _ in runs)} (moving average over {window} steps)"
    return plot_panels(runs, PANELS, out, window, title)


def plot_panels(
    runs: list[tuple[str, list[dict]]],
    panels,
    out: str | os.PathLike,
    window: int,
    title: str,
    columns: int = 2,
    log_panels: frozenset[str] = frozenset(),
) -> Path:
    """Write ``out``: a panel per (metric, title) of ``panels``, a line per (label, metrics rows)
    of ``runs``, each smoothed over ``window`` steps. Metrics in ``log_panels`` get a symmetric
    log axis (linear near 0), so that values of 1e-4 and of 0.8 show on one panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    columns = min(columns, len(panels))
    rows_count = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows_count, columns, figsize=(6 * columns, 3.2 * rows_count), squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis, (key, panel_title) in zip(axes.flat, panels):
        for name, rows in runs:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                steps, values = zip(*points)
                axis.plot(steps, smooth(list(values), window), label=name, linewidth=1.4)
        if key in log_panels:
            axis.set_yscale("symlog", linthresh=1e-4)
            axis.set_ylim(bottom=0)  # fractions: no negative decades
        axis.set_title(panel_title, fontsize=10)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    temporary = out.with_suffix(".tmp.png")
    figure.savefig(temporary, dpi=110)
    plt.close(figure)
    os.replace(temporary, out)
    return out
