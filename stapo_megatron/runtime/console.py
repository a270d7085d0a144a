"""The console: every message of every command goes through the standard ``logging`` module.

Each module logs to ``logging.getLogger(__name__)``; all of them sit under the ``stapo_megatron``
logger, which :func:`configure` gives the one console handler (stderr, so that what a command
prints on stdout, its product, stays clean for a pipe). A line reads
``2026-11-30 20:41:02 [stapo] resumed from ...``; warnings and errors say so after the bracket.

Rank-aware: by default a process of rank > 0 shows only its warnings and errors (an error on any
rank is never lost), so an N-rank run does not say everything N times. ``logging.all_ranks: true``
in a run's config, or ``STAPO_LOG_ALL_RANKS=1`` in the environment (for any command), shows every
rank's messages, each line then naming its rank (``[stapo rank 3]``).

While a tqdm progress bar is on the console (:func:`bar_started`), records are written with
``tqdm.write``, which clears the bar, writes the line and redraws the bar below it.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from stapo_megatron.config import ConfigError
from stapo_megatron.runtime.environment import env_int

ROOT_LOGGER = "stapo_megatron"
ALL_RANKS_ENV = "STAPO_LOG_ALL_RANKS"
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

_bars_shown = 0  # tqdm bars between bar_started and bar_ended


def all_ranks_from_env() -> bool:
    value = os.environ.get(ALL_RANKS_ENV, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"{ALL_RANKS_ENV}: expected 1 or 0 (true or false), got {os.environ[ALL_RANKS_ENV]!r}")
    return value in _TRUE


class ConsoleHandler(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (a redirected stderr is followed), through tqdm
    while a bar is shown; shows a rank > 0's records below WARNING only when ``all_ranks``."""

    def __init__(self, rank: int, all_ranks: bool):
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks
        self.addFilter(self._shown)

    def _shown(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or self.all_ranks or record.levelno >= logging.WARNING

    def format(self, record: logging.LogRecord) -> str:
        origin = f"stapo rank {self.rank}" if self.all_ranks or self.rank else "stapo"
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        when = time.strftime(TIME_FORMAT, time.localtime(record.created))
        return f"{when} [{origin}] {level}{super().format(record)}"  # super: the message, and a traceback

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            stream = sys.stderr
            if _bars_shown:
                from tqdm import tqdm

                tqdm.write(text, file=stream)
            else:
                stream.write(text + "\n")
            stream.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def configure(*, rank: int | None = None, all_ranks: bool | None = None) -> ConsoleHandler:
    """Set up the console on the first call in a process; a later call updates it and adds nothing.

    ``rank``: this process's rank (``None``: unchanged; at first the ``RANK`` torchrun sets, else 0).
    ``all_ranks``: show every rank's messages (``None``: unchanged); ``STAPO_LOG_ALL_RANKS=1`` in
    the environment turns it on whatever this says. Records still propagate to the root logger,
    which stapo never configures, so that an embedding program's (or pytest's) handlers see them.
    """
    logger = logging.getLogger(ROOT_LOGGER)
    handler = next((h for h in logger.handlers if isinstance(h, ConsoleHandler)), None)
    if handler is None:
        handler = ConsoleHandler(env_int("RANK", low=0, high=(1 << 20) - 1, default=0), all_ranks_from_env())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    if rank is not None:
        handler.rank = rank
    if all_ranks is not None:
        handler.all_ranks = all_ranks or all_ranks_from_env()
    return handler


def bar_started() -> None:
    """A tqdm bar is on the console now: records go through ``tqdm.write`` until :func:`bar_ended`."""
    global _bars_shown
    _bars_shown += 1


def bar_ended() -> None:
    global _bars_shown
    _bars_shown = max(_bars_shown - 1, 0)
