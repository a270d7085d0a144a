"""The files of an evaluation: the append-only responses, atomic JSON and text, and a directory lock.

Every response is one JSON line keyed by (benchmark, problem uid, sample index). A kill can only
leave the last line incomplete: reading drops it and cuts the file back to its last newline, so
the next append starts on a line of its own. A line inside the file that is damaged (malformed,
longer than a response can be, or not a response record) is skipped with one warning counting
them: its response counts as missing and is sampled again, and the line itself stays.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from stapo_megatron.config import ConfigError
from stapo_megatron.rewards.result import RewardResult
from stapo_megatron.runtime.jsonl import SkippedRows, is_finite_number, parse_row, read_lines
from stapo_megatron.runtime.run_files import atomic_open

RESPONSES_FILE = "responses.jsonl"
SETTINGS_FILE = "settings.json"
RESULTS_FILE = "results.json"
TABLE_FILE = "table.md"
# The files of an evaluation directory that stapo eval writes, replaces or (with --overwrite) removes.
EVALUATION_FILES = frozenset({RESPONSES_FILE, SETTINGS_FILE, RESULTS_FILE, TABLE_FILE})

Key = tuple[str, str, int]
# A response of 10^6 tokens fits; a longer line is damage, skipped without being read into memory.
MAX_RESPONSE_LINE_BYTES = 64 << 20

# Field -> accepted types of one response line.
RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "benchmark": (str,),
    "uid": (str,),
    "row": (int,),
    "sample": (int,),
    "seed": (int,),
    "answer": (str,),
    "response": (str,),
    "extracted": (str, type(None)),
    "reward": (int, float),
    "reason": (str,),
    "finish_reason": (str,),
    "tokens": (int,),
}


def record_key(record: dict) -> Key:
    return record["benchmark"], record["uid"], record["sample"]


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old file or the new one, never a part."""
    with atomic_open(path) as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def record_problem(record: dict) -> str | None:
    """Why ``record`` is not a response record (as a phrase: "has no field 'uid'"), or None."""
    for name, types in RECORD_FIELDS.items():
        if name not in record:
            return f"has no field '{name}'"
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"has a {type(value).__name__} for field '{name}'"
    if not is_finite_number(record["reward"]):
        return "has a reward that is not finite"
    try:
        RewardResult(float(record["reward"]), record["reason"], record["extracted"])
    except ValueError as err:
        return f"is not a valid score ({err})"
    return None


class ResponseStore:
    """The responses file of one evaluation directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def load(self, drop: tuple[str, ...] = ()) -> dict[Key, dict]:
        """Every complete record by key (the first one when a key repeats), without the ``drop`` fields
        (an evaluation's texts can take gigabytes); repairs a cut-off last line."""
        if not self.path.is_file():
            return {}
        records: dict[Key, dict] = {}
        skipped = SkippedRows(self.path)
        complete = 0  # bytes up to the end of the last whole line
        with open(self.path, "rb") as f:
            for line in read_lines(f, MAX_RESPONSE_LINE_BYTES):
                if not line.complete:
                    break  # the tail of a write that was killed
                complete = line.end
                record = parse_row(line, record_problem, skipped, drop_non_finite=False)
                if record is None:
                    continue
                key = record_key(record)
                if key not in records:
                    records[key] = {name: value for name, value in record.items() if name not in drop}
        skipped.warn()
        if complete < self.path.stat().st_size:
            # Cut the partial line, so the next append starts on a line of its own.
            with open(self.path, "r+b") as f:
                f.truncate(complete)
        return records

    def append(self, records: Iterable[dict]) -> None:
        """Append records and push them to disk before returning (a kill after this loses none of them)."""
        lines = []
        for record in records:
            problem = record_problem(record)
            if problem is not None:
                raise ConfigError(f"record: {problem}")
            lines.append(json.dumps(record, ensure_ascii=True) + "\n")
        text = "".join(lines)
        if not text:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


class DirectoryLock:
    """An exclusive lock on an evaluation directory, so two runs never append to the same file."""

    FILE = ".lock"

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / self.FILE
        self._file: TextIO | None = None

    def acquire(self) -> None:
        file = self._file = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            self._file = None
            raise ConfigError(f"{self.path.parent}: another evaluation is writing to this directory") from None

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None
