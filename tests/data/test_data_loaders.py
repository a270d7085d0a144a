"""Loading prompt records: the shared data files, bad rows, formats, the benchmark registry."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stapo_megatron.data import (
    BENCHMARKS,
    PAPER_BENCHMARKS,
    DataError,
    RowSchema,
    get_benchmark,
    load_benchmark,
    load_records,
)
from stapo_megatron.data.loaders import resolve_format
from tests.fixtures import ROWS, TRAIN_ROWS

# The shared README's table: file -> rows. Every row of every file has a usable answer: nothing is dropped.
SHARED_FILES = {
    "train/dapo_math_17k.parquet": 17_917,
    "eval/aime24.jsonl": 30,
    "eval/aime25.jsonl": 30,
    "eval/amc23.jsonl": 40,
    "eval/math500.jsonl": 500,
    "eval/minerva.jsonl": 272,
    "eval/olympiadbench.jsonl": 675,
    "eval/gsm8k_test.jsonl": 1_319,
}


FIXTURE_FILES = {
    "train/dapo_math_17k.parquet": TRAIN_ROWS,
    **{f"eval/{get_benchmark(name).file_name}": rows for name, rows in ROWS.items()},
}


@pytest.mark.parametrize(
    "source, relative, rows",
    [("data_dir", *item) for item in FIXTURE_FILES.items()]
    + [("shared_data_dir", *item) for item in SHARED_FILES.items()],
)
def test_every_data_file_loads_with_its_row_count(request, source, relative, rows):
    records, report = load_records(str(request.getfixturevalue(source) / relative))
    assert (report.rows, report.kept, report.dropped) == (rows, rows, {})
    assert len(records) == rows
    assert [r.row for r in records] == list(range(1, rows + 1))
    assert len({r.uid for r in records}) == rows
    assert all(r.problem.strip() and r.answer.strip() for r in records)


@pytest.mark.parametrize(
    "source, rows, unique, first_repeat", [("data_dir", TRAIN_ROWS, 40, 41), ("shared_data_dir", 17_917, 17_290, 180)]
)
def test_dapo_math_17k_in_the_verl_schema(request, caplog, source, rows, unique, first_repeat):
    path = str(request.getfixturevalue(source) / "train" / "dapo_math_17k.parquet")
    with caplog.at_level(logging.INFO, logger="stapo_megatron.data.loaders"):
        records, report = load_records(path)
    assert "problem from 'prompt', answer from 'reward_model.ground_truth' (plain)" in caplog.text
    assert f"{rows} rows, kept {rows}, dropped 0" in caplog.text
    first = records[0]
    assert first.answer == "34" and first.problem.startswith("In triangle $ABC$, $\\sin \\angle A = \\frac{4}{5}$")
    assert first.uid == "dapo_math_17k:1" and first.source == "dapo_math_17k"
    assert all(r.answer.lstrip("-").isdigit() for r in records)  # DAPO-Math-17k's answers are integers
    deduplicated, report = load_records(path, deduplicate=True)
    assert (len(deduplicated), report.dropped) == (unique, {"duplicate_problem": rows - unique})
    assert report.messages[0].endswith(f"row {first_repeat}: problem already seen")


BENCHMARK_SAMPLES = [
    ("aime24", 30, 32, {1: "204"}),
    ("aime25", 30, 32, {1: "70"}),
    ("amc23", 40, 32, {1: "27"}),  # 27.0 in the file
    ("math500", 500, 4, {1: "\\left( 3, \\frac{\\pi}{2} \\right)"}),
    ("minerva", 272, 4, {1: "1.6", 2: "4.5e33", 3: "41.8"}),  # the last \boxed{} of the solution
    ("olympiadbench", 675, 4, {1: "2"}),
    ("gsm8k", 1319, 1, {1: "18"}),
]


@pytest.mark.parametrize(
    "source, name, rows, k, samples",
    [("data_dir", name, ROWS[name], k, samples) for name, _, k, samples in BENCHMARK_SAMPLES]
    + [("shared_data_dir", *sample) for sample in BENCHMARK_SAMPLES],
)
def test_benchmarks_load_with_their_answers(request, source, name, rows, k, samples):
    records, report = load_benchmark(name, request.getfixturevalue(source) / "eval")
    assert (len(records), report.num_dropped, get_benchmark(name).default_k) == (rows, 0, k)
    for row, answer in samples.items():
        assert records[row - 1].answer == answer
    assert records[0].uid == f"{name}:1" and records[0].source == name


def test_olympiadbench_multiple_answers_and_gsm8k_thousands(data_dir):
    olympiad, _ = load_benchmark("olympiadbench", data_dir / "eval")
    answers = {r.answer for r in olympiad}
    assert "$69$,$84$" in answers and "1,3,5" in answers
    gsm8k, _ = load_benchmark("gsm8k", data_dir / "eval")
    assert "2125" in {r.answer for r in gsm8k}  # "#### 2,125" in the file
    assert all("," not in r.answer for r in gsm8k)


def test_benchmark_registry():
    assert PAPER_BENCHMARKS == ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
    assert {n: BENCHMARKS[n].default_k for n in PAPER_BENCHMARKS} == {
        "aime24": 32,
        "aime25": 32,
        "amc23": 32,
        "math500": 4,
        "minerva": 4,
        "olympiadbench": 4,
    }
    assert get_benchmark("minerva").schema == RowSchema("problem", "solution", "boxed")
    with pytest.raises(DataError, match="unknown benchmark 'aime26'"):
        get_benchmark("aime26")


def test_missing_benchmark_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"benchmark aime24: .*aime24.jsonl does not exist"):
        load_benchmark("aime24", tmp_path)


BAD_JSONL = [
    '{"problem": "What is 1+1?", "answer": "2"}',
    '{"problem": "No answer here"}',
    '{"problem": "   ", "answer": "3"}',
    "{not json",
    "",
    '["a", "list"]',
    '{"problem": "Null answer", "answer": null}',
    '{"problem": "Empty answer", "answer": "  "}',
    '{"problem": "What is 2+2?", "answer": 4.0}',
]


def test_bad_rows_are_dropped_with_file_row_and_reason(tmp_path, caplog):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(BAD_JSONL) + "\n")
    with caplog.at_level(logging.WARNING, logger="stapo_megatron.data.loaders"):
        records, report = load_records(str(path))
    assert [(r.row, r.answer) for r in records] == [(1, "2"), (9, "4")]
    assert report.rows == 8 and report.kept == 2  # the blank line 5 is not a row
    assert report.dropped == {
        "missing_answer": 2,
        "empty_problem": 1,
        "malformed_json": 1,
        "not_an_object": 1,
        "empty_answer": 1,
    }
    assert report.messages == [
        f"{path}: row 2: field 'answer' is missing",
        f"{path}: row 3: field 'problem' is empty",
        f"{path}: row 4: malformed JSON (Expecting property name enclosed in double quotes at column 2)",
        f"{path}: row 6: row is list, expected an object",
        f"{path}: row 7: field 'answer' is null",
        f"{path}: row 8: field 'answer' gives an empty answer",
    ]
    assert "kept 2, dropped 6" in caplog.text and f"first: {path}: row 2" in caplog.text


def _undecodable_rows() -> list[bytes]:
    """Good rows 1 and 6 around one row of each kind that used to stop the whole load."""
    return [
        b'{"problem": "What is 1+1?", "answer": "2"}',
        b'{"problem": "caf\xe9 au lait", "answer": "3"}',  # Latin-1, not UTF-8
        b'{"problem": "lone \\ud800 surrogate", "answer": "4"}',
        b'{"problem": "deep", "answer": "5", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"problem": "deep", "answer": "6", "meta": ' + b"[" * 100 + b"]" * 100 + b"}",
        b'{"problem": "What is 2+2?", "answer": "4"}',
        b'{"problem": "bad key", "answer": "7", "\\udc80": 1}',
    ]


def test_undecodable_surrogate_and_deep_rows_are_dropped_one_by_one(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(_undecodable_rows()) + b"\n")
    records, report = load_records(str(path))
    assert [(r.row, r.answer) for r in records] == [(1, "2"), (6, "4")]
    assert (report.rows, report.kept, report.dropped) == (7, 2, {"undecodable": 1, "invalid_text": 2, "too_deep": 2})
    assert report.messages == [
        f"{path}: row 2: not UTF-8 text (invalid continuation byte at column 17)",
        f"{path}: row 3: field 'problem' is not valid Unicode text (surrogates not allowed at character 6)",
        f"{path}: row 4: JSON nested too deeply to read",
        f"{path}: row 5: row is nested deeper than 64 levels",
        f"{path}: row 7: a key of '(row)' is not valid Unicode text",
    ]
    with pytest.raises(DataError, match=rf"^{path}: row 2: not UTF-8 text"):
        load_records(str(path), bad_rows="error")
    # One JSON array: undecodable bytes inside a string drop that row only.
    array = tmp_path / "mixed.json"
    array.write_bytes(b"[" + b",\n".join(r for i, r in enumerate(_undecodable_rows()) if i != 3) + b"]")
    records, report = load_records(str(array))
    assert [(r.row, r.answer) for r in records] == [(1, "2"), (5, "4")]
    assert report.dropped == {"invalid_text": 3, "too_deep": 1}
    assert report.messages[0] == (
        f"{array}: row 2: field 'problem' is not valid Unicode text (surrogates not allowed at character 4)"
    )
    # A file that starts with a byte-order mark still reads its first row.
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + _undecodable_rows()[0] + b"\n")
    assert [r.answer for r in load_records(str(bom))[0]] == ["2"]


def test_parquet_with_a_non_utf8_string_drops_that_row(tmp_path):
    problems = pa.array([b"What is 1+1?", b"\xff\xfe not text", b"What is 2+2?"], type=pa.binary()).view(pa.string())
    path = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"problem": problems, "answer": ["2", "3", "4"]}), path)
    records, report = load_records(str(path))
    assert [(r.row, r.answer) for r in records] == [(1, "2"), (3, "4")]
    assert report.dropped == {"undecodable": 1}
    assert report.messages == [f"{path}: row 2: a string column holds bytes that are not UTF-8 (invalid start byte)"]


def test_bad_rows_can_be_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(BAD_JSONL) + "\n")
    with pytest.raises(DataError, match=rf"^{path}: row 2: field 'answer' is missing$"):
        load_records(str(path), bad_rows="error")
    path.write_text('{"problem": "p", "answer": "1"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl: row 2: malformed JSON"):
        load_records(str(path), bad_rows="error")


@pytest.mark.parametrize(
    "row, fmt, reason",
    [
        ({"problem": "p", "solution": "no box"}, "boxed", "field 'solution' has no complete \\\\boxed"),
        ({"problem": "p", "solution": "\\boxed{1"}, "boxed", "has no complete"),
        ({"question": "q", "answer": "worked, no marker"}, "gsm8k", "has no '####' answer line"),
        ({"question": "q", "final_answer": "[unclosed"}, "list", "is not a list literal"),
        ({"question": "q", "final_answer": []}, "list", "gives an empty answer"),
        ({"problem": "p", "answer": ["1", "2"]}, "plain", "is a list; use answer_format list"),
        ({"problem": "p", "answer": True}, "plain", "is a boolean"),
        ({"problem": 5, "answer": "1"}, "plain", "field 'problem' is int, expected text"),
    ],
)
def test_unusable_answers_are_explained(tmp_path, row, fmt, reason):
    path = tmp_path / "one.jsonl"
    good = {
        "problem": "fine",
        "question": "fine",
        "answer": "#### 0" if fmt == "gsm8k" else "0",
        "solution": "\\boxed{0}",
        "final_answer": ["0"],
    }
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    problem = "question" if "question" in row else "problem"
    answer = {"boxed": "solution", "list": "final_answer"}.get(fmt, "answer")
    records, report = load_records(str(path), problem_field=problem, answer_field=answer, answer_format=fmt)
    assert len(records) == 1 and report.num_dropped == 1
    assert report.messages[0].startswith(f"{path}: row 2: ")
    assert reason.replace("\\\\", "\\") in report.messages[0]


def test_answer_formats(tmp_path):
    rows = [
        {"question": "q1", "final_answer": "['$3$', '$5$']"},  # a list written as a string
        {"question": "q2", "final_answer": ["$\\frac{1}{2}$"]},
        {"question": "q3", "final_answer": "7"},
    ]
    path = tmp_path / "lists.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    records, _ = load_records(str(path))
    assert [r.answer for r in records] == ["$3$, $5$", "$\\frac{1}{2}$", "7"]
    path = tmp_path / "numbers.jsonl"
    path.write_text(
        "\n".join(json.dumps({"problem": f"p{i}", "answer": a}) for i, a in enumerate([27.0, 2.5, "14.00", -3, " 8 "]))
    )
    assert [r.answer for r in load_records(str(path))[0]] == ["27", "2.5", "14", "-3", "8"]


def test_parquet_with_nulls_and_nested_fields(tmp_path):
    table = pa.table(
        {
            "prompt": [
                [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}],
                [{"role": "user", "content": "4+4?"}],
                [{"role": "system", "content": "only system"}],
            ],
            "reward_model": [
                {"ground_truth": "5", "style": "rule"},
                {"ground_truth": None, "style": "rule"},
                {"ground_truth": "1", "style": "rule"},
            ],
        }
    )
    path = tmp_path / "verl.parquet"
    pq.write_table(table, path)
    records, report = load_records(str(path))
    assert [(r.problem, r.answer) for r in records] == [("2+3?", "5")]
    assert report.messages == [
        f"{path}: row 2: field 'reward_model.ground_truth' is null",
        f"{path}: row 3: field 'prompt' holds no user message",
    ]


def test_hugging_face_datasets_from_a_local_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list([{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": None}])
    dataset.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "hub").mkdir()
    dataset.to_parquet(str(tmp_path / "hub" / "train.parquet"))
    for source in (tmp_path / "saved", tmp_path / "hub"):  # save_to_disk output, and load_dataset's path
        assert resolve_format(str(source)) == "hf"
        records, report = load_records(str(source), split="train")
        assert [(r.problem, r.answer, r.row) for r in records] == [("1+1?", "2", 1)]
        assert report.messages == [f"{source}: row 2: field 'answer' is null"]


def test_formats_and_missing_files(tmp_path):
    with pytest.raises(DataError, match=r"nowhere.parquet: file does not exist"):
        load_records(str(tmp_path / "nowhere.parquet"))
    with pytest.raises(DataError, match=r"nowhere.jsonl: file does not exist"):
        load_records(str(tmp_path / "nowhere.jsonl"), fmt="jsonl")
    odd = tmp_path / "data.txt"
    odd.write_text('{"problem": "p", "answer": "1"}\n')
    with pytest.raises(DataError, match="cannot tell the format"):
        load_records(str(odd))
    assert len(load_records(str(odd), fmt="jsonl")[0]) == 1
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(DataError, match="fake.parquet: not a readable parquet file"):
        load_records(str(not_parquet))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="empty.jsonl: no rows"):
        load_records(str(empty))
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"problem": "p", "answer": "1"}, {"problem": "q"}]))
    records, report = load_records(str(array))
    assert len(records) == 1 and report.messages == [f"{array}: row 2: field 'answer' is missing"]
    nofields = tmp_path / "nofields.jsonl"
    nofields.write_text('{"text": "p", "label": "1"}\n')
    with pytest.raises(DataError, match=r"nofields.jsonl: row 1: no problem field found among \['label', 'text'\]"):
        load_records(str(nofields))
    assert load_records(str(nofields), problem_field="text", answer_field="label")[0][0].answer == "1"
