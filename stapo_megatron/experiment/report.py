"""A study's report: a Markdown table of each method over its seeds and PNG figures with bands.

Every number is read from the runs' ``metrics.jsonl`` rows. Per run: the final accuracy is the
mean of ``reward/accuracy`` over the last tenth of the steps (at least one), the end entropy the
mean of ``policy/entropy`` over the same steps, the masked fraction the mean of
``s2t/masked_fraction`` over all steps. Per method: the mean of those over its seeds and the 95%
percentile bootstrap interval of that mean (:mod:`stapo_megatron.experiment.stats`). A figure
draws, per method, the mean over seeds of each run's moving average and, per step, the bootstrap
interval of that mean as a band.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from stapo_megatron.config import ConfigError
from stapo_megatron.experiment.methods import Method
from stapo_megatron.experiment.stats import CONFIDENCE, RESAMPLES, Interval, bootstrap_mean
from stapo_megatron.runtime.run_files import atomic_open
from stapo_megatron.trainer.plot import save_figure, smooth

TABLE_FILE = "comparison.md"
# The trainer logs the entropy quantiles beside policy/entropy only where policy/entropy is the
# mean over every response token of the step, whatever the preset and whether zero-advantage
# groups are left out of the update: every row of every run must have them, so that all methods'
# entropy is of the same population.
ENTROPY_POPULATION = "every response token of the step (the rollout's old policy), for every method alike"
# The clip fractions show that the off-policy mini-batches let the clip act (one mini-batch per
# rollout step has ratio 1, where no token is clipped).
CLIP_METRICS = ("policy/clip_low_fraction", "policy/clip_high_fraction", "policy/dual_clip_fraction")
REQUIRED_METRICS = ("reward/accuracy", "policy/entropy", "policy/entropy_p50", "s2t/masked_fraction", *CLIP_METRICS)
# (metric, figure file, panel quantity); a figure has a panel per group of methods (method_groups).
FIGURES = (
    ("reward/accuracy", "accuracy.png", "accuracy of sampled responses"),
    ("policy/entropy", "entropy.png", "policy entropy over all response tokens (nats)"),
    ("s2t/masked_fraction", "masked_fraction.png", "fraction of response tokens the token rule masks"),
)
# Masked fractions span 1e-4 (STAPO) to 0.8 (20-Entropy keeps the top 20%): a log axis shows both.
LOG_METRICS = frozenset({"s2t/masked_fraction"})


def edge_window(steps: int) -> int:
    """Steps averaged at the start and at the end of a run: a tenth of them, at least one."""
    return max(1, steps // 10)


@dataclasses.dataclass
class MethodRuns:
    """A method's finished runs: (seed, metrics rows in step order) each."""

    method: Method
    runs: list[tuple[int, list[dict]]]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def check_metrics(label: str, rows: list[dict]) -> None:
    """Refuse, in one line naming the run, rows without one of :data:`REQUIRED_METRICS` on some step."""
    if not rows:
        raise ConfigError(f"{label}: no metrics.jsonl rows to compare")
    for row in rows:
        missing = [key for key in REQUIRED_METRICS if row.get(key) is None]
        if missing:
            raise ConfigError(
                f"{label}: metrics.jsonl step {row.get('step')} has no {missing[0]} (a study needs "
                f"{', '.join(REQUIRED_METRICS)} on every step: entropy over {ENTROPY_POPULATION})"
            )


def summarize_run(rows: list[dict], window: int) -> dict[str, float]:
    """One run's numbers (its rows checked by :func:`check_metrics`); ``window``: the end's steps."""
    accuracy = [row["reward/accuracy"] for row in rows]
    entropy = [row["policy/entropy"] for row in rows]
    return {
        "steps": rows[-1]["step"],
        "final_accuracy": _mean(accuracy[-window:]),
        "entropy_start": _mean(entropy[:window]),
        "entropy_end": _mean(entropy[-window:]),
        "masked_mean": _mean([row["s2t/masked_fraction"] for row in rows]),
        "clipped_mean": _mean([sum(row[key] for key in CLIP_METRICS) for row in rows]),
        "step_seconds": sum(row.get("time/step", 0.0) for row in rows),
    }


def _run_label(method: Method, seed: int) -> str:
    return f"{method.spec} seed {seed}"


def _summaries(method_runs: MethodRuns, window: int) -> list[dict[str, float]]:
    for seed, rows in method_runs.runs:
        check_metrics(_run_label(method_runs.method, seed), rows)
    return [summarize_run(rows, window) for _, rows in method_runs.runs]


def study_table(methods: list[MethodRuns], window: int, wall_seconds: dict[str, float]) -> list[str]:
    """Markdown lines: one row per method, its numbers over its seeds. ``wall_seconds``: per run
    key (:func:`run_key`) the recorded time of ``stapo train``, else the sum of its steps' times."""
    lines = [
        "| method | seeds | steps | final accuracy | entropy end (nats, all response tokens) "
        "| masked fraction (mean) | entropy start (nats) | clipped tokens (mean) | wall time per run (s) |",
        "|---|---:|---:|---|---|---|---:|---:|---:|",
    ]
    for entry in methods:
        summaries = _summaries(entry, window)
        steps = sorted({int(s["steps"]) for s in summaries})
        walls = [
            wall_seconds.get(run_key(entry.method, seed), summary["step_seconds"])
            for (seed, _), summary in zip(entry.runs, summaries)
        ]
        lines.append(
            f"| {entry.method.spec} | {len(summaries)} | {'/'.join(map(str, steps))} "
            f"| {Interval.of([s['final_accuracy'] for s in summaries]).text('.3f')} "
            f"| {Interval.of([s['entropy_end'] for s in summaries]).text('.3f')} "
            f"| {Interval.of([s['masked_mean'] for s in summaries]).text('.3%')} "
            f"| {_mean([s['entropy_start'] for s in summaries]):.3f} "
            f"| {_mean([s['clipped_mean'] for s in summaries]):.3%} | {_mean(walls):.0f} |"
        )
    return lines


def runs_table(methods: list[MethodRuns], window: int, wall_seconds: dict[str, float]) -> list[str]:
    """Markdown lines: one row per run."""
    lines = [
        "| method | seed | final accuracy | entropy end (nats) | masked fraction (mean) | wall time (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for entry in methods:
        for (seed, _), summary in zip(entry.runs, _summaries(entry, window)):
            wall = wall_seconds.get(run_key(entry.method, seed), summary["step_seconds"])
            lines.append(
                f"| {entry.method.spec} | {seed} | {summary['final_accuracy']:.3f} | {summary['entropy_end']:.3f} "
                f"| {summary['masked_mean']:.3%} | {wall:.0f} |"
            )
    return lines


def run_key(method: Method, seed: int) -> str:
    """A run's key in the recorded wall times, and its directory relative to the study's."""
    return f"{method.name}/seed_{seed}"


def method_groups(methods: Sequence[Method]) -> list[tuple[str, list[Method]]]:
    """The figures' panels: the bare presets together, then one panel per preset and set of fields
    its variants set (``stapo:q=...``), with that preset's bare method as the reference."""
    groups: dict[tuple[str, ...], list[Method]] = {}
    for method in methods:
        key = (method.preset, *sorted(k for k, _ in method.fields)) if method.fields else ()
        groups.setdefault(key, []).append(method)
    panels = []
    for key, members in groups.items():
        if not key:
            panels.append(("presets", members))
            continue
        preset, *fields = key
        reference = [m for m in methods if m.preset == preset and not m.fields]
        panels.append((f"{preset}, varying {', '.join(fields)}", [*reference, *members]))
    return panels


def mean_band(runs: list[tuple[int, list[dict]]], key: str, window: int) -> tuple[list[int], tuple]:
    """The steps every run has ``key`` at, and over the runs, per step: the mean of each run's
    ``window``-step moving average and its bootstrap interval."""
    series = [{row["step"]: row[key] for row in rows if row.get(key) is not None} for _, rows in runs]
    steps = sorted(set.intersection(*(set(s) for s in series)))
    if not steps:
        raise ConfigError(f"{key}: the runs have no step in common to draw")
    smoothed = [smooth([s[step] for step in steps], window) for s in series]
    return steps, bootstrap_mean(smoothed)


def band_figure(methods: list[MethodRuns], key: str, quantity: str, out: Path, window: int) -> Path:
    """Write ``out``: a panel per :func:`method_groups` group, a mean curve and band per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name = {entry.method.name: entry for entry in methods}
    groups = method_groups([entry.method for entry in methods])
    colours = {entry.method.name: plt.get_cmap("tab20")(i % 20) for i, entry in enumerate(methods)}
    columns = min(3, len(groups))
    rows_count = -(-len(groups) // columns)
    figure, axes = plt.subplots(rows_count, columns, figsize=(6 * columns, 3.6 * rows_count), squeeze=False)
    for axis in axes.flat[len(groups) :]:
        axis.set_visible(False)
    for axis, (title, members) in zip(axes.flat, groups):
        for method in members:
            steps, (mean, low, high) = mean_band(by_name[method.name].runs, key, window)
            colour = colours[method.name]
            axis.plot(steps, mean, label=method.spec, color=colour, linewidth=1.4)
            axis.fill_between(steps, low, high, color=colour, alpha=0.2, linewidth=0)
        if key in LOG_METRICS:
            axis.set_yscale("symlog", linthresh=1e-4)
            axis.set_ylim(bottom=0)  # fractions: no negative decades
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(
        f"{quantity}: mean over seeds of the {window}-step moving average, "
        f"band: {CONFIDENCE:.0%} bootstrap interval of the mean per step",
        fontsize=10,
    )
    figure.tight_layout()
    return save_figure(figure, out)


def write_report(
    directory: str | os.PathLike,
    methods: list[MethodRuns],
    wall_seconds: dict[str, float],
    heading: Sequence[str],
    notes: Sequence[str] = (),
) -> list[Path]:
    """Write the table (under the ``heading`` lines, with the ``notes`` lines last) and one figure
    per metric of :data:`FIGURES` into ``directory``; returns the files written, the table first."""
    directory = Path(directory)
    for entry in methods:
        if not entry.runs:
            raise ConfigError(f"{entry.method.spec}: no runs to compare")
        for seed, rows in entry.runs:
            check_metrics(_run_label(entry.method, seed), rows)
    window = edge_window(max(len(rows) for entry in methods for _, rows in entry.runs))
    lines = [
        *heading,
        "",
        *study_table(methods, window, wall_seconds),
        "",
        f"Each cell: the mean over seeds and, in brackets, its {CONFIDENCE:.0%} percentile bootstrap interval "
        f"({RESAMPLES:,} resamples of the seeds, seeded: see stapo_megatron/experiment/stats.py). Per run: final "
        f"accuracy and end entropy are means over the last {window} steps, entropy start over the first {window}; "
        f"the masked fraction (response tokens the token rule gives no gradient, s2t/masked_fraction) is the "
        f"mean over all steps. Entropy (policy/entropy): the mean over {ENTROPY_POPULATION}. Clipped tokens: "
        "the run tokens whose ratio the clip, clip-higher or dual-clip caps (the sum of policy/clip_low_fraction, "
        "clip_high_fraction and dual_clip_fraction), mean over steps and seeds.",
        "",
        *(f"![{quantity}]({name})" for _, name, quantity in FIGURES),
        "",
        "Every run:",
        "",
        *runs_table(methods, window, wall_seconds),
        *notes,
    ]
    figures = [band_figure(methods, key, quantity, directory / name, window) for key, name, quantity in FIGURES]
    table = directory / TABLE_FILE
    with atomic_open(table) as f:
        f.write("\n".join(lines) + "\n")
    return [table, *figures]
