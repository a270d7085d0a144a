"""Every numeric flag of the light commands is bounded: a value out of range is argparse's one-line
error naming the flag (exit 2), before the command reads anything."""

from __future__ import annotations

import pytest

from stapo_megatron.cli import main


@pytest.mark.parametrize(
    ("argv", "flag", "bounds"),
    [
        (["inspect", "RUN", "--top", "-1"], "--top", "from 1 to 1000000"),
        (["inspect", "RUN", "--examples", "99999"], "--examples", "from 0 to 10000"),
        (["experiment", "study", "--steps", "0"], "--steps", "at least 1"),
        (["experiment", "study", "--minibatches", "-2"], "--minibatches", "at least 1"),
        (["status", "--last", "0"], "--last", "from 1 to 1000000"),
        (["logs", "EXP", "--job", "-1"], "--job", "from 0 to 1000000"),
    ],
)
def test_numeric_flags_out_of_range_are_refused_naming_the_flag(argv, flag, bounds, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: must be {bounds}" in error, error


@pytest.mark.parametrize("seeds", [str(1 << 32), "-3", "4-2", "0-4294967296"])
def test_study_seeds_out_of_range_are_refused_in_one_line(seeds, capsys):
    assert main(["experiment", "study", f"--seeds={seeds}", "--out", "never-made"]) != 0
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"stapo: error: --seeds {seeds}: "), error
