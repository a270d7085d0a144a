"""``stapo train`` writes, moves and replaces only inside run directories, and says so in one line
otherwise: a directory that is not a run directory (a git clone, a home directory, a user's own
config.yaml) is refused before anything in it changes, ``--overwrite`` archives only a run's own
outputs and only inside the run directory, a run directory that cannot be used (a file, a name too
long, a read-only file system, a dangling link) and a left-over or malformed environment are one
line each, and a launcher killed with SIGKILL leaves its private config in the run directory only,
where the next run removes it.

The refusals run through the real ``stapo`` command, many in one process
(tests/trainer/_train_cli_cases.py); the read-only file system is a real one, a read-only tmpfs
mounted in a mount namespace of the test's own (``unshare --mount``, root only)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stapo_megatron.config import ConfigError
from stapo_megatron.runtime import console
from stapo_megatron.runtime.run_files import (
    METRICS_FILE,
    RANKS_CONFIG,
    RESOLVED_CONFIG,
    RUN_MARKER,
    STOP_FILE,
    write_resolved_config,
)
from stapo_megatron.runtime.run_lock import GUARD_FILE, LOCK_FILE, RunLock
from stapo_megatron.trainer.launcher import load_train_config, prepare_run_directory
from stapo_megatron.trainer.run_directory import (
    DIRECTORY_ENTRIES,
    RUN_OUTPUTS,
    check_run_directory,
    is_run_directory,
    mark_run_directory,
)
from tests.trainer.runs import FAST

REPO = Path(__file__).resolve().parents[2]
# What would make the driver's own process a rank, or a requeued SLURM job: the cases set them.
_FOREIGN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_RESTART_COUNT")


def _train(run_dir, *args, env: dict[str, str] | None = None) -> dict:
    return {"argv": ["train", f"run.output_dir={run_dir}", "run.steps=1", *FAST, *args], "env": env or {}}


def _run_cases(tmp_path: Path, cases: list[dict], read_only: Path | None = None, timeout: float = 600) -> list[dict]:
    """The results of ``cases`` (see _train_cli_cases.py), run in one fresh process; with
    ``read_only``, a read-only file system is mounted there for that process alone."""
    cases_file, results_file = tmp_path / "cases.json", tmp_path / "results.json"
    cases_file.write_text(json.dumps(cases))
    command = [sys.executable, "-m", "tests.trainer._train_cli_cases", str(cases_file), str(results_file)]
    if read_only is not None:
        script = f"mount -t tmpfs -o ro,size=1m none {shlex.quote(str(read_only))} && exec {shlex.join(command)}"
        command = ["unshare", "--mount", "sh", "-c", script]
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_ENV and not k.startswith("STAPO_")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(results_file.read_text())


def _one_line(result: dict) -> str:
    """The one error line of a refused case (exit 2, no traceback), without its ``stapo: error: ``."""
    lines = [line for line in result["stderr"].splitlines() if line.startswith("stapo: error: ")]
    assert result["code"] == 2 and len(lines) == 1, result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"], result["stderr"][-3000:]
    return lines[0].removeprefix("stapo: error: ")


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: its kind and content, links not followed."""
    entries = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                entries[key] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                entries[key] = "directory"
            else:
                entries[key] = path.read_bytes().decode(errors="replace")
    return entries


def _not_a_run_directory(directory: Path) -> str:
    return f"{directory}: not a stapo_megatron run directory (no {RUN_MARKER}); choose an empty or new run.output_dir"


@pytest.mark.slow
def test_only_a_run_directory_is_written_archived_or_replaced(tmp_path):
    users = tmp_path / "users"  # what no run made: it must come out exactly as it went in
    clone = users / "clone"
    (clone / ".git").mkdir(parents=True)
    (clone / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (clone / "src").mkdir()
    (clone / "src" / "model.py").write_text("print('mine')\n")
    (clone / "README.md").write_text("# my project\n")
    own_config = users / "own_config"
    own_config.mkdir()
    (own_config / "config.yaml").write_text("my: own settings\n")
    home = users / "home"
    home.mkdir()
    (home / "notes.txt").write_text("notes\n")
    (home / LOCK_FILE).write_text("another tool's lock\n")  # old enough that a run would take it over
    os.utime(home / LOCK_FILE, (time.time() - 3600, time.time() - 3600))
    outside = users / "outside"
    outside.mkdir()
    # A marked run directory whose archive/ leads out of it.
    escape = tmp_path / "escape"
    escape.mkdir()
    mark_run_directory(escape)
    (escape / METRICS_FILE).write_text('{"step": 1}\n')
    (escape / "archive").symlink_to(outside)
    # A run directory of the release before the marker: only what a run writes, and the lock's guard.
    earlier = tmp_path / "earlier"
    (earlier / "checkpoints" / "iter_0000002").mkdir(parents=True)
    (earlier / "checkpoints" / "iter_0000002" / "stapo_complete.json").write_text('{"step": 2}')
    (earlier / "config.yaml").write_text("run:\n  name: earlier\n")
    (earlier / METRICS_FILE).write_text('{"step": 1}\n{"step": 2}\n')
    (earlier / GUARD_FILE).touch()
    before, escape_before = _tree(users), _tree(escape)

    # an outside launch (torchrun, SLURM): its rank 0 checks the directory as stapo train does
    rank0 = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29411"}
    results = _run_cases(
        tmp_path,
        [
            _train(clone, "--overwrite"),  # before: .git and every file moved to clone/archive/, exit 0
            _train(clone, "--no-resume"),
            _train(clone),
            _train(clone, env=rank0),
            _train(own_config),  # before: the user's config.yaml silently replaced
            _train(home),  # before: the other tool's .lock taken over (deleted), files written beside notes
            _train(escape, "--overwrite"),  # before: the run moved out to outside/
            _train(earlier, "--no-resume"),
        ],
    )
    for directory, result in zip([clone, clone, clone, clone, own_config, home], results, strict=False):
        assert _one_line(result) == _not_a_run_directory(directory)
    assert _one_line(results[6]).startswith(f"{escape / 'archive'}: not a directory of the run (a link or a file)")
    assert _tree(users) == before  # nothing moved, created, replaced or removed
    assert _tree(escape) == {**escape_before, GUARD_FILE: ""}  # a run directory: its lock was taken, and released

    # adopted: marked, then refused for its checkpoints as any run directory is
    assert "a run directory of an earlier stapo_megatron release; marked with .stapo_run" in results[7]["stderr"]
    assert "has checkpoints up to step 2 of an earlier run" in _one_line(results[7])
    assert is_run_directory(earlier)
    assert sorted(os.listdir(earlier)) == sorted([RUN_MARKER, GUARD_FILE, "checkpoints", "config.yaml", METRICS_FILE])
    marker = json.loads((earlier / RUN_MARKER).read_text())
    assert marker["format"] == 1 and marker["stapo_megatron"] and marker["created"]


def _can_mount_in_a_namespace(directory: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    script = f"mount -t tmpfs -o ro,size=1m none {shlex.quote(str(directory))}"
    return subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_run_directory_that_cannot_be_used_is_one_line_naming_run_output_dir(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing" / "run")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    mounted = _can_mount_in_a_namespace(read_only)  # a real read-only file system, for the driver's process only
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("root without unshare --mount: no read-only file system to try")
        read_only.chmod(0o500)  # as good as read-only for a user who is not root
    long_name = tmp_path / ("x" * 300)
    cases = [
        (a_file, "exists and is not a directory"),
        (a_file / "run", f"cannot be created: {a_file} is not a directory"),
        (long_name, "cannot be created: a name of 300 bytes ('xxxxxxxxxxxxxxxxxxxxxxxx'...), over the 255 allowed"),
        (tmp_path / "dangling", f"a symbolic link to '{tmp_path / 'missing' / 'run'}', which does not exist"),
        (read_only / "run", f"cannot be created: {read_only} is "),
        (read_only, f"{read_only} is "),  # an existing, empty directory nothing can be written in
    ]
    results = _run_cases(  # before: tracebacks
        tmp_path, [_train(directory) for directory, _ in cases], read_only=read_only if mounted else None
    )
    for (directory, reason), result in zip(cases, results, strict=True):
        line = _one_line(result)
        assert line.startswith(f"run.output_dir: {directory}: {reason}"), line
        assert line.endswith("; choose another run.output_dir")
    if mounted:
        assert "read-only file system" in _one_line(results[4]) and "read-only file system" in _one_line(results[5])
    assert a_file.read_text() == "not a directory\n" and not (tmp_path / "missing").exists()


@pytest.mark.slow
def test_left_over_or_malformed_environment_is_one_line_naming_the_variable(tmp_path):
    rank = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29412"}
    stopped = tmp_path / "stopped"  # a STOP file is what made the code before read the allocation's start
    stopped.mkdir()
    (stopped / "STOP").touch()
    cases = [
        # before: the lock and the data check skipped, then a MASTER_ADDR traceback
        (
            {"RANK": "0", "WORLD_SIZE": "2"},
            "environment: RANK='0', WORLD_SIZE='2' set, but not LOCAL_RANK, MASTER_ADDR, MASTER_PORT: left over "
            "from another launch? Unset RANK WORLD_SIZE to start the run here, or start it with torchrun",
        ),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "environment: RANK='1', WORLD_SIZE='2' set, but not LOCAL_RANK"),
        ({"LOCAL_RANK": "3"}, "environment: LOCAL_RANK='3' set, but not RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
        ({**rank, "RANK": "2"}, "RANK: must be in [0, 0], got '2'"),
        ({**rank, "WORLD_SIZE": "two"}, "WORLD_SIZE: expected an integer, got 'two'"),
        ({**rank, "MASTER_PORT": "99999"}, "MASTER_PORT: must be in [1, 65535], got '99999'"),
        ({**rank, "STAPO_LAUNCHER_PID": "me"}, "STAPO_LAUNCHER_PID: expected an integer, got 'me'"),
        (
            {**rank, "STAPO_RUN_LOCK_TOKEN": "left-over"},  # before: no lock taken, the run trained unguarded
            f"STAPO_RUN_LOCK_TOKEN: names no lock held on {tmp_path / 'run'} (left over from another launch? unset it)",
        ),
        ({"STAPO_ALLOCATION_STARTED": "yesterday"}, "STAPO_ALLOCATION_STARTED: expected a time in seconds since 1970"),
        ({"STAPO_ALLOCATION_STARTED": "nan"}, "STAPO_ALLOCATION_STARTED: expected a time in seconds since 1970"),
        ({"SLURM_RESTART_COUNT": "abc"}, "SLURM_RESTART_COUNT: expected an integer, got 'abc'"),
        ({"SLURM_RESTART_COUNT": "70000"}, "SLURM_RESTART_COUNT: must be in [0, 65535], got '70000'"),
    ]
    run_dir = tmp_path / "run"
    results = _run_cases(
        tmp_path,
        [_train(stopped if "STAPO_ALLOCATION_STARTED" in env else run_dir, env=env) for env, _ in cases],
    )
    for (env, message), result in zip(cases, results, strict=True):
        assert _one_line(result).startswith(message), (env, result["stderr"][-2000:])
    assert not run_dir.exists()  # refused before anything was made
    assert sorted(os.listdir(stopped)) == ["STOP"]


def _configs_in(directory: Path) -> list[Path]:
    """Config copies under ``directory`` (torch keeps its own pymp-*/ and inductor caches there too)."""
    return [*directory.glob("stapo-launch-*"), *directory.rglob("*.yaml")]


@pytest.mark.slow
def test_a_sigkilled_launcher_leaves_its_private_config_only_in_the_run_directory(tmp_path, monkeypatch):
    import psutil

    from stapo_megatron.runtime.launch import kill_tree
    from stapo_megatron.trainer.checkpoint_directory import CheckpointDirectory
    from tests.trainer.runs import start_session, train_command

    temporary = tmp_path / "tmp"  # the launcher's temporary directory, where the code before put it
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    run_dir = tmp_path / "run"
    launcher = start_session(train_command(run_dir, "run.steps=10000", "checkpoint.save_every=1"))
    try:
        deadline = time.monotonic() + 300
        while not CheckpointDirectory(run_dir, 1).complete_steps():
            assert launcher.poll() is None, launcher.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.2)
        private = run_dir / RANKS_CONFIG
        assert private.stat().st_mode & 0o777 == 0o600  # secrets: this user's only
        assert not _configs_in(temporary)
        launched = psutil.Process(launcher.pid).children(recursive=True)
        assert len(launched) >= 3  # torchrun and two ranks (and their checkpoint-queue managers)
        os.kill(launcher.pid, signal.SIGKILL)  # a real SIGKILL: no clean-up of the launcher runs
        launcher.wait()
        _, alive = psutil.wait_procs(launched, timeout=60)
        assert not alive
    finally:
        kill_tree(launcher.pid)
    assert private.is_file() and not _configs_in(temporary)  # before: stapo-launch-*/config.yaml left in TMPDIR

    # The next run in the directory (complete already: it stops after preparing it) removes it.
    done = subprocess.run(
        train_command(run_dir, "run.steps=1"), capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "taking over the lock of a run that is gone" in done.stderr
    assert f"removed {private}, the private config of a launcher that was killed" in done.stderr
    assert not private.exists() and not _configs_in(temporary)
    # what a real run left in its directory is all known to --overwrite and to adoption
    assert set(os.listdir(run_dir)) <= RUN_OUTPUTS | DIRECTORY_ENTRIES, sorted(os.listdir(run_dir))


def test_the_names_a_run_writes_are_those_of_their_writers(tmp_path):
    from stapo_megatron.eval.evaluator import step_directory
    from stapo_megatron.rollout.factory import sglang_settings
    from stapo_megatron.trainer.checkpoint_directory import CheckpointDirectory
    from stapo_megatron.trainer.inspector import DUMP_DIR
    from stapo_megatron.trainer.plot import plot_runs

    cfg = load_train_config(None, [f"run.output_dir={tmp_path}"])
    written = {
        RESOLVED_CONFIG,
        STOP_FILE,
        METRICS_FILE,
        DUMP_DIR,
        CheckpointDirectory(tmp_path, 1).root.name,
        step_directory(tmp_path, 1).parent.name,
        Path(sglang_settings(cfg.rollout, "", tmp_path).log_dir).name,
    }
    assert written <= RUN_OUTPUTS
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "reward/accuracy": 0.5}\n{"step": 2, "reward/accuracy": 0.6}\n')
    assert plot_runs([tmp_path]).name in RUN_OUTPUTS
    assert not RUN_OUTPUTS & DIRECTORY_ENTRIES


def test_what_counts_as_a_new_run_directory_and_what_a_marker_must_be(tmp_path):
    check_run_directory(tmp_path / "not yet")  # made by the run
    assert not (tmp_path / "not yet").exists()
    for name, entries in {
        "empty": [],
        "stop_only": ["STOP"],  # the requeue batch script's, before the ranks started
        "lock_only": [GUARD_FILE, LOCK_FILE],  # a run killed between its lock and its marker
    }.items():
        (tmp_path / name).mkdir()
        for entry in entries:
            (tmp_path / name / entry).touch()
        check_run_directory(tmp_path / name)
        mark_run_directory(tmp_path / name)
        assert is_run_directory(tmp_path / name)
    (tmp_path / "foreign_lock").mkdir()
    (tmp_path / "foreign_lock" / LOCK_FILE).touch()  # no guard: not a run's
    with pytest.raises(ConfigError, match=r"foreign_lock: not a stapo_megatron run directory \(no \.stapo_run\)"):
        check_run_directory(tmp_path / "foreign_lock")

    for text, problem in [
        ("{}", "not a JSON object with a format number"),
        ('{"format": "1"}', "not a JSON object with a format number"),
        ("[1]", "not a JSON object with a format number"),
        ("garbage", "not JSON"),
        ('{"format": 99}', "format 99, of a stapo_megatron newer than"),
    ]:
        (tmp_path / "empty" / RUN_MARKER).write_text(text)
        with pytest.raises(ConfigError, match=rf"\.stapo_run: not a stapo_megatron run marker \({problem}"):
            check_run_directory(tmp_path / "empty")
    (tmp_path / "empty" / RUN_MARKER).unlink()
    (tmp_path / "empty" / RUN_MARKER).mkdir()
    with pytest.raises(ConfigError, match=r"not a stapo_megatron run marker \(not a small regular file\)"):
        check_run_directory(tmp_path / "empty")
    assert not is_run_directory(tmp_path / "empty")


def test_overwrite_twice_in_one_second_keeps_both_earlier_runs(tmp_path, monkeypatch):
    console.configure(rank=0)
    cfg = load_train_config(None, [f"run.output_dir={tmp_path}", "checkpoint.resume=never"])
    mark_run_directory(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda *args: "20260101-000000")
    for run in ("first", "second"):
        (tmp_path / METRICS_FILE).write_text(run)
        (tmp_path / f".{METRICS_FILE}.123.tmp").write_text("cut off")  # a write a SIGKILL interrupted
        prepare_run_directory(cfg, overwrite=True)  # before: FileExistsError the second time
    archives = sorted((tmp_path / "archive").iterdir())
    assert [a.name for a in archives] == ["20260101-000000", "20260101-000000-2"]
    assert [(a / METRICS_FILE).read_text() for a in archives] == ["first", "second"]
    assert all((a / f".{METRICS_FILE}.123.tmp").is_file() for a in archives)
    assert sorted(os.listdir(tmp_path)) == [RUN_MARKER, "archive"]


def test_the_resolved_config_replaces_only_a_runs_own(tmp_path):
    # As rank 0 writes it in every launch (controller.Rank0Rollouts.build), also when no launcher checked first.
    cfg = load_train_config(None, [f"run.output_dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text("my: own\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: not written by a run \(.* has no \.stapo_run\)"):
        write_resolved_config(cfg)  # before: replaced
    assert (tmp_path / "config.yaml").read_text() == "my: own\n"
    (tmp_path / "marked").mkdir()
    mark_run_directory(tmp_path / "marked")  # a run directory: its config.yaml is the run's
    marked = load_train_config(None, [f"run.output_dir={tmp_path / 'marked'}"])
    (tmp_path / "marked" / "config.yaml").write_text("run: {}\n")
    assert write_resolved_config(marked).read_text().startswith("run:\n  name:")


def test_prepare_marks_a_directory_and_takes_a_stale_private_config(tmp_path, caplog):
    run_dir = tmp_path / "run"
    cfg = load_train_config(None, [f"run.output_dir={run_dir}"])
    with RunLock.acquire(run_dir):
        prepare_run_directory(cfg, overwrite=False)
    assert is_run_directory(run_dir)
    (run_dir / RANKS_CONFIG).write_text("secret: left by a killed launcher\n")
    with RunLock.acquire(run_dir):
        prepare_run_directory(cfg, overwrite=True)
    assert not (run_dir / RANKS_CONFIG).exists()
    assert f"removed {run_dir / RANKS_CONFIG}, the private config of a launcher that was killed" in caplog.text
    (run_dir / RANKS_CONFIG).mkdir()  # not a file the launcher writes: not removed
    with RunLock.acquire(run_dir), pytest.raises(ConfigError, match=r"\.ranks_config\.yaml: not a regular file"):
        prepare_run_directory(cfg, overwrite=False)
    assert (run_dir / RANKS_CONFIG).is_dir()
