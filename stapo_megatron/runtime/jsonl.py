"""Reading the JSON files a run or an evaluation wrote, whatever they hold now.

The files may be cut off by a kill, damaged, edited by hand or crafted, so a reader never trusts
them: a JSON-lines file is read line by line in chunks, and a line longer than the reader's bound
is skipped without being held in memory; a row that is not a JSON object, does not parse, is
nested too deeply for the JSON reader, or fails the reader's own check is skipped; a value that
is not a finite number (``NaN``, ``Infinity``, an integer beyond a float) is dropped from its
row. All of a file's skips become one warning that names the first and counts them all. A whole
JSON file is read only under a size bound, and anything wrong with it is a one-line ConfigError.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from stapo_megatron.config import ConfigError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
# The longest line of a run's JSON-lines files that is parsed (a response of 10^6 tokens fits).
MAX_LINE_BYTES = 64 << 20
# The largest whole JSON file read (settings, results: kilobytes).
MAX_JSON_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class Line:
    """One line of a file, as :func:`read_lines` gives it."""

    number: int  # 1-based
    data: bytes | None  # without its newline; None when it is longer than the bound (not kept)
    size: int  # its length in bytes, without the newline
    end: int  # the offset in the file just past it (past its newline when it has one)
    complete: bool  # ends with a newline (False only for the last line of a file)


def read_lines(file: IO[bytes], max_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Line]:
    """The lines of a binary ``file``, reading ``chunk_bytes`` at a time: memory stays within
    about ``max_bytes + chunk_bytes`` however long a line is."""
    number = offset = size = 0
    parts: list[bytes] | None = []  # the current line's pieces; None once it is over the bound
    while block := file.read(chunk_bytes):
        start = 0
        while True:
            newline = block.find(b"\n", start)
            stop = len(block) if newline < 0 else newline
            size += stop - start
            if parts is not None:
                if size > max_bytes:
                    parts = None
                else:
                    parts.append(block[start:stop])
            if newline < 0:
                break
            number += 1
            offset += size + 1
            yield Line(number, None if parts is None else b"".join(parts), size, offset, True)
            parts, size, start = [], 0, newline + 1
    if size:
        yield Line(number + 1, None if parts is None else b"".join(parts), size, offset + size, False)


class SkippedRows:
    """What a reader skipped in one file, reported as one warning naming the first skip."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.rows = 0
        self.values = 0
        self.first: str | None = None

    def skip_row(self, line: int, why: str) -> None:
        self.rows += 1
        self.first = self.first or f"line {line} {why}"

    def skip_value(self, line: int, key: str) -> None:
        self.values += 1
        self.first = self.first or f"line {line} has a non-finite {shown_key(key)}"

    def warn(self) -> None:
        if not self.first:
            return
        counts = []
        if self.rows:
            counts.append(f"{self.rows} malformed row{'s' if self.rows != 1 else ''}")
        if self.values:
            counts.append(f"{self.values} non-finite value{'s' if self.values != 1 else ''}")
        logger.warning("%s: %s; skipped %s", self.path, self.first, " and ".join(counts))


def shown_key(key: str, limit: int = 60) -> str:
    """A key read from a file, as a message names it: quoted, escaped, and cut to ``limit`` characters."""
    return repr(key if len(key) <= limit else key[:limit] + "...")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    if not is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def parse_row(
    line: Line,
    check: Callable[[dict], str | None],
    skipped: SkippedRows,
    drop_non_finite: bool = True,
) -> dict | None:
    """The row of ``line``, or None when it is blank or skipped (then recorded in ``skipped``).

    ``check`` returns why a parsed row is malformed, or None; with ``drop_non_finite`` the row's
    numbers that are not finite are taken out of it (and counted) before ``check`` sees it.
    """
    if line.data is None:
        skipped.skip_row(line.number, f"is {line.size:,} bytes long, more than a row may be")
        return None
    if not line.data.strip():
        return None
    try:
        row = json.loads(line.data.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested beyond the JSON reader's depth
        skipped.skip_row(line.number, "is cut off or malformed")
        return None
    if not isinstance(row, dict):
        skipped.skip_row(line.number, "is not a JSON object")
        return None
    if drop_non_finite:
        for key in [k for k, v in row.items() if is_number(v) and not is_finite_number(v)]:
            del row[key]
            skipped.skip_value(line.number, key)
    why = check(row)
    if why is not None:
        skipped.skip_row(line.number, why)
        return None
    return row


def read_rows(
    path: str | os.PathLike, check: Callable[[dict], str | None], max_line_bytes: int = MAX_LINE_BYTES
) -> list[dict]:
    """Every row of the JSON-lines file ``path`` that parses and passes ``check``, with its
    non-finite numbers dropped; one warning counts what was skipped. A path that is not a regular
    file (a FIFO would block the read) has no rows, with a warning."""
    if not Path(path).is_file():
        logger.warning("%s: not a regular file; skipped", path)
        return []
    skipped = SkippedRows(path)
    rows = []
    with open(path, "rb") as f:
        for line in read_lines(f, max_line_bytes):
            row = parse_row(line, check, skipped)
            if row is not None:
                rows.append(row)
    skipped.warn()
    return rows


def read_json(path: str | os.PathLike, what: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The content of the JSON file ``path``; anything wrong with it is a ConfigError naming ``what`` and the file."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO would block the read
        raise ConfigError(f"{what}: {path} is not a regular file")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise ConfigError(f"{what}: {path} does not exist") from None
    except OSError as err:
        raise ConfigError(f"{what}: cannot read {path} ({err.strerror})") from None
    if len(data) > max_bytes:
        raise ConfigError(f"{what}: {path} is larger than {max_bytes:,} bytes")
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ConfigError(f"{what}: {path} is nested too deeply to read") from None
    except ValueError as err:  # not UTF-8 or not JSON
        raise ConfigError(f"{what}: {path} is not valid JSON ({err})") from None
