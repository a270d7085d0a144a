"""A run directory's ``.lock`` and ``.lock.guard`` that no run of this release wrote: a dangling or
live symbolic link, a directory, a FIFO, content of the wrong shape or types. Each is refused in
one line or taken over once provably stale; none loops, hangs, tracebacks or writes through a link.
The cases that hung on the code before are run in a child process with a timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from stapo_megatron.config import ConfigError
from stapo_megatron.runtime import run_lock
from stapo_megatron.runtime.run_lock import GUARD_FILE, LOCK_FILE, RunLock

# Takes the lock of argv[1] in a fresh process and releases it: "acquired", or the one-line error.
_ACQUIRE = """
import sys
from stapo_megatron.config import ConfigError
from stapo_megatron.runtime.run_lock import RunLock
try:
    RunLock.acquire(sys.argv[1]).release()
except ConfigError as err:
    print(f"refused: {err}")
    sys.exit(2)
print("acquired")
"""


def _acquire_in_a_child(run_dir, timeout: float = 30) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-c", _ACQUIRE, str(run_dir)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"taking the lock of {run_dir} did not end within {timeout} s (spinning or blocked)")


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.stdout.splitlines()
    return line


def test_a_lock_that_is_a_link_or_a_fifo_is_refused_at_once_and_never_followed(tmp_path):
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / LOCK_FILE).symlink_to(tmp_path / "nowhere" / "lock")
    line = _one_line(_acquire_in_a_child(dangling))  # before: spun at full CPU forever
    assert f"{dangling / LOCK_FILE}: a symbolic link (to '{tmp_path / 'nowhere' / 'lock'}')" in line
    assert "not a lock file stapo_megatron writes" in line
    assert (dangling / LOCK_FILE).is_symlink() and not (tmp_path / "nowhere").exists()  # nothing made or removed

    # A link to a real file elsewhere: neither read as a holder nor removed, and the file is untouched.
    elsewhere = tmp_path / "users_file"
    elsewhere.write_text('{"host": "h", "pid": 1, "started": 0, "token": "t"}')
    os.utime(elsewhere, (time.time() - 3600, time.time() - 3600))  # a stale "holder" if it were followed
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / LOCK_FILE).symlink_to(elsewhere)
    assert "a symbolic link" in _one_line(_acquire_in_a_child(linked))
    assert (linked / LOCK_FILE).is_symlink() and elsewhere.read_text().startswith('{"host": "h"')

    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / LOCK_FILE)
    line = _one_line(_acquire_in_a_child(fifo))  # before: blocked for ever opening the FIFO
    assert f"{fifo / LOCK_FILE}: not a regular file, not a lock file stapo_megatron writes" in line


def test_a_lock_or_guard_that_is_a_directory_is_refused_in_one_line(tmp_path):
    (tmp_path / "lock" / LOCK_FILE).mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"\.lock: a directory, not a lock file stapo_megatron writes"):
        RunLock.acquire(tmp_path / "lock")  # before: IsADirectoryError
    assert (tmp_path / "lock" / LOCK_FILE).is_dir()

    (tmp_path / "guard" / GUARD_FILE).mkdir(parents=True)
    with pytest.raises(
        ConfigError, match=r"^run\.output_dir: .*/guard: cannot open its \.lock\.guard \(Is a directory\)"
    ):
        RunLock.acquire(tmp_path / "guard")  # before: IsADirectoryError


def test_a_guard_that_is_a_link_is_not_followed(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / GUARD_FILE).symlink_to(tmp_path / "made_elsewhere")
    with pytest.raises(ConfigError, match=r"\.lock\.guard: a symbolic link, not the lock guard stapo_megatron writes"):
        RunLock.acquire(run_dir)
    assert not (tmp_path / "made_elsewhere").exists()  # before: created through the link


def _write(run_dir, text: str, age: float) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(text)
    os.utime(path, (time.time() - age, time.time() - age))


HOST = socket.gethostname()
# Locks no run of this release writes; on this host, so that the code before read their pid.
GARBAGE = [
    (json.dumps({"host": HOST, "pid": "123", "started": 1.0, "token": "t"}), "pid is '123', not int"),
    (json.dumps({"host": HOST, "pid": 1.5, "started": 1.0, "token": "t"}), "pid is 1.5, not int"),
    (json.dumps({"host": HOST, "pid": -1, "started": 1.0, "token": "t"}), "pid -1 is out of range"),
    (json.dumps({"host": HOST, "pid": 10**30, "started": 1.0, "token": "t"}), "is out of range"),
    (json.dumps({"host": HOST, "pid": 1, "started": "x", "token": "t"}), "started is 'x', not int or float"),
    (json.dumps({"host": HOST, "pid": 1, "started": 1e300, "token": "t"}), "started 1e+300 is out of range"),
    (json.dumps({"host": ["x"], "pid": 1, "started": 1.0, "token": "t"}), "host is ['x'], not str"),
    (json.dumps({"host": HOST, "pid": 1, "started": 1.0, "token": "t", "restarts": "x"}), "restarts is 'x'"),
    (json.dumps({"host": HOST, "pid": True, "started": 1.0, "token": "t"}), "pid is True, not int"),
    (json.dumps({"host": HOST, "pid": 1, "token": "t"}), "has no started"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ("5", "holds a JSON int, not an object"),
    ("null", "holds a JSON NoneType, not an object"),
    ('{"host": "' + HOST, "not JSON (cut off, or not a lock)"),
    ("\xff\xfe", "not JSON"),
    ("x" * 5000, "over 4096 bytes"),
]


@pytest.mark.parametrize("text, problem", GARBAGE, ids=[p for _, p in GARBAGE])
def test_a_lock_naming_no_valid_holder_is_refused_while_fresh_and_taken_over_once_stale(
    tmp_path, monkeypatch, caplog, text, problem
):
    # A job of a requeued allocation: the code before compared a lock's restarts with this one's.
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    _write(tmp_path, text, age=1)
    with pytest.raises(ConfigError) as refused:  # before: TypeError / ValueError tracebacks, or a wrong holder
        RunLock.acquire(tmp_path)
    message = str(refused.value)
    assert "\n" not in message and "in use by another run (holder unknown: .lock " in message and problem in message
    assert (tmp_path / LOCK_FILE).read_text() == text  # refused: untouched

    _write(tmp_path, text, age=run_lock.STALE_AFTER_S + 10)  # no heartbeat: no run of any release holds it
    with RunLock.acquire(tmp_path) as lock:
        assert lock.held()
    assert "taking over the lock of a run that is gone (holder unknown: .lock " in caplog.text
    assert "no heartbeat for" in caplog.text


def test_an_empty_lock_is_a_run_that_is_starting(tmp_path):
    _write(tmp_path, "", age=1)
    with pytest.raises(ConfigError, match=r"in use by another run \(a run that is starting\)"):
        RunLock.acquire(tmp_path)


def test_held_is_false_not_an_error_once_the_lock_is_replaced_by_garbage(tmp_path):
    lock = RunLock.acquire(tmp_path)
    (tmp_path / LOCK_FILE).unlink()
    (tmp_path / LOCK_FILE).mkdir()
    assert not lock.held()
    lock.release()  # leaves what is not its own
    assert (tmp_path / LOCK_FILE).is_dir()


@pytest.mark.parametrize("value", ["abc", "1.5", "-1", "70000", "٤٢", ""])
def test_a_malformed_slurm_restart_count_is_one_line_naming_it(tmp_path, monkeypatch, value):
    monkeypatch.setenv("SLURM_RESTART_COUNT", value)
    with pytest.raises(ConfigError, match=rf"^SLURM_RESTART_COUNT: .*got '{value}'$"):  # before: ValueError
        RunLock.acquire(tmp_path)
    assert not (tmp_path / LOCK_FILE).exists()
