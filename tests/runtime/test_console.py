"""The console channel (:mod:`stapo_megatron.runtime.console`): rank filtering, the line's format,
the tqdm bar kept whole, one handler however often it is configured, and the CLI's messages on
stderr with its product on stdout."""

from __future__ import annotations

import logging
import re
import time

import pytest

from stapo_megatron.config import ConfigError
from stapo_megatron.runtime import console
from stapo_megatron.runtime.launch import spawn_ranks
from tests.runtime import _console_workers

log = logging.getLogger("stapo_megatron.tests.console")
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def _handlers() -> list[console.ConsoleHandler]:
    return [h for h in logging.getLogger(console.ROOT_LOGGER).handlers if isinstance(h, console.ConsoleHandler)]


@pytest.fixture(autouse=True)
def fresh_console(monkeypatch):
    """Each test configures a console of its own; the one a test before set up comes back after."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(console.ALL_RANKS_ENV, raising=False)
    root = logging.getLogger(console.ROOT_LOGGER)
    before, level = _handlers(), root.level
    for handler in before:
        root.removeHandler(handler)
    yield
    for handler in _handlers():
        root.removeHandler(handler)
    for handler in before:
        root.addHandler(handler)
    root.setLevel(level)


def _lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    assert captured.out == ""  # messages never go to stdout
    return captured.err.splitlines()


def test_rank_zero_speaks_other_ranks_only_warn_and_err_unless_all_ranks(capsys, monkeypatch):
    console.configure(rank=1)
    log.info("step 3 done")
    log.warning("disk nearly full")
    log.error("rank lost")
    lines = _lines(capsys)
    assert len(lines) == 2
    assert re.fullmatch(rf"{STAMP} \[stapo rank 1\] warning: disk nearly full", lines[0]), lines
    assert re.fullmatch(rf"{STAMP} \[stapo rank 1\] error: rank lost", lines[1]), lines

    console.configure(all_ranks=True)  # logging.all_ranks: true
    log.info("step 4 done")
    assert re.fullmatch(rf"{STAMP} \[stapo rank 1\] step 4 done", _lines(capsys)[0])

    console.configure(rank=0, all_ranks=False)
    log.info("step 5 done")
    assert re.fullmatch(rf"{STAMP} \[stapo\] step 5 done", _lines(capsys)[0])  # rank 0 alone: no rank named

    # The environment turns all ranks on for any command, whatever the config says; RANK is the
    # rank of a process torchrun started, before the process group exists.
    for handler in _handlers():
        logging.getLogger(console.ROOT_LOGGER).removeHandler(handler)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(console.ALL_RANKS_ENV, "1")
    console.configure()
    console.configure(all_ranks=False)
    log.info("from the environment")
    assert re.fullmatch(rf"{STAMP} \[stapo rank 3\] from the environment", _lines(capsys)[0])


def test_a_bad_all_ranks_environment_value_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv(console.ALL_RANKS_ENV, "maybe")
    with pytest.raises(ConfigError) as err:
        console.configure()
    assert str(err.value) == "STAPO_LOG_ALL_RANKS: expected 1 or 0 (true or false), got 'maybe'"


def test_a_line_carries_the_local_time_and_a_traceback_follows_it(capsys):
    console.configure()
    before = time.time()
    log.info("resumed from %s (step %d)", "iter_0000003", 3)
    try:
        raise ValueError("bad row")
    except ValueError:
        log.exception("data failed")
    after = time.time()
    lines = _lines(capsys)
    stamp, message = lines[0][:19], lines[0][20:]
    assert message == "[stapo] resumed from iter_0000003 (step 3)"
    # The timestamp is local time to the second, between the clock readings around the call.
    logged = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
    assert int(before) - 1 <= logged <= after
    assert lines[1].endswith("[stapo] error: data failed")
    assert lines[2] == "Traceback (most recent call last):" and lines[-1] == "ValueError: bad row"


def test_configuring_again_adds_no_handler_and_keeps_the_rank(capsys):
    first = console.configure(rank=2)
    assert console.configure() is first and console.configure(all_ranks=False) is first
    assert _handlers() == [first] and first.rank == 2
    log.warning("once")
    assert len(_lines(capsys)) == 1


def test_a_record_logged_under_the_progress_bar_leaves_the_bar_whole(tmp_path, capsys):
    from stapo_megatron.trainer.config import LoggingConfig
    from stapo_megatron.trainer.metrics import MetricsLogger

    console.configure()
    metrics = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), "run", {}, resume_step=0, total_steps=10)
    metrics.log(1, {"reward/accuracy": 0.5})
    log.info("evaluating")
    metrics.log(2, {"reward/accuracy": 0.75})
    metrics.close()
    err = capsys.readouterr().err
    # What the terminal shows after each carriage return or newline; a torn bar would be the bar's
    # text with the message glued after it.
    shown = re.split(r"[\r\n]", err)
    (message,) = [i for i, text in enumerate(shown) if "evaluating" in text]
    assert re.fullmatch(rf"{STAMP} \[stapo\] evaluating", shown[message]), shown
    # Before it: the bar as drawn, then blanked; after it, on the next line, the bar drawn again.
    assert shown[message - 2].startswith("run:") and shown[message - 1].strip() == "", shown
    assert shown[message + 1] == "" and re.match(r"run: +10%.* 1/10 ", shown[message + 2]), shown
    # The bar is gone: a record after close() is a plain line.
    log.info("after the bar")
    assert re.fullmatch(rf"{STAMP} \[stapo\] after the bar\n", capsys.readouterr().err)


@pytest.mark.slow  # a minute on a busy 2-core machine: two ranks import and start Megatron
def test_each_rank_logs_with_the_rank_init_distributed_gave_it(tmp_path):
    spawn_ranks(_console_workers.console_of_each_rank, 2, str(tmp_path))
    # What each rank's stderr got from this test's logger (Megatron may write there too).
    ranks = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(2)]
    mine = [[line[20:] for line in lines if "by default" in line or "all_ranks" in line] for lines in ranks]
    assert mine[0] == [
        "[stapo] info by default",
        "[stapo] warning: warning by default",
        "[stapo] error: error by default",
        "[stapo rank 0] info with all_ranks",
    ]
    assert mine[1] == [
        "[stapo rank 1] warning: warning by default",
        "[stapo rank 1] error: error by default",
        "[stapo rank 1] info with all_ranks",
    ]


def test_stapo_writes_messages_to_stderr_and_its_product_to_stdout(tmp_path, capsys):
    from stapo_megatron.cli import main

    rows = "".join(f'{{"step": {s}, "reward/accuracy": 0.5}}\n' for s in (1, 2)) + '{"step": 3, "rew'
    (tmp_path / "metrics.jsonl").write_text(rows)
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "curves.png")]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"wrote {tmp_path / 'curves.png'}\n"
    assert re.fullmatch(
        rf"{STAMP} \[stapo\] warning: {tmp_path / 'metrics.jsonl'}: line 3 is cut off or malformed; "
        r"skipped 1 malformed row\n",
        captured.err,
    )


def test_a_rank_applies_logging_all_ranks_of_its_config(monkeypatch, tmp_path):
    from stapo_megatron.trainer import launcher, trainer

    seen = []

    class Recorder:
        def __init__(self, cfg):
            pass

        def train(self):
            seen.extend((h.rank, h.all_ranks) for h in _handlers())

    monkeypatch.setattr(trainer, "Trainer", Recorder)
    monkeypatch.setenv("RANK", "1")
    console.configure()
    for all_ranks in ("false", "true"):
        cfg = launcher.load_train_config(None, [f"run.output_dir={tmp_path}", f"logging.all_ranks={all_ranks}"])
        launcher.run_rank(cfg)
    assert seen == [(1, False), (1, True)]
