"""The files of an evaluation: the append-only responses, atomic JSON and text, and a directory lock.

Every response is one JSON line keyed by (benchmark, problem uid, sample index). A kill can only
leave the last line incomplete: reading drops it and cuts the file back to its last newline, so
the next append starts on a line of its own.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from stapo_megatron.config import ConfigError

RESPONSES_FILE = "responses.jsonl"
SETTINGS_FILE = "settings.json"
RESULTS_FILE = "results.json"
TABLE_FILE = "table.md"

Key = tuple[str, str, int]

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
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def read_json(path: str | os.PathLike, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what}: {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{what}: {path} is not valid JSON ({err})") from None


def _check_record(record: Any, where: str) -> dict:
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    for name, types in RECORD_FIELDS.items():
        if name not in record:
            raise ConfigError(f"{where}: field '{name}' is missing")
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ConfigError(f"{where}: field '{name}' has a {type(value).__name__} value")
    return record


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
        complete = 0  # bytes up to the end of the last whole line
        with open(self.path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.endswith(b"\n"):
                    break  # the tail of a write that was killed
                complete += len(line)
                if not line.strip():
                    continue
                where = f"{self.path}:{number}"
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise ConfigError(
                        f"{where}: not a JSON line; the file is damaged (move it away to start over)"
                    ) from None
                key = record_key(_check_record(record, where))
                if key not in records:
                    records[key] = {name: value for name, value in record.items() if name not in drop}
        if complete < self.path.stat().st_size:
            # Cut the partial line, so the next append starts on a line of its own.
            with open(self.path, "r+b") as f:
                f.truncate(complete)
        return records

    def append(self, records: Iterable[dict]) -> None:
        """Append records and push them to disk before returning (a kill after this loses none of them)."""
        text = "".join(json.dumps(_check_record(r, "record"), ensure_ascii=True) + "\n" for r in records)
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

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / ".lock"
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
