"""The ranks of tests/trainer/test_rank0_alone.py: the trainer's own methods (ready_to_generate,
collect_rollouts) and its rollout side's (evaluate) on every rank of a real gloo world, with rank 0's rollout side, the
offload and the engine replaced by stand-ins that take the time a GPU would and record when.

Run as ``python -m tests.trainer._rank0_alone_workers MODE OUT_DIR HANG_TIMEOUT_S SLOW_S`` with
torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist


def _batch():
    from stapo_megatron.trainer.batch import RolloutBatch

    return RolloutBatch(
        prompt_ids=[[1, 2], [1, 2]],
        response_ids=[[3, 4, 5], [6]],
        rollout_logprobs=[[-0.5, -0.25, -1.0], [-2.0]],
        truncated=torch.tensor([False, True]),
        rewards=torch.tensor([1.0, 0.0]),
        correct=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.7, -0.7]),
        group_ids=torch.tensor([0, 0]),
    )


class _SlowOffload:
    """TrainerOffload's interface; rank 1's optimizer state takes ``seconds`` to leave."""

    def __init__(self, rank: int, seconds: float, events: dict):
        self.rank, self.seconds, self.events = rank, seconds, events

    def offload(self, part: str) -> int:
        if part == "optimizer":
            if self.rank == 1:
                time.sleep(self.seconds)
            self.events["optimizer offloaded"] = time.time()
        return 1

    def offloaded(self, part: str) -> bool:
        return False


def _trainer(rank: int, hang_timeout_s: float, slow_s: float, mode: str, events: dict):
    """A Trainer without __init__: the attributes its rollout-side methods read."""
    from stapo_megatron.trainer.controller import Rank0Rollouts, RolloutController
    from stapo_megatron.trainer.heartbeat import Heartbeat, job_store
    from stapo_megatron.trainer.trainer import Trainer

    def collect(step, timer):
        with timer("rollout"):
            if mode == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 frozen whole: its heartbeat threads too
            time.sleep(slow_s)  # generation longer than the hang timeout, with no phase change
        return _batch(), {"reward/mean": 0.5}

    def evaluate_in_training(step, run_dir):
        time.sleep(slow_s)
        events["eval finished"] = time.time()
        return {"eval/average/avg@k": 0.25}

    engine = SimpleNamespace(resume_memory=lambda: events.setdefault("engine resumed", time.time()))
    trainer = Trainer.__new__(Trainer)
    trainer.rank = rank
    trainer.ctx = SimpleNamespace(
        rank=rank, device=torch.device("cpu"), cpu_group=dist.group.WORLD, world_group=dist.group.WORLD
    )
    trainer.heartbeat = Heartbeat(hang_timeout_s, rank, saved_step=0, store=job_store())
    rank0 = (
        Rank0Rollouts(
            collector=SimpleNamespace(engine=engine, collect=collect),
            evaluator=SimpleNamespace(evaluate_in_training=evaluate_in_training),
            metrics_logger=None,
            run_dir=None,
        )
        if rank == 0
        else None
    )
    trainer.rollouts = RolloutController(trainer.ctx, None, trainer.heartbeat, rank0)
    trainer.offload = _SlowOffload(rank, slow_s, events) if mode == "offload" else None
    trainer.release_engine = False
    trainer.engine_released = mode == "offload"
    trainer.engine_version = 0
    trainer.moved_bytes = {"offload": 0, "reload": 0}
    trainer.step = 0
    return trainer


# The collectives' timeout (parallel.timeout_minutes) in the slow mode: shorter than rank 0's rollout and
# evaluation, which the other rank waits through all the same.
SLOW_MODE_COLLECTIVE_TIMEOUT_S = 2.0


def main(mode: str, out_dir: str, hang_timeout_s: float, slow_s: float) -> None:
    if mode == "slow":
        assert slow_s > SLOW_MODE_COLLECTIVE_TIMEOUT_S
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=SLOW_MODE_COLLECTIVE_TIMEOUT_S))
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    events: dict[str, float] = {}
    trainer = _trainer(rank, hang_timeout_s, slow_s, mode, events)
    heartbeat = trainer.heartbeat.start()
    timer = heartbeat.timer(1)
    result: dict = {}
    if mode == "offload":
        dist.barrier()  # both ranks start offloading at once
        trainer.ready_to_generate(version=0, timer=timer)
    else:
        start = time.monotonic()
        batch, metrics = trainer.collect_rollouts(1, timer)
        result["batch"] = [batch.response_ids, batch.advantages.tolist()]
        result["metrics"] = metrics
        result["eval"] = trainer.rollouts.evaluate(1, timer)
        result["seconds"] = time.monotonic() - start
        result["returned_at"] = time.time()
    heartbeat.stop()
    result["events"] = events
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
