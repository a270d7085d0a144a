"""What ``stapo submit`` checks and prepares before NeMo-Run is imported: its fields
(:class:`SubmitConfig`), the training config as ``stapo train`` would load it, the job's processes,
servers and layout (:mod:`.layout`), its options and environment, and the resolved config the job
runs (:func:`prepare`). The NeMo-Run job itself is :mod:`.submit`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from typing import Literal

import yaml

from stapo_megatron.config import MAX_BATCH, ConfigError, option, to_dict
from stapo_megatron.config.command import load_training_config
from stapo_megatron.config.core import check_fields
from stapo_megatron.launch.requeue import (
    DEFAULT_MAX_REQUEUES,
    DEFAULT_SIGNAL_LEAD_S,
    MAX_REQUEUES,
    MAX_SIGNAL_LEAD_S,
    check_requeue_options,
    time_limit_seconds,
)
from stapo_megatron.runtime.environment import rank_launch_env
from stapo_megatron.trainer.config import TrainConfig

DEFAULT_TIME = "04:00:00"
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# What shlex.quote leaves as it is: a value of only these characters reads the same to bash and sbatch, quoted or not.
_SHELL_SAFE = re.compile(r"[\w@%+=:,./-]+", re.ASCII)


@dataclasses.dataclass
class SubmitConfig:
    """``stapo submit``'s fields: the ``submit:`` section of the training config, or the command line."""

    executor: Literal["slurm", "local"] = option(
        "slurm", "slurm: NeMo-Run's SlurmExecutor (torchrun launcher); local: NeMo-Run's LocalExecutor, here."
    )
    nodes: int = option(1, "Nodes (slurm).", ge=1, le=MAX_BATCH)
    gpus_per_node: int | None = option(
        None,
        "GPUs per node, one rank each (default: the config's world size / nodes); 0: CPU nodes.",
        ge=0,
        le=MAX_BATCH,
    )
    procs_per_node: int | None = option(
        None, "Ranks per node (default: gpus_per_node); required with gpus_per_node 0.", ge=1, le=MAX_BATCH
    )
    partition: str | None = option(None, "SLURM partition.")
    account: str | None = option(None, "SLURM account to charge (required for slurm).")
    time: str = option(DEFAULT_TIME, "SLURM time limit.")
    signal_lead: int | None = option(
        None,
        "Slurm: the job is signalled this many seconds before its time limit and the run checkpoints and stops "
        "after its current step; give more than a step and a checkpoint take "
        f"(default {DEFAULT_SIGNAL_LEAD_S}, or a quarter of time if shorter).",
        ge=1,
        le=MAX_SIGNAL_LEAD_S,
    )
    max_requeues: int | None = option(
        None,
        "Slurm: a job that ends before run.steps (stopped for its time limit, a hang, a failure) requeues itself "
        f"and resumes from its latest checkpoint, at most this many times (default {DEFAULT_MAX_REQUEUES}; 0: never; "
        f"at most {MAX_REQUEUES}, as SLURM counts requeues in 16 bits).",
        ge=0,
        le=MAX_REQUEUES,
    )
    cpus_per_task: int | None = option(None, "CPUs for each node's task (torchrun and its ranks).", ge=1, le=MAX_BATCH)
    exclusive: bool = option(False, "Whole nodes (slurm).")
    container_image: str | None = option(None, "Container image (pyxis/enroot); the job dir is mounted at /nemo_run.")
    mounts: list[str] = option([], "Container mounts, SRC:DST or SRC:DST:FLAGS.")
    env: list[str] = option([], "Job environment, NAME=VALUE each.")
    job_name: str | None = option(None, "Experiment and job name (default: run.name).")
    tunnel: Literal["local", "ssh"] = option(
        "local", "local: sbatch on this machine (a login node); ssh: through host."
    )
    host: str | None = option(None, "Login node (with tunnel ssh).")
    user: str | None = option(None, "User on the login node (with tunnel ssh).")
    port: int | None = option(None, "SSH port.", ge=1, le=65535)
    identity: str | None = option(None, "SSH private key.")
    remote_job_dir: str | None = option(None, "Experiments directory on the cluster (with tunnel ssh).")
    workdir: str | None = option(
        None,
        "Directory the job runs in, where relative config paths resolve (default: this directory when the job "
        "shares this file system, else NeMo-Run's job directory).",
    )
    check_files: bool | None = option(
        None,
        "Check that the config's files exist here (default: true, except with tunnel ssh, where paths may exist "
        "only on the cluster).",
    )
    dryrun: bool = option(False, "Print the sbatch script (local: the job script); submit nothing.")
    wait: bool = option(False, "Slurm: wait for the job to end (default: return once submitted).")

    def __post_init__(self):
        check_fields(self)  # also when built directly, not by the command line


@dataclasses.dataclass
class SubmitOptions(SubmitConfig):
    """A submission: the training config (file and dotted overrides, as for ``stapo train``) and how to run it."""

    config: str | None = None  # None: the packaged tiny_cpu.yaml
    overrides: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Processes:
    nodes: int
    per_node: int  # torchrun processes (ranks) per node
    gpus_per_node: int  # GPUs requested per node (0: a CPU job)


def load_submitted_config(options: SubmitOptions) -> TrainConfig:
    """The config as ``stapo train`` would load it; file checks can be skipped for remote paths."""
    from stapo_megatron.trainer.launcher import default_config_path
    from stapo_megatron.trainer.validation import check_train_config

    check_files = options.check_files if options.check_files is not None else options.tunnel != "ssh"
    cfg = load_training_config(TrainConfig, options.config or default_config_path(), options.overrides)
    check_train_config(cfg, files=check_files)
    return cfg


def resolve_processes(options: SubmitOptions, cfg: TrainConfig) -> Processes:
    """Nodes x processes per node, checked against the config's parallel layout."""
    p = cfg.parallel
    world = p.world_size
    layout = (
        f"tensor x pipeline x context x data parallel = {p.tensor_parallel} x {p.pipeline_parallel} x "
        f"{p.context_parallel} x {p.data_parallel} = {world}"
    )
    if options.executor == "local" and options.nodes != 1:
        raise ConfigError(f"--nodes: the local executor runs on this machine only (1 node), got {options.nodes}")
    gpus, procs = options.gpus_per_node, options.procs_per_node
    sglang = cfg.rollout.sglang
    # disaggregated servers launched beside the trainer take the GPUs its ranks leave on every node
    beside = cfg.rollout.engine == "sglang" and sglang.launches and not sglang.colocated
    if procs is None:
        if gpus == 0:
            raise ConfigError("--procs-per-node: required on CPU nodes (--gpus-per-node 0): processes per node")
        if gpus is None or (beside and world % options.nodes == 0):
            if world % options.nodes:
                raise ConfigError(
                    f"--nodes: {options.nodes} nodes cannot hold the {world} ranks of the config's layout "
                    f"({layout}) evenly"
                )
            procs = world // options.nodes
        else:
            procs = gpus
    if gpus is None:
        gpus = procs if options.executor == "slurm" else 0
    if gpus and procs > gpus:
        raise ConfigError(
            f"--procs-per-node: {procs} processes per node need one GPU each, but --gpus-per-node is {gpus}"
        )
    if options.nodes * procs != world:
        raise ConfigError(
            f"--nodes/--gpus-per-node: {options.nodes} node(s) x {procs} processes per node = "
            f"{options.nodes * procs}, but the config's layout needs {layout}"
        )
    return Processes(nodes=options.nodes, per_node=procs, gpus_per_node=gpus)


def check_rollout_placement(cfg: TrainConfig, procs: Processes) -> list[str]:
    """Errors for SGLang servers that cannot be placed; returns notes worth printing."""
    notes = []
    sglang = cfg.rollout.sglang
    launching = cfg.rollout.engine == "sglang" and sglang.launches
    if launching and procs.gpus_per_node == 0:
        raise ConfigError("rollout.engine: SGLang servers need GPUs, but the job requests none (--gpus-per-node 0)")
    if launching and sglang.colocated:
        from stapo_megatron.rollout.node_servers import plan_node_servers

        # every node's local rank 0 starts one server per tp_size of its GPUs
        plan_node_servers(sglang, procs.per_node, procs.nodes)
    elif launching:
        # disaggregated: every node's leader starts its servers on GPUs the trainer does not use
        needed = sglang.base_gpu_id + sglang.num_servers * sglang.tp_size
        if needed > procs.gpus_per_node:
            raise ConfigError(
                f"rollout.sglang: {sglang.num_servers} server(s) x tp_size {sglang.tp_size} from GPU "
                f"{sglang.base_gpu_id} "
                f"need GPUs 0..{needed - 1} of each node, which has {procs.gpus_per_node} (--gpus-per-node)"
            )
        if not sglang.colocated and sglang.base_gpu_id < procs.per_node:
            raise ConfigError(
                f"rollout.sglang.base_gpu_id: {sglang.base_gpu_id} puts servers on the trainer's GPUs "
                f"0..{procs.per_node - 1}; "
                f"set it to >= {procs.per_node} or set rollout.sglang.placement: colocated"
            )
    spare = procs.gpus_per_node - procs.per_node
    if launching and not sglang.colocated:
        from stapo_megatron.rollout.node_servers import plan_node_servers

        counts = plan_node_servers(sglang, procs.per_node, procs.nodes)
        idle = sum(spare - count * sglang.tp_size for count in counts)
        if idle > 0:
            notes.append(f"{idle} requested GPU(s) run no trainer rank and no SGLang server")
    elif spare > 0:
        notes.append(f"{spare} GPU(s) per node are requested but run no trainer rank and no SGLang server")
    return notes


def check_job_layout(options: SubmitOptions, cfg: TrainConfig, procs: Processes) -> None:
    """The whole layout on the job's nodes (ranks, groups, servers, weight-sync routes, memory):
    stapo_megatron/launch/layout.py, with the GPU memory of the config's ``plan:`` section."""
    from stapo_megatron.launch.layout import Machines, check_train_layout, plan_section
    from stapo_megatron.trainer.launcher import default_config_path

    on_gpus = procs.gpus_per_node > 0
    machines = Machines(procs.nodes, procs.gpus_per_node if on_gpus else procs.per_node, on_gpus=on_gpus)
    check_train_layout(cfg, machines, plan_section(options.config or default_config_path()))


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--env {item}: expected NAME=VALUE")
        if not _ENV_NAME.fullmatch(name):
            # NeMo-Run writes `export NAME.upper()=...`; a lower-case name would silently change
            raise ConfigError(
                f"--env {item}: the name must be upper-case letters, digits and _ (NeMo-Run upper-cases names)"
            )
        env[name] = value
    return env


def parse_mounts(items: list[str]) -> list[str]:
    for item in items:
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
            raise ConfigError(f"--mounts {item}: expected SRC:DST or SRC:DST:FLAGS")
    return list(items)


def check_unquoted(flag: str, value: str) -> None:
    """A value NeMo-Run writes into the sbatch script as it is (its srun line quotes nothing)."""
    if not _SHELL_SAFE.fullmatch(value):
        raise ConfigError(
            f"{flag}: {value!r} cannot go into the sbatch script, which NeMo-Run writes it into unquoted "
            "(use letters, digits and _@%+=:,./- only)"
        )


def check_one_line(flag: str, value: str) -> None:
    """A value stapo quotes for the script must still fit on its one line."""
    if not value.isprintable():
        raise ConfigError(
            f"{flag}: {value!r} contains a control character (e.g. a newline), which the job script cannot carry"
        )


def check_options(options: SubmitOptions) -> None:
    if options.workdir is not None:
        check_one_line("--workdir", options.workdir)
    if options.job_name is not None and not _JOB_NAME.fullmatch(options.job_name):
        raise ConfigError(
            f"--job-name: {options.job_name!r} must be letters, digits, '_', '.', '-' (it names a directory)"
        )
    if options.executor == "local":
        slurm_only = {
            "--partition": options.partition,
            "--account": options.account,
            "--container-image": options.container_image,
            "--mounts": options.mounts,
            "--cpus-per-task": options.cpus_per_task,
            "--exclusive": options.exclusive,
            "--host": options.host,
            "--remote-job-dir": options.remote_job_dir,
        }
        slurm_flags_set = [flag for flag, value in slurm_only.items() if value]
        slurm_flags_set += [
            flag
            for flag, value in (("--signal-lead", options.signal_lead), ("--max-requeues", options.max_requeues))
            if value is not None
        ]
        if slurm_flags_set:
            raise ConfigError(f"{slurm_flags_set[0]}: only for --executor slurm")
        if options.tunnel != "local":
            raise ConfigError("--tunnel: only for --executor slurm")
        return
    if not options.account:
        raise ConfigError("--account: required by --executor slurm (the SLURM account to charge)")
    for flag, value in (
        ("--account", options.account),
        ("--partition", options.partition),
        ("--container-image", options.container_image),
        ("--remote-job-dir", options.remote_job_dir),
        *(("--mounts", mount) for mount in options.mounts),
    ):
        if value is not None:
            check_unquoted(flag, value)
    if options.tunnel == "ssh":
        for flag, value in (
            ("--host", options.host),
            ("--user", options.user),
            ("--remote-job-dir", options.remote_job_dir),
        ):
            if not value:
                raise ConfigError(f"{flag}: required with --tunnel ssh")
    check_requeue_options(signal_lead_s(options), max_requeues(options), options.time)


def signal_lead_s(options: SubmitOptions) -> int:
    if options.signal_lead is not None:
        return options.signal_lead
    return min(DEFAULT_SIGNAL_LEAD_S, time_limit_seconds(options.time) // 4)


def max_requeues(options: SubmitOptions) -> int:
    return DEFAULT_MAX_REQUEUES if options.max_requeues is None else options.max_requeues


def workdir_for(options: SubmitOptions) -> str | None:
    """Where the job runs (its relative paths, runs/<name> among them, resolve there).

    Default: this directory when the job sees this file system (local executor, or a local
    tunnel without a container); otherwise NeMo-Run's own (the job directory's code/ folder).
    """
    if options.workdir:
        return options.workdir
    if options.executor == "local" or (options.tunnel == "local" and not options.container_image):
        here = os.getcwd()
        check_one_line("--workdir (default: this directory)", here)
        return here
    return None


def job_environment(options: SubmitOptions, *, for_shell: bool) -> dict[str, str]:
    """The job's environment: what ``stapo train`` sets for its ranks, then --env.

    Values are exported by the sbatch script (``for_shell``: quoted for bash) or passed to the
    process as they are (local executor).
    """
    env = {**rank_launch_env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    bindir = os.path.dirname(sys.executable)
    if options.executor == "local":
        # torchrun and python of this environment, whether or not it is activated
        env["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    elif options.tunnel == "local" and not options.container_image:
        env["PATH"] = f"{shlex.quote(bindir)}:$PATH"  # expanded by the sbatch script's shell
    user = parse_env(options.env)
    if for_shell:
        user = {k: shlex.quote(v) for k, v in user.items()}
    env.update(user)
    return env


@dataclasses.dataclass
class Submission:
    cfg: TrainConfig
    config_yaml: str
    processes: Processes
    title: str
    notes: list[str]


def prepare(options: SubmitOptions) -> Submission:
    """Every check that needs neither NeMo-Run nor the cluster, in the order a user fixes them."""
    check_options(options)
    cfg = load_submitted_config(options)
    processes = resolve_processes(options, cfg)
    notes = check_rollout_placement(cfg, processes)
    check_job_layout(options, cfg, processes)
    parse_env(options.env)
    parse_mounts(options.mounts)
    title = options.job_name or cfg.run.name
    if not _JOB_NAME.fullmatch(title):
        raise ConfigError(f"run.name: {title!r} cannot name a job (letters, digits, '_', '.', '-'); give --job-name")
    # The job's ranks read this file, so it keeps secrets, except in a dry run, which prints it.
    config_yaml = yaml.safe_dump(to_dict(cfg, redact=options.dryrun), sort_keys=False)
    return Submission(cfg=cfg, config_yaml=config_yaml, processes=processes, title=title, notes=notes)
