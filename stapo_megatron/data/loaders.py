"""Prompt records from parquet, JSON lines, or a Hugging Face dataset.

Rows stream from the source; the schema (where problem and answer are) is fixed from the first
row unless given. A row without a usable problem or answer is dropped and counted by reason,
with its file and row number (or, with ``bad_rows="error"``, stops the load right there).
"""

from __future__ import annotations

import codecs
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stapo_megatron.data.records import DataError, LoadReport, PromptRecord
from stapo_megatron.data.rows import BadRow, RowSchema, check_row_text, detect_schema, row_to_record

logger = logging.getLogger(__name__)

FORMATS = ("auto", "parquet", "jsonl", "hf")
_FILE_FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}


def resolve_format(source: str, fmt: str = "auto") -> str:
    """parquet, jsonl or hf for ``source``; raises DataError for a file path that does not exist."""
    if fmt not in FORMATS:
        raise DataError(f"{source}: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    path = Path(source)
    if fmt in ("parquet", "jsonl"):
        if not path.is_file():
            raise DataError(f"{source}: file does not exist")
        return fmt
    if fmt == "hf":
        return fmt
    if path.is_dir():
        return "hf"
    suffix = path.suffix.lower()
    if suffix in _FILE_FORMATS:
        if not path.is_file():
            raise DataError(f"{source}: file does not exist")
        return _FILE_FORMATS[suffix]
    if path.exists():
        raise DataError(f"{source}: cannot tell the format from the name; set format to parquet or jsonl")
    return "hf"  # a dataset name on the Hugging Face hub


class _Malformed:
    """Stands for a row that could not even be decoded."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


def _jsonl_line(raw: bytes, first: bool) -> Any:
    """One JSON line's row, or a marker saying why it cannot be read (bytes that are not UTF-8,
    malformed JSON, nesting deeper than the JSON reader goes)."""
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as err:
        return _Malformed("undecodable", f"not UTF-8 text ({err.reason} at column {err.start + 1})")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        return _Malformed("malformed_json", f"malformed JSON ({err.msg} at column {err.colno})")
    except RecursionError:  # the C scanner's own depth guard: caught per row, nothing is left half-done
        return _Malformed("too_deep", "JSON nested too deeply to read")


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    # Bytes, decoded line by line: one undecodable line is one bad row, not a failed load.
    with open(path, "rb") as f:
        start = f.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip()
        while not start:
            chunk = f.read(1 << 16)
            if not chunk:
                break
            start = chunk.lstrip()
        f.seek(0)
        if start.startswith(b"["):  # a .json file holding one array
            # surrogateescape keeps undecodable bytes inside strings as lone surrogates, so that
            # check_row_text drops just the rows holding them.
            text = f.read().decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as err:
                yield err.lineno, _Malformed("malformed_json", f"malformed JSON ({err.msg})")
                return
            except RecursionError:
                yield 1, _Malformed("too_deep", "JSON nested too deeply to read")
                return
            yield from enumerate(rows, start=1)
            return
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            yield line_number, _jsonl_line(raw, line_number == 1)


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    row_number = 0
    for batch in parquet.iter_batches(batch_size=4096):
        try:
            rows = batch.to_pylist()
        except UnicodeDecodeError:
            # A string column holding bytes that are not UTF-8: convert row by row to find them.
            rows = [_parquet_row(batch, i) for i in range(batch.num_rows)]
        for row in rows:
            row_number += 1
            yield row_number, row


def _parquet_row(batch: Any, index: int) -> Any:
    try:
        return batch.slice(index, 1).to_pylist()[0]
    except UnicodeDecodeError as err:
        return _Malformed("undecodable", f"a string column holds bytes that are not UTF-8 ({err.reason})")


def _hf_rows(source: str, split: str) -> Iterator[tuple[int, Any]]:
    import datasets

    path = Path(source)
    if path.is_dir() and (path / "dataset_info.json").exists() and (path / "state.json").exists():
        dataset = datasets.load_from_disk(source)  # written by Dataset.save_to_disk
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise DataError(f"{source}: no split {split!r} (splits: {', '.join(dataset)})")
            dataset = dataset[split]
    else:
        dataset = datasets.load_dataset(source, split=split)
    yield from enumerate(dataset, start=1)


def iter_rows(source: str, fmt: str = "auto", split: str = "train") -> Iterator[tuple[int, Any]]:
    """(1-based row number, row) pairs; undecodable JSON lines come as markers, reported as bad rows."""
    fmt = resolve_format(source, fmt)
    if fmt == "parquet":
        return _parquet_rows(Path(source))
    if fmt == "jsonl":
        return _jsonl_rows(Path(source))
    return _hf_rows(source, split)


def load_records(
    source: str,
    *,
    fmt: str = "auto",
    split: str = "train",
    problem_field: str = "auto",
    answer_field: str = "auto",
    answer_format: str = "auto",
    schema: RowSchema | None = None,
    name: str | None = None,
    bad_rows: str = "drop",
    deduplicate: bool = False,
) -> tuple[list[PromptRecord], LoadReport]:
    """Records from ``source`` and the report of what was kept and dropped (also logged).

    ``name`` labels the records (``uid = name:row``; default: the file name without suffix).
    ``bad_rows="error"`` raises DataError at the first unusable row; ``deduplicate`` drops rows
    whose problem text already appeared.
    """
    if bad_rows not in ("drop", "error"):
        raise DataError(f"{source}: bad_rows must be 'drop' or 'error', got {bad_rows!r}")
    label = name or Path(source.rstrip("/" + os.sep)).stem or source
    report = LoadReport(source=source)
    records: list[PromptRecord] = []
    seen: set[str] = set()
    for row_number, row in iter_rows(source, fmt, split):
        report.rows += 1
        try:
            if isinstance(row, _Malformed):
                raise BadRow(row.reason, row.detail)
            check_row_text(row)
            if schema is None:
                if not isinstance(row, dict):
                    raise BadRow("not_an_object", f"row is {type(row).__name__}, expected an object")
                try:
                    schema = detect_schema(row, problem_field, answer_field, answer_format)
                except ValueError as err:
                    raise DataError(f"{source}: row {row_number}: {err}") from None
                logger.info(
                    "%s: problem from '%s', answer from '%s' (%s)",
                    source,
                    schema.problem_field,
                    schema.answer_field,
                    schema.answer_format,
                )
            record = row_to_record(row, schema, label, row_number)
        except BadRow as bad:
            message = f"{source}: row {row_number}: {bad.detail}"
            if bad_rows == "error":
                raise DataError(message) from None
            report.drop(bad.reason, message)
            continue
        if deduplicate:
            if record.problem in seen:
                report.drop("duplicate_problem", f"{source}: row {row_number}: problem already seen")
                continue
            seen.add(record.problem)
        records.append(record)
    report.kept = len(records)
    if report.rows == 0:
        raise DataError(f"{source}: no rows")
    (logger.warning if report.dropped else logger.info)("%s", report.summary())
    return records, report
