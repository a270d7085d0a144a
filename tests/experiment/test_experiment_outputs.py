"""`stapo experiment study` replaces only what it wrote, and reads its settings file as untrusted:
both checked before any run starts, without training (the runs are finished ones)."""

from __future__ import annotations

import json

import pytest

from stapo_megatron.config import ConfigError
from stapo_megatron.experiment.methods import parse_methods
from stapo_megatron.experiment.study import SETTINGS_FILE, Study, run_study
from tests.experiment.test_experiment_report import GRPO_RUNS, STAPO_RUNS, STEPS, write_runs


def finished_runs(out):
    write_runs(out, {"grpo": GRPO_RUNS[:1], "stapo": STAPO_RUNS, "stapo+q=0.5": STAPO_RUNS})


def study(out):
    return Study(out, methods=parse_methods("grpo,stapo,stapo:q=0.5"), seeds=(0,), steps=STEPS)


def snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.parametrize(
    "name", ["comparison.md", "entropy.png", "inspect_stapo+q=0.5.txt", "base_config.yaml", "logs"]
)
def test_files_of_its_names_in_a_directory_it_did_not_make_are_refused(tmp_path, name):
    """The comparison was written over a user's comparison.md, figures and reports in --out, a
    base_config.yaml there was trained on, and logs were added to a logs/ of theirs; now refused
    before any run starts, nothing touched."""
    finished_runs(tmp_path)
    if name == "logs":
        (tmp_path / name).mkdir()
    else:
        (tmp_path / name).write_text("the user's own")
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as error:
        run_study(study(tmp_path))
    assert str(error.value) == (
        f"--out {tmp_path}: holds {name} but no {SETTINGS_FILE} of an experiment; "
        "its files are not the experiment's to replace: choose another --out"
    )
    assert snapshot(tmp_path) == before and not (tmp_path / SETTINGS_FILE).exists()


def test_its_own_directory_is_written_again(tmp_path):
    finished_runs(tmp_path)
    experiment = study(tmp_path)
    first = [p.read_bytes() for p in run_study(experiment)]
    again = [p.read_bytes() for p in run_study(experiment)]
    assert [a[:8] for a in again[1:]] == [b"\x89PNG\r\n\x1a\n"] * 3 and first == again


@pytest.mark.parametrize(
    "content, problem",
    [
        ("not json", "is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        ("[" * 200_000 + "]" * 200_000, "is nested too deeply to read"),
        ("[1, 2]", "is not an experiment's settings file (not a JSON object); choose another --out"),
        ('{"steps": 20}', "is not an experiment's settings file (no minibatches); choose another --out"),
    ],
)
def test_a_malformed_settings_file_is_one_line(tmp_path, content, problem):
    """Before: JSONDecodeError, RecursionError or AttributeError tracebacks."""
    finished_runs(tmp_path)
    (tmp_path / SETTINGS_FILE).write_text(content)
    with pytest.raises(ConfigError) as error:
        run_study(study(tmp_path))
    prefix = (
        "--out: " if problem.startswith("is not valid") or problem.startswith("is nested") else f"--out {tmp_path}: "
    )
    assert str(error.value) == f"{prefix}{tmp_path / SETTINGS_FILE} {problem}"


def test_recorded_wall_times_that_are_not_seconds_are_one_line(tmp_path):
    """A text in wall_seconds was a ValueError traceback when the table was written (and a TypeError
    in the sum after a run, once it had trained)."""
    finished_runs(tmp_path)
    experiment = study(tmp_path)
    settings = {**experiment.settings(), "wall_seconds": {"grpo/seed_0": "12"}}
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match=r"wall_seconds is not a mapping of runs to seconds"):
        run_study(experiment)
