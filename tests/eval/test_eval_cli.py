"""``stapo eval`` argument errors: one line naming the flag at fault, before any model is loaded."""

from __future__ import annotations

import shutil

import pytest

from stapo_megatron.cli import main
from stapo_megatron.eval.cli import parse_k
from stapo_megatron.eval.model import default_model_name
from tests.helpers import CONSOLE_LINE

KNOWN = "aime24, aime25, amc23, math500, minerva, olympiadbench, gsm8k"


def error_line(capsys, args) -> str:
    assert main(["eval", *args]) == 2
    # Besides the console's messages (a benchmark loaded before the next one failed): the error alone.
    lines = [line for line in capsys.readouterr().err.splitlines() if not CONSOLE_LINE.match(line)]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--benchmarks", "aime24,foo"], f"--benchmarks: unknown benchmark 'foo' (known: {KNOWN})"),
        (["--benchmarks", "aime24,amc23,aime24"], "--benchmarks: 'aime24' is listed twice"),
        (["--k", "x"], "--k: cannot read 'x' (give N, or benchmark=N, comma-separated)"),
        (["--k", "aime99=2"], f"--k: unknown benchmark 'aime99' (known: {KNOWN})"),
        (["--k", "4,aime24=0"], "--k: aime24: must be an integer >= 1, got 0"),
        (["--k", "-3"], "--k: must be >= 0, got -3"),
        (["--limit", "-1"], "--limit: must be >= 0, got -1"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
        (["--problems-per-call", "-2"], "--problems-per-call: must be >= 0, got -2"),
        (
            ["--template", "nope"],
            "--template: prompt template 'nope' is not known and does not contain {problem} (known: stapo, raw)",
        ),
        (
            ["--chat-template-kwargs", "[1, 2]"],
            "--chat-template-kwargs: '[1, 2]' is not a mapping (e.g. '{enable_thinking: false}')",
        ),
        (["--reward-workers", "0"], "--reward-workers: must be >= 1, got 0"),
    ],
)
def test_flag_errors(capsys, tmp_path, eval_data_dir, extra, expected):
    args = ["--model", str(tmp_path / "never-read"), "--data-dir", str(eval_data_dir), *extra]
    assert error_line(capsys, args) == f"stapo: error: {expected}"


def test_path_errors(capsys, tmp_path, eval_data_dir, tiny_model):
    base = ["--data-dir", str(eval_data_dir)]
    assert error_line(capsys, ["--model", str(tiny_model)]) == (
        "stapo: error: --data-dir: required (the directory holding aime24.jsonl, math500.jsonl, ...)"
    )
    assert error_line(capsys, ["--model", str(tiny_model), "--data-dir", str(tmp_path / "none")]) == (
        f"stapo: error: --data-dir: {tmp_path / 'none'} is not a directory"
    )
    assert (
        error_line(capsys, ["--model", str(tmp_path / "none"), *base])
        == f"stapo: error: --model: {tmp_path / 'none'} does not exist"
    )
    assert error_line(capsys, ["--model", str(tmp_path), *base]) == (
        f"stapo: error: --model: {tmp_path} is neither a Hugging Face checkpoint (config.json and safetensors) nor a "
        "complete stapo Megatron checkpoint (with stapo_complete.json)"
    )
    no_tokenizer = tmp_path / "bare"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model / name, no_tokenizer / name)
    assert error_line(capsys, ["--model", str(no_tokenizer), *base]) == (
        f"stapo: error: --model: {no_tokenizer} holds no tokenizer files (tokenizer.json or vocab.json); pass "
        "--tokenizer DIR"
    )
    assert error_line(capsys, ["--model", str(no_tokenizer), "--tokenizer", str(tmp_path / "none"), *base]) == (
        f"stapo: error: --tokenizer: {tmp_path / 'none'} is not a directory"
    )
    assert error_line(capsys, ["--model", str(tiny_model), "--rollout", "engine=vllm", *base]) == (
        "stapo: error: rollout.engine: 'vllm' is not one of 'local', 'sglang'"
    )
    partial = tmp_path / "partial-data"
    partial.mkdir()
    shutil.copy(eval_data_dir / "aime24.jsonl", partial)
    assert error_line(
        capsys,
        [
            "--model",
            str(tiny_model),
            "--data-dir",
            str(partial),
            "--benchmarks",
            "aime24,amc23",
            "--out",
            str(tmp_path / "out"),
        ],
    ) == (f"stapo: error: --data-dir: benchmark amc23: {partial / 'amc23.jsonl'} does not exist")
    assert not (tmp_path / "out").exists()


def test_parse_k_and_model_names(tmp_path):
    assert parse_k(None) == (0, {})
    assert parse_k("16") == (16, {})
    assert parse_k("8, aime24=32,math500=4") == (8, {"aime24": 32, "math500": 4})
    run_checkpoint = tmp_path / "stapo-1.7b" / "checkpoints" / "iter_0000300"
    run_checkpoint.mkdir(parents=True)
    assert default_model_name(run_checkpoint) == "stapo-1.7b/iter_0000300"
    assert default_model_name(tmp_path / "stapo-1.7b") == "stapo-1.7b"
