"""stapo plan --async (stapo_megatron/launch/split_plan.py) and the asynchronous paper config at full scale."""

from __future__ import annotations

import re

import pytest

from stapo_megatron.cli import main
from stapo_megatron.config import load_config
from stapo_megatron.config.command import load_training_config
from stapo_megatron.launch.plan_config import PlanConfig
from stapo_megatron.launch.split_plan import plan_async
from stapo_megatron.launch.step_time import DECODE_TOKENS_PER_GPU_S, REFERENCE_EFFICIENCY, TRAIN_TOKENS_PER_GPU_S
from stapo_megatron.trainer.config import TrainConfig
from tests.helpers import REPO_ROOT

SYNC = str(REPO_ROOT / "configs" / "qwen3_32b_stapo.yaml")
ASYNC = str(REPO_ROOT / "configs" / "qwen3_32b_stapo_async.yaml")
GENERATED = 2048 * 5120  # 256 prompts x 8 samples x a third of 15,360 new tokens
TRAINED = 2048 * (108 + 5120)


@pytest.fixture(scope="module")
def plan_32b():
    return plan_async(PlanConfig(), load_config(TrainConfig, SYNC))


def test_synchronous_layout_of_the_paper_config(plan_32b):
    sync = plan_32b.synchronous
    assert (sync.layout.tp, sync.layout.pp, sync.layout.dp) == (8, 2, 4)  # the config's own
    assert len(sync.job.servers) == 8 and sync.job.mode == "tensor"
    # 64 GPUs generate 10,485,760 tokens at 1,040.32 each per second
    assert sync.time.generation_s == pytest.approx(GENERATED / (64 * DECODE_TOKENS_PER_GPU_S))  # 157.5
    assert sync.time.generation_s == pytest.approx(157.49, abs=0.01)
    # micro-batches of 17,408 tokens: ceil(512 x 5,228 / (4 x 17,408)) = 39 per DP rank, PP 2: 39/40 busy
    efficiency = (39 / 40) / REFERENCE_EFFICIENCY
    assert sync.time.training_s == pytest.approx(TRAINED / (64 * TRAIN_TOKENS_PER_GPU_S * efficiency))
    assert sync.time.total_s == pytest.approx(157.49 + 130.42 + 16.0, abs=0.02)


def test_splits_are_checked_and_timed(plan_32b):
    by_t = {s.trainer_per_node: s for s in plan_32b.splits}
    assert sorted(by_t) == [1, 2, 3, 4, 5, 6, 7]
    for t in (1, 3, 5, 7):  # an odd number of server GPUs: TP1 servers, and 32.8B in bf16 leaves no KV cache
        assert by_t[t].time is None and "a TP1 server cannot hold the model" in by_t[t].refused
    even = by_t[4]
    assert even.server_tp == 4 and even.layout.gpus == 32 and even.job.mode == "distributed"
    assert [s.endpoint.node for s in even.job.servers] == list(range(8))  # one beside each node's 4 ranks
    for server in even.job.servers:
        assert server.gpus == (4, 5, 6, 7)
    assert even.time.generation_s == pytest.approx(GENERATED / (32 * DECODE_TOKENS_PER_GPU_S))  # 315.0
    # its trainer layout has one stage (no bubble): 10,706,944 tokens on 32 GPUs
    assert even.layout.pp == 1
    assert even.time.training_s == pytest.approx(TRAINED / (32 * TRAIN_TOKENS_PER_GPU_S / REFERENCE_EFFICIENCY))
    assert even.time.training_s == pytest.approx(254.32, abs=0.01)
    best = plan_32b.best
    assert best.time.total_s == min(s.time.total_s for s in plan_32b.splits if s.time)
    assert plan_32b.speedup(best) == pytest.approx(plan_32b.synchronous.time.total_s / best.time.total_s)


def test_a_split_that_cannot_hold_the_model_is_one_line(capsys):
    assert main(["plan", "--config", SYNC, "--async", "--trainer-gpus-per-node", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--trainer-gpus-per-node: 1 per node cannot work: a TP1 server cannot hold the model" in err


def test_async_config_passes_the_layout_check_at_full_scale(capsys):
    cfg = load_training_config(TrainConfig, ASYNC)
    assert cfg.rollout.async_.max_staleness == 1 and not cfg.rollout.sglang.colocated
    assert (cfg.batch.prompts_per_step, cfg.batch.group_size, cfg.batch.max_new_tokens) == (256, 8, 15360)
    assert main(["plan", "--config", ASYNC, "--check"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "layout Qwen3 32.8B TP4 PP1 DP8 CP1 on 8 node(s) x 8 GPUs, disaggregated SGLang TP4, "
        "weight_sync distributed: ok"
    )
    assert out[1].startswith("ranks: 32 on 8 node(s), 4 per node")
    assert "servers: 0: node 0 GPUs 4-7 (disaggregated, TP4); 1: node 1 GPUs 4-7 (disaggregated, TP4)" in out[3]
    assert out[3].endswith("(8 in all)") and not any(line.startswith("idle:") for line in out)
    # a server on a trainer GPU is refused in one line, before anything starts
    assert main(["plan", "--config", ASYNC, "--check", "rollout.sglang.base_gpu_id=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "disaggregated server 0 runs on GPU 2 of node 0, a trainer GPU" in err


def test_async_config_is_the_planners_best_split(capsys):
    assert main(["plan", "--config", ASYNC, "--async", "--trainer-gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if re.match(r"\s*4 ", line)]
    assert len(rows) == 2  # the planner's split of 4 trainer GPUs per node, and the config's own
    assert rows[0].split()[:4] == rows[1].split()[:4] == ["4", "TP4", "PP1", "DP8"]


def test_submit_dryrun_runs_the_async_config(nemorun_home, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", ASYNC, "--account", "rl", "--dryrun", "--no-check-files"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=8\n" in out and "#SBATCH --gpus-per-node=8\n" in out
    assert re.search(r"--nnodes 8 --nproc-per-node 4 ", out)
