"""``stapo status`` and ``stapo logs``: NeMo-Run's experiment records, reopened by id.

``stapo submit`` names each experiment ``<job name>_<time in ns>``; NeMo-Run keeps it in
``$NEMORUN_HOME/experiments/<job name>/<id>`` (NEMORUN_HOME defaults to ~/.nemo_run), and
``run.Experiment.from_id`` rebuilds it from there: executor, tunnel, job handle. A job name in
place of an id means its latest experiment. NeMo-Run's own CLI reads the same records:
``nemo experiment status <id>``, ``nemo experiment logs <id> 0``, ``nemo experiment cancel <id> 0``.
"""

from __future__ import annotations

import json
import os
import sys

from stapo_megatron.config import ConfigError
from stapo_megatron.config.command import int_in
from stapo_megatron.launch.submit import (
    import_nemo_run,
    job_id_from_handle,
    nemo_console_to_stderr,
)


def experiments_root() -> str:
    from nemo_run.config import get_nemorun_home

    return os.path.join(get_nemorun_home(), "experiments")


def open_experiment(run, name: str):
    """The experiment with this id, or the latest one of this job name."""
    root = experiments_root()
    title = name.rpartition("_")[0]
    if title and os.path.isdir(os.path.join(root, title, name)):
        return run.Experiment.from_id(name)
    parent = os.path.join(root, name)
    if os.path.isdir(parent) and any(os.path.isdir(os.path.join(parent, d)) for d in os.listdir(parent)):
        return run.Experiment.from_title(name)
    raise ConfigError(f"experiment: no experiment or job name {name!r} under {root}")


def list_experiments(root: str) -> list[tuple[float, str, str]]:
    """(creation time, job name, id) of every experiment, oldest first."""
    found = []
    if os.path.isdir(root):
        for title in os.listdir(root):
            for exp_id in os.listdir(os.path.join(root, title)) if os.path.isdir(os.path.join(root, title)) else []:
                path = os.path.join(root, title, exp_id)
                if os.path.isdir(path):
                    found.append((os.path.getctime(path), title, exp_id))
    return sorted(found)


def experiment_status(name: str) -> dict:
    """{'id', 'jobs': [{'name', 'state', 'job_id', 'local_dir', 'remote_dir'}]} of one experiment."""
    run = import_nemo_run("stapo status")
    with nemo_console_to_stderr():
        exp = open_experiment(run, name)
        table = exp.status(return_dict=True) or {}
    jobs = []
    for job_name, info in table.items():
        jobs.append(
            {
                "name": job_name,
                "state": str(info.get("status")).rsplit(".", 1)[-1],
                "job_id": info.get("job_id") or job_id_from_handle(info.get("handle")),
                "local_dir": info.get("local_dir"),
                "remote_dir": info.get("remote_dir"),
            }
        )
    exp_id = os.path.basename(os.path.dirname(exp.jobs[0].executor.job_dir)) if exp.jobs else name
    return {"id": exp_id, "jobs": jobs}


def run_status(args) -> None:
    if not args.experiment:
        import_nemo_run("stapo status")
        root = experiments_root()
        rows = list_experiments(root)
        if not rows:
            print(f"no experiments under {root}")
            return
        for *_, exp_id in rows[-args.last :]:
            print(exp_id)
        return
    status = experiment_status(args.experiment)
    if args.json:
        print(json.dumps(status, indent=2))
        return
    print(f"experiment {status['id']}")
    for job in status["jobs"]:
        print(f"  {job['name']}: {job['state']}  job {job['job_id']}  dir {job['remote_dir'] or job['local_dir']}")


def run_logs(args) -> None:
    run = import_nemo_run("stapo logs")
    with nemo_console_to_stderr():
        exp = open_experiment(run, args.experiment)
        jobs = exp.jobs
        if not 0 <= args.job < len(jobs):
            raise ConfigError(f"--job: experiment {args.experiment} has {len(jobs)} job(s), no index {args.job}")
        # NeMo-Run streams the job's log files (found through its scheduler) to stderr
        exp.logs(job_id=jobs[args.job].id, regex=args.regex)
    sys.stderr.flush()


def register(subparsers) -> None:
    status = subparsers.add_parser(
        "status",
        help="state of submitted experiments (NeMo-Run)",
        description="Without an id: the latest experiments' ids. With one (or a job name, meaning its latest): "
        "each job's state, scheduler job id and directory.",
    )
    status.add_argument("experiment", nargs="?", default=None, help="experiment id or job name")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument(
        "--last", type=int_in(1, 1_000_000), default=20, help="how many experiments to list (default 20)"
    )
    status.set_defaults(func=run_status)
    logs = subparsers.add_parser(
        "logs",
        help="logs of a submitted experiment (NeMo-Run)",
        description="Print the job's log (all ranks, through torchrun's --tee) to stderr.",
    )
    logs.add_argument("experiment", help="experiment id or job name")
    logs.add_argument("--job", type=int_in(0, 1_000_000), default=0, help="job index in the experiment (default 0)")
    logs.add_argument("--regex", default=None, help="only lines matching this regular expression")
    logs.set_defaults(func=run_logs)
