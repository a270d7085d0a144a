"""What rank 0 does alone while every other rank waits for it, on two real gloo ranks running the
trainer's own methods (tests/trainer/_rank0_alone_workers.py):

* a rollout and an evaluation each longer than run.hang_timeout_s and than the collectives' timeout
  end no rank: rank 0 beats through them and the waiting rank, waiting in the job's store, beats
  whenever rank 0 does;
* a rank 0 frozen mid-rollout (SIGSTOP: every thread of it) still has the waiting rank ended, within
  the timeout, naming the wait;
* with offload, rank 0 resumes the servers' memory only after every rank's optimizer state is off
  its GPU.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from stapo_megatron.runtime.launch import agent_store_env, rendezvous_store
from stapo_megatron.trainer.heartbeat import HANG_EXIT_CODE

REPO = Path(__file__).resolve().parents[2]


def _launch(mode: str, out_dir: Path, hang_timeout_s: float, slow_s: float):
    """The store (this process serves it, as torchrun's agent does: a frozen rank 0 does not freeze
    it; keep it while the ranks run) and the two rank processes."""
    store = rendezvous_store(2)
    ranks = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            **agent_store_env(store),
            "OMP_NUM_THREADS": "1",
        }
        command = [sys.executable, "-m", "tests.trainer._rank0_alone_workers", mode, str(out_dir)]
        ranks.append(
            subprocess.Popen(
                [*command, str(hang_timeout_s), str(slow_s)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return store, ranks


def _finish(ranks: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    outcomes = []
    try:
        for process in ranks:
            _, stderr = process.communicate(timeout=timeout)
            outcomes.append((process.returncode, stderr))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    return outcomes


def _results(out_dir: Path) -> list[dict]:
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_a_rollout_and_an_evaluation_longer_than_the_hang_timeout_end_no_rank(tmp_path):
    hang_timeout_s, slow_s = 1.0, 3.5
    _store, ranks = _launch("slow", tmp_path, hang_timeout_s, slow_s)
    outcomes = _finish(ranks)
    for rank, (returncode, stderr) in enumerate(outcomes):
        assert returncode == 0, f"rank {rank} exited {returncode}: {stderr[-3000:]}"
        assert "no progress" not in stderr
    rank0, rank1 = _results(tmp_path)
    # rank 1 waited through both (each over three timeouts long), then got rank 0's rollouts: it came
    # back only once rank 0's evaluation had ended (the two clocks started apart, so durations differ)
    assert rank0["seconds"] >= 2 * slow_s and rank1["returned_at"] >= rank0["events"]["eval finished"]
    assert rank0["batch"] == rank1["batch"] == [[[3, 4, 5], [6]], [0.699999988079071, -0.699999988079071]]
    assert rank0["metrics"] == {"reward/mean": 0.5} and rank1["metrics"] == {}
    assert rank0["eval"] == {"eval/average/avg@k": 0.25} and rank1["eval"] == {}


def test_a_frozen_rank_0_still_ends_the_rank_waiting_for_it(tmp_path):
    _store, (rank0, rank1) = _launch("freeze", tmp_path, hang_timeout_s=1.0, slow_s=600)
    try:
        _, stderr = rank1.communicate(timeout=60)
        assert rank1.returncode == HANG_EXIT_CODE, stderr[-3000:]
        assert rank0.poll() is None  # stopped, not dead: nothing but the heartbeat could end rank 1
    finally:
        rank0.send_signal(signal.SIGKILL)
        rank0.wait()
    [line] = [line for line in stderr.splitlines() if "no progress" in line]
    found = re.fullmatch(
        r"stapo: error: rank 1: no progress for (\d+) s \(run.hang_timeout_s=1\) in phase 'rollout, waiting for "
        r"rank 0' of step 1; exiting with code 75, the run has no checkpoint to resume from yet",
        line,
    )
    assert found, line
    # ended about one timeout after rank 0's last beat, not after the 600 s rank 0 would take
    assert int(found.group(1)) <= 5


def test_rank0_resumes_the_servers_only_after_every_rank_offloaded(tmp_path):
    slow_s = 1.5  # rank 1's optimizer state takes this long to leave its GPU
    _store, ranks = _launch("offload", tmp_path, hang_timeout_s=60, slow_s=slow_s)
    outcomes = _finish(ranks)
    for rank, (returncode, stderr) in enumerate(outcomes):
        assert returncode == 0, f"rank {rank} exited {returncode}: {stderr[-3000:]}"
    rank0, rank1 = (result["events"] for result in _results(tmp_path))
    assert set(rank0) == {"optimizer offloaded", "engine resumed"} and set(rank1) == {"optimizer offloaded"}
    # both started offloading together (a barrier); rank 0 waited for rank 1's slow one
    assert rank0["engine resumed"] >= rank1["optimizer offloaded"] >= rank0["optimizer offloaded"]
