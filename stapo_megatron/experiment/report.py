"""The comparison of an experiment's runs: a Markdown table and PNG figures from their metrics.

Every summary number is read from the runs' ``metrics.jsonl`` rows; "start" and "end" are the
means over the first and last tenth of the steps (at least one step), so a single noisy step
does not decide them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from stapo_megatron.config import ConfigError
from stapo_megatron.runtime.run_files import atomic_open
from stapo_megatron.trainer.plot import plot_panels, smooth

TABLE_FILE = "comparison.md"
# (metric, figure file, panel title); all algorithms on each figure.
FIGURES = (
    ("policy/entropy", "entropy.png", "policy entropy of response tokens (nats)"),
    ("reward/accuracy", "accuracy.png", "accuracy of sampled responses"),
    ("s2t/masked_fraction", "masked_fraction.png", "fraction of response tokens the token rule masks"),
    ("response/length_mean", "response_length.png", "response length (tokens)"),
)
# Masked fractions span 1e-4 (STAPO) to 0.8 (20-Entropy keeps the top 20%): a log axis shows both.
LOG_METRICS = frozenset({"s2t/masked_fraction"})
# Relative change of entropy from start to end under which its trend counts as flat.
FLAT_ENTROPY_CHANGE = 0.05


def edge_window(steps: int) -> int:
    """Steps averaged at the start and at the end of a run: a tenth of them, at least one."""
    return max(1, steps // 10)


def _series(rows: list[dict], key: str) -> list[float]:
    return [row[key] for row in rows if row.get(key) is not None]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize_run(rows: list[dict]) -> dict[str, float | int | str]:
    """The table's numbers for one run's metrics rows (in step order)."""
    window = edge_window(len(rows))
    accuracy = _series(rows, "reward/accuracy")
    entropy = _series(rows, "policy/entropy")
    masked = _series(rows, "s2t/masked_fraction")
    length = _series(rows, "response/length_mean")
    if not (accuracy and entropy and masked and length):
        raise ConfigError(
            "metrics.jsonl: rows lack reward/accuracy, policy/entropy, s2t/masked_fraction or response/length_mean"
        )
    entropy_start, entropy_end = _mean(entropy[:window]), _mean(entropy[-window:])
    change = entropy_end / entropy_start - 1 if entropy_start > 0 else 0.0
    trend = "flat" if abs(change) < FLAT_ENTROPY_CHANGE else ("rising" if change > 0 else "falling")
    return {
        "steps": rows[-1]["step"],
        "final_accuracy": _mean(accuracy[-window:]),
        "peak_accuracy": max(smooth(accuracy, window)),
        "entropy_start": entropy_start,
        "entropy_end": entropy_end,
        "entropy_change": change,
        "entropy_trend": trend,
        "masked_mean": _mean(masked),
        "masked_max": max(masked),
        "length_end": _mean(length[-window:]),
        "step_seconds": sum(_series(rows, "time/step")),
    }


def comparison_table(runs: list[tuple[str, list[dict]]], wall_seconds: dict[str, float]) -> list[str]:
    """Markdown lines: one row per (name, metrics rows) of ``runs``. The wall time is the
    recorded one of ``stapo train`` where ``wall_seconds`` has it, else the sum of its steps' times."""
    lines = [
        "| algorithm | steps | final accuracy | peak accuracy | entropy start | entropy end | entropy trend "
        "| masked fraction (mean) | masked fraction (max) | response length (end) | wall time (s) |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name, rows in runs:
        s = summarize_run(rows)
        wall = wall_seconds.get(name, s["step_seconds"])
        lines.append(
            f"| {name} | {s['steps']} | {s['final_accuracy']:.3f} | {s['peak_accuracy']:.3f} | "
            f"{s['entropy_start']:.3f} "
            f"| {s['entropy_end']:.3f} | {s['entropy_trend']} ({s['entropy_change']:+.0%}) | {s['masked_mean']:.3%} "
            f"| {s['masked_max']:.3%} | {s['length_end']:.2f} | {wall:.0f} |"
        )
    return lines


def write_comparison(
    directory: str | os.PathLike,
    runs: list[tuple[str, list[dict]]],
    wall_seconds: dict[str, float],
    heading: list[str],
    notes: Sequence[str] = (),
) -> list[Path]:
    """Write the table (under the ``heading`` lines, with the ``notes`` lines last) and one
    figure per metric of :data:`FIGURES` into ``directory``; returns the files written, the table first."""
    directory = Path(directory)
    for name, rows in runs:
        if not rows:
            raise ConfigError(f"{name}: no metrics.jsonl rows to compare")
    steps = max(len(rows) for _, rows in runs)
    window = edge_window(steps)
    figures = []
    for key, file_name, title in FIGURES:
        figures.append(
            plot_panels(
                runs,
                ((key, title),),
                directory / file_name,
                window,
                f"moving average over {window} steps",
                columns=1,
                log_panels=LOG_METRICS,
            )
        )
    lines = [
        *heading,
        "",
        *comparison_table(runs, wall_seconds),
        "",
        f"Start and end: means over the first and last {window} steps; peak accuracy: the highest {window}-step "
        f"moving average; entropy trend: the change from start to end (flat within {FLAT_ENTROPY_CHANGE:.0%}); "
        "masked fraction: response tokens the token rule gives no gradient (s2t/masked_fraction), over all steps.",
        "",
        *(f"![{title}]({path.name})" for path, (_, _, title) in zip(figures, FIGURES)),
        *notes,
    ]
    table = directory / TABLE_FILE
    with atomic_open(table) as f:
        f.write("\n".join(lines) + "\n")
    return [table, *figures]
