"""The files of a run directory: their names, the resolved config's writer, files written whole
or not at all, and a full disk reported as one line.

A write that fails leaves no partial file: it goes to a hidden temporary beside its target and
is renamed into place only when complete (and on disk); on failure the temporary is removed. A
full disk (ENOSPC, or a full quota) anywhere in a run's writes becomes :class:`NoSpaceError`,
whose message is ``no space left on <path>``, instead of a traceback per rank. A run directory
that cannot be used (a file in its place, a read-only file system, a name too long) is a one-line
error naming ``run.output_dir``, found before anything is created.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import stat
from pathlib import Path

import yaml

from stapo_megatron.config import ConfigError, to_dict

# The names of what a run writes into its run directory (the rest: trainer/run_directory.py's RUN_OUTPUTS).
RUN_MARKER = ".stapo_run"  # makes a directory a run directory (trainer/run_directory.py)
RESOLVED_CONFIG = "config.yaml"  # the resolved config, for people: secrets redacted
STOP_FILE = "STOP"  # a request to stop after the current step: a first Ctrl-C, or the requeue script's USR1 trap
# What asks a run to stop after the current step, with a checkpoint (STOP_FILE for the ranks of a
# launch); SIGHUP as SIGTERM, so a closed terminal or a dropped ssh session loses nothing since the
# last checkpoint and leaves no private file behind.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
METRICS_FILE = "metrics.jsonl"  # one row per step (trainer/metrics.py)
# The config a `stapo train` launcher hands its ranks (secrets included, 0600): made under the lock,
# removed when the launcher ends, and by the next run when a SIGKILL left it.
RANKS_CONFIG = ".ranks_config.yaml"

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How the errors read once a library (torch's checkpoint writer, a C++ extension) has turned
# the OSError into text.
_NO_SPACE_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


class NoSpaceError(ConfigError):
    """The filesystem of ``path`` is full."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        super().__init__(f"no space left on {self.path}")


def is_no_space(error: BaseException | None) -> bool:
    """Whether ``error``, or any exception in its chain, is a full disk."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _NO_SPACE_ERRNOS:
            return True
        if any(text in str(error) for text in _NO_SPACE_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def reporting_no_space(path: str | os.PathLike):
    """Turn a full disk inside the block into :class:`NoSpaceError` naming ``path``."""
    try:
        yield
    except NoSpaceError:
        raise
    except BaseException as error:  # torch's CheckpointException is not an Exception
        if is_no_space(error):
            raise NoSpaceError(path) from None
        raise


_TEMPORARY_SUFFIX = ".tmp"
_TEMPORARY_NAME = re.compile(r"\.(?P<target>.+)\.\d+" + re.escape(_TEMPORARY_SUFFIX))


def temporary_target(name: str) -> str | None:
    """The file name that :func:`atomic_open`'s temporary ``name`` was to become (a write cut off by
    SIGKILL leaves one), or None when ``name`` is not one."""
    match = _TEMPORARY_NAME.fullmatch(name)
    return match.group("target") if match else None


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w"):
    """``open(path, mode)`` for a file that appears only whole (``mode`` "w" or "wb")."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}{_TEMPORARY_SUFFIX}")
    try:
        with reporting_no_space(path):
            with open(temporary, mode, encoding=None if "b" in mode else "utf-8") as f:
                yield f
                f.flush()
                # A full disk may show only when the data reaches it (delayed allocation, NFS).
                os.fsync(f.fileno())
            os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def run_directory_error(directory: str | os.PathLike, reason: str) -> ConfigError:
    """The one-line error of a run directory that cannot be used, naming ``run.output_dir``."""
    return ConfigError(f"run.output_dir: {directory}: {reason}; choose another run.output_dir")


def _unwritable(directory: Path) -> str | None:
    """Why no file can be made in the existing directory ``directory``, or None."""
    if os.statvfs(directory).f_flag & os.ST_RDONLY:
        return f"{directory} is on a read-only file system"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable ({os.strerror(errno.EACCES)})"
    return None


def check_usable_directory(directory: str | os.PathLike) -> None:
    """Raise :func:`run_directory_error` when ``directory`` is not, and cannot become, a directory
    this process writes in, without creating anything (the checks are of the nearest existing
    directory on its path: a file in the way, a read-only file system, a name too long)."""
    directory = Path(directory)
    # os.path's tests: False, not an exception, for a name too long and the like
    if os.path.islink(directory) and not os.path.exists(directory):
        raise run_directory_error(directory, f"a symbolic link to {os.readlink(directory)!r}, which does not exist")
    if os.path.exists(directory):
        if not os.path.isdir(directory):
            raise run_directory_error(directory, "exists and is not a directory")
        reason = _unwritable(directory)
        if reason:
            raise run_directory_error(directory, reason)
        return
    missing = []
    existing = Path(os.path.abspath(directory))
    while not os.path.exists(existing):
        if os.path.islink(existing):
            raise run_directory_error(
                directory, f"{existing} is a symbolic link to a missing {os.readlink(existing)!r}"
            )
        missing.append(existing.name)
        existing = existing.parent
    if not os.path.isdir(existing):
        raise run_directory_error(directory, f"cannot be created: {existing} is not a directory")
    name_max = os.pathconf(existing, "PC_NAME_MAX")
    for name in missing:
        size = len(os.fsencode(name))
        if size > name_max:
            raise run_directory_error(
                directory, f"cannot be created: a name of {size} bytes ({name[:24]!r}...), over the {name_max} allowed"
            )
    path_max = os.pathconf(existing, "PC_PATH_MAX")
    if len(os.fsencode(os.path.abspath(directory))) >= path_max:
        raise run_directory_error(directory, f"cannot be created: its path is longer than the {path_max} bytes allowed")
    reason = _unwritable(existing)
    if reason:
        raise run_directory_error(directory, f"cannot be created: {reason}")


def is_run_directory(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` carries a run's marker (a regular file, not a link)."""
    try:
        return stat.S_ISREG(os.lstat(Path(directory) / RUN_MARKER).st_mode)
    except OSError:
        return False


def write_resolved_config(cfg) -> Path:
    """``<run>/config.yaml`` of the training config ``cfg``, for people (secrets redacted). It
    replaces only a config a run wrote: one in a directory without the run marker is the user's
    own, and is refused."""
    directory = cfg.run.directory
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RESOLVED_CONFIG
    if os.path.lexists(path) and not is_run_directory(directory):
        raise ConfigError(
            f"{path}: not written by a run ({directory} has no {RUN_MARKER}); stapo_megatron does not replace it: "
            "choose an empty or new run.output_dir"
        )
    with atomic_open(path) as f:
        yaml.safe_dump(to_dict(cfg, redact=True), f, sort_keys=False)  # for people: secrets hidden
    return path
