"""``stapo train``: load and check the config, then run the ranks (starting them when needed).

Inside an existing launch (torchrun, or SLURM through NeMo-Run's torchrun) this process is one
rank. Otherwise ``stapo train`` checks the data, takes the run directory's lock (one run per
directory, see :mod:`stapo_megatron.runtime.run_lock`) and starts torchrun with one process per
rank in a session of its own, handing the ranks a private copy of the config. The ranks end when
this process ends, however it ends. Ctrl-C asks the ranks to stop after the current step and
write a checkpoint; a second Ctrl-C stops them at once (exit status 130).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import yaml

from stapo_megatron.config import ConfigError, to_dict
from stapo_megatron.config.command import load_training_config
from stapo_megatron.runtime import console
from stapo_megatron.runtime.launch import kill_tree, watch_launcher
from stapo_megatron.runtime.run_files import atomic_open
from stapo_megatron.runtime.run_lock import GUARD_FILE, LOCK_FILE, TOKEN_ENV, RunLock
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.validation import check_train_config

DEFAULT_CONFIG = "tiny_cpu.yaml"
RESOLVED_CONFIG = "config.yaml"
STOP_FILE = "STOP"
ARCHIVE_DIR = "archive"
LAUNCHER_PID_ENV = "STAPO_LAUNCHER_PID"
# Set by the requeue batch script (launch/requeue.py): a STOP file newer than this is a request of
# this allocation, made while the ranks were starting, not one left by an earlier run.
ALLOCATION_STARTED_ENV = "STAPO_ALLOCATION_STARTED"
# What belongs to the directory rather than to one run: kept in place by --overwrite.
_DIRECTORY_ENTRIES = {ARCHIVE_DIR, LOCK_FILE, GUARD_FILE}

logger = logging.getLogger(__name__)


def default_config_path() -> Path:
    return Path(str(resources.files("stapo_megatron.configs") / DEFAULT_CONFIG))


def load_train_config(path: str | os.PathLike | None, overrides: list[str]) -> TrainConfig:
    """The validated config; every check that needs no process group runs here."""
    cfg = load_training_config(TrainConfig, path or default_config_path(), overrides)  # plan:/submit: are theirs
    check_train_config(cfg)
    return cfg


def _inside_launch() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def write_resolved_config(cfg: TrainConfig) -> Path:
    directory = cfg.run.directory
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RESOLVED_CONFIG
    with atomic_open(path) as f:
        yaml.safe_dump(to_dict(cfg, redact=True), f, sort_keys=False)  # for people: secrets hidden
    return path


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


def prepare_run_directory(cfg: TrainConfig, overwrite: bool) -> None:
    """Under the run's lock, before any rank reads the directory: refuse to start a new run on
    top of an old run's checkpoints unless ``overwrite`` (which moves the old run to
    ``<run>/archive/<time>/``), and drop a stop request left by an earlier run."""
    from stapo_megatron.trainer.checkpointing import Checkpointer

    directory = cfg.run.directory
    steps = Checkpointer(directory, cfg.checkpoint.keep_last).complete_steps()
    if cfg.checkpoint.resume == "never" and steps and not overwrite:
        raise ConfigError(
            f"{directory}: has checkpoints up to step {steps[-1]} of an earlier run; starting afresh on top of them "
            "mixes two runs: add --overwrite to move them to <run>/archive/ first, or choose another run.output_dir"
        )
    old = sorted(p for p in directory.iterdir() if p.name not in _DIRECTORY_ENTRIES) if overwrite else []
    if old:
        archive = directory / ARCHIVE_DIR / time.strftime("%Y%m%d-%H%M%S")
        archive.mkdir(parents=True)
        for entry in old:
            entry.rename(archive / entry.name)
        logger.info("--overwrite: moved the earlier run (%s) to %s", ", ".join(p.name for p in old), archive)
    stop_file = directory / STOP_FILE
    if not stop_file.exists():
        return
    allocation_started = os.environ.get(ALLOCATION_STARTED_ENV)
    if allocation_started and stop_file.stat().st_mtime >= float(allocation_started):
        logger.info("%s: a stop request of this allocation (its time limit is near): one step, then stop", stop_file)
        return
    stop_file.unlink()
    logger.info("removed %s, a stop request left by an earlier run", stop_file)


@contextlib.contextmanager
def _rank_owns_directory(cfg: TrainConfig, overwrite: bool):
    """Rank 0 of an outside launch (torchrun, SLURM) takes the lock and prepares the directory;
    under ``stapo train``, whose token is in the environment, the launcher already did both."""
    if os.environ.get("RANK") != "0" or os.environ.get(TOKEN_ENV):
        yield
        return
    with RunLock.acquire(cfg.run.directory):
        prepare_run_directory(cfg, overwrite)
        yield


def run_rank(cfg: TrainConfig, overwrite: bool = False) -> None:
    from stapo_megatron.trainer.trainer import Trainer

    console.configure(all_ranks=cfg.logging.all_ranks)
    if LAUNCHER_PID_ENV in os.environ:
        watch_launcher(int(os.environ[LAUNCHER_PID_ENV]))
    with _rank_owns_directory(cfg, overwrite):
        Trainer(cfg).train()


def _write_private_config(cfg: TrainConfig, directory: str) -> Path:
    """The ranks' config: this launcher's own copy (0600, in a 0700 directory) that no other run
    can replace, with every value the ranks need (secrets too, unlike <run>/config.yaml)."""
    path = Path(directory) / RESOLVED_CONFIG
    with open(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "w", encoding="utf-8") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    return path


def launch(cfg: TrainConfig, lock: RunLock) -> int:
    """Start torchrun for ``cfg``'s world size and wait; returns its exit status. The first
    Ctrl-C (or SIGTERM) asks the ranks to stop after the current step and checkpoint; the second
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

    with tempfile.TemporaryDirectory(prefix="stapo-launch-") as private:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            "-m",
            "stapo_megatron.trainer.main",
            "--config",
            str(_write_private_config(cfg, private)),
        ]
        env = {
            **os.environ,
            "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            LAUNCHER_PID_ENV: str(os.getpid()),
            TOKEN_ENV: lock.holder.token,
        }
        process = subprocess.Popen(command, env=env, start_new_session=True)
        # Set explicitly: a shell that starts this in the background would otherwise leave SIGINT ignored.
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = process.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            # A request that the killed ranks never read must not stop the next run.
            stop_file.unlink(missing_ok=True)
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
    from stapo_megatron.trainer.metrics import METRICS_FILE, read_metrics

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
    if _inside_launch():
        run_rank(cfg, args.overwrite)
        if os.environ["RANK"] == "0":
            print(run_summary(cfg), flush=True)
        return
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
