"""`stapo experiment entropy`'s table and figures from hand-made metrics, its checks, and its
resumption (finished runs are not run again), without training."""

from __future__ import annotations

import json

import pytest

from stapo_megatron.config import ConfigError, load_config
from stapo_megatron.experiment.entropy import (
    BASE_CONFIG,
    SETTINGS_FILE,
    EntropyExperiment,
    run_experiment,
)
from stapo_megatron.experiment.report import TABLE_FILE, write_comparison
from stapo_megatron.runtime import console
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.launcher import default_config_path

STEPS = 20  # the start and end windows are 2 steps


def rising_run() -> list[dict]:
    """Accuracy i/20, entropy falling by 0.05 a step from 2.0, masked 0.1% on even steps, 5 tokens."""
    return [
        {
            "step": i,
            "reward/accuracy": i / 20,
            "policy/entropy": 2.0 - 0.05 * (i - 1),
            "s2t/masked_fraction": 0.001 if i % 2 == 0 else 0.0,
            "response/length_mean": 5.0,
            "time/step": 1.5,
        }
        for i in range(1, STEPS + 1)
    ]


def flat_run() -> list[dict]:
    """Accuracy 0.5, entropy 1.0, 80% masked, length i."""
    return [
        {
            "step": i,
            "reward/accuracy": 0.5,
            "policy/entropy": 1.0,
            "s2t/masked_fraction": 0.8,
            "response/length_mean": float(i),
            "time/step": 2.0,
        }
        for i in range(1, STEPS + 1)
    ]


def table_rows(path) -> dict[str, list[str]]:
    rows = [
        line.strip("|").split("|")
        for line in path.read_text().splitlines()
        if line.startswith("| ") and "---" not in line
    ]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_table_and_figures_from_metrics(tmp_path):
    files = write_comparison(tmp_path, [("rising", rising_run()), ("flat", flat_run())], {"flat": 123.4}, ["# heading"])
    assert [f.name for f in files] == [
        TABLE_FILE,
        "entropy.png",
        "accuracy.png",
        "masked_fraction.png",
        "response_length.png",
    ]
    for figure in files[1:]:
        assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000
    rows = table_rows(tmp_path / TABLE_FILE)
    # final: mean of 19/20 and 20/20; entropy start mean(2.0, 1.95), end mean(1.1, 1.05), -45.6%;
    # masked: mean 0.05%, max 0.1%; wall: no recorded time, so the steps' 20 x 1.5 s.
    assert rows["rising"] == [
        "20",
        "0.975",
        "0.975",
        "1.975",
        "1.075",
        "falling (-46%)",
        "0.050%",
        "0.100%",
        "5.00",
        "30",
    ]
    # the recorded wall time wins over the steps' 40 s; length end: mean(19, 20).
    assert rows["flat"] == [
        "20",
        "0.500",
        "0.500",
        "1.000",
        "1.000",
        "flat (+0%)",
        "80.000%",
        "80.000%",
        "19.50",
        "123",
    ]
    text = (tmp_path / TABLE_FILE).read_text()
    assert text.startswith("# heading\n") and "![policy entropy of response tokens (nats)](entropy.png)" in text


def test_a_run_without_the_metrics_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="empty: no metrics.jsonl rows"):
        write_comparison(tmp_path, [("empty", [])], {}, [])


def test_bad_options_fail_before_any_run(tmp_path):
    with pytest.raises(ConfigError, match=r"run.steps=3: the experiment sets run.steps for every run; use --steps"):
        EntropyExperiment(tmp_path, overrides=("run.steps=3",))
    with pytest.raises(ConfigError, match="algo.eps_high=0.3: the experiment sets algo.eps_high"):
        EntropyExperiment(tmp_path, overrides=("algo.eps_high=0.3",))
    with pytest.raises(ConfigError, match="--algos: stapo given more than once"):
        EntropyExperiment(tmp_path, algos=("stapo", "grpo", "stapo"))
    with pytest.raises(ConfigError, match="unknown algo preset 'nope'"):
        EntropyExperiment(tmp_path, algos=("grpo", "nope")).run_overrides()
    assert not any(tmp_path.iterdir())


def test_each_run_is_the_same_train_run_but_for_the_preset(tmp_path):
    plans = EntropyExperiment(
        tmp_path, algos=("grpo", "dapo"), steps=7, seed=3, overrides=("batch.max_new_tokens=10",)
    ).run_overrides()
    common = [
        "batch.max_new_tokens=10",
        "run.steps=7",
        "run.seed=3",
        "parallel.tensor_parallel=1",
        "logging.progress_bar=false",
    ]
    for algo, overrides in plans.items():
        assert set(common) <= set(overrides)
        assert f"algo={algo}" in overrides and f"run.output_dir={tmp_path / algo}" in overrides
    # DAPO's overlong buffer: a fifth of the responses' maximum, as 4096 of DAPO's 20480.
    assert plans["dapo"][-1] == "algo.overlong_buffer=2"
    assert not any(o.startswith("algo.overlong_buffer") for o in plans["grpo"])


def test_finished_runs_are_not_run_again_and_settings_must_match(tmp_path, capsys):
    console.configure(rank=0)  # as `stapo` does: messages on stderr
    for algo, rows in (("grpo", flat_run()), ("stapo", rising_run())):
        (tmp_path / algo).mkdir()
        (tmp_path / algo / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "stapo" / "spurious").mkdir()
    (tmp_path / "stapo" / "spurious" / "step_0000010.jsonl").write_text(
        json.dumps({"step": 10, "token": "7", "probability": 1e-3, "entropy": 0.2, "before": "3 + 4 =", "after": ""})
        + "\n"
    )
    experiment = EntropyExperiment(tmp_path, algos=("grpo", "stapo"), steps=STEPS)
    files = run_experiment(experiment)  # would start `stapo train` for an unfinished run
    err = capsys.readouterr().err
    assert [err.count(f"[stapo] experiment {algo}: finished earlier") for algo in ("grpo", "stapo")] == [1, 1]
    assert "started" not in err
    # the STAPO run's silenced tokens, next to the paper's classes; grpo dumped none
    assert [f.name for f in files][-1] == "inspect_stapo.txt"
    inspection = files[-1].read_text().splitlines()
    assert inspection[0] == "1 silenced tokens in 1 dumps (steps 10..10), 1 distinct"
    assert inspection[-1].split() == ["all", "1", "100.0%", "0.0%", "0.0%", "100.0%", "'7'*", "1"]
    assert "[inspect_stapo.txt](inspect_stapo.txt)" in files[0].read_text()
    rows = table_rows(files[0])
    assert rows["stapo"][1] == "0.975" and rows["grpo"][6] == "80.000%"
    assert json.loads((tmp_path / SETTINGS_FILE).read_text())["steps"] == STEPS
    assert (tmp_path / BASE_CONFIG).read_text() == default_config_path().read_text()
    with pytest.raises(ConfigError, match=rf"holds runs made with steps={STEPS}, not {STEPS + 1}"):
        run_experiment(EntropyExperiment(tmp_path, algos=("grpo",), steps=STEPS + 1))


def test_runs_keep_the_config_copied_at_the_start(tmp_path):
    """A resumed experiment trains on the copy it took, whatever the packaged default says now."""
    text = default_config_path().read_text()
    (tmp_path / BASE_CONFIG).write_text(text.replace("\n  hidden_size: ", "\n  hidden_size: -1 #"))
    with pytest.raises(ConfigError, match="hidden_size"):
        EntropyExperiment(tmp_path, algos=("dapo",)).run_overrides()


def test_without_a_config_the_runs_train_the_packaged_free_words_task(tmp_path):
    experiment = EntropyExperiment(tmp_path, algos=("dapo",))
    assert experiment.source_config() == default_config_path()
    assert load_config(TrainConfig, experiment.source_config()).reward.kind == "free_words"
    plans = experiment.run_overrides()
    assert plans["dapo"][:2] == ["algo=dapo", "run.steps=300"]  # nothing but the experiment's own fields
    assert plans["dapo"][-1] == "algo.overlong_buffer=1"  # a fifth of its 3 response tokens, at least 1


def test_the_preset_the_config_sets_fields_on_keeps_them_and_the_others_run_as_published(tmp_path):
    """The tiny task's algo section is stapo with its own tau_p: the stapo run trains with it, as
    `stapo train` does; grpo gets its preset, tau_p included. A bare preset name keeps nothing."""
    experiment = EntropyExperiment(tmp_path / "tiny", algos=("grpo", "stapo"))
    assert experiment.configured_algo() == "stapo"
    plans = experiment.run_overrides()
    assert "algo=grpo" in plans["grpo"] and not any(o.startswith("algo") for o in plans["stapo"])
    task = load_config(TrainConfig, default_config_path())
    stapo = load_config(TrainConfig, default_config_path(), plans["stapo"])
    grpo = load_config(TrainConfig, default_config_path(), plans["grpo"])
    assert stapo.algo == task.algo and stapo.algo.tau_p != load_config(TrainConfig, None, ["algo=stapo"]).algo.tau_p
    assert grpo.algo == load_config(TrainConfig, None, ["algo=grpo"]).algo
    bare = tmp_path / "bare.yaml"
    text = default_config_path().read_text()
    section = text[text.index("\nalgo:") : text.index("\noptim:")]
    bare.write_text(text.replace(section, "\nalgo: stapo"))
    named = EntropyExperiment(tmp_path / "bare", algos=("stapo",), config=str(bare))
    assert named.configured_algo() is None and "algo=stapo" in named.run_overrides()["stapo"]
