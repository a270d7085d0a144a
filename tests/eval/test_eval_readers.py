"""`stapo eval`'s files against what a careless user or a crafted file gives it: --overwrite and the
output directory touch only what stapo eval made, --compare's table replaces only a table of its
own, and every input it reads is a one-line error or a counted skip, never a traceback."""

from __future__ import annotations

import json
import os

import pytest

from stapo_megatron.cli import main
from stapo_megatron.config import ConfigError
from stapo_megatron.eval.runner import EvalRun
from tests.eval.test_eval_runner import SAMPLING, SETTINGS, TRAIN, evaluate, tasks_for

DEEP = "[" * 200_000 + "]" * 200_000


@pytest.fixture
def small_tasks(qwen3_tokenizer, eval_data_dir):
    return tasks_for(qwen3_tokenizer, eval_data_dir, ["aime24"], limit=2, k=2)


def snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_overwrite_removes_nothing_it_did_not_make(tmp_path, small_tasks):
    """--overwrite (fresh) deleted results.json, table.md and responses.jsonl and replaced
    settings.json in whatever directory --out named; without it the evaluation wrote its files into
    any directory. Only a new or empty directory, or one holding stapo eval's settings.json, is used."""
    users = tmp_path / "users"
    users.mkdir()
    for name, text in {
        "results.json": '{"mine": 1}',
        "table.md": "my table",
        "responses.jsonl": "my lines\n",
        "notes.txt": "notes",
    }.items():
        (users / name).write_text(text)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "settings.json").write_text('{"theme": "dark"}')
    (theirs / "results.json").write_text("[]")
    for directory, first in ((users, "notes.txt"), (theirs, "results.json")):
        before = snapshot(directory)
        for fresh in (True, False):
            with pytest.raises(ConfigError) as error:
                EvalRun(directory, small_tasks, SAMPLING, SETTINGS, fresh=fresh)
            assert str(error.value) == (
                f"{directory}: not an evaluation directory (it holds {first!r} but no settings.json written by "
                "stapo eval); give a new or empty directory"
            )
            assert snapshot(directory) == before  # not even a lock file was left

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".lock").write_text("")  # a start killed before its settings were written
    with EvalRun(empty, small_tasks, SAMPLING, SETTINGS, fresh=True) as run:
        assert run.pending() == 4


def test_overwrite_on_the_command_line_names_out(tmp_path, tiny_model, eval_data_dir, capsys):
    users = tmp_path / "users"
    users.mkdir()
    (users / "results.json").write_text('{"mine": 1}')
    command = ["eval", "--model", str(tiny_model), "--data-dir", str(eval_data_dir), "--benchmarks", "aime24"]
    small = ["--limit", "1", "--k", "1", "--max-new-tokens", "2", "--reward-workers", "1", "--device", "cpu"]
    assert main([*command, *small, "--out", str(users), "--overwrite"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stapo: error:")]
    assert errors == [
        f"stapo: error: --out: {users}: not an evaluation directory (it holds 'results.json' but no settings.json "
        "written by stapo eval); give a new or empty directory"
    ]
    assert (users / "results.json").read_text() == '{"mine": 1}' and sorted(os.listdir(users)) == ["results.json"]


def test_the_comparison_table_replaces_only_a_table_of_its_own(tmp_path, qwen3_tokenizer, small_tasks, capsys):
    """`stapo eval --compare A --out A/results.json` wrote the table over A's results (exit 0), and
    any file named by --out was replaced."""
    finished = tmp_path / "a"
    evaluate(finished, qwen3_tokenizer, small_tasks, lambda name, i: 1, "m", TRAIN)
    capsys.readouterr()
    before = snapshot(finished)
    readme = tmp_path / "README.md"
    readme.write_text("# my notes\n")
    refused = {
        finished / "results.json": f"is a file of the evaluation in {finished}; write the table elsewhere",
        finished / "table.md": f"is a file of the evaluation in {finished}; write the table elsewhere",
        readme: "exists and is not a table stapo eval wrote; remove it or write the table elsewhere",
        tmp_path: "exists and is not a table stapo eval wrote; remove it or write the table elsewhere",
    }
    for out, why in refused.items():
        assert main(["eval", "--compare", str(finished), "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == f"stapo: error: --out: {out} {why}"
    missing = tmp_path / "missing" / "table.md"
    assert main(["eval", "--compare", str(finished), "--out", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"stapo: error: --out: {missing}: {missing.parent} is not a directory"
    assert snapshot(finished) == before and readme.read_text() == "# my notes\n"

    table = tmp_path / "comparison.md"
    for _ in range(2):  # a new file, then its own table again
        assert main(["eval", "--compare", str(finished), "--out", str(table)]) == 0
        assert table.read_text() == capsys.readouterr().out == (finished / "table.md").read_text()


@pytest.mark.parametrize(
    "content, problem",
    [
        (DEEP, "is nested too deeply to read"),
        (b"\xff\xfe{}", "is not valid JSON ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)"),
        ('{"model": "m", "decoding": {}, "benchmarks": {}}', "its decoding lacks a finite temperature and top_p"),
        (
            '{"model": "m", "decoding": {"temperature": 1, "top_p": 1}, "benchmarks": []}',
            "it holds no benchmarks",
        ),
        (
            '{"model": ["m"], "decoding": {"temperature": 1, "top_p": 1}, "benchmarks": {"aime24": {}}}',
            "its model is not a text",
        ),
        (
            '{"model": "m", "decoding": {"temperature": 1, "top_p": 1}, '
            '"benchmarks": {"aime24": {"avg@k": "0.5", "k": 32, "problems": 30, "problems_total": 30}}}',
            "benchmark 'aime24' lacks a finite avg@k or whole counts k, problems, problems_total",
        ),
        (
            '{"model": "m", "decoding": {"temperature": NaN, "top_p": 1}, "benchmarks": {"aime24": {}}}',
            "its decoding lacks a finite temperature and top_p",
        ),
    ],
)
def test_malformed_results_to_compare_are_one_line(tmp_path, capsys, content, problem):
    """Before: RecursionError, TypeError, KeyError or AttributeError tracebacks."""
    path = tmp_path / "results.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["eval", "--compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    separator = " " if problem.startswith(("is ", "is not")) else ": "
    assert err == f"stapo: error: --compare: {path}{separator}{problem}\n"


def test_a_crafted_model_name_cannot_drive_the_terminal(tmp_path, qwen3_tokenizer, small_tasks, capsys):
    finished = tmp_path / "a"
    evaluate(finished, qwen3_tokenizer, small_tasks, lambda name, i: 1, "m", TRAIN)
    results = json.loads((finished / "results.json").read_text())
    results["model"] = "evil\x1b]0;title\x07\u202e"
    (finished / "results.json").write_text(json.dumps(results))
    assert main(["eval", "--compare", str(finished)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "| evil\\x1b]0;title\\x07\\u202e |" in out


def test_deeply_nested_settings_are_one_line(tmp_path, small_tasks):
    """settings.json nested 200,000 deep: RecursionError traceback."""
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "settings.json").write_text(DEEP)
    with pytest.raises(ConfigError) as error:
        EvalRun(directory, small_tasks, SAMPLING, SETTINGS)
    assert str(error.value) == f"settings: {directory / 'settings.json'} is nested too deeply to read"


def test_a_response_line_over_the_bound_is_skipped_and_sampled_again(tmp_path, qwen3_tokenizer, small_tasks, caplog):
    """A line longer than any response (64 MiB) is damage: skipped without being read into memory,
    and its response sampled again (before: read whole, parsed and kept)."""
    whole, _ = evaluate(tmp_path / "run", qwen3_tokenizer, small_tasks, lambda name, i: 1, "m", TRAIN)
    path = tmp_path / "run" / "responses.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    record = json.loads(lines[0])
    record["response"] = "<here>"
    head, tail = json.dumps(record).split("<here>")
    block = "x" * (1 << 20)
    with open(path, "w") as f:
        f.write(head)
        for _ in range(65):
            f.write(block)
        f.write(tail + "\n" + "".join(lines[1:]))
    with caplog.at_level("WARNING"):
        again, engine = evaluate(tmp_path / "run", qwen3_tokenizer, small_tasks, lambda name, i: 1, "m", TRAIN)
    size = len(head) + 65 * len(block) + len(tail)
    assert f"{path}: line 1 is {size:,} bytes long, more than a row may be; skipped 1 malformed row" in caplog.text
    assert again == whole and len(engine.calls) == 1


def test_a_damaged_export_marker_means_the_export_is_redone(tmp_path, monkeypatch):
    """The marker of a kept export nested 200,000 deep: RecursionError traceback."""
    from stapo_megatron.checkpoint import convert
    from stapo_megatron.eval.model import EVAL_EXPORT_MARKER, HFExport, ModelSource
    from stapo_megatron.models.qwen3.config import Qwen3Config

    export_dir = tmp_path / "export"
    export_dir.mkdir()
    (export_dir / EVAL_EXPORT_MARKER).write_text(DEEP)
    exports = []
    monkeypatch.setattr(HFExport, "_identity", lambda self: {"checkpoint": "c", "complete": "x", "tokenizer": "t"})
    monkeypatch.setattr(convert, "convert_megatron_to_hf", lambda *args, **kwargs: exports.append(args))
    source = ModelSource(tmp_path / "ckpt", "megatron", Qwen3Config(), tmp_path / "ckpt")
    assert HFExport(source, str(export_dir)).materialize() == export_dir
    assert len(exports) == 1
    assert json.loads((export_dir / EVAL_EXPORT_MARKER).read_text()) == {
        "checkpoint": "c",
        "complete": "x",
        "tokenizer": "t",
    }
