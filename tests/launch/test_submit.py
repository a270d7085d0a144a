"""stapo submit: the dry-run sbatch script, the local job script, and the checks before submitting."""

from __future__ import annotations

import os
import re
import shlex
import sys

import pytest
import yaml

from stapo_megatron.cli import main
from stapo_megatron.config import ConfigError, load_config
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.launcher import load_train_config


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def sbatch_flags(script: str) -> dict[str, str]:
    flags = {}
    for line in script.splitlines():
        match = re.fullmatch(r"#SBATCH --([a-z-]+)(?:=(.*))?", line)
        if match:
            flags[match.group(1)] = match.group(2) if match.group(2) is not None else True
    return flags


def exports(script: str) -> dict[str, str]:
    return dict(line[len("export ") :].split("=", 1) for line in script.splitlines() if line.startswith("export "))


def main_srun(script: str) -> list[str]:
    lines = [line for line in script.splitlines() if line.startswith("srun ") and " torchrun " in line]
    assert len(lines) == 1, script
    return shlex.split(lines[0].replace("${SLURM_RESTART_COUNT:-0}", "0"))


def option_values(argv: list[str], name: str) -> list[str]:
    """Every value of ``name`` in argv, written as `name value` or `name=value`."""
    values = []
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith(name + "="):
            values.append(arg.split("=", 1)[1])
    return values


# Exported by NeMo-Run's template and torchrun component whatever the options.
NEMO_EXPORTS = {"PYTHONUNBUFFERED", "SLURM_UNBUFFEREDIO", "TORCHX_MAX_RETRIES", "LOGLEVEL"}


def test_gpu_dryrun_sbatch_has_exactly_the_settings(nemorun_home, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(
        capsys,
        "submit",
        "--executor",
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--partition",
        "batch",
        "--account",
        "rl_team",
        "--time",
        "1-12:00:00",
        "--container-image",
        "nvcr.io/nvidia/pytorch:25.01-py3",
        "--mounts",
        "/lustre/data:/data",
        "--mounts",
        "/lustre/models:/models:ro",
        "--env",
        "NCCL_DEBUG=INFO",
        "--env",
        "HF_HOME=/data/hf cache",
        "--job-name",
        "tiny-gpu",
        "--dryrun",
        "parallel.data_parallel=8",
        "run.steps=3",
    )
    assert code == 0, err
    flags = sbatch_flags(out)
    output = flags.pop("output")
    assert flags == {
        "account": "rl_team",
        "partition": "batch",
        "nodes": "2",
        "gpus-per-node": "8",
        "ntasks-per-node": "1",
        "time": "1-12:00:00",
        "job-name": "stapo.tiny-gpu",
        "open-mode": "append",
        "signal": "B:USR1@900",
    }
    assert output.startswith(str(nemorun_home / "experiments" / "tiny-gpu"))
    env = exports(out)
    assert env["NCCL_DEBUG"] == "INFO" and env["HF_HOME"] == "'/data/hf cache'"
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["NCCL_CUMEM_ENABLE"] == "0" and env["NCCL_NVLS_ENABLE"] == "0"  # as SGLang's servers have them
    # the requeue script's allocation start, which rank 0 compares a STOP file with
    assert env["STAPO_ALLOCATION_STARTED"] == "$(date +%s)"
    # in a container the job has the image's PATH: stapo adds nothing else
    assert set(env) == NEMO_EXPORTS | {
        "NCCL_DEBUG",
        "HF_HOME",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "NCCL_CUMEM_ENABLE",
        "NCCL_NVLS_ENABLE",
        "OMP_NUM_THREADS",
        "STAPO_ALLOCATION_STARTED",
    }
    srun = main_srun(out)
    assert option_values(srun, "--container-image") == ["nvcr.io/nvidia/pytorch:25.01-py3"]
    mounts = option_values(srun, "--container-mounts")[0].split(",")
    assert mounts[:2] == ["/lustre/data:/data", "/lustre/models:/models:ro"] and mounts[2].endswith(":/nemo_run")
    torchrun = srun[srun.index("torchrun") :]
    assert option_values(torchrun, "--nnodes") == ["2"] and option_values(torchrun, "--nproc-per-node") == ["8"]
    assert torchrun[-5:] == ["-m", "stapo_megatron.cli", "train", "--config", "/nemo_run/stapo_config.yaml"]
    # a dry run leaves no experiment behind
    assert not any((nemorun_home / "experiments").iterdir())


def test_cpu_dryrun_requests_no_gpus_and_runs_in_this_directory(nemorun_home, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(
        capsys,
        "submit",
        "--executor",
        "slurm",
        "--gpus-per-node",
        "0",
        "--procs-per-node",
        "2",
        "--account",
        "a",
        "--cpus-per-task",
        "2",
        "--dryrun",
        "run.steps=3",
    )
    assert code == 0, err
    flags = sbatch_flags(out)
    assert not {"gpus-per-node", "gres", "gpus", "gpus-per-task", "partition"} & set(flags)
    assert flags["nodes"] == "1" and flags["ntasks-per-node"] == "1" and flags["cpus-per-task"] == "2"
    assert flags["job-name"] == "stapo.tiny_cpu" and flags["time"] == "04:00:00"
    env = exports(out)
    assert env["PATH"] == f"{os.path.dirname(sys.executable)}:$PATH"
    srun = main_srun(out)
    # srun keeps the last --chdir: this directory, where run.output_dir (runs/tiny_cpu) resolves
    assert option_values(srun, "--chdir")[-1] == str(tmp_path)
    torchrun = srun[srun.index("torchrun") :]
    assert option_values(torchrun, "--nnodes") == ["1"] and option_values(torchrun, "--nproc-per-node") == ["2"]
    config = torchrun[-1]
    assert config.startswith(str(nemorun_home / "experiments" / "tiny_cpu")) and config.endswith(
        "/tiny_cpu/stapo_config.yaml"
    )


def test_ssh_tunnel_dryrun_needs_no_connection(nemorun_home, capsys):
    code, out, err = run_cli(
        capsys,
        "submit",
        "--account",
        "a",
        "--tunnel",
        "ssh",
        "--host",
        "login.invalid",
        "--user",
        "alice",
        "--remote-job-dir",
        "/lustre/alice/experiments",
        "--nodes",
        "2",
        "--job-name",
        "remote",
        "--workdir",
        "/lustre/alice/w",
        "--dryrun",
        "parallel.data_parallel=8",
    )
    assert code == 0, err
    flags = sbatch_flags(out)
    assert flags["output"].startswith("/lustre/alice/experiments/remote/remote_")
    assert flags["gpus-per-node"] == "8"  # 16 ranks over 2 nodes
    srun = main_srun(out)
    assert option_values(srun, "--chdir")[-1] == "/lustre/alice/w"
    assert srun[-1].startswith("/lustre/alice/experiments/remote/") and srun[-1].endswith("/stapo_config.yaml")
    assert "PATH" not in exports(out)  # the cluster's environment, not this machine's


def test_ssh_tunnel_leaves_the_clusters_paths_unchecked_unless_asked(nemorun_home, capsys):
    ssh = [
        "submit",
        "--account",
        "a",
        "--tunnel",
        "ssh",
        "--host",
        "login.invalid",
        "--user",
        "alice",
        "--remote-job-dir",
        "/lustre/alice/experiments",
        "--gpus-per-node",
        "2",
        "--dryrun",
        "checkpoint.load_hf=/lustre/alice/models/qwen",
    ]
    code, out, err = run_cli(capsys, *ssh)
    assert code == 0, err
    code, _, err = run_cli(capsys, *ssh, "--check-files")
    assert code == 2 and "checkpoint.load_hf: /lustre/alice/models/qwen is not a directory" in err


def test_local_dryrun_writes_the_resolved_config_and_runs_stapo_train(nemorun_home, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "submit", "--executor", "local", "--dryrun", "run.steps=2", "optim.lr=0.002")
    assert code == 0, err
    expected = load_train_config(None, ["run.steps=2", "optim.lr=0.002"])
    heredoc = re.search(r"<<'STAPO_RESOLVED_CONFIG_EOF'\n(.*?)\nSTAPO_RESOLVED_CONFIG_EOF\n", out, re.DOTALL)
    assert heredoc, out
    written = tmp_path / "written.yaml"
    written.write_text(heredoc.group(1))
    assert load_config(TrainConfig, written) == expected
    assert f"cd {tmp_path}\n" in out
    assert f'exec {sys.executable} -m stapo_megatron.cli train --config "$job_dir/stapo_config.yaml"' in out


def test_resolved_config_round_trips_and_the_packager_writes_it(tmp_path):
    from stapo_megatron.launch.submission import SubmitOptions, prepare

    pytest.importorskip("nemo_run", reason="NeMo-Run is not importable: pip install -e '.[launch]'")
    from stapo_megatron.launch.nemo import CONFIG_NAME, ResolvedConfigPackager

    options = SubmitOptions(
        config=None, overrides=["run.steps=7", "algo=grpo"], account="a", gpus_per_node=0, procs_per_node=2
    )
    sub = prepare(options)
    assert sub.cfg == load_train_config(None, ["run.steps=7", "algo=grpo"])
    job_dir = tmp_path / "job"
    assert ResolvedConfigPackager(config_yaml=sub.config_yaml).package(tmp_path, str(job_dir), "job") == ""
    assert load_config(TrainConfig, job_dir / CONFIG_NAME) == sub.cfg
    assert yaml.safe_load((job_dir / CONFIG_NAME).read_text())["algo"]["name"] == "grpo"


BAD = [
    (
        ["--gpus-per-node", "4", "--account", "a"],
        (
            "--nodes/--gpus-per-node: 1 node(s) x 4 processes per node = 4, but the "
            "config's layout needs tensor x pipeline x context x data parallel = 2 x 1 x 1 x 1 = 2"
        ),
    ),
    (
        ["--nodes", "2", "--gpus-per-node", "8", "--account", "a", "parallel.data_parallel=4"],
        "= 16, but the config's layout needs",
    ),
    (["--nodes", "3", "--account", "a"], "--nodes: 3 nodes cannot hold the 2 ranks"),
    (["--gpus-per-node", "0", "--account", "a"], "--procs-per-node: required on CPU nodes"),
    (
        ["--gpus-per-node", "1", "--procs-per-node", "2", "--account", "a"],
        "--procs-per-node: 2 processes per node need one GPU each",
    ),
    (["--gpus-per-node", "0", "--procs-per-node", "2"], "--account: required by --executor slurm"),
    (
        ["--account", "a", "--tunnel", "ssh", "--user", "u", "--remote-job-dir", "/x"],
        "--host: required with --tunnel ssh",
    ),
    (["--account", "a", "--env", "lower=1"], "--env lower=1: the name must be upper-case"),
    (["--account", "a", "--env", "NOVALUE"], "--env NOVALUE: expected NAME=VALUE"),
    (["--account", "a", "--mounts", "/only-one-path"], "--mounts /only-one-path: expected SRC:DST"),
    (["--account", "a", "--time", "ten minutes"], "--time: 'ten minutes' is not a SLURM time limit"),
    # before: accepted, and the batch script's `[ "$restarts" -ge 10**26 ]` fails as bash reads 64-bit integers
    (["--account", "a", "--max-requeues", str(10**26)], f"--max-requeues: must be <= 65535, got {10**26}"),
    (["--account", "a", "--max-requeues", "65536"], "--max-requeues: must be <= 65535, got 65536"),
    (["--account", "a", "--max-requeues", "-1"], "--max-requeues: must be >= 0, got -1"),
    (["--account", "a", "--signal-lead", str(10**20)], f"--signal-lead: must be <= 65535, got {10**20}"),
    (["--account", "a", "--time", "99999999999:00:00"], "--time: 99999999999:00:00 is longer than SLURM can hold"),
    (["--account", "a", "--port", "70000"], "--port: must be <= 65535, got 70000"),
    (["--account", "a", "--cpus-per-task", str(10**9)], "--cpus-per-task: must be <= 1048576, got 1000000000"),
    (["--executor", "local", "--nodes", "2"], "--nodes: the local executor runs on this machine only"),
    (["--executor", "local", "--partition", "p"], "--partition: only for --executor slurm"),
    (["--account", "a", "--job-name", "a/b"], "--job-name: 'a/b' must be letters"),
    (
        ["--account", "a", "parallel.tensor_parallel=3"],
        "parallel.tensor_parallel: 3 does not divide the 4 attention heads",
    ),
    (["--account", "a", "optim.lr=-1"], "optim.lr: must be > 0"),
    (
        ["--account", "a", "checkpoint.load_hf=/nonexistent/hf"],
        "checkpoint.load_hf: /nonexistent/hf is not a directory",
    ),
    (
        [
            "--gpus-per-node",
            "0",
            "--procs-per-node",
            "2",
            "--account",
            "a",
            "rollout.engine=sglang",
            "rollout.sglang.model_path=/m",
        ],
        "rollout.engine: SGLang servers need GPUs",
    ),
    (
        [
            "--gpus-per-node",
            "4",
            "--procs-per-node",
            "2",
            "--account",
            "a",
            "rollout.engine=sglang",
            "rollout.sglang.model_path=/m",
            "rollout.sglang.num_servers=2",
            "rollout.sglang.tp_size=2",
            "rollout.sglang.base_gpu_id=1",
        ],
        "rollout.sglang: 2 server(s) x tp_size 2 from GPU 1 need GPUs 0..4",
    ),
    (
        [
            "--gpus-per-node",
            "4",
            "--procs-per-node",
            "2",
            "--account",
            "a",
            "rollout.engine=sglang",
            "rollout.sglang.model_path=/m",
            "rollout.sglang.num_servers=2",
        ],
        "rollout.sglang.base_gpu_id: 0 puts servers on the trainer's GPUs 0..1",
    ),
]


@pytest.mark.parametrize("args, message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_errors_are_one_line_and_nothing_is_submitted(args, message, capsys, tmp_path, monkeypatch):
    home = tmp_path / "nemo_home"
    monkeypatch.setenv("NEMORUN_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "submit", "--dryrun", *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("stapo: error: ") and message in err, err
    assert not (home / "experiments").exists()


def test_separate_rollout_gpus_are_accepted(nemorun_home, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(
        capsys,
        "submit",
        "--gpus-per-node",
        "4",
        "--procs-per-node",
        "2",
        "--account",
        "a",
        "--dryrun",
        "rollout.engine=sglang",
        "rollout.sglang.model_path=/m",
        "rollout.sglang.num_servers=2",
        "rollout.sglang.base_gpu_id=2",
    )
    assert code == 0, err
    assert sbatch_flags(out)["gpus-per-node"] == "4"
    torchrun = main_srun(out)
    assert option_values(torchrun[torchrun.index("torchrun") :], "--nproc-per-node") == ["2"]


def test_missing_nemo_run_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "nemo_run", None)  # `import nemo_run` raises ImportError
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(
        capsys, "submit", "--account", "a", "--gpus-per-node", "0", "--procs-per-node", "2", "--dryrun"
    )
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("stapo: error: stapo submit: NeMo-Run is not importable")
    assert "pip install 'stapo_megatron[launch]'" in err


def test_status_and_logs_of_unknown_experiment(nemorun_home, capsys):
    for command in (["status", "nothing_123"], ["logs", "nothing_123"]):
        code, _, err = run_cli(capsys, *command)
        assert code == 2 and err.count("\n") == 1 and "no experiment or job name 'nothing_123'" in err


def test_status_lists_nothing_in_an_empty_home(nemorun_home, capsys):
    code, out, _ = run_cli(capsys, "status")
    assert code == 0 and out.startswith("no experiments under")


def test_prepare_needs_no_nemo_run(monkeypatch):
    from stapo_megatron.launch.submission import SubmitOptions, prepare

    monkeypatch.setitem(sys.modules, "nemo_run", None)
    sub = prepare(SubmitOptions(config=None, overrides=[], account="a", nodes=1, gpus_per_node=2))
    assert (sub.processes.nodes, sub.processes.per_node, sub.processes.gpus_per_node) == (1, 2, 2)
    with pytest.raises(ConfigError, match="--nodes/--gpus-per-node"):
        prepare(SubmitOptions(config=None, overrides=[], account="a", nodes=1, gpus_per_node=1))


def test_every_numeric_flag_of_submit_and_plan_is_bounded_both_ways():
    """A count with no upper bound reaches a script or a planner as it is (--max-requeues 10**26)."""
    from stapo_megatron.config.core import describe
    from stapo_megatron.launch.plan_config import PlanConfig
    from stapo_megatron.launch.submission import SubmitConfig

    for section in (SubmitConfig, PlanConfig):
        for name, type_name, _, _ in describe(section):
            if type_name.split()[0] in ("int", "float"):
                assert " in [" in type_name or " in (" in type_name, f"{section.__name__}.{name}: {type_name}"
