"""`stapo inspect` against dumps that are malformed or crafted: entries skipped with one counted
warning per file, and the model's text printed with its terminal controls escaped."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from stapo_megatron.cli import main
from stapo_megatron.trainer.inspector import DUMP_DIR, read_dumps


def entry(**fields) -> dict:
    return {
        "step": 1,
        "sequence": 0,
        "position": 0,
        "token_id": 5,
        "token": "a",
        "probability": 1e-3,
        "entropy": 0.5,
        "advantage": 1.0,
        "correct": True,
        "before": "3 + 4 =",
        "after": "<eos>",
        **fields,
    }


def write_dump(run_dir, step, lines):
    directory = run_dir / DUMP_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:07d}.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_malformed_dump_entries_are_skipped_with_one_counted_warning_per_file(tmp_path, caplog, capsys):
    """Before: TypeError (a list), KeyError (no token), TypeError (a text probability, a text step,
    a list token) tracebacks from `stapo inspect`; a NaN entropy made the token's mean NaN."""
    good = entry()
    first = write_dump(
        tmp_path,
        1,
        [
            json.dumps(good),
            "[1]",  # line 2
            json.dumps({"step": 1}),  # no token
            json.dumps(entry(probability="p")),
            json.dumps(entry(step="1")),
            json.dumps(entry(token=["a"])),
            json.dumps(entry(correct=1)),
            json.dumps(entry(position=1.5)),
            json.dumps(entry(step=-4)),
            "{" * 100_000,
            json.dumps(entry(entropy=float("nan"))),  # dropped value, entry kept
        ],
    )
    second = write_dump(tmp_path, 2, [json.dumps(entry(step=2, token="b")), '{"step": 2, "tok'])
    with caplog.at_level(logging.WARNING):
        entries = read_dumps(tmp_path)
    nan_entry = {k: v for k, v in entry().items() if k != "entropy"}
    assert entries == [good, nan_entry, entry(step=2, token="b")]
    assert [r.getMessage() for r in caplog.records] == [
        f"{first}: line 2 is not a JSON object; skipped 9 malformed rows and 1 non-finite value",
        f"{second}: line 2 is cut off or malformed; skipped 1 malformed row",
    ]

    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "3 silenced tokens in 2 dumps (steps 1..2), 2 distinct"
    ranking = {line.split()[1]: line.split() for line in out[3:5]}
    assert ranking["'a'"][2:6] == ["2", "66.67%", "1.00e-03", "0.500"]  # the mean entropy of the one finite value


def test_entries_with_only_step_and_token_are_shown(tmp_path, capsys):
    """Probability, entropy and context are optional: what is missing is shown as '-'."""
    write_dump(tmp_path, 3, [json.dumps({"step": 3, "token": "7"})])
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3].split() == ["1", "'7'", "1", "100.00%", "-", "-", "digit"]
    assert "  step     3 p=- H=-: ...[[7]]..." in out


def test_the_models_text_cannot_drive_the_terminal(tmp_path, capsys):
    """The context of a silenced token is model text: it reached the terminal raw (a clear-screen,
    a window title set by OSC, an 8-bit CSI, a right-to-left override that reorders the line)."""
    write_dump(
        tmp_path,
        1,
        [
            json.dumps(
                entry(
                    token="x\x1b[2J",
                    before="\x1b]0;pwned\x07\x1b[31mred\u2066",
                    after="\u202eevil\x9b6n\nnext line\ttab\u2028",
                ),
                ensure_ascii=False,
            )
        ],
    )
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for raw in ("\x1b", "\x07", "\x9b", "\u202e", "\u2066", "\u2028", "\t"):
        assert raw not in out, repr(raw)
    assert "...\\x1b]0;pwned\\x07\\x1b[31mred\\u2066[[x\\x1b[2J]]\\u202eevil\\x9b6n\\nnext line\\ttab\\u2028..." in out


def test_a_dump_that_is_not_a_regular_file_does_not_block(tmp_path):
    """A FIFO named like a dump: opening it waited for a writer forever."""
    write_dump(tmp_path, 1, [json.dumps(entry())])
    os.mkfifo(tmp_path / DUMP_DIR / "step_0000002.jsonl")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "stapo_megatron.cli", "inspect", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("stapo inspect blocked on a FIFO") from None
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("1 silenced tokens in 1 dumps")
    assert "step_0000002.jsonl: not a regular file; skipped" in done.stderr
