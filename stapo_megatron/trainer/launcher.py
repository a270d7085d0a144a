"""``stapo train``: load and check the config, then run the ranks (starting them when needed).

Inside an existing launch (torchrun, or SLURM through NeMo-Run's torchrun: the environment has
every variable of a rank, :func:`inside_launch`) this process is one rank. Otherwise ``stapo
train`` checks the run directory (a new, empty or run directory, see
:mod:`stapo_megatron.trainer.run_directory`) and the data, takes the run directory's lock (one run
per directory, see :mod:`stapo_megatron.runtime.run_lock`) and starts torchrun with one process per
rank in a session of its own, handing the ranks a private copy of the config in the run directory.
The ranks end when this process ends, however it ends; the private copy goes with it, or with the
next run's start after a SIGKILL. Ctrl-C asks the ranks to stop after the current step and write a
checkpoint; a second Ctrl-C stops them at once (exit status 130).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import yaml

from stapo_megatron.config import ConfigError, to_dict
from stapo_megatron.config.command import load_training_config
from stapo_megatron.runtime import console
from stapo_megatron.runtime.distributed import prepare_megatron_import
from stapo_megatron.runtime.environment import env_int, env_seconds, rank_launch_env
from stapo_megatron.runtime.launch import kill_tree, watch_launcher
from stapo_megatron.runtime.run_files import METRICS_FILE, RANKS_CONFIG, STOP_FILE, STOP_SIGNALS, write_resolved_config
from stapo_megatron.runtime.run_lock import TOKEN_ENV, RunLock, held_with, slurm_restart_count
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.run_directory import archive_run_outputs, check_run_directory, mark_run_directory
from stapo_megatron.trainer.validation import check_train_config

DEFAULT_CONFIG = "tiny_cpu.yaml"
LAUNCHER_PID_ENV = "STAPO_LAUNCHER_PID"
# Set by the requeue batch script (launch/requeue.py): a STOP file newer than this is a request of
# this allocation, made while the ranks were starting, not one left by an earlier run.
ALLOCATION_STARTED_ENV = "STAPO_ALLOCATION_STARTED"
# What every rank of a launch has: torchrun sets them all (and more), as does this project's
# spawn_ranks. A shell with only some of them has them left over from another launch.
_RANK_IDENTITY_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_LAUNCH_ENV = (*_RANK_IDENTITY_ENV, "MASTER_ADDR", "MASTER_PORT")
_MAX_WORLD = 1 << 20

logger = logging.getLogger(__name__)


def default_config_path() -> Path:
    return Path(str(resources.files("stapo_megatron.configs") / DEFAULT_CONFIG))


def load_train_config(path: str | os.PathLike | None, overrides: list[str]) -> TrainConfig:
    """The validated config; every check that needs no process group runs here."""
    cfg = load_training_config(TrainConfig, path or default_config_path(), overrides)  # plan:/submit: are theirs
    check_train_config(cfg)
    return cfg


def inside_launch() -> bool:
    """Whether this process is a rank of a launch: every variable of :data:`_LAUNCH_ENV` set, and
    consistent. Some of them without the others (a shell's left-overs of another launch) or values
    that disagree are a one-line :class:`ConfigError` naming them."""
    given = [name for name in _LAUNCH_ENV if name in os.environ]
    if not any(name in os.environ for name in _RANK_IDENTITY_ENV):
        return False  # MASTER_ADDR / MASTER_PORT alone: torchrun, started here, sets its own
    missing = [name for name in _LAUNCH_ENV if name not in os.environ]
    if missing:
        shown = ", ".join(f"{name}={os.environ[name]!r}" for name in given)
        raise ConfigError(
            f"environment: {shown} set, but not {', '.join(missing)}: left over from another launch? Unset "
            f"{' '.join(given)} to start the run here, or start it with torchrun"
        )
    world = env_int("WORLD_SIZE", low=1, high=_MAX_WORLD)
    rank = env_int("RANK", low=0, high=world - 1)
    env_int("LOCAL_RANK", low=0, high=rank)
    env_int("MASTER_PORT", low=1, high=65535)
    return True


def check_environment() -> bool:
    """Every variable ``stapo train`` reads from its environment, checked before any work starts;
    returns :func:`inside_launch`."""
    env_seconds(ALLOCATION_STARTED_ENV)
    slurm_restart_count()
    return inside_launch()


def check_data(cfg: TrainConfig) -> None:
    """Load the training prompts as rank 0 will, so that a bad data path, file or row fails here
    in seconds rather than after torchrun and the model have started."""
    from stapo_megatron.data.prompts import build_prompt_dataset, load_tokenizer
    from stapo_megatron.data.records import DataError

    try:
        tokenizer = load_tokenizer(cfg.data, cfg.hf_tokenizer_dir)
    except OSError as err:
        raise ConfigError(f"tokenizer: cannot load {cfg.hf_tokenizer_dir}: {str(err).splitlines()[0]}") from None
    try:
        build_prompt_dataset(cfg.data, tokenizer)
    except DataError as err:
        raise ConfigError(f"data.source: {str(err).splitlines()[0]}") from None


def _remove_stale_ranks_config(directory: Path) -> None:
    """The private config of a launcher killed with SIGKILL (no clean-up runs then)."""
    path = directory / RANKS_CONFIG
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{path}: not a regular file, so not the launcher's config; remove it yourself")
    path.unlink()
    logger.info("removed %s, the private config of a launcher that was killed", path)


def prepare_run_directory(cfg: TrainConfig, overwrite: bool) -> None:
    """Under the run's lock, before any rank reads the directory: mark it as a run directory
    (refusing one that is not), refuse to start a new run on top of an old run's checkpoints unless
    ``overwrite`` (which moves the old run's outputs to ``<run>/archive/<time>/``), and drop what
    an earlier run left: its stop request, its launcher's private config."""
    from stapo_megatron.trainer.checkpoint_directory import CheckpointDirectory, check_run_files
    from stapo_megatron.trainer.resume import check_resume_early

    directory = cfg.run.directory
    mark_run_directory(directory)
    _remove_stale_ranks_config(directory)
    steps = CheckpointDirectory(directory, cfg.checkpoint.keep_last).complete_steps()
    if cfg.checkpoint.resume == "never" and steps and not overwrite:
        raise ConfigError(
            f"{directory}: has checkpoints up to step {steps[-1]} of an earlier run; starting afresh on top of them "
            "mixes two runs: add --overwrite to move them to <run>/archive/ first, or choose another run.output_dir"
        )
    if overwrite:
        archive_run_outputs(directory)
    check_run_files(directory)  # damage found only at the first save would lose that step
    check_resume_early(cfg)  # a resume the ranks would refuse, refused before torchrun starts
    stop_file = directory / STOP_FILE
    if not stop_file.exists():
        return
    allocation_started = env_seconds(ALLOCATION_STARTED_ENV)
    if allocation_started is not None and stop_file.stat().st_mtime >= allocation_started:
        logger.info("%s: a stop request of this allocation (its time limit is near): one step, then stop", stop_file)
        return
    stop_file.unlink()
    logger.info("removed %s, a stop request left by an earlier run", stop_file)


@contextlib.contextmanager
def _rank_owns_directory(cfg: TrainConfig, overwrite: bool):
    """Rank 0 of an outside launch (torchrun, SLURM) takes the lock and prepares the directory;
    under ``stapo train``, whose token is in the environment, the launcher already did both."""
    if os.environ.get("RANK") != "0":
        yield
        return
    token = os.environ.get(TOKEN_ENV)
    if token:
        if not held_with(cfg.run.directory, token):
            raise ConfigError(
                f"{TOKEN_ENV}: names no lock held on {cfg.run.directory} (left over from another launch? unset it)"
            )
        yield
        return
    check_run_directory(cfg.run.directory)
    with RunLock.acquire(cfg.run.directory):
        prepare_run_directory(cfg, overwrite)
        yield


def run_rank(cfg: TrainConfig, overwrite: bool = False) -> None:
    prepare_megatron_import()  # the trainer's modules import Megatron
    from stapo_megatron.trainer.trainer import Trainer

    console.configure(all_ranks=cfg.logging.all_ranks)
    if LAUNCHER_PID_ENV in os.environ:
        watch_launcher(env_int(LAUNCHER_PID_ENV, low=1, high=2**31 - 1))
    with _rank_owns_directory(cfg, overwrite):
        Trainer(cfg).train()


def _write_ranks_config(cfg: TrainConfig) -> Path:
    """The ranks' config: this launcher's own copy (0600, made under the run's lock, so no other
    run can replace it), with every value the ranks need (secrets too, unlike <run>/config.yaml)."""
    path = cfg.run.directory / RANKS_CONFIG
    with open(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600), "w", encoding="utf-8") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    return path


def launch(cfg: TrainConfig, lock: RunLock) -> int:
    """Start torchrun for ``cfg``'s world size and wait; returns its exit status. The first
    Ctrl-C (or SIGTERM, or SIGHUP: a closed terminal, a dropped ssh session) asks the ranks to stop
    after the current step and checkpoint; the second
    kills them, and the status is then 128 + the signal."""
    world = cfg.parallel.world_size
    stop_file = cfg.run.directory / STOP_FILE
    signals = []

    def on_signal(signum, frame):
        signals.append(signum)
        if len(signals) == 1:
            logger.info("stopping after the current step (checkpoint follows); Ctrl-C again to kill")
            stop_file.touch()
        else:
            kill_tree(process.pid)

    ranks_config = _write_ranks_config(cfg)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "stapo_megatron.trainer.main",
        "--config",
        str(ranks_config),
    ]
    env = {
        **os.environ,
        **rank_launch_env(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        LAUNCHER_PID_ENV: str(os.getpid()),
        TOKEN_ENV: lock.holder.token,
    }
    try:
        process = subprocess.Popen(command, env=env, start_new_session=True)
        # Set explicitly: a shell that starts this in the background would otherwise leave SIGINT ignored.
        previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
        try:
            code = process.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            # A request that the killed ranks never read must not stop the next run.
            stop_file.unlink(missing_ok=True)
    finally:  # a SIGKILL skips this: the next run's prepare_run_directory removes it
        ranks_config.unlink(missing_ok=True)
    if len(signals) > 1:
        logger.error("killed by a second %s; no final checkpoint was written", signal.Signals(signals[-1]).name)
        return 128 + signals[-1]
    return code


# The summary's metrics: the mean over this many last steps, as the README quotes accuracy.
SUMMARY_STEPS = 10
_SUMMARY_METRICS = (
    ("reward/accuracy", "accuracy"),
    ("policy/entropy", "entropy"),
    ("s2t/masked_fraction", "masked fraction"),
)


def _newest_checkpoint(directory: Path) -> tuple[Path | None, int]:
    """The run's newest intact checkpoint and its step (0 without one)."""
    from stapo_megatron.checkpoint.cli import newest_intact_checkpoint

    checkpoint, _ = newest_intact_checkpoint(directory)
    return checkpoint, int(checkpoint.name.removeprefix("iter_")) if checkpoint else 0


def run_summary(cfg: TrainConfig) -> str:
    """Where a run stands and what it left: its final metrics, where its checkpoint, metrics, plots
    and silenced-token dumps are, and the commands to try next."""
    from stapo_megatron.trainer.inspector import DUMP_DIR
    from stapo_megatron.trainer.metrics import read_metrics

    directory = cfg.run.directory
    checkpoint, step = _newest_checkpoint(directory)
    if step >= cfg.run.steps:
        lines = [f"[stapo] run complete: step {step}/{cfg.run.steps} in {directory}"]
    else:
        lines = [
            f"[stapo] run stopped at step {step}/{cfg.run.steps} in {directory}; the same `stapo train` resumes it"
        ]
    rows = read_metrics(directory)[-SUMMARY_STEPS:]
    means = []
    for key, label in _SUMMARY_METRICS:
        values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
        if values:
            means.append(f"{label} {sum(values) / len(values):.4g}")
    if means:
        lines.append(f"  last {len(rows)} steps: {', '.join(means)}")
    plots = directory / "curves.png"
    dumps = sorted((directory / DUMP_DIR).glob("step_*.jsonl"))
    lines += [
        f"  checkpoint  {checkpoint or 'none'}",
        f"  metrics     {directory / METRICS_FILE}",
        f"  plots       {plots}" + ("" if plots.is_file() else " (drawn by stapo plot)"),
        f"  spurious    {directory / DUMP_DIR}/ ({len(dumps)} dumps; logging.inspect_every sets how often)",
        "next:",
        f"  stapo plot {directory}",
        f"  stapo inspect {directory}",
    ]
    if checkpoint:
        if not cfg.data.is_synthetic:  # the benchmarks are math problems: a synthetic-task model cannot read them
            lines.append(f"  stapo eval --model {checkpoint} --data-dir {cfg.eval.data_dir or 'BENCHMARK_DIR'}")
        lines.append(f"  stapo convert megatron-to-hf --ckpt {checkpoint} --out {directory / 'hf'}")
    return "\n".join(lines)


def _already_complete(cfg: TrainConfig) -> bool:
    """Whether the run's newest intact checkpoint is at ``run.steps`` already (said, with the summary)."""
    if cfg.checkpoint.resume == "never":
        return False
    _, step = _newest_checkpoint(cfg.run.directory)
    if step < cfg.run.steps:
        return False
    logger.info(
        "%s: already complete (step %d/%d), nothing to train "
        "(raise run.steps to train on, or --overwrite to start afresh)",
        cfg.run.directory,
        step,
        cfg.run.steps,
    )
    print(run_summary(cfg), flush=True)
    return True


def run_train(args, check_layout: Callable[[TrainConfig, str | os.PathLike | None], None] | None = None) -> None:
    """``stapo train``: one rank inside torchrun or SLURM, else the whole run from here.
    ``check_layout(cfg, config_path)`` runs before any rank or server starts."""
    # The run directory, checkpoints, configs and logs of this process and its ranks and servers:
    # this user's only (0700 directories, 0600 files).
    os.umask(0o077)
    if args.overwrite and args.resume == "required":
        raise ConfigError("--overwrite starts the run afresh; it cannot be combined with --resume")
    overrides = list(args.overrides)
    resume = "never" if args.overwrite else args.resume
    if resume is not None:
        overrides.append(f"checkpoint.resume={resume}")
    cfg = load_train_config(args.config, overrides)
    if check_environment():
        run_rank(cfg, args.overwrite)
        if os.environ["RANK"] == "0":
            print(run_summary(cfg), flush=True)
        return
    check_run_directory(cfg.run.directory)
    check_data(cfg)
    if check_layout is not None:
        check_layout(cfg, args.config)
    with RunLock.acquire(cfg.run.directory) as lock:
        prepare_run_directory(cfg, args.overwrite)
        if _already_complete(cfg):
            return
        write_resolved_config(cfg)
        if cfg.parallel.world_size > 1:
            code = launch(cfg, lock)
        else:
            from stapo_megatron.runtime.launch import become_single_rank

            become_single_rank()
            os.environ[TOKEN_ENV] = lock.holder.token
            run_rank(cfg)
            code = 0
    if code:
        raise SystemExit(code)
    print(run_summary(cfg), flush=True)
