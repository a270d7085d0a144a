"""``stapo train``: load and check the config, then run the ranks (starting them when needed).

Inside an existing launch (torchrun, or SLURM through NeMo-Run's torchrun) this process is one
rank. Otherwise ``stapo train`` starts torchrun with one process per rank in a session of its
own: Ctrl-C then asks the ranks to stop after the current step and write a checkpoint (a second
Ctrl-C stops them at once).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from importlib import resources
from pathlib import Path

import yaml

from stapo_megatron.config import load_config, to_dict
from stapo_megatron.runtime.launch import kill_tree
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.validation import check_train_config

DEFAULT_CONFIG = "tiny_cpu.yaml"
RESOLVED_CONFIG = "config.yaml"


def default_config_path() -> Path:
    return Path(str(resources.files("stapo_megatron.configs") / DEFAULT_CONFIG))


def load_train_config(path: str | os.PathLike | None, overrides: list[str]) -> TrainConfig:
    """The validated config; every check that needs no process group runs here."""
    cfg = load_config(TrainConfig, path or default_config_path(), overrides)
    check_train_config(cfg)
    return cfg


def _inside_launch() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def write_resolved_config(cfg: TrainConfig) -> Path:
    directory = cfg.run.directory
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RESOLVED_CONFIG
    temporary = path.with_suffix(".yaml.tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    os.replace(temporary, path)
    return path


def run_rank(cfg: TrainConfig) -> None:
    from stapo_megatron.trainer.trainer import Trainer

    Trainer(cfg).train()


def launch(cfg: TrainConfig, resolved: Path) -> int:
    """Start torchrun for ``cfg``'s world size and wait. The first Ctrl-C (or SIGTERM) asks the
    ranks to stop after the current step and checkpoint; the second kills them."""
    world = cfg.parallel.world_size
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        "-m", "stapo_megatron.trainer.main", "--config", str(resolved),
    ]
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    process = subprocess.Popen(command, env=env, start_new_session=True)
    stop_file = cfg.run.directory / "STOP"
    signals = []

    def on_signal(signum, frame):
        signals.append(signum)
        if len(signals) == 1:
            print("\n[stapo] stopping after the current step (checkpoint follows); Ctrl-C again to kill", file=sys.stderr, flush=True)
            stop_file.touch()
        else:
            kill_tree(process.pid)

    # Set explicitly: a shell that starts this in the background would otherwise leave SIGINT ignored.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_train(args) -> None:
    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={args.resume}")
    cfg = load_train_config(args.config, overrides)
    if _inside_launch():
        run_rank(cfg)
        return
    resolved = write_resolved_config(cfg)
    if cfg.parallel.world_size == 1:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        from stapo_megatron.runtime.launch import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
        run_rank(cfg)
        return
    code = launch(cfg, resolved)
    if code:
        raise SystemExit(code)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train with STAPO (or a baseline); default: the tiny CPU run",
        description="Train a Qwen3 policy. Without --config: the embedded tiny CPU configuration.",
    )
    parser.add_argument("--config", default=None, help=f"YAML config (default: the packaged {DEFAULT_CONFIG})")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", dest="resume", action="store_const", const="required",
                        help="continue from the run's latest complete checkpoint; fail if there is none "
                             "(default: continue when one exists)")
    resume.add_argument("--no-resume", dest="resume", action="store_const", const="never",
                        help="start from the initial weights even if the run has checkpoints")
    parser.set_defaults(resume=None)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo=grpo optim.lr=2e-6 run.steps=100")
    parser.set_defaults(func=run_train)
