"""The README's commands work as written: every ``stapo ...`` command of its fenced blocks runs,
in a fresh directory, exactly as the README spells it; training only gets ``run.steps=2`` added.
The commands that read a run (``runs/...``) run after that training, with its summary, a rerun
that says it is complete, and ``stapo convert`` pointed at the run directory."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from stapo_megatron.cli import main
from tests.helpers import REPO_ROOT

README = REPO_ROOT / "README.md"
TRAIN_STEPS = "run.steps=2"  # the only setting added to a README command


def readme_commands(text: str) -> list[list[str]]:
    """The ``stapo`` commands of the fenced blocks, as argument lists: each line, or each part of
    an ``a && b`` chain, that starts with ``stapo``; ``# comments`` dropped."""
    commands = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        for line in block.splitlines():
            for part in line.split("&&"):
                if part.split()[:1] == ["stapo"]:
                    commands.append(shlex.split(part, comments=True))
    return commands


COMMANDS = readme_commands(README.read_text(encoding="utf-8"))


def _reads_a_run(words: list[str]) -> bool:
    return any(word.startswith("runs/") for word in words)


def _stapo(words: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``words`` as the shell would run them: the installed ``stapo`` script of this environment."""
    script = Path(sys.executable).with_name("stapo")
    argv = [str(script), *words[1:]] if script.is_file() else [sys.executable, "-m", "stapo_megatron.cli", *words[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _ok(done: subprocess.CompletedProcess, words: list[str]) -> str:
    command = shlex.join(words)
    assert done.returncode == 0, f"README command `{command}` exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stdout


def test_the_readme_has_its_commands():
    names = [words[:2] for words in COMMANDS]
    assert ["stapo", "train"] in names and ["stapo", "plot"] in names and ["stapo", "plan"] in names
    assert all(word != "..." for words in COMMANDS for word in words), "a README command holds a placeholder"


@pytest.mark.parametrize("words", [w for w in COMMANDS if w[1] != "train" and not _reads_a_run(w)], ids=shlex.join)
def test_readme_command_runs_as_written(words, tmp_path, monkeypatch, capsys):
    """In this process (the ``stapo`` script calls the same ``main``); the training test runs the script."""
    monkeypatch.chdir(tmp_path)
    assert main(words[1:]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip(), f"`{shlex.join(words)}` printed nothing"


def test_help_of_every_command(capsys):
    for words in (["stapo"], *(["stapo", name] for name in sorted({w[1] for w in COMMANDS}))):
        with pytest.raises(SystemExit) as done:
            main([*words[1:], "--help"])
        assert done.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {' '.join(words)} "), words


@pytest.mark.slow
def test_readme_training_and_the_commands_on_its_run(tmp_path):
    train = [w for w in COMMANDS if w[1] == "train"]
    assert train, "the README trains"
    first = _ok(_stapo([*train[0], TRAIN_STEPS], tmp_path), train[0])
    run_dir = Path("runs", "tiny_cpu")
    checkpoint = run_dir / "checkpoints" / "iter_0000002"
    assert (tmp_path / checkpoint / "stapo_complete.json").is_file()
    # the summary: where things are, the final metrics, what to run next
    summary = first[first.index("[stapo] run complete: step 2/2") :]
    for expected in (
        f"checkpoint  {checkpoint}",
        f"metrics     {run_dir / 'metrics.jsonl'}",
        "last 2 steps: accuracy ",
        f"stapo plot {run_dir}",
        f"stapo inspect {run_dir}",
        f"stapo convert megatron-to-hf --ckpt {checkpoint}",
    ):
        assert expected in summary, (expected, summary)
    for words in [w for w in COMMANDS if _reads_a_run(w)]:
        _ok(_stapo(words, tmp_path), words)
    assert (tmp_path / run_dir / "curves.png").stat().st_size > 10_000  # drawn by the README's `stapo plot`
    # a second `stapo train` starts nothing: it says the run is complete and repeats the summary
    second = _stapo([*train[0], TRAIN_STEPS], tmp_path, timeout=300)
    again = _ok(second, train[0])
    assert f"[stapo] {run_dir}: already complete (step 2/2)" in second.stderr  # a message: the console's stderr
    assert again.replace(" (drawn by stapo plot)", "") == summary.replace(" (drawn by stapo plot)", "")
    # `stapo convert` given the run directory names the checkpoint inside it
    convert = ["stapo", "convert", "megatron-to-hf", "--ckpt", str(run_dir), "--out", "hf"]
    done = _stapo(convert, tmp_path, timeout=300)
    assert done.returncode == 2 and done.stderr == (
        f"stapo: error: --ckpt: {run_dir} is a run directory, not a checkpoint; its checkpoints are "
        f"{run_dir / 'checkpoints'}/iter_*: the newest intact one is {checkpoint} (pass --ckpt {checkpoint})\n"
    )


def test_the_install_commands_and_ci_install_from_the_constraints():
    """A fresh machine gets the stack the README's figures were measured on: both README install
    commands and .ci/run install through constraints.txt, which pins every package they install."""
    import setuptools

    lines = README.read_text(encoding="utf-8").splitlines()
    installs = [line for line in lines if line.startswith("python3 -m venv .venv && ")]
    installs.append((REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert len(installs) == 3 and all("pip install -c constraints.txt -e " in text for text in installs), installs
    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert re.fullmatch(r"[0-9][0-9A-Za-z.]*", version), line  # exact, no local build label
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    captured = {}
    with pytest.MonkeyPatch.context() as patch:  # setup.py's arguments, without building anything
        patch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
        patch.chdir(REPO_ROOT)
        exec(compile((REPO_ROOT / "setup.py").read_text(encoding="utf-8"), "setup.py", "exec"), {"__name__": "x"})
    wanted = [*captured["install_requires"], *captured["extras_require"]["dev"], *captured["extras_require"]["launch"]]
    names = {re.sub(r"[-_.]+", "-", re.split(r"[<>=!\[; ]", spec, maxsplit=1)[0]).lower() for spec in wanted}
    assert names - pins.keys() == set(), "constraints.txt misses these: refresh it (tools/refresh_constraints.sh)"
    assert pins["torch"] == "2.13.0"
