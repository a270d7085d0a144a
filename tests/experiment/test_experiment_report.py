"""`stapo experiment study`'s table and figures from hand-made metrics, its checks, and its
resumption (finished runs are not run again), without training."""

from __future__ import annotations

import json

import pytest

from stapo_megatron.config import ConfigError, load_config
from stapo_megatron.experiment.methods import Method, parse_methods
from stapo_megatron.experiment.report import (
    TABLE_FILE,
    MethodRuns,
    mean_band,
    method_groups,
    write_report,
)
from stapo_megatron.experiment.study import BASE_CONFIG, SETTINGS_FILE, Study, run_study
from stapo_megatron.runtime import console
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.launcher import default_config_path
from stapo_megatron.trainer.plot import drawn_by_stapo

STEPS = 20  # the start and end windows are 2 steps


def synthetic_run(accuracy: float, entropy_end: float, masked: float, steps: int = STEPS) -> list[dict]:
    """Accuracy constant; entropy 2.0 over the first half, then ``entropy_end``; ``masked`` on even
    steps and 0 on odd ones (mean masked / 2); 1% of tokens clipped low, 2% high in the second
    half (mean 2%); 1.5 s a step."""
    return [
        {
            "step": i,
            "reward/accuracy": accuracy,
            "policy/entropy": 2.0 if i <= steps // 2 else entropy_end,
            "policy/entropy_p50": 1.0,
            "s2t/masked_fraction": masked if i % 2 == 0 else 0.0,
            "policy/clip_low_fraction": 0.01,
            "policy/clip_high_fraction": 0.02 if i > steps // 2 else 0.0,
            "policy/dual_clip_fraction": 0.0,
            "time/step": 1.5,
        }
        for i in range(1, steps + 1)
    ]


GRPO_RUNS = [
    (0, synthetic_run(0.9, 0.2, 0.002)),
    (1, synthetic_run(0.95, 0.3, 0.004)),
    (2, synthetic_run(1.0, 0.4, 0.006)),
]
STAPO_RUNS = [(0, synthetic_run(0.5, 1.0, 0.0))]


def write_runs(out, runs_by_method):
    for method, runs in runs_by_method.items():
        for seed, rows in runs:
            run_dir = out / method / f"seed_{seed}"
            run_dir.mkdir(parents=True)
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def table_rows(path) -> dict[str, list[str]]:
    """The first table's rows by their first cell."""
    text = path.read_text()
    start = text.index("| method |")
    table = []
    for line in text[start:].splitlines():
        if not line.startswith("|"):
            break
        table.append(line)
    rows = [line.strip("|").split("|") for line in table if "---" not in line]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_table_and_figures_from_metrics(tmp_path):
    methods = [MethodRuns(Method("grpo"), GRPO_RUNS), MethodRuns(Method("stapo"), STAPO_RUNS)]
    files = write_report(tmp_path, methods, {"grpo/seed_0": 100.0}, ["# heading"])
    assert [f.name for f in files] == [TABLE_FILE, "accuracy.png", "entropy.png", "masked_fraction.png"]
    for figure in files[1:]:
        assert drawn_by_stapo(figure) and figure.stat().st_size > 10_000
    rows = table_rows(tmp_path / TABLE_FILE)
    # Three seeds: every resample of them is all the lowest one with chance 1/27 > 2.5% (and all
    # the highest likewise), so the intervals are the range of the seeds. Masked: per run the mean
    # of m on even steps, 0 on odd; entropy start: 2.0; wall: grpo seed 0's recorded 100 s and the
    # steps' 20 x 1.5 s of the others.
    assert rows["grpo"] == [
        "3",
        "20",
        "0.950 [0.900, 1.000]",
        "0.300 [0.200, 0.400]",
        "0.200% [0.100%, 0.300%]",
        "2.000",
        "2.000%",
        "53",
    ]
    assert rows["stapo"] == [
        "1",
        "20",
        "0.500 [0.500, 0.500]",
        "1.000 [1.000, 1.000]",
        "0.000% [0.000%, 0.000%]",
        "2.000",
        "2.000%",
        "30",
    ]
    every_run = (tmp_path / TABLE_FILE).read_text().split("Every run:")[1]
    runs = [line.split("|")[1:-1] for line in every_run.splitlines() if line.startswith("| grpo")]
    assert [[c.strip() for c in cells] for cells in runs] == [
        ["grpo", "0", "0.900", "0.200", "0.100%", "100"],
        ["grpo", "1", "0.950", "0.300", "0.200%", "30"],
        ["grpo", "2", "1.000", "0.400", "0.300%", "30"],
    ]
    text = (tmp_path / TABLE_FILE).read_text()
    assert text.startswith("# heading\n") and "![policy entropy over all response tokens (nats)](entropy.png)" in text
    assert "Entropy (policy/entropy): the mean over every response token of the step" in text


def test_a_run_without_the_all_tokens_entropy_is_refused(tmp_path):
    """The entropy quantiles come with the entropy over every response token: a run of a trainer
    whose policy/entropy covered only the updated sequences has none, and cannot be compared."""
    rows = synthetic_run(0.5, 1.0, 0.0)
    del rows[4]["policy/entropy_p50"]
    with pytest.raises(ConfigError, match=r"^stapo seed 0: metrics.jsonl step 5 has no policy/entropy_p50 \(a study"):
        write_report(tmp_path, [MethodRuns(Method("stapo"), [(0, rows)])], {}, [])
    with pytest.raises(ConfigError, match="stapo seed 0: no metrics.jsonl rows to compare"):
        write_report(tmp_path, [MethodRuns(Method("stapo"), [(0, [])])], {}, [])
    assert not any(tmp_path.iterdir())


def test_panels_group_each_presets_variants_with_it():
    methods = parse_methods(
        "grpo,stapo,stapo:q=0.5,stapo:token_rule=s2t_random,stapo:q=0.9,stapo:token_rule=lowprob_all"
    )
    assert [(title, [m.spec for m in members]) for title, members in method_groups(methods)] == [
        ("presets", ["grpo", "stapo"]),
        ("stapo, varying q", ["stapo", "stapo:q=0.5", "stapo:q=0.9"]),
        ("stapo, varying token_rule", ["stapo", "stapo:token_rule=s2t_random", "stapo:token_rule=lowprob_all"]),
    ]


def test_the_band_is_the_mean_of_the_moving_averages_over_seeds():
    runs = [
        (0, [{"step": 1, "x": 0.0}, {"step": 2, "x": 2.0}, {"step": 3, "x": 4.0}]),
        (1, [{"step": 2, "x": 4.0}, {"step": 3, "x": 0.0}]),
    ]
    steps, (mean, low, high) = mean_band(runs, "x", 2)
    # steps both runs have; moving averages over 2: run 0 (2, 3), run 1 (4, 2)
    assert steps == [2, 3] and list(mean) == [3.0, 2.5] and list(low) == [2.0, 2.0] and list(high) == [4.0, 3.0]


def test_finished_runs_are_not_run_again_and_settings_must_match(tmp_path, capsys):
    console.configure(rank=0)  # as `stapo` does: messages on stderr
    write_runs(tmp_path, {"grpo": GRPO_RUNS, "stapo": [(seed, synthetic_run(0.5, 1.0, 0.0)) for seed in range(3)]})
    (tmp_path / "stapo" / "seed_0" / "spurious").mkdir()
    (tmp_path / "stapo" / "seed_0" / "spurious" / "step_0000010.jsonl").write_text(
        json.dumps({"step": 10, "token": "7", "probability": 1e-3, "entropy": 0.2, "before": "3 + 4 =", "after": ""})
        + "\n"
    )
    study = Study(tmp_path, methods=parse_methods("grpo,stapo"), seeds=(0, 1, 2), steps=STEPS)
    files = run_study(study)  # would start `stapo train` for an unfinished run
    err = capsys.readouterr().err
    assert [
        err.count(f"[stapo] experiment {m}/seed_{s}: finished earlier") for m in ("grpo", "stapo") for s in range(3)
    ] == [1] * 6
    assert "started" not in err
    # the STAPO runs' silenced tokens (its first seed), next to the paper's classes; grpo dumped none
    assert [f.name for f in files][-1] == "inspect_stapo.txt"
    inspection = files[-1].read_text().splitlines()
    assert inspection[0] == "1 silenced tokens in 1 dumps (steps 10..10), 1 distinct"
    assert "[inspect_stapo.txt](inspect_stapo.txt)" in files[0].read_text()
    rows = table_rows(files[0])
    assert rows["grpo"][2] == "0.950 [0.900, 1.000]" and rows["stapo"][0] == "3"
    assert f"--methods grpo,stapo --seeds 0-2 --steps {STEPS} --minibatches 4" in files[0].read_text()
    settings = json.loads((tmp_path / SETTINGS_FILE).read_text())
    assert (settings["steps"], settings["minibatches"]) == (STEPS, 4)
    assert (tmp_path / BASE_CONFIG).read_text() == default_config_path().read_text()
    with pytest.raises(ConfigError, match=rf"holds runs made with steps={STEPS}, not {STEPS + 1}"):
        run_study(Study(tmp_path, methods=(Method("grpo"),), seeds=(0,), steps=STEPS + 1))
    with pytest.raises(ConfigError, match="holds runs made with minibatches=4, not 2"):
        run_study(Study(tmp_path, methods=(Method("grpo"),), seeds=(0,), steps=STEPS, minibatches=2))


def test_runs_keep_the_config_copied_at_the_start(tmp_path):
    """A resumed study trains on the copy it took, whatever the packaged default says now."""
    text = default_config_path().read_text()
    (tmp_path / BASE_CONFIG).write_text(text.replace("\n  hidden_size: ", "\n  hidden_size: -1 #"))
    with pytest.raises(ConfigError, match="hidden_size"):
        Study(tmp_path, methods=(Method("dapo"),)).method_overrides()


def test_without_a_config_the_runs_train_the_packaged_free_words_task(tmp_path):
    study = Study(tmp_path, methods=(Method("dapo"),))
    assert study.source_config() == default_config_path()
    assert load_config(TrainConfig, study.source_config()).reward.kind == "free_words"
    plans = study.method_overrides()
    # DAPO's overlong buffer: a fifth of the responses' maximum (3 tokens), at least 1, as 4096 of DAPO's 20480.
    assert plans["dapo"][-1] == "algo.overlong_buffer=1"
    assert not any(
        o.startswith("algo.overlong_buffer")
        for o in Study(tmp_path, methods=(Method("grpo"),)).method_overrides()["grpo"]
    )


def test_the_preset_the_config_sets_fields_on_keeps_them_and_the_others_run_as_published(tmp_path):
    """The tiny task's algo section is stapo with its own tau_p: the stapo methods train with it, as
    `stapo train` does, their own fields on top; grpo gets its preset, tau_p included. A bare
    preset name keeps nothing."""
    study = Study(tmp_path / "tiny", methods=parse_methods("grpo,stapo,stapo:q=0.5"))
    assert study.configured_preset() == "stapo"
    plans = study.method_overrides()
    assert "algo=grpo" in plans["grpo"] and not any(o.startswith("algo") for o in plans["stapo"])
    assert [o for o in plans["stapo+q=0.5"] if o.startswith("algo")] == ["algo.q=0.5"]
    task = load_config(TrainConfig, default_config_path())
    stapo = load_config(TrainConfig, default_config_path(), plans["stapo"])
    variant = load_config(TrainConfig, default_config_path(), plans["stapo+q=0.5"])
    grpo = load_config(TrainConfig, default_config_path(), plans["grpo"])
    assert stapo.algo == task.algo and stapo.algo.tau_p != load_config(TrainConfig, None, ["algo=stapo"]).algo.tau_p
    assert (variant.algo.tau_p, variant.algo.q) == (task.algo.tau_p, 0.5)
    assert grpo.algo == load_config(TrainConfig, None, ["algo=grpo"]).algo
    bare = tmp_path / "bare.yaml"
    text = default_config_path().read_text()
    section = text[text.index("\nalgo:") : text.index("\noptim:")]
    bare.write_text(text.replace(section, "\nalgo: stapo"))
    named = Study(tmp_path / "bare", methods=(Method("stapo"),), config=str(bare))
    assert named.configured_preset() is None and "algo=stapo" in named.method_overrides()["stapo"]
