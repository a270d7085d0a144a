"""examples/qwen3: the configs are the paper's setup and the scripts submit what the configs need."""

from __future__ import annotations

import os
import re
import stat
import subprocess

import pytest

from stapo_megatron.cli import main
from stapo_megatron.config import load_config
from stapo_megatron.models.qwen3.parallelize import check_layout
from stapo_megatron.trainer.config import TrainConfig
from tests.helpers import REPO_ROOT

# size -> (nodes, tensor, pipeline) stated by the script and the README
EXAMPLES = {"1.7b": (1, 1, 1), "8b": (2, 4, 1), "14b": (4, 4, 2), "32b": (8, 8, 2)}
GPUS_PER_NODE = 8


@pytest.mark.parametrize("size", sorted(EXAMPLES))
def test_config_is_the_papers_setup_on_its_nodes(size):
    cfg = load_config(TrainConfig, REPO_ROOT / "configs" / f"qwen3_{size}_stapo.yaml")
    nodes, tp, pp = EXAMPLES[size]
    p = cfg.parallel
    assert (p.tensor_parallel, p.pipeline_parallel) == (tp, pp)
    assert p.world_size == nodes * GPUS_PER_NODE
    check_layout(cfg.model, tp, pp)
    assert cfg.model.hidden_size == {"1.7b": 2048, "8b": 4096, "14b": 5120, "32b": 5120}[size]
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.clip_grad) == (1e-6, 10, 1.0)
    assert (cfg.batch.prompts_per_step, cfg.batch.group_size, cfg.batch.prompts_per_minibatch) == (256, 8, 64)
    assert cfg.batch.max_new_tokens == 15360 and cfg.algo.name == "stapo" and cfg.algo.kl_coef == 0
    assert cfg.data.source.endswith("dapo_math_17k.parquet") and cfg.reward.kind == "dapo"
    sglang = cfg.rollout.sglang
    assert cfg.rollout.engine == "sglang" and sglang.colocated
    assert GPUS_PER_NODE % sglang.tp_size == 0  # colocated: one server per tp_size GPUs on every node
    assert cfg.checkpoint.load_megatron.endswith(f"tp{tp}pp{pp}")


@pytest.mark.parametrize("size", sorted(EXAMPLES))
def test_script_submits_the_config_on_its_nodes(size, tmp_path, nemorun_home, capsys, monkeypatch):
    """Run the script with a stand-in `stapo` that records its arguments, then submit those (dry run)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv"
    shim = bin_dir / "stapo"
    shim.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {record}\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "ACCOUNT": "rl",
        "PARTITION": "batch",
        "STAPO_DRYRUN": "1",
        "WORKDIR": str(work),
    }
    script = REPO_ROOT / "examples" / "qwen3" / f"run_qwen3_{size}.sh"
    done = subprocess.run(["bash", str(script), "run.steps=5"], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    argv = record.read_text().split("\0")[:-1]
    assert argv[:3] == ["submit", "--config", str(REPO_ROOT / "configs" / f"qwen3_{size}_stapo.yaml")]
    assert "run.steps=5" in argv and "--dryrun" in argv
    # from the Hugging Face base model unless CONVERT=1 (below)
    model_dir = f"models/Qwen3-{size.upper()}-Base"
    assert "checkpoint.load_megatron=" in argv and f"checkpoint.load_hf={model_dir}" in argv
    if size == "32b":
        converted = subprocess.run(
            ["bash", str(script)], env={**env, "CONVERT": "1"}, capture_output=True, text=True, check=False
        )
        assert converted.returncode == 0, converted.stderr
        submitted = record.read_text().split("\0")[:-1]
        assert submitted[0] == "submit" and "checkpoint.load_megatron=checkpoints/qwen3_32b_base_tp8pp2" in submitted
        assert not any(a.startswith("checkpoint.load_hf=") for a in submitted)

    monkeypatch.chdir(work)
    assert main(argv) == 0
    out = capsys.readouterr().out
    nodes, _, _ = EXAMPLES[size]
    assert f"#SBATCH --nodes={nodes}\n" in out and f"#SBATCH --gpus-per-node={GPUS_PER_NODE}\n" in out
    assert "#SBATCH --account=rl\n" in out and "#SBATCH --partition=batch\n" in out
    assert re.search(rf"--nnodes {nodes} --nproc-per-node {GPUS_PER_NODE} ", out)
    assert f"--chdir={work} " in out
