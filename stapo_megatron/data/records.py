"""The one record type every prompt source produces, and the report of a load."""

from __future__ import annotations

import dataclasses
from typing import Any


class DataError(ValueError):
    """Bad input data; the message names the file (or dataset), the row and the reason."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """A problem and its ground-truth answer.

    ``source`` is the benchmark or file the record came from and ``row`` its 1-based position
    there (the line number for JSON lines), so any record can be traced back. ``extra`` is the row
    itself, every field as read (a custom reward function gets it); {} for records not read from
    rows (the synthetic task's).
    """

    uid: str
    problem: str
    answer: str
    source: str
    row: int
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False, repr=False)


@dataclasses.dataclass(frozen=True)
class EncodedPrompt:
    """A record with the token ids of its prompt (template and chat template applied)."""

    record: PromptRecord
    prompt_ids: tuple[int, ...]


@dataclasses.dataclass
class LoadReport:
    """What a load kept and what it dropped, by reason, with the first few row messages."""

    source: str
    rows: int = 0
    kept: int = 0
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    messages: list[str] = dataclasses.field(default_factory=list)

    MAX_MESSAGES = 20

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def drop(self, reason: str, message: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if len(self.messages) < self.MAX_MESSAGES:
            self.messages.append(message)

    def summary(self) -> str:
        line = f"{self.source}: {self.rows} rows, kept {self.kept}, dropped {self.num_dropped}"
        if self.dropped:
            reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.dropped.items()))
            line += f" ({reasons}; first: {self.messages[0]})"
        return line
