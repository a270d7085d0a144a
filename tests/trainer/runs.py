"""Start real training runs of the tiny configuration from tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

# Fast settings for tests on top of configs/tiny_cpu.yaml.
FAST = ["logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.save_every=0"]


def train_command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "stapo_megatron.cli", "train", f"run.output_dir={run_dir}", *FAST, *overrides]


def torchrun_command(config: Path, nproc: int, *overrides: str) -> list[str]:
    """The ranks under an existing torchrun launch, as SLURM / NeMo-Run start them."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "stapo_megatron.trainer.main",
        "--config",
        str(config),
        *overrides,
    ]


def attempt(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run to its end, whatever its exit status; on a timeout or failure of the test, nothing of
    the launch stays alive."""
    from stapo_megatron.runtime.launch import kill_tree

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        kill_tree(process.pid)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run to completion; a failure is an AssertionError with the end of its stderr."""
    result = attempt(command, timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result


def metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def start_session(command: list[str]) -> subprocess.Popen:
    """A process in a session of its own, so the whole launch can be killed at once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def kill_when(process: subprocess.Popen, condition, timeout: float = 300, poll: float = 0.002) -> None:
    """SIGKILL the process and all its descendants (torchrun's ranks) as soon as ``condition()`` holds."""
    from stapo_megatron.runtime.launch import kill_tree

    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(
                f"the run ended (exit {process.returncode}) before the kill point:\n{process.stdout.read()[-3000:]}"
            )
        if time.monotonic() > deadline:
            kill_tree(process.pid)
            raise AssertionError("the kill point was not reached in time")
        time.sleep(poll)
    kill_tree(process.pid)
    process.wait()


def _save_plain_tensors(directories: list[str], out_files: list[str]) -> None:
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import load_plain_tensors

    dist.init_process_group("gloo")
    for directory, out_file in zip(directories, out_files, strict=True):
        torch.save({k: v for k, v in load_plain_tensors(directory).items() if torch.is_tensor(v)}, out_file)


def checkpoint_tensors(*directories: Path) -> list[dict[str, torch.Tensor]]:
    """Every tensor of each Megatron checkpoint (model and optimizer), read by one fresh process
    (one for all of them: its start, with Megatron's imports, costs more than a tiny checkpoint's read)."""
    from stapo_megatron.runtime.launch import spawn_ranks

    out_files = [directory.parent / f"{directory.name}.tensors.pt" for directory in directories]
    spawn_ranks(_save_plain_tensors, 1, [str(d) for d in directories], [str(f) for f in out_files])
    tensors: list[dict[str, torch.Tensor]] = []
    for out_file in out_files:
        tensors.append(torch.load(out_file, weights_only=True))
        out_file.unlink()
    return tensors
