"""The step heartbeat: a rank that stops making progress ends with a one-line message naming the
phase, the step and the checkpoint the run resumes from, and exit code 75; one that keeps beating
runs on; run.hang_timeout_s is checked against the collective timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stapo_megatron.config import ConfigError, load_config
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.heartbeat import HANG_EXIT_CODE


def _run(body: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    code = "import time\nfrom stapo_megatron.trainer.heartbeat import Heartbeat\n" + textwrap.dedent(body)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False)
    return done, time.monotonic() - start


def test_a_phase_that_hangs_ends_the_process_with_the_phase_step_and_checkpoint_named():
    done, elapsed = _run("""
        heartbeat = Heartbeat(1.0, rank=3, saved_step=4).start()
        timer = heartbeat.timer(5)
        with timer("statistics"):
            pass
        with timer("rollout"):
            time.sleep(60)  # the hang
        print("not reached")
    """)
    assert done.returncode == HANG_EXIT_CODE == 75, done.stderr
    assert "not reached" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert re.fullmatch(
        r"stapo: error: rank 3: no progress for \d+ s \(run.hang_timeout_s=1\) in phase 'rollout' of step 5; "
        r"exiting with code 75, the run resumes from the checkpoint of step 4",
        lines[0],
    ), lines[0]
    assert elapsed < 30  # fired after ~1.1 s (plus the interpreter's start), not after the 60 s sleep


def test_the_latest_checkpoint_is_what_the_message_names():
    done, _ = _run("""
        heartbeat = Heartbeat(0.5, rank=0, saved_step=0).start()
        heartbeat.beat("checkpoint", 7)
        heartbeat.saved(7)
        time.sleep(60)
    """)
    assert done.returncode == HANG_EXIT_CODE
    assert "in phase 'checkpoint written' of step 7;" in done.stderr
    assert done.stderr.strip().endswith("the run resumes from the checkpoint of step 7")

    done, _ = _run("""
        Heartbeat(0.5, rank=1, saved_step=0).start()
        time.sleep(60)
    """)
    assert done.returncode == HANG_EXIT_CODE
    assert "rank 1: no progress" in done.stderr and "in phase 'start' of step 0;" in done.stderr
    assert done.stderr.strip().endswith("the run has no checkpoint to resume from yet")


def test_a_rank_that_keeps_beating_runs_on_and_a_stopped_heartbeat_never_fires():
    # 60 phases of 0.1 s each: 6 s in all, three times the timeout, but never 2 s without a beat (a
    # phase only fires the watchdog if the machine stalls the process for 1.9 s)
    done, elapsed = _run("""
        heartbeat = Heartbeat(2.0, rank=0, saved_step=0).start()
        for step in range(1, 21):
            timer = heartbeat.timer(step)
            for phase in ("rollout", "update", "sync"):
                with timer(phase):
                    time.sleep(0.1)
            assert set(timer.seconds) == {"rollout", "update", "sync"} and min(timer.seconds.values()) >= 0.1
        heartbeat.stop()
        time.sleep(4.0)  # after stop: silence is no hang
        print("finished")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "finished" and done.stderr == ""
    assert elapsed >= 10.0


def test_hang_timeout_is_checked_when_the_config_loads():
    assert load_config(TrainConfig, None, ["run.hang_timeout_s=90"]).run.hang_timeout_s == 90.0
    with pytest.raises(ConfigError, match=r"^run.hang_timeout_s: must be > 0, got 0"):
        load_config(TrainConfig, None, ["run.hang_timeout_s=0"])
    with pytest.raises(ConfigError, match=r"^run.hang_timeout_s: must be a finite number"):
        load_config(TrainConfig, None, ["run.hang_timeout_s=inf"])
    with pytest.raises(
        ConfigError,
        match=r"^run.hang_timeout_s: 3600 s must be below the collective timeout "
        r"parallel.timeout_minutes=30 \(1800 s\)$",
    ):
        load_config(TrainConfig, None, ["run.hang_timeout_s=3600"])
    assert (
        load_config(TrainConfig, None, ["run.hang_timeout_s=3600", "parallel.timeout_minutes=90"]).run.hang_timeout_s
        == 3600
    )
    # the ranks wait for the node leaders' servers to start in a collective: its timeout must outlast theirs
    sglang = ["rollout.engine=sglang", "rollout.sglang.model_path=m", "rollout.sglang.startup_timeout_s=1800"]
    with pytest.raises(
        ConfigError,
        match=r"^rollout.sglang.startup_timeout_s: 1800 s must be below the collective timeout "
        r"parallel.timeout_minutes=30 \(1800 s\)$",
    ):
        load_config(TrainConfig, None, sglang)
    assert load_config(TrainConfig, None, [*sglang, "parallel.timeout_minutes=31"]).parallel.timeout_minutes == 31


def _ranks_of(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = [v[5:] for v in environ if v.startswith(b"RANK=")]
        if parent == launcher_pid and rank:
            ranks[int(rank[0])] = int(entry.name)
    return ranks


@pytest.mark.slow
def test_a_rank_stuck_in_a_collective_is_ended_and_the_run_resumes_from_the_named_checkpoint(tmp_path):
    from stapo_megatron.runtime.launch import kill_tree
    from stapo_megatron.trainer.launcher import default_config_path
    from tests.trainer.runs import metrics, run, start_session, torchrun_command, train_command

    run_dir = tmp_path / "run"
    settings = ["run.steps=12", "checkpoint.save_every=1", "checkpoint.keep_last=2", "run.hang_timeout_s=10"]
    launch = start_session(
        torchrun_command(
            default_config_path(),
            2,
            f"run.output_dir={run_dir}",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            *settings,
        )
    )
    try:
        deadline = time.monotonic() + 300
        # complete lines only: the logger may be half-way through the next one
        while ((run_dir / "metrics.jsonl").read_text().count("\n") if (run_dir / "metrics.jsonl").exists() else 0) < 3:
            assert launch.poll() is None and time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.2)
        ranks = _ranks_of(launch.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGSTOP)  # rank 1 is gone without a word: rank 0 waits in its next collective
        stopped_at = time.monotonic()
        output = []
        while not any("no progress for" in line for line in output):
            line = launch.stdout.readline()
            assert line, "".join(output[-40:])
            output.append(line)
        fired_after = time.monotonic() - stopped_at
    finally:
        kill_tree(launch.pid)  # rank 1 (stopped) and torchrun
        launch.wait()
    message = next(line for line in output if "no progress for" in line)
    assert fired_after < 60, fired_after  # the last beat may precede the SIGSTOP by up to a phase
    silent = int(message.split("no progress for ", 1)[1].split(" s ")[0])
    assert message.startswith("stapo: error: rank 0: no progress for") and 10 <= silent < 20, message
    assert "(run.hang_timeout_s=10)" in message
    assert "exiting with code 75, the run resumes from the checkpoint of step" in message
    named = int(message.rsplit("checkpoint of step ", 1)[1].split()[0])
    step = int(message.split("of step ", 1)[1].split(";")[0])
    assert named >= 2 and step in (named, named + 1), message
    assert (run_dir / "checkpoints" / f"iter_{named:07d}").is_dir()

    resumed = run(train_command(run_dir, *settings))
    # The message names the last checkpoint rank 0 saw complete; one that completed while it was
    # already blocked (after the marker, before the heartbeat heard of it) can be the next step, and
    # the resume rightly takes the latest complete one.
    latest = named if not (run_dir / "checkpoints" / f"iter_{named + 1:07d}").is_dir() else named + 1
    assert f"resumed from {run_dir / 'checkpoints' / f'iter_{latest:07d}'} (step {latest})" in resumed.stderr
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, 13))
