"""``stapo plot RUN_DIR``: PNG curves of a run (or several runs on the same axes).

The figure replaces nothing that stapo did not draw: ``--out`` must end in ``.png``; a file
already there is replaced only when it is a figure a stapo command drew (every figure carries
:data:`FIGURE_SOFTWARE` as its PNG "Software" text, which :func:`drawn_by_stapo` reads), so that
neither an input such as ``metrics.jsonl`` nor a file of anyone else is ever written over; and a
figure goes beside a run's ``metrics.jsonl`` or outside the run, never into a run directory's
subdirectories (a file added to a checkpoint would make it fail its integrity check). The
figure is written whole or not at all.
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

from stapo_megatron.config import MAX_STEPS, ConfigError
from stapo_megatron.loss.diagnostics import ENTROPY_QUANTILES, QUADRANTS
from stapo_megatron.runtime.run_files import METRICS_FILE, atomic_open, is_run_directory
from stapo_megatron.trainer.metrics import read_metrics

# The PNG "Software" text of every figure stapo draws: how a later command knows it may replace one.
FIGURE_SOFTWARE = "stapo_megatron"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_OWN_TEXT = b"Software\x00" + FIGURE_SOFTWARE.encode()
# matplotlib writes the text chunks right after the header; this many chunks are looked at.
_HEADER_CHUNKS = 16

# (metric, panel title) in the order of the panels; a panel of several metrics names them as
# (metric, line label) pairs and draws a line per metric and run.
PANELS = (
    ("reward/accuracy", "accuracy of sampled responses"),
    ("reward/mean", "reward (shaped)"),
    ("policy/entropy", "policy entropy (every response token)"),
    (
        tuple((f"policy/entropy_{name}", name) for name, _ in ENTROPY_QUANTILES),
        "policy entropy quantiles (every response token)",
    ),
    (
        tuple((f"quadrant/{name}_grad_share", name) for name in QUADRANTS),
        "A > 0 tokens' share of the gradient norm (lowp: p < tau_p, lowh: H < split)",
    ),
    ("s2t/masked_fraction", "S2T masked fraction"),
    ("response/length_mean", "response length (tokens)"),
    ("response/clipped_fraction", "responses cut at the length limit"),
    ("optim/grad_norm", "gradient norm"),
    ("mismatch/logprob_abs_mean", "train/rollout |log-prob difference|"),
)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (window 1: unchanged) of finite values (read_metrics drops the others,
    which would make every average after them NaN)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def drawn_by_stapo(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file holding a PNG that a stapo command drew."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # opening a FIFO would block
            return False
        with open(path, "rb") as f:
            if f.read(len(_PNG_SIGNATURE)) != _PNG_SIGNATURE:
                return False
            for _ in range(_HEADER_CHUNKS):
                header = f.read(8)
                if len(header) < 8:
                    return False
                length, kind = struct.unpack(">I4s", header)
                if kind == b"IDAT":  # the image data: the text chunks are before it
                    return False
                if kind == b"tEXt" and length == len(_OWN_TEXT):
                    if f.read(length) == _OWN_TEXT:
                        return True
                else:
                    f.seek(length, os.SEEK_CUR)
                f.seek(4, os.SEEK_CUR)  # the chunk's CRC
    except OSError:
        return False
    return False


def check_figure_path(out: Path, flag: str = "--out") -> None:
    """Refuse, in one line naming ``flag``, a figure path that would replace or add what it must not."""
    if out.suffix.lower() != ".png":
        raise ConfigError(f"{flag} {out}: must end in .png (the figure is a PNG)")
    if not out.parent.is_dir():
        raise ConfigError(f"{flag} {out}: {out.parent} is not a directory")
    if os.path.lexists(out) and not drawn_by_stapo(out):
        raise ConfigError(f"{flag} {out}: exists and is not a figure stapo drew; remove it or choose another {flag}")
    for directory in out.parent.resolve().parents:
        # marked, or a run of a release from before the marker
        if is_run_directory(directory) or (directory / METRICS_FILE).is_file():
            raise ConfigError(
                f"{flag} {out}: inside the run directory {directory}; "
                f"put the figure beside its {METRICS_FILE} or outside it"
            )


def plot_runs(run_dirs: list[str | os.PathLike], out: str | os.PathLike | None = None, window: int = 10) -> Path:
    """One PNG with a panel per metric; one line per run. Returns the file written."""
    if isinstance(window, bool) or not 1 <= window <= MAX_STEPS:
        raise ConfigError(f"--window: must be a whole number of steps from 1 to {MAX_STEPS:,}, got {window}")
    out = Path(out) if out else Path(run_dirs[0]) / "curves.png"
    check_figure_path(out)
    runs = []
    for run_dir in run_dirs:
        rows = read_metrics(run_dir)
        if not rows:
            raise ConfigError(f"{run_dir}: no metrics.jsonl rows to plot")
        runs.append((Path(run_dir).name, rows))
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
    """Write ``out`` (whole, marked as stapo's): a panel per (metric, title) of ``panels`` (or
    per ((metric, label), ...), title): several metrics, each line labelled), a line per (label,
    metrics rows) of ``runs`` and metric, each smoothed over ``window`` steps. Metrics in
    ``log_panels`` get a symmetric log axis (linear near 0), so that values of 1e-4 and of 0.8
    show on one panel. The caller checks that ``out`` may be written (:func:`check_figure_path`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    columns = min(columns, len(panels))
    rows_count = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows_count, columns, figsize=(6 * columns, 3.2 * rows_count), squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis, (metrics, panel_title) in zip(axes.flat, panels):
        lines = [(metrics, None)] if isinstance(metrics, str) else list(metrics)
        for name, rows in runs:
            for key, label in lines:
                points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
                if points:
                    steps, values = zip(*points)
                    shown = name if label is None else (f"{name} {label}" if len(runs) > 1 else label)
                    axis.plot(steps, smooth(list(values), window), label=shown, linewidth=1.4)
        if len(lines) > 1 and axis.get_lines():
            axis.legend(fontsize=7)
        if any(key in log_panels for key, _ in lines):
            axis.set_yscale("symlog", linthresh=1e-4)
            axis.set_ylim(bottom=0)  # fractions: no negative decades
        axis.set_title(panel_title, fontsize=10)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    return save_figure(figure, out)


def save_figure(figure, out: Path) -> Path:
    """Write ``figure`` to ``out`` as a PNG marked as drawn by this project (atomically), then close it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_open(out, "wb") as f:
            figure.savefig(f, format="png", dpi=110, metadata={"Software": FIGURE_SOFTWARE})
    finally:
        plt.close(figure)
    return out
