"""The files of an evaluation: the append-only responses and verdicts, atomic JSON and text, and a directory lock.

Every response (and every verifier verdict) is one JSON line keyed by (benchmark, problem uid,
sample index). A kill can only leave the last line incomplete: reading drops it and cuts the file
back to its last newline, so the next append starts on a line of its own. A line inside the file
that is damaged (malformed, longer than a record can be, or not a record of the file's kind) is
skipped with one warning counting them: its response (or verdict) counts as missing and is made
again, and the line itself stays.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Container, Hashable, Iterable
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
VERDICTS_FILE = "verdicts.jsonl"
VERIFIER_FILE = "verifier.json"  # the settings of the verifier whose verdicts VERDICTS_FILE holds
# The files of an evaluation directory that stapo eval writes, replaces or (with --overwrite) removes.
EVALUATION_FILES = frozenset({RESPONSES_FILE, SETTINGS_FILE, RESULTS_FILE, TABLE_FILE, VERDICTS_FILE, VERIFIER_FILE})

Key = tuple[str, str, int]
# A response of 10^6 tokens fits; a longer line is damage, skipped without being read into memory.
MAX_RECORD_LINE_BYTES = 64 << 20

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


def fields_problem(record: dict, fields: dict[str, tuple[type, ...]]) -> str | None:
    """Why ``record`` lacks one of ``fields`` (field -> accepted types) or has a wrong type there, or None."""
    for name, types in fields.items():
        if name not in record:
            return f"has no field '{name}'"
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"has a {type(value).__name__} for field '{name}'"
    return None


def record_problem(record: dict) -> str | None:
    """Why ``record`` is not a response record (as a phrase: "has no field 'uid'"), or None."""
    problem = fields_problem(record, RECORD_FIELDS)
    if problem is not None:
        return problem
    if not is_finite_number(record["reward"]):
        return "has a reward that is not finite"
    try:
        RewardResult(float(record["reward"]), record["reason"], record["extracted"])
    except ValueError as err:
        return f"is not a valid score ({err})"
    return None


class RecordStore:
    """An append-only JSON-lines file of one evaluation directory: its responses, or its verdicts.

    ``problem`` says why a line's record is not one of the file's (or None); ``key`` names a record.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        problem: Callable[[dict], str | None] = record_problem,
        key: Callable[[dict], Hashable] = record_key,
    ):
        self.path = Path(path)
        self.problem = problem
        self.key = key

    def load(self, keep: Callable[[dict], Any] = dict, only: Container | None = None) -> dict:
        """``keep(record)`` of every complete record by key (the first one when a key repeats), of the
        keys in ``only`` when given; ``keep`` decides what stays in memory (an evaluation's texts can
        take gigabytes). Repairs a cut-off last line."""
        if not self.path.is_file():
            return {}
        records: dict = {}
        skipped = SkippedRows(self.path)
        complete = 0  # bytes up to the end of the last whole line
        with open(self.path, "rb") as f:
            for line in read_lines(f, MAX_RECORD_LINE_BYTES):
                if not line.complete:
                    break  # the tail of a write that was killed
                complete = line.end
                record = parse_row(line, self.problem, skipped, drop_non_finite=False)
                if record is None:
                    continue
                key = self.key(record)
                if key not in records and (only is None or key in only):
                    records[key] = keep(record)
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
            problem = self.problem(record)
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
