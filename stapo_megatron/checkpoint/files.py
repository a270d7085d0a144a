"""A checkpoint's files are regular files, and are only opened as such.

Opening a FIFO for reading waits for a writer that never comes; a device or a link can stand for
anything outside the checkpoint. Every file of a checkpoint is looked at with ``lstat`` (links
not followed) before it is read, and opened with ``O_NOFOLLOW | O_NONBLOCK``, then checked again
on the open descriptor, so nothing can be swapped in between. A refusal is one line naming the file.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from typing import cast

from stapo_megatron.config import ConfigError

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _not_regular(path: str | os.PathLike, mode: int) -> ConfigError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return ConfigError(f"{path}: {kind}, where a checkpoint holds only regular files")


def regular_size(path: str | os.PathLike) -> int:
    """The size of ``path``, which must be a regular file itself (not a link to one).
    A missing file raises FileNotFoundError, for the caller to name."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(path, info.st_mode)
    return info.st_size


def open_regular(path: str | os.PathLike, buffering: int = -1) -> io.BufferedReader | io.FileIO:
    """``open(path, "rb")`` of a regular file; a link, FIFO, device, socket or directory is a
    one-line ConfigError and is never waited on. A missing file raises FileNotFoundError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _not_regular(path, stat.S_IFLNK) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        # O_NONBLOCK has no effect on reads of a regular file; the descriptor is an ordinary one.
        return cast(io.BufferedReader | io.FileIO, os.fdopen(fd, "rb", buffering=buffering))
    except BaseException:
        os.close(fd)
        raise
