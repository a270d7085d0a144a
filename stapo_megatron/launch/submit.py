"""``stapo submit``: run ``stapo train`` with a checked config on SLURM or locally, through NeMo-Run.

The config is loaded and checked here exactly as ``stapo train`` checks it, then written, resolved
(every default filled in), into the job directory; the job runs ``stapo train --config`` on that
file. What runs on the cluster is therefore the run that ``stapo train`` would start here.

- ``--executor slurm``: NeMo-Run's ``SlurmExecutor`` with its torchrun launcher: one task per
  node, torchrun starting ``--procs-per-node`` ranks (one per GPU: ``--gpus-per-node``; on CPU
  nodes ``--gpus-per-node 0 --procs-per-node P`` requests no GPUs). It reaches the cluster
  through an SSH tunnel (``--tunnel ssh --host --user --remote-job-dir``) or, on a login node,
  a local one. ``--dryrun`` prints the sbatch script and submits nothing. A run longer than
  ``--time`` is signalled ``--signal-lead`` seconds before the limit, checkpoints, requeues
  itself and resumes, up to ``--max-requeues`` times (stapo_megatron/launch/requeue.py).
- ``--executor local``: NeMo-Run's ``LocalExecutor`` runs ``stapo train`` here (it starts its own
  torchrun), and waits.

Experiments live under ``$NEMORUN_HOME/experiments/<job name>/<id>`` (default ~/.nemo_run);
``stapo status`` and ``stapo logs`` find them by id (or job name: the latest), as do NeMo-Run's
``nemo experiment status|logs|cancel <id>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shlex
import shutil
import sys
import time
from typing import Literal

import yaml

from stapo_megatron.config import MAX_BATCH, ConfigError, option, to_dict
from stapo_megatron.config.command import (
    CommandConfig,
    FieldNames,
    Flag,
    FlagKind,
    add_command_arguments,
    load_command,
    load_training_config,
    register_command_config,
)
from stapo_megatron.config.core import check_fields
from stapo_megatron.launch.requeue import (
    DEFAULT_MAX_REQUEUES,
    DEFAULT_SIGNAL_LEAD_S,
    MAX_REQUEUES,
    MAX_SIGNAL_LEAD_S,
    batch_script_lines,
    check_requeue_options,
    run_dir_for_batch_shell,
    time_limit_seconds,
)
from stapo_megatron.trainer.config import TrainConfig

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'stapo_megatron[launch]' (nemo-run with leptonai==0.27.3)"
DEFAULT_TIME = "04:00:00"
# NeMo-Run names the sbatch job <prefix><job name>; its status parser splits on the last dot.
JOB_NAME_PREFIX = "stapo."
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# What shlex.quote leaves as it is: a value of only these characters reads the same to bash and sbatch, quoted or not.
_SHELL_SAFE = re.compile(r"[\w@%+=:,./-]+", re.ASCII)
_CONFIG_EOF = "STAPO_RESOLVED_CONFIG_EOF"
SUBMIT_SECTION = "submit"  # the key of the command's own fields in a training config file


def import_nemo_run(command: str):
    """nemo_run, or a one-line error saying how to install it."""
    try:
        import nemo_run
    except ImportError as err:  # leptonai other than 0.27.3 breaks the import with a ModuleNotFoundError
        raise ConfigError(f"{command}: NeMo-Run is not importable ({err}); {INSTALL_HINT}") from None
    return nemo_run


@contextlib.contextmanager
def nemo_console_to_stderr():
    """NeMo-Run's rich console writes to stdout; keep stdout for what stapo prints (scripts, JSON)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


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


# ---- checks (no NeMo-Run needed) ------------------------------------------------------------


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
    if procs is None:
        if gpus == 0:
            raise ConfigError("--procs-per-node: required on CPU nodes (--gpus-per-node 0): processes per node")
        if gpus is None:
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
        # disaggregated: the first node's leader starts the servers on GPUs the trainer does not use
        needed = sglang.base_gpu_id + sglang.num_servers * sglang.tp_size
        if needed > procs.gpus_per_node:
            raise ConfigError(
                f"rollout.sglang: {sglang.num_servers} server(s) x tp_size {sglang.tp_size} from GPU "
                f"{sglang.base_gpu_id} "
                f"need GPUs 0..{needed - 1} of the first node, which has {procs.gpus_per_node} (--gpus-per-node)"
            )
        if not sglang.colocated and sglang.base_gpu_id < procs.per_node:
            raise ConfigError(
                f"rollout.sglang.base_gpu_id: {sglang.base_gpu_id} puts servers on the trainer's GPUs "
                f"0..{procs.per_node - 1}; "
                f"set it to >= {procs.per_node} or set rollout.sglang.placement: colocated"
            )
    spare = procs.gpus_per_node - procs.per_node
    if spare > 0 and not (launching and not cfg.rollout.sglang.colocated):
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
        given = [flag for flag, value in slurm_only.items() if value]
        given += [
            flag
            for flag, value in (("--signal-lead", options.signal_lead), ("--max-requeues", options.max_requeues))
            if value is not None
        ]
        if given:
            raise ConfigError(f"{given[0]}: only for --executor slurm")
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
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
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


# ---- the NeMo-Run job -----------------------------------------------------------------------


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


def _slurm_executor(run, options: SubmitOptions, sub: Submission):
    from stapo_megatron.launch.nemo import ResolvedConfigPackager

    if options.tunnel == "ssh":
        tunnel = run.SSHTunnel(
            host=options.host,
            user=options.user,
            job_dir=options.remote_job_dir,
            identity=options.identity,
            port=options.port,
        )
    else:
        from nemo_run.config import get_nemorun_home

        # the job directory (logs, config) lies under it and appears unquoted in the script
        check_unquoted("NEMORUN_HOME", get_nemorun_home())
        # a local tunnel copies nothing: it must use NeMo-Run's own experiments folder ("")
        tunnel = run.LocalTunnel(job_dir="")
    srun_args = []
    workdir = workdir_for(options)
    if workdir:
        # srun takes the last of repeated options: this overrides NeMo-Run's own --chdir / workdir.
        # NeMo-Run writes srun arguments unquoted, so the value is quoted here.
        flag = "--container-workdir" if options.container_image else "--chdir"
        srun_args.append(f"{flag}={shlex.quote(workdir)}")
    return run.SlurmExecutor(
        account=options.account,
        partition=options.partition,
        nodes=sub.processes.nodes,
        ntasks_per_node=sub.processes.per_node,  # the torchrun launcher turns this into nproc-per-node
        gpus_per_node=sub.processes.gpus_per_node or None,  # CPU nodes: request no GPUs
        cpus_per_task=options.cpus_per_task,
        exclusive=True if options.exclusive else None,
        time=options.time,
        signal=f"B:USR1@{signal_lead_s(options)}",  # to the batch shell: see launch/requeue.py
        container_image=options.container_image,
        container_mounts=parse_mounts(options.mounts),
        env_vars=job_environment(options, for_shell=True),
        srun_args=srun_args or None,
        tunnel=tunnel,
        packager=ResolvedConfigPackager(config_yaml=sub.config_yaml),
        launcher="torchrun",
        job_name_prefix=JOB_NAME_PREFIX,
    )


def _batch_shell_run_dir(options: SubmitOptions, sub: Submission, cluster_job_dir: str) -> str:
    """The run directory as the batch script sees it (launch/requeue.py)."""
    from stapo_megatron.launch.nemo import JOB_DIR_IN_SCRIPT

    return run_dir_for_batch_shell(
        str(sub.cfg.run.directory),
        workdir_for(options) or f"{JOB_DIR_IN_SCRIPT}/code",  # where the ranks run: a relative run directory is there
        [f"{cluster_job_dir}:{JOB_DIR_IN_SCRIPT}", *(parse_mounts(options.mounts) if options.container_image else [])],
        in_container=bool(options.container_image),
    )


def _add_requeue_lines(executor, options: SubmitOptions, sub: Submission) -> None:
    """The batch script's USR1 trap and requeue (launch/requeue.py), once NeMo-Run has placed the job."""
    # the job directory on the cluster, as NeMo-Run lays it out (<tunnel job dir>/<job dir name>)
    cluster_job_dir = os.path.join(executor.tunnel.job_dir, os.path.basename(executor.job_dir))
    run_dir = _batch_shell_run_dir(options, sub, cluster_job_dir)
    executor.setup_lines = batch_script_lines(run_dir, signal_lead_s(options), max_requeues(options))


def _slurm_task(run):
    from stapo_megatron.launch.nemo import CONFIG_NAME, JOB_DIR_IN_SCRIPT

    # `stapo train` inside torchrun is one rank (RANK and WORLD_SIZE are set)
    return run.Script(
        path="stapo_megatron.cli",
        args=["train", "--config", f"{JOB_DIR_IN_SCRIPT}/{CONFIG_NAME}"],
        entrypoint="python",
        m=True,
    )


def local_script(sub: Submission, workdir: str) -> str:
    """The local job: write the resolved config into its job directory, then `stapo train` on it."""
    from stapo_megatron.launch.nemo import CONFIG_NAME

    if _CONFIG_EOF in sub.config_yaml:
        raise ConfigError(f"config: contains the line {_CONFIG_EOF}, which ends the job script's here-document")
    return "\n".join(
        [
            "set -euo pipefail",
            # NeMo-Run writes this script to <job dir>/scripts/
            'job_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"',
            f"cat > \"$job_dir/{CONFIG_NAME}\" <<'{_CONFIG_EOF}'",
            sub.config_yaml.rstrip("\n"),
            _CONFIG_EOF,
            f"cd {shlex.quote(workdir)}",
            f'exec {shlex.quote(sys.executable)} -m stapo_megatron.cli train --config "$job_dir/{CONFIG_NAME}"',
            "",
        ]
    )


def _job_id(handle: str | None) -> str:
    """The scheduler's job id from a NeMo-Run app handle (<scheduler>://<session>/<id>)."""
    if not handle:
        return ""
    return handle.partition("://")[2].split("/")[-1]


def submit(options: SubmitOptions) -> int:
    sub = prepare(options)
    for note in sub.notes:
        logger.warning("%s", note)
    run = import_nemo_run("stapo submit")
    if options.executor == "slurm":
        _batch_shell_run_dir(
            options, sub, cluster_job_dir="/"
        )  # an unreachable run directory: refused before any experiment
    with nemo_console_to_stderr():
        if options.executor == "slurm":
            executor, task = _slurm_executor(run, options, sub), _slurm_task(run)
        else:
            executor = run.LocalExecutor(env_vars=job_environment(options, for_shell=False))
            workdir = workdir_for(options)
            assert workdir is not None  # the local executor always runs in a directory of this file system
            task = run.Script(inline=local_script(sub, workdir))
        # the id is NeMo-Run's own scheme (<title>_<ns>), made here so stapo can print it
        exp_id = f"{sub.title}_{time.time_ns()}"
        exp = run.Experiment(
            sub.title,
            executor=executor,
            id=exp_id,
            log_level="WARN",
            enable_goodbye_message=False,
            skip_status_at_exit=True,
        )
        with exp:
            exp.add(task, name=sub.title)
            job = exp.jobs[0]
            if options.executor == "slurm":
                _add_requeue_lines(job.executor, options, sub)
            if options.dryrun:
                exp.dryrun(log=False, delete_exp_dir=False)
                shown = _dryrun_text(options, job)
                shutil.rmtree(job.executor.experiment_dir, ignore_errors=True)
                with contextlib.suppress(OSError):  # the job name's folder, unless other experiments are in it
                    os.rmdir(os.path.dirname(job.executor.experiment_dir))
            else:
                exp.run(detach=options.executor == "slurm" and not options.wait)
    if options.dryrun:
        print(shown, end="" if shown.endswith("\n") else "\n")
        return 0
    job_id = _job_id(job.handle)
    print(f"experiment {exp_id}: {options.executor} job {job_id}, job directory {job.executor.job_dir}")
    print(f"  stapo status {exp_id}    (NeMo-Run: nemo experiment status {exp_id})")
    print(f"  stapo logs {exp_id}      (NeMo-Run: nemo experiment logs {exp_id} 0)")
    if options.executor == "local" or options.wait:
        state = str(job.state).rsplit(".", 1)[-1]
        print(f"finished: {state}")
        if state != "SUCCEEDED":
            print(f"stapo: error: job {job_id} ended {state}; see stapo logs {exp_id}", file=sys.stderr)
            return 1
    return 0


def _dryrun_text(options: SubmitOptions, job) -> str:
    executor = job.executor
    if options.executor == "slurm":
        with open(os.path.join(executor.experiment_dir, f"{executor.job_name}_sbatch.sh"), encoding="utf-8") as f:
            return f.read()
    # the local job is the inline script NeMo-Run wrote into the job directory
    from nemo_run.config import SCRIPTS_DIR

    with open(os.path.join(executor.job_dir, SCRIPTS_DIR, f"{job.id}.sh"), encoding="utf-8") as f:
        return f.read()


# ---- the command ----------------------------------------------------------------------------


def submit_command() -> CommandConfig:
    return CommandConfig(
        "submit",
        SubmitConfig,
        FLAGS,
        section=SUBMIT_SECTION,
        note="The other dotted overrides and the rest of --config are the training config, as for stapo train "
        "(stapo config --docs).",
    )


def options_from_args(args) -> tuple[SubmitOptions, FieldNames]:
    """The submission and the names of its fields as the user spelled them."""
    loaded = load_command(submit_command(), args)
    own = {f.name: getattr(loaded.cfg, f.name) for f in dataclasses.fields(SubmitConfig)}
    return SubmitOptions(**own, config=args.config, overrides=loaded.train_overrides), loaded.names


def run_submit(args) -> None:
    options, names = options_from_args(args)
    with names.renaming():
        code = submit(options)
    if code:
        raise SystemExit(code)


_FLAG_KINDS: dict[str, FlagKind] = {
    "exclusive": "true",
    "mounts": "append",
    "env": "append",
    "dryrun": "true",
    "wait": "true",
}
FLAGS = tuple(
    Flag(f"--{f.name.replace('_', '-')}", f"{SUBMIT_SECTION}.{f.name}", kind=_FLAG_KINDS.get(f.name, "value"))
    for f in dataclasses.fields(SubmitConfig)
    if f.name != "check_files"
) + (
    Flag("--check-files", f"{SUBMIT_SECTION}.check_files", kind="true"),
    Flag("--no-check-files", f"{SUBMIT_SECTION}.check_files", kind="false"),
)


def register(subparsers) -> None:
    register_command_config("submit", submit_command)
    parser = subparsers.add_parser(
        "submit",
        help="submit stapo train to SLURM (or run it locally) through NeMo-Run",
        description="Check a training config, copy it resolved into a NeMo-Run job directory and run `stapo train` "
        "on it with SLURM (torchrun launcher) or locally.",
    )
    add_command_arguments(
        parser,
        submit_command(),
        config_help="training config (default: the packaged tiny_cpu.yaml); its submit: section holds these fields",
        overrides_help="dotted overrides: submit.FIELD=VALUE, or a training config field as for stapo train "
        "(e.g. run.steps=100)",
    )
    parser.set_defaults(func=run_submit)
