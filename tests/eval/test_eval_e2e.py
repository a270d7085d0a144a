"""End to end with real engines: the ``stapo eval`` command on a tiny random Qwen3 with the real tokenizer.

The model has the Qwen3 vocabulary and tiny hidden sizes; its responses are noise, so these tests
check the plumbing (files, names, seeds, resume, checkpoint export, training hook) while
test_eval_runner checks the scores against known answers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stapo_megatron.cli import main
from stapo_megatron.data.benchmarks import BENCHMARKS
from stapo_megatron.rewards import REASONS
from tests.fixtures import ROWS
from tests.helpers import CONSOLE_LINE

pytestmark = pytest.mark.slow

ALL = list(BENCHMARKS)
COMMON = ["--k", "2", "--max-new-tokens", "4", "--reward-workers", "1", "--device", "cpu"]
FAKE_SGLANG = Path(__file__).resolve().parents[1] / "rollout" / "fake_sglang.py"


def read_records(directory: Path) -> dict[tuple, dict]:
    records = {}
    for line in (directory / "responses.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[(record["benchmark"], record["uid"], record["sample"])] = record
    return records


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, tiny_model, eval_data_dir):
    """``stapo eval`` in a process of its own over every benchmark file, 3 problems each, k = 2."""
    out = tmp_path_factory.mktemp("cli") / "out"
    command = [
        sys.executable,
        "-m",
        "stapo_megatron.cli",
        "eval",
        "--model",
        str(tiny_model),
        "--data-dir",
        str(eval_data_dir),
        "--benchmarks",
        ",".join(ALL),
        "--limit",
        "3",
        "--out",
        str(out),
        *COMMON,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, command, done.stdout


def test_every_benchmark_file_loads_and_scores(cli_run, eval_data_dir):
    out, _, stdout = cli_run
    # Every file of the eval folder is one of the registered benchmarks.
    assert {p.name for p in eval_data_dir.glob("*.jsonl")} == {spec.file_name for spec in BENCHMARKS.values()}
    results = json.loads((out / "results.json").read_text())
    assert list(results["benchmarks"]) == ALL
    assert results["model"] == "tiny-qwen3"
    assert results["decoding"] == {"preset": "train", "temperature": 1.0, "top_p": 1.0}
    records = read_records(out)
    assert len(records) == len(ALL) * 3 * 2
    for name, score in results["benchmarks"].items():
        mine = [r for r in records.values() if r["benchmark"] == name]
        assert sorted((r["uid"], r["sample"]) for r in mine) == [
            (f"{name}:{row}", s) for row in (1, 2, 3) for s in (0, 1)
        ]
        assert (score["k"], score["problems"], score["samples"]) == (2, 3, 6)
        assert score["problems_total"] == ROWS[name]
        assert score["avg@k"] == pytest.approx(sum(r["reward"] for r in mine) / 6)
        assert score["truncated"] == pytest.approx(sum(r["finish_reason"] == "length" for r in mine) / 6)
        assert score["response_tokens_mean"] == pytest.approx(sum(r["tokens"] for r in mine) / 6)
        assert score["reasons"] == {reason: sum(r["reason"] == reason for r in mine) for reason in REASONS}
        assert all(1 <= r["tokens"] <= 4 and r["finish_reason"] in ("stop", "length") for r in mine)
        assert all(r["answer"] for r in mine)  # minerva's boxed and olympiadbench's list answers were found
        for key in (f"eval/{name}/avg@2", f"eval/{name}/pass@1", f"eval/{name}/pass@2", f"eval/{name}/truncated"):
            assert key in results["metrics"]
    assert results["metrics"]["eval/average/avg@k"] == results["average"]["avg@k"]

    def cell(name):
        s = results["benchmarks"][name]
        return f"{100 * s['avg@k']:.1f} (avg@2; 3 of {s['problems_total']} problems)"

    table = [
        "| Model | Decoding | AIME24 | AIME25 | AMC23 | MATH-500 | Minerva | OlympiadBench | GSM8K | Avg. |",
        "|:--|:--|--:|--:|--:|--:|--:|--:|--:|--:|",
        f"| tiny-qwen3 | T=1.0, top-p=1.0 | {' | '.join(cell(n) for n in ALL)} | "
        f"{100 * results['average']['avg@k']:.1f} |",
    ]
    assert (out / "table.md").read_text().splitlines() == table
    assert stdout.splitlines() == table


def test_resume_after_an_interruption_gives_the_uninterrupted_result(cli_run, tmp_path):
    out, command, _ = cli_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(out / "settings.json", resumed)
    lines = (out / "responses.jsonl").read_text().splitlines(keepends=True)
    # Killed mid-line, mid-problem: olympiadbench's third problem has one of its two samples.
    (resumed / "responses.jsonl").write_text("".join(lines[:35]) + lines[35][:50])
    args = command[command.index("eval") :]
    args[args.index("--out") + 1] = str(resumed)
    assert main(args) == 0
    assert (resumed / "results.json").read_text() == (out / "results.json").read_text()
    assert sorted((resumed / "responses.jsonl").read_text().splitlines()) == sorted(line.rstrip("\n") for line in lines)


def test_other_settings_in_the_output_directory_are_refused_before_any_model_loads(cli_run, capsys):
    out, command, _ = cli_run
    args = command[command.index("eval") :]
    args[args.index("--max-new-tokens") + 1] = "5"
    assert main(args) == 2
    expected = (
        f"stapo: error: --out: {out}: holds responses sampled with max_new_tokens=4, this evaluation has "
        "max_new_tokens=5 (use another output directory, or --overwrite to start over)"
    )
    # The benchmarks were loaded (the console says so); then the error, alone, before any model.
    errors = [line for line in capsys.readouterr().err.splitlines() if not CONSOLE_LINE.match(line)]
    assert errors == [expected]


def test_a_megatron_checkpoint_is_exported_and_evaluated_like_its_source(cli_run, tiny_model, eval_data_dir, tmp_path):
    from stapo_megatron.checkpoint.convert import convert_hf_to_megatron
    from stapo_megatron.eval.model import HFExport, inspect_model

    ckpt = convert_hf_to_megatron(tiny_model, tmp_path / "mg")
    assert (ckpt / "hf_assets" / "tokenizer.json").is_file()
    export_dir = tmp_path / "export"
    args = [
        "eval",
        "--model",
        str(ckpt),
        "--data-dir",
        str(eval_data_dir),
        "--benchmarks",
        "aime24,minerva",
        "--limit",
        "2",
        "--out",
        str(tmp_path / "out"),
        "--export-dir",
        str(export_dir),
        *COMMON,
    ]
    assert main(args) == 0
    # The same weights, prompts and seeds: the same responses as the Hugging Face source gave.
    reference = read_records(cli_run[0])
    records = read_records(tmp_path / "out")
    assert len(records) == 8
    for key, record in records.items():
        assert record == reference[key]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["model"] == "mg"
    # The kept export is reused while the checkpoint is unchanged.
    weights = export_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert HFExport(inspect_model(str(ckpt)), str(export_dir)).materialize() == export_dir
    assert weights.stat().st_mtime_ns == stamp


def test_evaluation_inside_training(cli_run, tiny_model, qwen3_tokenizer, eval_data_dir, tmp_path):
    from stapo_megatron.data.config import DataConfig
    from stapo_megatron.eval.config import EvalConfig
    from stapo_megatron.eval.evaluator import Evaluator
    from stapo_megatron.eval.model import load_hf_weights
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.rewards import RewardConfig
    from stapo_megatron.rollout.local_engine import LocalEngine

    arch = Qwen3Config.from_hf(tiny_model)
    engine = LocalEngine(arch)
    load_hf_weights(engine, tiny_model, arch)
    eval_cfg = EvalConfig(every=5, benchmarks=["aime24", "olympiadbench"], data_dir=str(eval_data_dir), k=2, limit=2)
    # The trainer's own call; its reward kind (exact, for the synthetic task) must not reach math benchmarks.
    evaluator = Evaluator(
        engine,
        qwen3_tokenizer,
        eval_cfg,
        # stapo eval's default prompt (JustRL's, in the chat template), so the two sample alike
        DataConfig(source="train.parquet", prompt_template="justrl", chat_template=True),
        RewardConfig(kind="exact", num_workers=1),
        default_max_new_tokens=4,
    )
    metrics = evaluator.evaluate_in_training(5, tmp_path / "run")
    directory = tmp_path / "run" / "eval" / "step_0000005"
    results = json.loads((directory / "results.json").read_text())
    assert metrics == results["metrics"]
    expected = {"eval/average/avg@k", "eval/average/pass@k", "eval/average/truncated"}
    for name in ("aime24", "olympiadbench"):
        expected |= {f"eval/{name}/{m}" for m in ("avg@2", "pass@1", "pass@2", "truncated", "response_tokens_mean")}
        expected |= {f"eval/{name}/reason_{r}" for r in REASONS}
    assert set(metrics) == expected and all(isinstance(v, float) for v in metrics.values())
    assert results["settings"]["reward_kind"] == "math"
    # The same code as stapo eval: the same responses for the same problems.
    reference = read_records(cli_run[0])
    records = read_records(directory)
    assert len(records) == 8 and all(record == reference[key] for key, record in records.items())
    assert (directory / "table.md").read_text().splitlines()[
        0
    ] == "| Model | Decoding | AIME24 | OlympiadBench | Avg. |"


def test_the_sglang_engine_gets_the_model_directory(tiny_model, eval_data_dir, tmp_path, capsys):
    record_dir = tmp_path / "requests"
    record_dir.mkdir()
    config = tmp_path / "rollout.yaml"
    config.write_text(
        json.dumps(
            {
                "sglang": {
                    # started as sglang.launch_server is: through the wrapper that hands it the API key
                    "server_command": [sys.executable, "-m", "stapo_megatron.rollout.sglang_launch", str(FAKE_SGLANG)],
                    "startup_timeout_s": 60,
                    "shutdown_grace_s": 3,
                    "env": {"FAKE_SGLANG_RECORD_DIR": str(record_dir)},
                    # seeds act (and the resume below reproduces) only under deterministic inference
                    "deterministic_inference": True,
                }
            }
        )
    )
    args = [
        "eval",
        "--model",
        str(tiny_model),
        "--data-dir",
        str(eval_data_dir),
        "--benchmarks",
        "aime24,math500",
        "--limit",
        "3",
        "--engine",
        "sglang",
        "--rollout-config",
        str(config),
        "--decoding",
        "justrl",
        "--out",
        str(tmp_path / "out"),
        *COMMON,
    ]
    assert main(args) == 0
    assert "| tiny-qwen3 | T=0.7, top-p=0.9 |" in capsys.readouterr().out
    requests = [json.loads(line) for f in record_dir.glob("*.jsonl") for line in f.read_text().splitlines()]
    generate = [r["body"] for r in requests if r["path"] == "/generate"]
    # One call per benchmark (3 problems fit one group), each sample with its own seed.
    sampling = [p for body in generate for p in body["sampling_params"]]
    assert len(sampling) == 2 * 3 * 2 and len({p["sampling_seed"] for p in sampling}) == 12
    assert {(p["temperature"], p["top_p"], p["max_new_tokens"]) for p in sampling} == {(0.7, 0.9, 4)}
    # The server was launched on the model directory itself (its log file is in the output directory).
    logs = [f.read_text() for f in (tmp_path / "out" / "sglang").glob("*.log")]
    assert len(logs) == 1 and f"serving {tiny_model} on" in logs[0]
    whole = tmp_path / "out"
    lines = (whole / "responses.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 12
    # Resume with SGLang: a deterministic server samples alike from the same seeds, so the result is the same.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(whole / "settings.json", resumed)
    (resumed / "responses.jsonl").write_text("".join(lines[:7]) + lines[7][:25])
    args[args.index("--out") + 1] = str(resumed)
    assert main(args) == 0
    assert (resumed / "results.json").read_text() == (whole / "results.json").read_text()
    assert sorted((resumed / "responses.jsonl").read_text().splitlines(keepends=True)) == sorted(lines)
    assert os.listdir(resumed) and not (resumed / ".responses.jsonl.tmp").exists()


def read_verdicts(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "verdicts.jsonl").read_text().splitlines()]


def test_a_tiny_random_verifier_answers_junk_that_is_counted_and_changes_nothing(cli_run, tiny_model, tmp_path):
    """The local engine serves the verifier from its path; a random model's answers are never one
    letter, so every verdict is unparsed and every grade stays the rules'."""
    out, command, _ = cli_run
    judged = tmp_path / "judged"
    shutil.copytree(out, judged)
    args = command[command.index("eval") :]
    args[args.index("--out") + 1] = str(judged)
    # Two benchmarks' first problems (each verdict costs a prefill of the whole prompt on the CPU).
    args[args.index("--benchmarks") + 1] = "aime24,minerva"
    args[args.index("--limit") + 1] = "1"
    assert main([*args, "--verifier-model", str(tiny_model)]) == 0
    # Added to a finished evaluation: nothing sampled again.
    assert (judged / "responses.jsonl").read_bytes() == (out / "responses.jsonl").read_bytes()
    chosen = {("aime24", "aime24:1"), ("minerva", "minerva:1")}
    records = read_records(out)
    wrong = [r for r in records.values() if r["reward"] != 1.0 and (r["benchmark"], r["uid"]) in chosen]
    verdicts = read_verdicts(judged)
    assert len(verdicts) == len(wrong) > 0
    assert {v["status"] for v in verdicts} == {"unparsed"}
    assert all(v["rectified_reward"] == v["rule_reward"] and v["output"] for v in verdicts)
    after = json.loads((judged / "results.json").read_text())
    assert after["verifier"]["name"] == "tiny-qwen3" and after["verifier"]["engine"] == "local"
    assert list(after["benchmarks"]) == ["aime24", "minerva"]
    for name, score in after["benchmarks"].items():
        rectified = score.pop("verifier")
        mine = [r for r in records.values() if r["benchmark"] == name and (name, r["uid"]) in chosen]
        assert (score["problems"], score["samples"]) == (1, 2) and len(mine) == 2
        assert score["avg@k"] == pytest.approx(sum(r["reward"] for r in mine) / 2)
        assert rectified["avg@k"] == score["avg@k"] and rectified["pass@k"] == score["pass@k"]
        assert rectified["flips"] == 0 and rectified["verdicts"]["unparsed"] == rectified["rule_wrong"]
    rows = (judged / "table.md").read_text().splitlines()
    assert rows[2].startswith("| tiny-qwen3 | T=1.0, top-p=1.0 | rules |")
    assert rows[3].startswith("| tiny-qwen3 | T=1.0, top-p=1.0 | rules + tiny-qwen3 |")
    assert all(" flips; " in cell and " unparsed; " in cell for cell in rows[3].split(" | ")[3:-1])


def test_sglang_servers_are_launched_on_the_verifier(tiny_model, eval_data_dir, tmp_path):
    record_dir = tmp_path / "requests"
    record_dir.mkdir()
    verifier = tmp_path / "CompassVerifier-3B"
    shutil.copytree(tiny_model, verifier)
    config = tmp_path / "rollout.yaml"
    config.write_text(
        json.dumps(
            {
                "sglang": {
                    "server_command": [sys.executable, "-m", "stapo_megatron.rollout.sglang_launch", str(FAKE_SGLANG)],
                    "startup_timeout_s": 60,
                    "shutdown_grace_s": 3,
                    "env": {"FAKE_SGLANG_RECORD_DIR": str(record_dir)},
                }
            }
        )
    )
    out = tmp_path / "out"
    args = ["eval", "--model", str(tiny_model), "--data-dir", str(eval_data_dir), "--benchmarks", "aime24"]
    args += ["--limit", "2", "--engine", "sglang", "--rollout-config", str(config), "--out", str(out), *COMMON]
    assert main([*args, "--verifier-model", str(verifier)]) == 0
    logs = {str(f.relative_to(out)): f.read_text() for f in out.glob("sglang/**/*.log")}
    assert len(logs) == 2
    assert [f"serving {tiny_model} on" in text for name, text in sorted(logs.items())] == [True, False]
    assert [f"serving {verifier} on" in text for name, text in sorted(logs.items())] == [False, True]
    assert sorted(logs)[1].startswith("sglang/verifier/")
    requests = [json.loads(line) for f in record_dir.glob("*.jsonl") for line in f.read_text().splitlines()]
    sampling = [p for r in requests if r["path"] == "/generate" for p in r["body"]["sampling_params"]]
    judging = [p for p in sampling if p.get("top_k") == 1]
    verdicts = read_verdicts(out)
    wrong = [r for r in read_records(out).values() if r["reward"] != 1.0]
    assert len(judging) == len(verdicts) == len(wrong) == len(sampling) - 2 * 2 > 0
    assert {(p["n"], p["max_new_tokens"]) for p in judging} == {(1, 8)}
    results = json.loads((out / "results.json").read_text())
    assert results["verifier"]["engine"] == "sglang" and results["verifier"]["name"] == "CompassVerifier-3B"
    counts = results["benchmarks"]["aime24"]["verifier"]["verdicts"]
    assert sum(counts.values()) == len(wrong) and counts == {
        status: sum(v["status"] == status for v in verdicts) for status in counts
    }


def test_stapo_eval_with_a_custom_reward_function(tiny_model, eval_data_dir, tmp_path, capsys):
    """``stapo eval ... reward.kind=custom reward.function=...``: the function scores every response with its
    benchmark row, and belongs to the settings a resumed evaluation must match."""
    out = tmp_path / "custom"
    functions = "tests.rewards.custom_reward_functions"
    args = [
        "eval",
        "--model",
        str(tiny_model),
        "--data-dir",
        str(eval_data_dir),
        "--benchmarks",
        "aime24",
        "--limit",
        "2",
        "--out",
        str(out),
        *COMMON,
        "reward.kind=custom",
        f"reward.function={functions}:cites_row",
    ]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert (results["settings"]["reward_kind"], results["settings"]["reward_function"]) == (
        "custom",
        f"{functions}:cites_row",
    )
    ids = [json.loads(line)["id"] for line in (eval_data_dir / "aime24.jsonl").read_text().splitlines()[:2]]
    records = read_records(out)
    assert sorted(records) == [("aime24", f"aime24:{row}", s) for row in (1, 2) for s in (0, 1)]
    for (_, uid, _), record in records.items():
        boxed = f"\\boxed{{{record['answer']}}}" in record["response"]
        assert (record["reward"], record["detail"]) == (float(boxed), f"row id {ids[int(uid.split(':')[1]) - 1]}")
    capsys.readouterr()
    args[-1] = f"reward.function={functions}:with_row"
    assert main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if not CONSOLE_LINE.match(line)]
    assert errors == [
        f"stapo: error: --out: {out}: holds responses sampled with reward_function='{functions}:cites_row', this "
        f"evaluation has reward_function='{functions}:with_row' (use another output directory, or --overwrite to "
        "start over)"
    ]
