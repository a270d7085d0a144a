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
        (["experiment", "entropy", "--seed", "-3"], "--seed", "from 0 to 4294967295"),
        (["experiment", "entropy", "--seed", str(1 << 32)], "--seed", "from 0 to 4294967295"),
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
