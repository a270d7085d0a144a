"""The evaluation pipeline with a scripted engine: exact scores, the paper's table, --compare, resume."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from fractions import Fraction

import pytest

from stapo_megatron.cli import main
from stapo_megatron.config import ConfigError
from stapo_megatron.data.prompts import PromptEncoder
from stapo_megatron.eval.config import EvalConfig
from stapo_megatron.eval.runner import EvalRun, Sampling, group_seed, load_tasks
from stapo_megatron.eval.store import RECORD_FIELDS
from stapo_megatron.rewards import REASONS, RewardConfig
from tests.eval.scripted import ScriptedEngine
from tests.fixtures import ROWS

SAMPLING = Sampling(
    temperature=1.0, top_p=1.0, max_new_tokens=64, stop_token_ids=(151645,), seed=0, problems_per_call=8
)
SETTINGS = {"model": "scripted", "engine": "scripted"}
TRAIN = {"preset": "train", "temperature": 1.0, "top_p": 1.0}
JUSTRL = {"preset": "justrl", "temperature": 0.7, "top_p": 0.9}
REWARDS = RewardConfig(num_workers=1)


def tasks_for(tokenizer, data_dir, benchmarks, **fields):
    cfg = EvalConfig(benchmarks=benchmarks, data_dir=str(data_dir), **fields)
    return load_tasks(cfg, PromptEncoder(tokenizer, "stapo"))


def closed_pass(n, c, k):
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def evaluate(directory, tokenizer, tasks, correct, model, decoding, sampling=SAMPLING):
    engine = ScriptedEngine(tokenizer, tasks, correct)
    with EvalRun(directory, tasks, sampling, SETTINGS) as run:
        run.generate(engine, tokenizer, REWARDS)
        results = run.results(model, decoding)
    return results, engine


def aime_correct(name, i):
    return (i * 7) % 33 if name == "aime24" else (i * 5 + 3) % 33


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory, qwen3_tokenizer, eval_data_dir):
    """AIME24 and AMC23 (every fixture row) at the paper's k = 32, with a known number of right answers per problem."""
    tasks = tasks_for(qwen3_tokenizer, eval_data_dir, ["aime24", "amc23"])
    directory = tmp_path_factory.mktemp("paper") / "stapo"
    results, _ = evaluate(directory, qwen3_tokenizer, tasks, aime_correct, "STAPO", TRAIN)
    return directory, results


def test_scores_match_the_known_answers(paper_run):
    directory, results = paper_run
    expected_avg = {}
    for name in ("aime24", "amc23"):
        problems = ROWS[name]
        counts = [aime_correct(name, i) for i in range(problems)]
        score = results["benchmarks"][name]
        assert (score["k"], score["problems"], score["problems_total"], score["samples"]) == (
            32,
            problems,
            problems,
            32 * problems,
        )
        expected_avg[name] = sum(c / 32 for c in counts) / problems
        assert score["avg@k"] == pytest.approx(expected_avg[name], rel=1e-12)
        assert list(score["pass@k"]) == ["1", "2", "4", "8", "16", "32"]
        for j, value in score["pass@k"].items():
            assert value == pytest.approx(sum(closed_pass(32, c, int(j)) for c in counts) / problems, rel=1e-12)
        assert score["pass@k"]["1"] == pytest.approx(score["avg@k"], rel=1e-12)
        # The wrong responses are the "length" ones, and have no box.
        assert score["truncated"] == pytest.approx(1 - expected_avg[name], rel=1e-12)
        assert score["reasons"] == {
            **dict.fromkeys(REASONS, 0),
            "correct": sum(counts),
            "no_box": 32 * problems - sum(counts),
        }
    assert results["average"]["avg@k"] == pytest.approx((expected_avg["aime24"] + expected_avg["amc23"]) / 2, rel=1e-12)

    metrics = results["metrics"]
    assert metrics["eval/aime24/avg@32"] == results["benchmarks"]["aime24"]["avg@k"]
    assert metrics["eval/average/avg@k"] == results["average"]["avg@k"]
    expected_names = {"eval/average/avg@k", "eval/average/pass@k", "eval/average/truncated"}
    for name in ("aime24", "amc23"):
        expected_names |= {f"eval/{name}/avg@32", f"eval/{name}/truncated", f"eval/{name}/response_tokens_mean"}
        expected_names |= {f"eval/{name}/pass@{j}" for j in (1, 2, 4, 8, 16, 32)}
        expected_names |= {f"eval/{name}/reason_{r}" for r in REASONS}
    assert set(metrics) == expected_names
    assert json.loads((directory / "results.json").read_text()) == results

    lines = (directory / "responses.jsonl").read_text().splitlines()
    assert len(lines) == 32 * (ROWS["aime24"] + ROWS["amc23"])
    records = [json.loads(line) for line in lines]
    assert all(set(r) == set(RECORD_FIELDS) for r in records)
    first = next(r for r in records if r["uid"] == "aime24:2" and r["sample"] == 3)
    seed = group_seed(0, "aime24", "aime24:1")  # aime24:2 is in the group of 8 that aime24:1 starts
    assert first == {
        "benchmark": "aime24",
        "uid": "aime24:2",
        "row": 2,
        "sample": 3,
        "seed": seed,
        "answer": first["answer"],
        "response": f"Seed {seed}, sample 3: the answer is \\boxed{{{first['answer']}}}.",
        "extracted": first["answer"],
        "reward": 1.0,
        "reason": "correct",
        "finish_reason": "stop",
        "tokens": first["tokens"],
    }


def test_table_has_the_papers_layout(paper_run):
    directory, results = paper_run
    a, b = results["benchmarks"]["aime24"]["avg@k"], results["benchmarks"]["amc23"]["avg@k"]
    assert (directory / "table.md").read_text().splitlines() == [
        "| Model | Decoding | AIME24 | AMC23 | Avg. |",
        "|:--|:--|--:|--:|--:|",
        f"| STAPO | T=1.0, top-p=1.0 | {100 * a:.1f} | {100 * b:.1f} | {100 * (a + b) / 2:.1f} |",
    ]


def test_compare_prints_one_table_across_runs(paper_run, tmp_path, qwen3_tokenizer, eval_data_dir, capsys):
    stapo_dir, stapo = paper_run
    tasks = tasks_for(qwen3_tokenizer, eval_data_dir, ["aime24", "math500"], k_by_benchmark={"math500": 2}, limit=5)
    grpo, _ = evaluate(tmp_path / "grpo", qwen3_tokenizer, tasks, lambda name, i: i % 3, "GRPO", JUSTRL)
    assert main(["eval", "--compare", str(stapo_dir), str(tmp_path / "grpo"), "--out", str(tmp_path / "table.md")]) == 0
    a, b = stapo["benchmarks"]["aime24"]["avg@k"], stapo["benchmarks"]["amc23"]["avg@k"]
    g = grpo["benchmarks"]["aime24"]["avg@k"]
    m = grpo["benchmarks"]["math500"]["avg@k"]
    assert g == pytest.approx((0 + 1 + 2 + 0 + 1) / 32 / 5) and m == pytest.approx((0 + 0.5 + 1 + 0 + 0.5) / 5)
    expected = [
        "| Model | Decoding | AIME24 | AMC23 | MATH-500 | Avg. |",
        "|:--|:--|--:|--:|--:|--:|",
        f"| STAPO | T=1.0, top-p=1.0 | {100 * a:.1f} | {100 * b:.1f} | – | – |",
        f"| GRPO | T=0.7, top-p=0.9 | {100 * g:.1f} (5 of {ROWS['aime24']} problems) | – |"
        f" {100 * m:.1f} (avg@2; 5 of {ROWS['math500']} problems) | – |",
    ]
    assert capsys.readouterr().out.splitlines() == expected
    assert (tmp_path / "table.md").read_text().splitlines() == expected


def test_compare_names_a_directory_without_results(tmp_path, capsys):
    assert main(["eval", "--compare", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"stapo: error: --compare: {tmp_path} has no results.json (not a finished evaluation)"
    )


def test_resume_samples_only_the_missing_groups_with_the_same_seeds(tmp_path, qwen3_tokenizer, eval_data_dir):
    tasks = tasks_for(qwen3_tokenizer, eval_data_dir, ["aime24", "amc23"], limit=6, k=4)
    sampling = dataclasses.replace(SAMPLING, problems_per_call=2)

    def correct(name, i):
        return i % 3

    whole, engine = evaluate(tmp_path / "whole", qwen3_tokenizer, tasks, correct, "m", TRAIN, sampling)
    assert [(n, k) for _, n, k in engine.calls] == [(2, 4)] * 6

    # Killed while writing: 13 whole lines (group 0 and part of group 1 of aime24) and half a line.
    lines = (tmp_path / "whole" / "responses.jsonl").read_text().splitlines(keepends=True)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copy(tmp_path / "whole" / "settings.json", resumed_dir)
    (resumed_dir / "responses.jsonl").write_text("".join(lines[:13]) + lines[13][:40])
    with EvalRun(resumed_dir, tasks, sampling, SETTINGS) as run:
        assert len(run.records) == 13
        assert run.pending() == 6 * 4 * 2 - 13
    resumed, engine_again = evaluate(resumed_dir, qwen3_tokenizer, tasks, correct, "m", TRAIN, sampling)
    assert engine_again.calls == engine.calls[1:]
    assert resumed == whole
    assert (resumed_dir / "results.json").read_text() == (tmp_path / "whole" / "results.json").read_text()
    resumed_lines = (resumed_dir / "responses.jsonl").read_text().splitlines(keepends=True)
    assert sorted(resumed_lines) == sorted(lines)

    # Complete: nothing left to sample, the engine is not called.
    finished, engine_done = evaluate(resumed_dir, qwen3_tokenizer, tasks, correct, "m", TRAIN, sampling)
    assert engine_done.calls == [] and finished == whole


def test_a_directory_of_other_settings_is_refused(tmp_path, qwen3_tokenizer, eval_data_dir):
    tasks = tasks_for(qwen3_tokenizer, eval_data_dir, ["aime24"], limit=2, k=2)
    evaluate(tmp_path / "run", qwen3_tokenizer, tasks, lambda name, i: 1, "m", TRAIN)
    hotter = dataclasses.replace(SAMPLING, temperature=0.7)
    with pytest.raises(ConfigError, match=r"sampled with temperature=1.0, this evaluation has temperature=0.7"):
        EvalRun(tmp_path / "run", tasks, hotter, {**SETTINGS, "temperature": 0.7})
    # The lock was released by the refusal: the same settings open fine, twice in a row but not at once.
    with EvalRun(tmp_path / "run", tasks, SAMPLING, SETTINGS) as run:
        assert run.pending() == 0
        with pytest.raises(ConfigError, match="another evaluation is writing"):
            EvalRun(tmp_path / "run", tasks, SAMPLING, SETTINGS)
    # fresh (what training does for a step evaluated again) starts over.
    with EvalRun(tmp_path / "run", tasks, hotter, SETTINGS, fresh=True) as run:
        assert run.pending() == 4 and not (tmp_path / "run" / "results.json").exists()


def test_damaged_lines_inside_the_file_are_skipped_counted_and_sampled_again(
    tmp_path, qwen3_tokenizer, eval_data_dir, caplog
):
    """A damaged line refused the whole evaluation ("move it away to start over": every response
    sampled again). Now each damaged line is skipped with one warning counting them, its response
    is sampled again, and the line itself stays in the file."""
    tasks = tasks_for(qwen3_tokenizer, eval_data_dir, ["aime24"], limit=2, k=2)
    whole, _ = evaluate(tmp_path / "run", qwen3_tokenizer, tasks, lambda name, i: 1, "m", TRAIN)
    path = tmp_path / "run" / "responses.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 4
    text_reward = json.loads(lines[2])
    text_reward["reward"] = "1"
    unmatched = json.loads(lines[3])
    unmatched["reward"] = 1.0 - unmatched["reward"]  # a reward that does not go with its reason
    damaged = [
        lines[0],
        lines[1][:30] + "\n",
        json.dumps(text_reward) + "\n",
        json.dumps(unmatched) + "\n",
        "[" * 100_000 + "]" * 100_000 + "\n",
    ]
    path.write_text("".join(damaged))
    with caplog.at_level("WARNING"):
        again, engine = evaluate(tmp_path / "run", qwen3_tokenizer, tasks, lambda name, i: 1, "m", TRAIN)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{path}: line 2 is cut off or malformed; skipped 4 malformed rows"
    ]
    assert again == whole
    assert [(n, k) for _, n, k in engine.calls] == [(2, 2)]  # the one group of the three missing samples
    kept = path.read_text().splitlines(keepends=True)
    assert kept[: len(damaged)] == damaged and sorted(kept[len(damaged) :]) == sorted(lines[1:])


def test_a_tokenizer_that_cannot_encode_the_benchmarks_is_a_config_error(eval_data_dir):
    from stapo_megatron.data.synthetic import synthetic_tokenizer

    # The synthetic task's word-level tokenizer has no unknown token: a word outside it fails.
    with pytest.raises(
        ConfigError, match=r"^benchmarks: aime24: the tokenizer cannot encode its prompts \(WordLevel error"
    ):
        tasks_for(synthetic_tokenizer(5), eval_data_dir, ["aime24"], limit=1)


def test_a_custom_reward_scores_with_the_benchmark_rows(tmp_path, qwen3_tokenizer, eval_data_dir):
    """reward.kind custom: the function gets each benchmark row; its score is the reward and its reason the
    record's detail; problem i has i of its 4 samples boxing the answer."""
    from stapo_megatron.eval.runner import prompt_settings

    tasks = tasks_for(qwen3_tokenizer, eval_data_dir, ["aime24"], limit=3, k=4)
    reward = RewardConfig(kind="custom", function="tests.rewards.custom_reward_functions:cites_row", num_workers=1)
    engine = ScriptedEngine(qwen3_tokenizer, tasks, lambda name, i: i)
    with EvalRun(tmp_path / "run", tasks, SAMPLING, SETTINGS) as run:
        run.generate(engine, qwen3_tokenizer, reward)
        results = run.results("m", TRAIN)
    ids = [json.loads(line)["id"] for line in (eval_data_dir / "aime24.jsonl").read_text().splitlines()[:3]]
    records = [json.loads(line) for line in (tmp_path / "run" / "responses.jsonl").read_text().splitlines()]
    assert sorted((r["row"], r["sample"], r["reward"], r["reason"], r["detail"]) for r in records) == [
        (row, s, float(s < row - 1), "correct" if s < row - 1 else "wrong", f"row id {ids[row - 1]}")
        for row in (1, 2, 3)
        for s in range(4)
    ]
    assert all(set(r) == {*RECORD_FIELDS, "detail"} and r["extracted"] is None for r in records)
    score = results["benchmarks"]["aime24"]
    assert score["avg@k"] == pytest.approx((0 + 1 / 4 + 2 / 4) / 3, rel=1e-12)
    assert score["reasons"] == {**dict.fromkeys(REASONS, 0), "correct": 3, "wrong": 9}
    # The function belongs to the settings a resumed evaluation must match; other kinds' settings are unchanged.
    encoder = PromptEncoder(qwen3_tokenizer, "stapo")
    assert prompt_settings(encoder, reward)["reward_function"] == reward.function
    assert "reward_function" not in prompt_settings(encoder, RewardConfig())
