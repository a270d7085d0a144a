"""What makes a directory a run directory, and what ``--overwrite`` moves out of one.

The trainer writes the marker :data:`RUN_MARKER` (a small JSON: its format, when it was made, the
stapo_megatron release) into every run directory it creates or starts a run in. A run starts only
in a directory that is

- new or empty: it becomes a run directory;
- marked;
- a run directory of a release from before the marker: it holds only entries a run writes
  (:data:`RUN_OUTPUTS`, :data:`DIRECTORY_ENTRIES` and their cut-off atomic writes) and the lock's
  guard, which every run of those releases left behind. It is adopted: the marker is written.

Anything else is refused in one line before anything in it is created, moved or replaced. A
directory holding only a ``STOP`` file counts as new: the requeue batch script makes it when SLURM's
signal comes before the ranks have started (stapo_megatron/launch/requeue.py).

``--overwrite`` moves those of :data:`RUN_OUTPUTS` that are there into ``<run>/archive/<time>/``,
inside the run directory. The directory's own entries (:data:`DIRECTORY_ENTRIES`: the marker, the
lock, the archive, a launcher's private config) stay, and so does every entry no run writes, which
the message names.

Only the standard library and light modules are imported, so that the readers of run directories
(``stapo plot``, ``stapo inspect``) can ask :func:`is_run_directory` cheaply.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path

from stapo_megatron import __version__
from stapo_megatron.config import ConfigError
from stapo_megatron.runtime.run_files import (
    METRICS_FILE,
    RANKS_CONFIG,
    RESOLVED_CONFIG,
    RUN_MARKER,
    STOP_FILE,
    atomic_open,
    check_usable_directory,
    is_run_directory,
    run_directory_error,
    temporary_target,
)
from stapo_megatron.runtime.run_lock import GUARD_FILE, LOCK_FILE

logger = logging.getLogger(__name__)

MARKER_FORMAT = 1
_MAX_MARKER_BYTES = 4096
ARCHIVE_DIR = "archive"

# What a run, and the commands its summary suggests, write into the run directory: an earlier
# run's, which --overwrite moves to the archive. The names that live in modules too heavy to
# import here are written out; tests/trainer/test_run_directory_confinement.py checks them against
# those modules and a real run's directory.
RUN_OUTPUTS = frozenset(
    {
        RESOLVED_CONFIG,
        STOP_FILE,  # a first Ctrl-C, or the requeue batch script's USR1 trap
        METRICS_FILE,
        "checkpoints",  # trainer.checkpoint_directory.CheckpointDirectory.root
        "tensorboard",  # trainer.metrics.MetricsLogger
        "wandb",  # wandb.init(dir=<run>)
        "spurious",  # trainer.inspector.DUMP_DIR
        "tokenizer",  # the synthetic task's tokenizer, trainer.trainer.Trainer._tokenizer_files
        "sglang",  # the launched servers' logs, rollout.factory.sglang_settings
        "eval",  # in-training evaluation, eval.evaluator.step_directory
        "curves.png",  # stapo plot's default output
        "hf",  # stapo convert --out <run>/hf, as the run summary suggests
    }
)
# What belongs to the directory rather than to one run: kept in place by --overwrite.
DIRECTORY_ENTRIES = frozenset({RUN_MARKER, ARCHIVE_DIR, LOCK_FILE, GUARD_FILE, RANKS_CONFIG})

_MARKED, _NEW, _EARLIER_RELEASE = "marked", "new", "earlier release"


def _written_by_a_run(name: str) -> bool:
    return (temporary_target(name) or name) in RUN_OUTPUTS | DIRECTORY_ENTRIES


def _marker_problem(path: Path) -> str | None:
    """Why ``path`` is not a marker this release reads, or None when it is one."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_MARKER_BYTES:
            return "not a small regular file"
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
            marker = json.loads(f.read())
    except OSError as err:
        return err.strerror or str(err)
    except ValueError:  # not UTF-8, not JSON
        return "not JSON"
    version = marker.get("format") if isinstance(marker, dict) else None
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        return "not a JSON object with a format number"
    if version > MARKER_FORMAT:
        return f"format {version}, of a stapo_megatron newer than {__version__}"
    return None


def _state(directory: Path) -> str:
    """Which kind of run directory ``directory`` (an existing directory) is; ConfigError if none."""
    marker = directory / RUN_MARKER
    if os.path.lexists(marker):
        problem = _marker_problem(marker)
        if problem:
            raise ConfigError(f"{marker}: not a stapo_megatron run marker ({problem}); choose another run.output_dir")
        return _MARKED
    try:
        names = set(os.listdir(directory))
    except OSError as err:
        raise run_directory_error(directory, f"cannot be listed ({err.strerror})") from None
    if not names or names == {STOP_FILE}:
        return _NEW
    # Every run of the releases before the marker took the lock first, which leaves the guard.
    if GUARD_FILE in names and all(_written_by_a_run(name) for name in names):
        # nothing but the lock and a stop request: a run killed before its marker, or the batch script's STOP
        outputs = any((temporary_target(name) or name) in RUN_OUTPUTS - {STOP_FILE} for name in names)
        return _EARLIER_RELEASE if outputs else _NEW
    raise ConfigError(
        f"{directory}: not a stapo_megatron run directory (no {RUN_MARKER}); choose an empty or new run.output_dir"
    )


def check_run_directory(directory: str | os.PathLike) -> None:
    """Raise a one-line :class:`ConfigError` unless a run may start in ``directory``: one it can
    create, an empty one or a run directory (see the module). Nothing is created or changed."""
    check_usable_directory(directory)
    if os.path.isdir(directory):
        _state(Path(directory))


def mark_run_directory(directory: str | os.PathLike) -> None:
    """Under the run's lock: check ``directory`` again and write its marker if it has none."""
    directory = Path(directory)
    state = _state(directory)
    if state == _MARKED:
        return
    with atomic_open(directory / RUN_MARKER) as f:
        created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        json.dump({"format": MARKER_FORMAT, "created": created, "stapo_megatron": __version__}, f)
        f.write("\n")
    if state == _EARLIER_RELEASE:
        logger.info("%s: a run directory of an earlier stapo_megatron release; marked with %s", directory, RUN_MARKER)


def _new_archive(directory: Path) -> Path:
    """A new, empty ``<run>/archive/<time>[-n]/`` (two --overwrite runs may start within a second)."""
    root = directory / ARCHIVE_DIR
    if os.path.lexists(root) and (os.path.islink(root) or not os.path.isdir(root)):
        raise ConfigError(
            f"{root}: not a directory of the run (a link or a file); --overwrite archives only inside the run "
            "directory: move it away first"
        )
    root.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for suffix in ("", *(f"-{n}" for n in range(2, 100))):
        try:
            (root / f"{stamp}{suffix}").mkdir()
        except FileExistsError:
            continue
        return root / f"{stamp}{suffix}"
    raise ConfigError(f"{root}: {stamp} and 98 more archives of this second exist already")


def archive_run_outputs(directory: str | os.PathLike) -> None:
    """``--overwrite``: move the earlier run's outputs (:data:`RUN_OUTPUTS`) of the marked run
    directory ``directory`` into a new ``<run>/archive/<time>/``; nothing else is touched."""
    directory = Path(directory)
    if not is_run_directory(directory):  # mark_run_directory comes first: this is a programming error
        raise RuntimeError(f"{directory}: --overwrite in a directory without {RUN_MARKER}")
    names = sorted(os.listdir(directory))
    moved = [name for name in names if (temporary_target(name) or name) in RUN_OUTPUTS]
    foreign = [name for name in names if not _written_by_a_run(name)]
    if moved:
        archive = _new_archive(directory)
        for name in moved:
            try:
                os.rename(directory / name, archive / name)
            except OSError as err:
                raise ConfigError(f"{directory / name}: cannot be moved to {archive} ({err.strerror})") from None
        logger.info("--overwrite: moved the earlier run (%s) to %s", ", ".join(moved), archive)
    if foreign:
        logger.info("--overwrite: left in place what no run writes: %s", ", ".join(foreign))
