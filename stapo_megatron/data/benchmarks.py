"""The evaluation benchmarks by name: which file, where problem and answer are, and the default k.

``default_k`` is the number of samples per problem for avg@k: 32 for the small AIME/AMC sets,
4 for the larger ones (the STAPO paper's protocol).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from stapo_megatron.data.loaders import load_records
from stapo_megatron.data.records import DataError, LoadReport, PromptRecord
from stapo_megatron.data.rows import RowSchema


@dataclasses.dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    file_name: str
    problem_field: str
    answer_field: str
    answer_format: str
    default_k: int

    @property
    def schema(self) -> RowSchema:
        return RowSchema(self.problem_field, self.answer_field, self.answer_format)


BENCHMARKS: dict[str, BenchmarkSpec] = {
    spec.name: spec
    for spec in (
        BenchmarkSpec("aime24", "aime24.jsonl", "problem", "answer", "plain", 32),
        BenchmarkSpec("aime25", "aime25.jsonl", "problem", "answer", "plain", 32),
        BenchmarkSpec("amc23", "amc23.jsonl", "problem", "answer", "plain", 32),
        BenchmarkSpec("math500", "math500.jsonl", "problem", "answer", "plain", 4),
        BenchmarkSpec("minerva", "minerva.jsonl", "problem", "solution", "boxed", 4),
        BenchmarkSpec("olympiadbench", "olympiadbench.jsonl", "question", "final_answer", "list", 4),
        BenchmarkSpec("gsm8k", "gsm8k_test.jsonl", "question", "answer", "gsm8k", 1),
    )
}

# The six benchmarks the STAPO paper reports.
PAPER_BENCHMARKS: tuple[str, ...] = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")


def get_benchmark(name: str) -> BenchmarkSpec:
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise DataError(f"unknown benchmark {name!r} (known: {', '.join(BENCHMARKS)})") from None


def load_benchmark(
    name: str, data_dir: str | os.PathLike, bad_rows: str = "drop"
) -> tuple[list[PromptRecord], LoadReport]:
    """The records of benchmark ``name`` from ``data_dir/<file_name>`` (uids ``name:row``)."""
    spec = get_benchmark(name)
    path = Path(data_dir) / spec.file_name
    if not path.is_file():
        raise DataError(f"benchmark {name}: {path} does not exist")
    return load_records(str(path), fmt="jsonl", schema=spec.schema, name=name, bad_rows=bad_rows)
