"""``stapo eval`` argument errors: one line naming the flag at fault, before any model is loaded."""

from __future__ import annotations

import json
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
            "--template: prompt template 'nope' is not known and does not contain {problem} "
            "(known: stapo, raw, justrl)",
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


def test_the_default_length_is_the_papers(eval_data_dir):
    from stapo_megatron.cli import parse_args
    from stapo_megatron.eval.cli import load_eval_config

    def max_new_tokens(*flags):
        args = parse_args(["eval", "--model", "m", "--data-dir", str(eval_data_dir), *flags])
        return load_eval_config(args).cfg.eval.max_new_tokens

    # STAPO v1 evaluates with a maximum length of 20,480 tokens (it was 16,384 here).
    assert max_new_tokens() == 20480
    assert max_new_tokens("--max-new-tokens", "7") == 7


def test_verifier_errors_come_before_any_generation(capsys, tmp_path, eval_data_dir, tiny_model):
    out = tmp_path / "out"
    base = ["--model", str(tiny_model), "--data-dir", str(eval_data_dir), "--out", str(out)]
    missing = tmp_path / "CompassVerifier-3B"
    assert error_line(capsys, [*base, "--verifier-model", str(missing)]) == (
        f"stapo: error: --verifier-model: {missing} does not exist"
    )
    # CompassVerifier is a Qwen2.5: the local engine runs Qwen3 models only.
    qwen2 = tmp_path / "qwen2"
    qwen2.mkdir()
    (qwen2 / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768})
    )
    shutil.copy(tiny_model / "tokenizer.json", qwen2)
    assert error_line(capsys, [*base, "--verifier-model", str(qwen2)]) == (
        f"stapo: error: --verifier-model: the local engine runs Qwen3 models only ({qwen2 / 'config.json'}: not a "
        "dense Qwen3 model (model_type='qwen2', architectures=['Qwen2ForCausalLM']); expected model_type 'qwen3' "
        "and Qwen3ForCausalLM); serve this verifier with rollout.engine=sglang"
    )
    no_context = tmp_path / "no-context"
    no_context.mkdir()
    (no_context / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert error_line(capsys, [*base, "--verifier-model", str(no_context)]) == (
        f"stapo: error: --verifier-model: {no_context / 'config.json'} has no usable max_position_embeddings (got None)"
    )
    attached = [*base, "--engine", "sglang", "--rollout", "sglang.urls=[http://127.0.0.1:9]"]
    assert error_line(capsys, [*attached, "--verifier-model", str(tiny_model)]) == (
        "stapo: error: --verifier-model: rollout.sglang.urls attaches to servers of the evaluated model; the "
        "verifier needs servers launched on it (drop urls)"
    )
    assert error_line(capsys, ["--compare", str(tmp_path), "--verifier-model", str(tiny_model)]) == (
        "stapo: error: --verifier-model: compare tabulates finished evaluations; it judges nothing"
    )
    assert not out.exists()


def test_a_custom_reward_function_is_checked_before_any_model_loads(capsys, tmp_path, eval_data_dir):
    functions = "tests.rewards.custom_reward_functions"
    base = ["--model", str(tmp_path / "never-read"), "--data-dir", str(eval_data_dir), "reward.kind=custom"]
    assert error_line(capsys, [*base, f"reward.function={functions}:two_arguments"]) == (
        f"stapo: error: reward.function: {functions}:two_arguments(response, ground_truth) cannot be called as "
        "function(response, ground_truth, extra): too many positional arguments"
    )
    assert error_line(capsys, [*base, "reward.function=tests.rewards.absent:score"]) == (
        "stapo: error: reward.function: cannot import module 'tests.rewards.absent' (ModuleNotFoundError: No module "
        "named 'tests.rewards.absent'; is it installed or on PYTHONPATH?)"
    )
    # A good function passes; the model is the next thing checked.
    assert error_line(capsys, [*base, f"reward.function={functions}:cites_row"]) == (
        f"stapo: error: --model: {tmp_path / 'never-read'} does not exist"
    )
