"""``stapo submit``: run ``stapo train`` with a checked config on SLURM or locally, through NeMo-Run.

The config is loaded and checked (:mod:`.submission`) exactly as ``stapo train`` checks it, then
written, resolved (every default filled in), into the job directory; the job runs ``stapo train
--config`` on that file. What runs on the cluster is therefore the run that ``stapo train`` would start here.

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
import shlex
import shutil
import sys
import time

from stapo_megatron.config import ConfigError
from stapo_megatron.config.command import (
    CommandConfig,
    FieldNames,
    Flag,
    FlagKind,
    add_command_arguments,
    load_command,
    register_command_config,
)
from stapo_megatron.launch.requeue import batch_script_lines, run_dir_for_batch_shell
from stapo_megatron.launch.submission import (
    Submission,
    SubmitConfig,
    SubmitOptions,
    check_unquoted,
    job_environment,
    max_requeues,
    parse_mounts,
    prepare,
    signal_lead_s,
    workdir_for,
)

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'stapo_megatron[launch]' (nemo-run with leptonai==0.27.3)"
# NeMo-Run names the sbatch job <prefix><job name>; its status parser splits on the last dot.
JOB_NAME_PREFIX = "stapo."
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


# ---- the NeMo-Run job -----------------------------------------------------------------------


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


def job_id_from_handle(handle: str | None) -> str:
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
    job_id = job_id_from_handle(job.handle)
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
