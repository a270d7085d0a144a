"""benchmarks/gpu_smoke.py, the script meant for the first GPU, runs its own --cpu mode to the end:
every check passes with its figures, so the script cannot rot unnoticed before a GPU is lent."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.py"


def _smoke(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_without_cuda_it_says_so_and_exits_0():
    done = _smoke(timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.fullmatch(
        r"gpu_smoke: skipped: no CUDA device \(torch .+, built with CUDA .+\); --cpu runs the checks on the CPU\n",
        done.stdout,
    ), done.stdout


@pytest.mark.slow
def test_cpu_mode_runs_every_check_and_passes(tmp_path):
    done = _smoke("--cpu", "--train-steps", "4", "--tokens", "256", "--workdir", str(tmp_path), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = re.findall(r"^\[(PASS|FAIL)\] ([^:]+): (.*)$", done.stdout, re.M)
    assert [(verdict, name) for verdict, name, _ in lines] == [
        ("PASS", "logits float32 vs transformers"),
        ("PASS", "logits bfloat16 vs transformers"),
        ("PASS", "token statistics, 256 tokens x V=151936 bf16"),
        ("PASS", "stapo train 4 steps, killed after step 2, resumed"),
        ("PASS", "conversion HF -> Megatron -> HF"),
    ], done.stdout
    checks = {name: details for _, name, details in lines}
    fp32 = float(re.search(r"max\|diff\|/max\|logit\| = (\S+) ", checks["logits float32 vs transformers"])[1])
    assert fp32 <= 1e-4
    resume = checks["stapo train 4 steps, killed after step 2, resumed"]
    same, total = map(int, re.match(r"(\d+)/(\d+) parameters bit-identical;", resume).groups())
    assert same == total > 0 and "metrics of steps 3-4 equal" in resume, resume
    assert re.search(r"^\d+ tensors bit-exact; ", checks["conversion HF -> Megatron -> HF"])
    assert re.search(r"^gpu_smoke: 5/5 checks passed in \d+ s$", done.stdout, re.M), done.stdout
    # both runs of the resume check left their checkpoints in the kept work directory
    assert (tmp_path / "resumed" / "checkpoints" / "iter_0000004").is_dir()
    assert (tmp_path / "reference" / "checkpoints" / "iter_0000004").is_dir()
