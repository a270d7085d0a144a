"""Turning one raw row (a dict from parquet, JSON lines or ``datasets``) into a PromptRecord.

A :class:`RowSchema` says where the problem and the answer are and how the answer is written:

- ``plain``: the field is the answer (a number is written without a trailing ``.0``);
- ``boxed``: the answer is the last ``\\boxed{}`` of the field (minerva's ``solution``);
- ``gsm8k``: the answer follows the last ``####`` (thousands separators removed);
- ``list``: the field is a list of answers, or a string holding one (olympiadbench's
  ``final_answer``); they are joined with ``", "``.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from stapo_megatron.data.records import PromptRecord
from stapo_megatron.rewards.extract import extract_boxed

ANSWER_FORMATS = ("plain", "boxed", "gsm8k", "list")
_INTEGRAL_DECIMAL = re.compile(r"([+-]?\d+)\.0+")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?")
# Real rows are a few levels deep (verl's chat messages: 3); deeper ones are dropped as bad rows.
MAX_ROW_DEPTH = 64


class BadRow(Exception):
    """A row that cannot become a record: ``reason`` is a short category, ``detail`` the message."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class RowSchema:
    problem_field: str
    answer_field: str
    answer_format: str

    def __post_init__(self):
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format: {self.answer_format!r} is not one of {', '.join(ANSWER_FORMATS)}")


def detect_schema(
    row: Mapping[str, Any], problem_field: str = "auto", answer_field: str = "auto", answer_format: str = "auto"
) -> RowSchema:
    """The schema of a source, from its first row; explicit (non-"auto") choices are kept."""
    reward_model = row.get("reward_model")
    guess: tuple[str | None, str | None, str]  # (problem field, answer field, answer format); None: unknown
    if isinstance(reward_model, Mapping) and "ground_truth" in reward_model:  # verl
        guess = ("prompt", "reward_model.ground_truth", "plain")
    elif "final_answer" in row:
        guess = (None, "final_answer", "list")
    elif "answer" in row:
        value = row["answer"]
        guess = (None, "answer", "gsm8k" if isinstance(value, str) and "####" in value else "plain")
    elif "solution" in row:
        guess = (None, "solution", "boxed")
    else:
        guess = (None, None, "plain")
    problem = guess[0] or next((f for f in ("problem", "question", "prompt") if f in row), None)
    chosen_problem = problem_field if problem_field != "auto" else problem
    chosen_answer = answer_field if answer_field != "auto" else guess[1]
    if chosen_problem is None:
        raise ValueError(f"no problem field found among {sorted(row)}; set problem_field")
    if chosen_answer is None:
        raise ValueError(f"no answer field found among {sorted(row)}; set answer_field")
    return RowSchema(chosen_problem, chosen_answer, answer_format if answer_format != "auto" else guess[2])


def _invalid_unicode(text: str) -> UnicodeEncodeError | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err
    return None


def check_row_text(row: Any) -> None:
    """Raise :class:`BadRow` for a row nested deeper than MAX_ROW_DEPTH or holding a string that is
    not valid Unicode (a lone surrogate, from a ``\\ud800`` escape or an undecodable byte), which
    would fail later in the tokenizer and stop the whole load. Iterative: no recursion to exhaust.
    Messages never quote the bad text (it cannot even be logged)."""
    stack: list[tuple[Any, str, int]] = [(row, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            err = _invalid_unicode(value)
            if err:
                detail = (
                    f"field '{where or '(row)'}' is not valid Unicode text ({err.reason} at character {err.start + 1})"
                )
                raise BadRow("invalid_text", detail)
            continue
        if not isinstance(value, (Mapping, list, tuple)):
            continue
        if depth >= MAX_ROW_DEPTH:
            raise BadRow("too_deep", f"row is nested deeper than {MAX_ROW_DEPTH} levels")
        if isinstance(value, Mapping):
            for key, item in value.items():
                if isinstance(key, str) and _invalid_unicode(key):
                    raise BadRow("invalid_text", f"a key of '{where or '(row)'}' is not valid Unicode text")
                stack.append((item, f"{where}.{key}" if where else str(key), depth + 1))
        else:
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


def _get(row: Mapping[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _problem_text(value: Any, field: str) -> str:
    if isinstance(value, (list, tuple)):  # chat messages (verl's "prompt"): the last user turn
        users = [m.get("content") for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        if not users:
            raise BadRow("missing_problem", f"field '{field}' holds no user message")
        value = users[-1]
    if not isinstance(value, str):
        raise BadRow("missing_problem", f"field '{field}' is {type(value).__name__}, expected text")
    if not value.strip():
        raise BadRow("empty_problem", f"field '{field}' is empty")
    return value


def _scalar_text(value: Any, field: str) -> str:
    if isinstance(value, bool):
        raise BadRow("unusable_answer", f"field '{field}' is a boolean")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadRow("unusable_answer", f"field '{field}' is {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    if not isinstance(value, str):
        raise BadRow("unusable_answer", f"field '{field}' is {type(value).__name__}, expected text or a number")
    text = value.strip()
    integral = _INTEGRAL_DECIMAL.fullmatch(text)
    return integral.group(1) if integral else text


def _answer_text(value: Any, schema: RowSchema) -> str:
    field, fmt = schema.answer_field, schema.answer_format
    if fmt == "plain":
        if isinstance(value, (list, tuple)):
            raise BadRow("unusable_answer", f"field '{field}' is a list; use answer_format list")
        answer = _scalar_text(value, field)
    elif fmt == "boxed":
        if not isinstance(value, str):
            raise BadRow("unusable_answer", f"field '{field}' is {type(value).__name__}, expected text")
        boxed = extract_boxed(value)
        if boxed is None:
            raise BadRow("unusable_answer", f"field '{field}' has no complete \\boxed{{}}")
        answer = boxed
    elif fmt == "gsm8k":
        if not isinstance(value, str) or "####" not in value:
            raise BadRow("unusable_answer", f"field '{field}' has no '####' answer line")
        answer = value.rsplit("####", 1)[1].strip()
        if _THOUSANDS.fullmatch(answer):
            answer = answer.replace(",", "")
    else:  # list
        if isinstance(value, str) and value.lstrip().startswith("["):
            try:
                # literal_eval reads Python literals only; it never runs code.
                value = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError, RecursionError) as err:
                raise BadRow("unusable_answer", f"field '{field}' is not a list literal ({err})") from None
        items = value if isinstance(value, (list, tuple)) else [value]
        answer = ", ".join(text for text in (_scalar_text(item, field) for item in items) if text)
    if not answer.strip():
        raise BadRow("empty_answer", f"field '{field}' gives an empty answer")
    return answer.strip()


def row_to_record(row: Any, schema: RowSchema, source: str, row_number: int) -> PromptRecord:
    """A record from one row; raises :class:`BadRow` naming the field at fault."""
    if not isinstance(row, Mapping):
        raise BadRow("not_an_object", f"row is {type(row).__name__}, expected an object")
    try:
        problem_value = _get(row, schema.problem_field)
    except KeyError:
        raise BadRow("missing_problem", f"field '{schema.problem_field}' is missing") from None
    try:
        answer_value = _get(row, schema.answer_field)
    except KeyError:
        raise BadRow("missing_answer", f"field '{schema.answer_field}' is missing") from None
    if answer_value is None:
        raise BadRow("missing_answer", f"field '{schema.answer_field}' is null")
    problem = _problem_text(problem_value, schema.problem_field)
    answer = _answer_text(answer_value, schema)
    return PromptRecord(
        uid=f"{source}:{row_number}", problem=problem, answer=answer, source=source, row=row_number, extra=dict(row)
    )
