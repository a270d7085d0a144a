"""`stapo plot` and the readers of metrics.jsonl against files a kill, a disk, a hand or an attacker
left: malformed rows skipped with one counted warning, non-finite points dropped, memory bounded on
a huge line, a bounded --window, and a figure that never replaces what stapo did not draw."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import textwrap

import pytest

from stapo_megatron.cli import main
from stapo_megatron.trainer.metrics import METRICS_FILE, MetricsLogger, read_metrics
from stapo_megatron.trainer.plot import plot_runs, smooth

GOOD = [{"step": s, "reward/accuracy": 0.1 * s, "policy/entropy": 1.0 / s} for s in (1, 2, 3)]


def write_run(directory, lines):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / METRICS_FILE).write_text("".join(line + "\n" for line in lines))
    return directory


def stapo_errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("stapo: error:")]


def drawn_by_stapo(path) -> bool:
    from stapo_megatron.trainer.plot import drawn_by_stapo as drawn

    return drawn(path)


def test_malformed_rows_are_skipped_with_one_counted_warning(tmp_path, caplog):
    """Rows that are no objects, lack a step, or hold texts, lists, objects, booleans or null where
    numbers belong are skipped (before: AttributeError, KeyError or TypeError tracebacks in plot,
    or a string step drawn as a category); one warning names the first and counts them all."""
    lines = [
        json.dumps(GOOD[0]),
        "[1, 2]",  # line 2: not an object
        '{"reward/accuracy": 0.5}',  # no step
        '{"step": "2", "reward/accuracy": 0.5}',  # a text step
        '{"step": true, "reward/accuracy": 0.5}',  # a boolean step
        '{"step": 2.5, "reward/accuracy": 0.5}',  # not a whole number
        '{"step": -1, "reward/accuracy": 0.5}',  # below 0
        '{"step": 4, "reward/accuracy": "0.5"}',  # a text value
        '{"step": 4, "reward/accuracy": [0.5]}',  # a list
        '{"step": 4, "reward/accuracy": {"a": 1}}',  # an object
        '{"step": 4, "reward/accuracy": false}',  # a boolean value
        "[" * 100_000 + "]" * 100_000,  # nested beyond the JSON reader's depth
        json.dumps(GOOD[1]),
        '{"step": 5, "reward/accuracy": 0.5, "policy/entropy": null}',  # null: how the trainer writes a NaN
        json.dumps(GOOD[2]),
        '{"step": 6, "reward/acc',  # cut off
    ]
    run = write_run(tmp_path / "run", lines)
    with caplog.at_level(logging.WARNING):
        rows = read_metrics(run)
    assert rows == [GOOD[0], GOOD[1], {"step": 5, "reward/accuracy": 0.5, "policy/entropy": None}, GOOD[2]]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{run / METRICS_FILE}: line 2 is not a JSON object; skipped 12 malformed rows"]

    caplog.clear()
    assert main(["plot", str(run)]) == 0
    assert drawn_by_stapo(run / "curves.png")


def test_nan_and_inf_points_are_dropped_not_propagated(tmp_path, caplog):
    """A NaN made every moving average after it NaN, so the curve vanished from there on (before:
    read_metrics kept NaN, Infinity and overflowing numbers). They are dropped, and counted."""
    lines = [
        '{"step": 1, "reward/accuracy": 0.5}',
        '{"step": 2, "reward/accuracy": NaN, "policy/entropy": 1.0}',
        '{"step": 3, "reward/accuracy": Infinity}',
        '{"step": 4, "reward/accuracy": -Infinity}',
        '{"step": 5, "reward/accuracy": 1e999}',
        '{"step": 6, "reward/accuracy": ' + "9" * 400 + "}",  # an integer no float holds
        '{"step": 7, "reward/accuracy": 0.7}',
    ]
    run = write_run(tmp_path / "run", lines)
    with caplog.at_level(logging.WARNING):
        rows = read_metrics(run)
    assert rows == [
        {"step": 1, "reward/accuracy": 0.5},
        {"step": 2, "policy/entropy": 1.0},
        {"step": 3},
        {"step": 4},
        {"step": 5},
        {"step": 6},
        {"step": 7, "reward/accuracy": 0.7},
    ]
    assert [r.getMessage() for r in caplog.records] == [
        f"{run / METRICS_FILE}: line 2 has a non-finite 'reward/accuracy'; skipped 5 non-finite values"
    ]
    series = [row["reward/accuracy"] for row in rows if row.get("reward/accuracy") is not None]
    assert smooth(series, 10) == [0.5, 0.6]  # the curve goes on after the NaN
    assert main(["plot", str(run)]) == 0


def test_window_below_one_is_one_line(tmp_path, capsys):
    """--window 0 divided by zero, a negative one too (ZeroDivisionError traceback)."""
    run = write_run(tmp_path / "run", [json.dumps(row) for row in GOOD])
    for window in ("0", "-3"):
        assert main(["plot", str(run), "--window", window]) == 2
        err = capsys.readouterr().err
        assert stapo_errors(err) == [
            f"stapo: error: --window: must be a whole number of steps from 1 to 10,000,000, got {window}"
        ]
        assert "Traceback" not in err
    assert not (run / "curves.png").exists()


def test_the_figure_replaces_only_what_stapo_drew(tmp_path, capsys):
    """`stapo plot RUN --out RUN/metrics.jsonl` wrote a PNG over the metrics with exit 0. Now --out
    must end in .png, an existing file is replaced only when stapo drew it, and a figure never goes
    into a run directory's subdirectories (an extra file fails a checkpoint's integrity check)."""
    run = write_run(tmp_path / "run", [json.dumps(row) for row in GOOD])
    metrics = (run / METRICS_FILE).read_bytes()
    (run / "checkpoints" / "iter_0000003").mkdir(parents=True)
    marked = tmp_path / "marked"  # a run directory by its marker alone, before its first metrics row
    (marked / "checkpoints").mkdir(parents=True)
    (marked / ".stapo_run").write_text('{"format": 1}')
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n a figure of the user's own")
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's notes")
    os.mkfifo(tmp_path / "pipe.png")

    refused = {
        run / METRICS_FILE: "must end in .png (the figure is a PNG)",
        notes: "must end in .png (the figure is a PNG)",
        mine: "exists and is not a figure stapo drew; remove it or choose another --out",
        tmp_path / "pipe.png": "exists and is not a figure stapo drew; remove it or choose another --out",
        run / "checkpoints" / "iter_0000003" / "x.png": (
            f"inside the run directory {run.resolve()}; put the figure beside its metrics.jsonl or outside it"
        ),
        marked / "checkpoints" / "x.png": (
            f"inside the run directory {marked.resolve()}; put the figure beside its metrics.jsonl or outside it"
        ),
        tmp_path / "missing" / "x.png": f"{tmp_path / 'missing'} is not a directory",
    }
    for out, why in refused.items():
        assert main(["plot", str(run), "--out", str(out)]) == 2
        assert stapo_errors(capsys.readouterr().err) == [f"stapo: error: --out {out}: {why}"]
    assert (run / METRICS_FILE).read_bytes() == metrics
    assert mine.read_bytes() == b"\x89PNG\r\n\x1a\n a figure of the user's own"
    assert notes.read_text() == "the user's notes"
    assert os.listdir(run / "checkpoints" / "iter_0000003") == []

    # Its own figures it replaces: the default one twice, and one beside the run.
    for out in (None, None, tmp_path / "beside.PNG"):
        assert main(["plot", str(run), *(["--out", str(out)] if out else [])]) == 0
        written = out or run / "curves.png"
        assert capsys.readouterr().out == f"wrote {written}\n"
        assert drawn_by_stapo(written) and written.stat().st_size > 10_000
    assert sorted(os.listdir(run)) == ["checkpoints", "curves.png", METRICS_FILE]  # no temporary left
    assert b"Software\x00stapo_megatron" in (run / "curves.png").read_bytes()[:200]


def test_plot_runs_checks_before_reading(tmp_path):
    """The library call refuses the same way as the command (the experiment draws through it)."""
    from stapo_megatron.config import ConfigError

    run = write_run(tmp_path / "run", [json.dumps(row) for row in GOOD])
    with pytest.raises(ConfigError, match=r"must end in \.png"):
        plot_runs([run], run / METRICS_FILE)
    with pytest.raises(ConfigError, match="--window"):
        plot_runs([run], window=0)


def test_the_metrics_repair_on_resume_skips_malformed_rows(tmp_path, caplog):
    """Resuming rewrote metrics.jsonl through ``row.get("step", 0) <= step``: a text step was a
    TypeError at the start of every resumed run. Malformed rows are now dropped by the repair."""
    from tests.trainer.test_run_directory import _config

    run = write_run(
        tmp_path,
        [json.dumps(GOOD[0]), '{"step": "2"}', "[]", json.dumps(GOOD[1]), '{"step": 3, "x": NaN}', json.dumps(GOOD[2])],
    )
    logging_cfg = _config(tmp_path, "logging.progress_bar=false", "logging.tensorboard=false").logging
    with caplog.at_level(logging.WARNING):
        logger = MetricsLogger(run, logging_cfg, "run", {}, resume_step=2, total_steps=10)
    logger.close()
    assert [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()] == GOOD[:2]
    assert "line 2 has a step that is not a whole number from 0 to 10,000,000; skipped 2 malformed rows" in caplog.text


_MEASURE = textwrap.dedent(
    """
    import json, logging, resource, sys
    from stapo_megatron.trainer.metrics import read_metrics
    logging.basicConfig(level=logging.WARNING)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = read_metrics(sys.argv[1])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"rows": rows, "grown_kib": grown}))
    """
)


def test_a_huge_line_is_skipped_in_bounded_memory(tmp_path):
    """A single-line metrics.jsonl of 2 GB peaked at 4.5 GB: the reader held the line, then its
    text. Here a 200 MB line (600 MB of growth before); the bound is on the peak resident memory of
    a fresh process, which must grow by less than 64 MB, and the rows around the line are kept."""
    run = tmp_path / "run"
    run.mkdir()
    start, block, end = b'{"step": 2, "note": "', b"a" * (1 << 20), b'"}'
    with open(run / METRICS_FILE, "wb") as f:
        f.write(b'{"step": 1, "reward/accuracy": 0.5}\n' + start)
        for _ in range(200):
            f.write(block)
        f.write(end + b'\n{"step": 3, "reward/accuracy": 0.7}\n')
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(run)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["grown_kib"] < 64 * 1024, f"peak memory grew by {result['grown_kib'] / 1024:.0f} MB"
    assert result["rows"] == [{"step": 1, "reward/accuracy": 0.5}, {"step": 3, "reward/accuracy": 0.7}]
    size = len(start) + 200 * len(block) + len(end)
    assert f"{run / METRICS_FILE}: line 2 is {size:,} bytes long, more than a row may be; skipped 1 malformed row" in (
        done.stderr
    )


def test_rows_the_trainer_writes_read_back_unchanged(tmp_path):
    """The reader's checks accept every row the trainer's own logger writes, non-finite values included."""
    from tests.trainer.test_run_directory import _config

    logging_cfg = _config(tmp_path, "logging.progress_bar=false", "logging.tensorboard=false").logging
    logger = MetricsLogger(tmp_path, logging_cfg, "run", {}, resume_step=0, total_steps=10)
    logger.log(1, {"reward/accuracy": 0.25, "optim/grad_norm": math.nan, "time/step": 3})
    logger.close()
    assert read_metrics(tmp_path) == [{"step": 1, "optim/grad_norm": None, "reward/accuracy": 0.25, "time/step": 3.0}]
