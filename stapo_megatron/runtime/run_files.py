"""Files of a run written whole or not at all, and a full disk reported as one line.

A write that fails leaves no partial file: it goes to a hidden temporary beside its target and
is renamed into place only when complete (and on disk); on failure the temporary is removed. A
full disk (ENOSPC, or a full quota) anywhere in a run's writes becomes :class:`NoSpaceError`,
whose message is ``no space left on <path>``, instead of a traceback per rank.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from stapo_megatron.config import ConfigError

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


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w"):
    """``open(path, mode)`` for a file that appears only whole (``mode`` "w" or "wb")."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
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
