"""A run longer than one SLURM allocation: the job is signalled before its time limit, the run
checkpoints and stops, the job requeues itself and resumes until run.steps, ending bit-identical
to an uninterrupted run.

The fast tests check the options, the paths and the generated batch-script code (run by bash with
stand-ins for srun and scontrol, and a real USR1). The slow test runs the tiny CPU run on the real
one-node SLURM of tests/slurm/cluster.py with a 60-second lead and allocations of the
shortest whole-minute limit (2 minutes on a quiet machine) that leaves room for the measured start-up:

    python -m pytest -m slow tests/launch/test_slurm_requeue.py -rs
"""

from __future__ import annotations

import math
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch

from stapo_megatron.config import ConfigError
from stapo_megatron.launch.requeue import (
    batch_script_lines,
    check_requeue_options,
    run_dir_for_batch_shell,
    time_limit_seconds,
)
from stapo_megatron.launch.submission import SubmitOptions, check_options, signal_lead_s
from tests.launch.test_submit import run_cli, sbatch_flags


def test_time_limits_and_leads():
    assert [time_limit_seconds(t) for t in ("2", "2:30", "04:00:00", "2-00", "2-1:30", "1-00:00:10")] == [
        120,
        150,
        14400,
        172800,
        178200,
        86410,
    ]
    # the default lead: 900 s, or a quarter of a shorter limit
    assert signal_lead_s(SubmitOptions(config=None, overrides=[], time="04:00:00")) == 900
    assert signal_lead_s(SubmitOptions(config=None, overrides=[], time="00:10:00")) == 150
    assert signal_lead_s(SubmitOptions(config=None, overrides=[], time="2", signal_lead=30)) == 30
    for lead, requeues, limit, message in [
        (120, 5, "2", r"^--signal-lead: 120 s leaves no time to train within --time 2 \(120 s\)$"),
        (0, 5, "2", r"^--signal-lead: must be in \[1, 65535\] seconds, got 0$"),
        (70000, 5, "3-00:00:00", r"^--signal-lead: must be in \[1, 65535\] seconds, got 70000$"),
        (30, -1, "2", r"^--max-requeues: must be in \[0, 65535\], got -1$"),
        # SLURM_RESTART_COUNT counts in 16 bits: a larger bound is never reached (and 10**26 breaks bash's test)
        (30, 10**26, "2", rf"^--max-requeues: must be in \[0, 65535\], got {10**26}$"),
        (
            30,
            5,
            "99999999999:00:00",
            r"^--time: 99999999999:00:00 is longer than SLURM can hold \(4294967293 minutes\)$",
        ),
        (30, 5, "2h", r"^--time: '2h' is not a SLURM time limit"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_requeue_options(lead, requeues, limit)
    with pytest.raises(ConfigError, match=r"^--max-requeues: only for --executor slurm$"):
        check_options(SubmitOptions(config=None, overrides=[], executor="local", max_requeues=0))
    with pytest.raises(ConfigError, match=r"^--signal-lead: only for --executor slurm$"):
        check_options(SubmitOptions(config=None, overrides=[], executor="local", signal_lead=60))


def test_the_run_directory_as_the_batch_shell_sees_it():
    job = ["/cluster/jobs/x:/nemo_run"]
    # outside a container: absolute as it is, relative under the ranks' working directory
    assert run_dir_for_batch_shell("/scratch/r", "/home/a", job, in_container=False) == "/scratch/r"
    assert run_dir_for_batch_shell("runs/t", "/home/a", job, in_container=False) == "/home/a/runs/t"
    # NeMo-Run's default working directory is the job directory's code/, at /nemo_run in the script
    assert run_dir_for_batch_shell("runs/t", "/nemo_run/code", job, in_container=False) == "/cluster/jobs/x/code/runs/t"
    # in a container: back through the longest matching mount
    mounts = [*job, "/lustre:/data", "/lustre/results/team:/data/results"]
    assert run_dir_for_batch_shell("/data/results/r1", "/w", mounts, in_container=True) == "/lustre/results/team/r1"
    assert run_dir_for_batch_shell("/data/other", "/w", mounts, in_container=True) == "/lustre/other"
    with pytest.raises(
        ConfigError,
        match=r"^--max-requeues: the run directory /results/r exists inside the container "
        r"only, .*put run.output_dir under one of --mounts$",
    ):
        run_dir_for_batch_shell("/results/r", "/w", mounts, in_container=True)


def test_dryrun_asks_for_the_signal_and_carries_the_trap(nemorun_home, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(
        capsys,
        "submit",
        "--account",
        "a",
        "--time",
        "2",
        "--signal-lead",
        "30",
        "--max-requeues",
        "4",
        "--gpus-per-node",
        "0",
        "--procs-per-node",
        "2",
        "--dryrun",
        "run.output_dir=out/run 1",
    )
    assert code == 0, err
    assert sbatch_flags(out)["signal"] == "B:USR1@30" and sbatch_flags(out)["time"] == "2"
    assert f"touch '{tmp_path}/out/run 1/STOP'" in out and "trap stapo_stop USR1" in out
    assert '[ "$restarts" -ge 4 ]' in out
    # the wrapper is defined before the job step it wraps
    assert out.index("srun() {") < out.index("\nsrun --output")

    # a run directory the batch shell cannot see is refused before anything is written
    code, _, err = run_cli(
        capsys,
        "submit",
        "--account",
        "a",
        "--gpus-per-node",
        "2",
        "--container-image",
        "img:1",
        "--dryrun",
        "run.output_dir=/results/r",
    )
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("stapo: error: --max-requeues: the run directory /results/r exists inside the container only")
    assert not (nemorun_home / "experiments").exists() or not any((nemorun_home / "experiments").iterdir())


# ---- the generated bash, run with stand-ins for srun and scontrol -------------------------------

_FAKE_SRUN = """#!/bin/bash
# a job step: exits $FAKE_EXIT at once, or (FAKE_EXIT=stop or complete) runs until the run's STOP file appears
touch "$FAKE_DIR/started"
echo "$STAPO_ALLOCATION_STARTED" > "$FAKE_DIR/allocation_started"
if [ "$FAKE_EXIT" = stop ] || [ "$FAKE_EXIT" = complete ]; then
    while [ ! -f "$FAKE_RUN/STOP" ]; do sleep 0.05; done
    # stop: rank 0 agrees to stop and removes the file; complete: the last step was already past it
    [ "$FAKE_EXIT" = stop ] && rm "$FAKE_RUN/STOP"
    exit 0
fi
exit "$FAKE_EXIT"
"""
_FAKE_SCONTROL = """#!/bin/bash
echo "$@" >> "$FAKE_DIR/scontrol.log"
"""


def _stand_ins(tmp_path: Path) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(stat.S_IRWXU)
    return bindir


def _batch_shell(
    tmp_path: Path, run_dir: Path, fake_exit: str, restarts: int | None, usr1: bool
) -> tuple[int, str, str]:
    """The setup lines and one job step, as NeMo-Run's script runs them; USR1 sent mid-step if asked."""
    script = batch_script_lines(str(run_dir), 30, 2) + '\nsrun --output x torchrun stapo\necho "step returned $?"\n'
    env = {
        "PATH": f"{_stand_ins(tmp_path)}:{os.environ['PATH']}",
        "FAKE_DIR": str(tmp_path),
        "FAKE_RUN": str(run_dir),
        "FAKE_EXIT": fake_exit,
        "SLURM_JOB_ID": "42",
    }
    if restarts is not None:
        env["SLURM_RESTART_COUNT"] = str(restarts)
    shell = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if usr1:
        deadline = time.monotonic() + 30
        while not (tmp_path / "started").exists():
            assert time.monotonic() < deadline and shell.poll() is None, "the step did not start"
            time.sleep(0.05)
        time.sleep(0.2)  # the shell is in `wait`
        shell.send_signal(signal.SIGUSR1)
    out, _ = shell.communicate(timeout=30)
    log = tmp_path / "scontrol.log"
    return int(out.strip().splitlines()[-1].split()[-1]), out, log.read_text() if log.exists() else ""


def test_a_finished_run_ends_the_job(tmp_path):
    before = int(time.time())
    code, out, scontrol = _batch_shell(tmp_path, tmp_path / "run", "0", None, usr1=False)
    assert code == 0 and scontrol == "" and "stapo:" not in out
    # the ranks learn when the allocation began (rank 0 keeps a STOP file made since)
    assert before <= int((tmp_path / "allocation_started").read_text()) <= time.time()


def test_usr1_stops_the_run_and_requeues_the_job(tmp_path):
    run_dir = tmp_path / "run dir"  # created by the trap if the ranks have not yet
    code, out, scontrol = _batch_shell(tmp_path, run_dir, "stop", 1, usr1=True)
    assert "stapo: USR1, the time limit is 30 s away: asking the run to checkpoint and stop" in out
    assert "stapo: the run is not complete (step exit 0, stopped for time: 1); requeue 2 of at most 2" in out
    assert scontrol == "requeue 42\n" and code == 0
    assert not (run_dir / "STOP").exists()  # the step saw it (and removed it, as rank 0 does)


def test_a_run_that_completes_as_usr1_comes_ends_the_job(tmp_path):
    run_dir = tmp_path / "run"
    code, out, scontrol = _batch_shell(tmp_path, run_dir, "complete", 1, usr1=True)
    assert "stapo: the run completed before it saw the stop request; the job ends" in out
    assert scontrol == "" and code == 0 and "not complete" not in out
    assert not (run_dir / "STOP").exists()  # no stop request left for a later run in the directory


def test_a_failed_step_requeues_the_job(tmp_path):
    code, out, scontrol = _batch_shell(tmp_path, tmp_path / "run", "75", None, usr1=False)
    assert "the run is not complete (step exit 75, stopped for time: 0); requeue 1 of at most 2" in out
    assert scontrol == "requeue 42\n" and code == 75


def test_no_requeue_beyond_max_requeues(tmp_path):
    code, out, scontrol = _batch_shell(tmp_path, tmp_path / "run", "stop", 2, usr1=True)
    assert "the job was requeued 2 time(s), the most --max-requeues allows" in out
    assert scontrol == "" and code == 75  # stopped for time, not complete: the job fails


# ---- the real SLURM -------------------------------------------------------------------------

# Every sequence trains (none skipped for a zero advantage) on a small batch: a step takes the
# same time early and late in the run, so a few steps measure them all.
SETTINGS = [
    "checkpoint.save_every=0",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "batch.skip_zero_advantage=false",
    "batch.prompts_per_step=16",
    "batch.prompts_per_minibatch=16",
]
# slurmctld checks time limits every 30 s, so USR1 comes 60 to 90 s before the limit: after
# limit - 90 to limit - 60 s of an allocation. A longer lead gives shorter allocations (a shorter
# test, more of them); a signal before the ranks have started still stops the run, after one step.
# Slurm's limits are whole minutes: the shortest that leaves the measured start-up room is taken.
LEAD_S, SLURM_CHECK_PERIOD_S, MOST_MINUTES = 60, 30, 5


def _start(command: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, timeout: float) -> None:
    from stapo_megatron.runtime.launch import kill_tree

    try:
        _, err = process.communicate(timeout=timeout)
    finally:
        kill_tree(process.pid)
    assert process.returncode == 0, err[-3000:]


def _allocation_for_three(tmp_path: Path, env: dict) -> tuple[int, int]:
    """(time limit in minutes, run.steps): allocations of that limit, of which two cannot finish the
    run on this machine now.

    A short run gives the seconds per step and of start-up, both slower on a loaded machine. The limit
    is the shortest whole number of minutes whose earliest USR1 (LEAD_S + SLURM_CHECK_PERIOD_S before
    it) comes at least 5 s after the start-up: a start-up longer than the earliest signal would make
    each allocation train about one step. USR1 comes at the latest LEAD_S before the limit, so one
    allocation trains at most limit - LEAD_S - start-up seconds; run.steps is 2.6 times what that
    allows (the 0.6 for a step time that drifts: the chain's steps can run faster than the
    calibration's, and two allocations that finish the run would leave nothing to requeue). The
    signal's 30 s window makes the chain 3 to 6 allocations long.
    """
    from tests.trainer.runs import metrics, train_command

    started = time.monotonic()
    _finish(_start(train_command(tmp_path / "calibration", "run.steps=12", *SETTINGS), env), timeout=300)
    wall = time.monotonic() - started
    per_step = sorted(row["time/step"] for row in metrics(tmp_path / "calibration"))[6]
    start_up = wall - 12 * per_step
    minutes = math.ceil((start_up + 5 + LEAD_S + SLURM_CHECK_PERIOD_S) / 60 + 1e-9)
    minutes = max(2, minutes)
    assert minutes <= MOST_MINUTES, f"start-up takes {start_up:.0f} s here: allocations would be {minutes} minutes"
    most_per_allocation = (60 * minutes - LEAD_S - start_up) / per_step
    return minutes, max(30, math.ceil(2.6 * most_per_allocation))


@pytest.mark.slow
def test_short_allocations_finish_a_longer_run_bit_identical(slurm_cluster, tmp_path):
    from tests.launch.test_slurm_submit import experiment_id, stapo
    from tests.slurm.cluster import PARTITION
    from tests.trainer.runs import checkpoint_tensors, metrics, train_command

    work = tmp_path / "work"
    work.mkdir()
    env = {
        **slurm_cluster.env,
        "NEMORUN_HOME": str(tmp_path / "nemo_home"),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    minutes, steps = _allocation_for_three(tmp_path, env)
    overrides = [f"run.steps={steps}", *SETTINGS]
    # the uninterrupted reference trains after the chain: beside it, it would slow the chain below the
    # measured speed and add allocations
    done = stapo(
        "submit",
        "--executor",
        "slurm",
        "--account",
        "stapo",
        "--partition",
        PARTITION,
        "--time",
        str(minutes),
        "--signal-lead",
        str(LEAD_S),
        "--max-requeues",
        "8",
        "--gpus-per-node",
        "0",
        "--procs-per-node",
        "2",
        "--job-name",
        "chain",
        "--wait",
        "run.output_dir=run",
        *overrides,
        env=env,
        cwd=work,
        timeout=600 + 8 * 60 * minutes,  # at most 8 requeues, then the last allocation
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "finished: SUCCEEDED" in done.stdout
    exp_id = experiment_id(done.stdout)
    job_id = done.stdout.split(": slurm job ")[1].split(",")[0]

    # every allocation is in the accounting: the requeued ones, then the one that completed
    sacct = slurm_cluster.run("sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State")
    states = sacct.stdout.split()
    assert len(states) >= 3 and states[-1] == "COMPLETED" and set(states[:-1]) == {"REQUEUED"}, sacct.stdout

    # each allocation's ranks: stopped on the signal with a checkpoint, the next resumed from it
    job_dir = next((tmp_path / "nemo_home" / "experiments" / "chain").glob(f"{exp_id}/chain"))
    stopped, resumed = [], []
    for restart in range(len(states)):
        log = (job_dir / f"log-stapo.chain_{job_id}_{restart}.out").read_text()
        stopped += [
            int(line.split("checkpoint of step ")[1].split()[0])
            for line in log.splitlines()
            if "stop requested: checkpoint of step" in line
        ]
        resumed += [
            int(line.split("(step ")[1].rstrip(")")) for line in log.splitlines() if "[stapo] resumed from" in line
        ]
    assert len(stopped) == len(states) - 1 and resumed == stopped, (stopped, resumed)
    assert stopped == sorted(stopped) and 0 < stopped[0] and stopped[-1] < steps
    batch_log = (job_dir / f"sbatch_stapo.chain_{job_id}.out").read_text().splitlines()  # with bash's -vx echo
    usr1 = f"stapo: USR1, the time limit is {LEAD_S} s away"
    # the last allocation may get USR1 too, as its run completes: the job then ends, nothing requeued
    completed_first = sum(
        line.startswith("stapo: the run completed before it saw the stop request") for line in batch_log
    )
    assert completed_first <= 1
    assert sum(line.startswith(usr1) for line in batch_log) == len(states) - 1 + completed_first
    assert [line for line in batch_log if line.startswith("stapo: the run is not complete")] == [
        f"stapo: the run is not complete (step exit 0, stopped for time: 1); requeue {i} of at most 8"
        for i in range(1, len(states))
    ]

    # the end: every step logged once, in order, and the same parameters as the uninterrupted run
    assert [row["step"] for row in metrics(work / "run")] == list(range(1, steps + 1))
    reference_dir = tmp_path / "reference"
    _finish(_start(train_command(reference_dir, *overrides), env), timeout=900)
    final = f"iter_{steps:07d}"
    chained, uninterrupted = checkpoint_tensors(
        work / "run" / "checkpoints" / final, reference_dir / "checkpoints" / final
    )
    parameters = [k for k in uninterrupted if not k.startswith("optimizer.")]
    assert "embedding.word_embeddings.weight" in parameters and len(parameters) == 10
    for key in parameters:
        assert torch.equal(chained[key], uninterrupted[key]), f"{key} differs from the uninterrupted run"
