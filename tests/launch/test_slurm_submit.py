"""End to end: the tiny CPU run submitted with stapo submit to a real SLURM cluster, and run locally.

    python -m pytest -m slow tests/launch -rs

The SLURM test installs Debian's slurm-wlm, munge, slurmdbd and mariadb-server when they are
missing (root, apt), starts a one-node cluster with accounting in a scratch directory
(tests/slurm/cluster.py), submits through a local tunnel, waits, checks the run's outputs and
NeMo-Run's view of the job, and stops every daemon it started. It skips, saying why, only
where the cluster cannot be had (not root, packages not installable).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stapo_megatron.config import load_config
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.launcher import load_train_config

pytestmark = pytest.mark.slow

STEPS = 3
OVERRIDES = [f"run.steps={STEPS}", "run.output_dir=run", "checkpoint.save_every=0", "logging.tensorboard=false"]


def stapo(*argv: str, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stapo_megatron.cli", *argv],
        env=env,
        cwd=cwd,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def experiment_id(stdout: str) -> str:
    first = stdout.splitlines()[0]
    assert first.startswith("experiment "), stdout
    return first.split()[1].rstrip(":")


def check_run(work: Path, steps: int) -> None:
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == steps
    assert (work / "run" / "checkpoints" / f"iter_{steps:07d}").is_dir()


def check_job_config(home: Path, job_name: str, expected: TrainConfig) -> None:
    configs = list((home / "experiments" / job_name).glob(f"*/{job_name}/stapo_config.yaml"))
    assert len(configs) == 1, configs
    assert load_config(TrainConfig, configs[0]) == expected


def test_tiny_run_through_slurm(slurm_cluster, tmp_path):
    from tests.slurm.cluster import PARTITION

    work = tmp_path / "work"
    work.mkdir()
    home = tmp_path / "nemo_home"
    env = {**slurm_cluster.env, "NEMORUN_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    # the job is `stapo train` with TP=2: one node, two processes, no GPU requested
    done = stapo(
        "submit",
        "--executor",
        "slurm",
        "--account",
        "stapo",
        "--partition",
        PARTITION,
        "--time",
        "00:10:00",
        "--gpus-per-node",
        "0",
        "--procs-per-node",
        "2",
        "--job-name",
        "tiny",
        "--wait",
        *OVERRIDES,
        env=env,
        cwd=work,
        timeout=420,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    exp_id = experiment_id(done.stdout)
    assert "finished: SUCCEEDED" in done.stdout
    check_run(work, STEPS)
    check_job_config(home, "tiny", load_train_config(None, OVERRIDES))

    status = stapo("status", exp_id, "--json", env=env, cwd=work, timeout=120)
    assert status.returncode == 0, status.stderr
    job = json.loads(status.stdout)["jobs"][0]
    assert job["state"] == "SUCCEEDED" and job["job_id"].isdigit()
    sacct = slurm_cluster.run("sacct", "-n", "-P", "-X", "-j", job["job_id"], "-o", "State,JobName")
    assert sacct.stdout.split("\n")[0] == "COMPLETED|stapo.tiny", sacct.stdout
    # the latest experiment of a job name, as NeMo-Run's CLI resolves it
    assert stapo("status", "tiny", env=env, cwd=work, timeout=120).stdout.startswith(f"experiment {exp_id}")

    # NeMo-Run's own command reads the same experiment (it rebuilds stapo's packager from its record)
    nemo = subprocess.run(
        [str(Path(sys.executable).parent / "nemo"), "experiment", "status", exp_id],
        env=env,
        cwd=work,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert nemo.returncode == 0 and "SUCCEEDED" in nemo.stdout, nemo.stdout + nemo.stderr

    logs = stapo("logs", exp_id, env=env, cwd=work, timeout=120)
    assert logs.returncode == 0, logs.stderr
    # rank 0's lines through torchrun's --tee (rank 1 prints nothing since Megatron's import
    # warnings are filtered)
    assert "[default0]:[stapo] run complete: step 3/3" in logs.stderr
    assert "worker group successfully finished" in logs.stderr


def test_tiny_run_through_the_local_executor(tmp_path):
    pytest.importorskip("nemo_run", reason="NeMo-Run is not importable: pip install -e '.[launch]'")
    work = tmp_path / "work"
    work.mkdir()
    home = tmp_path / "nemo_home"
    env = {**os.environ, "NEMORUN_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    done = stapo(
        "submit", "--executor", "local", "--job-name", "tiny-local", *OVERRIDES, env=env, cwd=work, timeout=420
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "finished: SUCCEEDED" in done.stdout
    check_run(work, STEPS)
    check_job_config(home, "tiny-local", load_train_config(None, OVERRIDES))
