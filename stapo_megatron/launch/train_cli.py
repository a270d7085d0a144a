"""``stapo train``'s command line: the layout checked (:mod:`stapo_megatron.launch.layout`), then the run
itself (:mod:`stapo_megatron.trainer.launcher`)."""

from __future__ import annotations

import argparse

from stapo_megatron.config.command import CommandConfig, format_fields, register_command_config
from stapo_megatron.config.core import ConfigError, parse_override


def train_command() -> CommandConfig:
    from stapo_megatron.trainer.config import TrainConfig
    from stapo_megatron.trainer.launcher import default_config_path

    return CommandConfig("train", TrainConfig, default_file=default_config_path)


def run_train_command(args) -> None:
    """``stapo train``, once the resume flags and a checkpoint.resume override are known to agree."""
    from stapo_megatron.launch.layout import check_node_layout
    from stapo_megatron.trainer.launcher import run_train

    flag, resume = (
        ("--overwrite", "never")
        if args.overwrite
        else ({"required": "--resume", "never": "--no-resume"}.get(args.resume), args.resume)
    )
    if resume is not None:
        for text in args.overrides:
            path, value = parse_override(text)
            if path == ["checkpoint", "resume"] and value != resume:
                raise ConfigError(f"{flag} and {text}: two values for checkpoint.resume; give one")
    run_train(args, check_layout=check_node_layout)


def register(subparsers) -> None:
    from stapo_megatron.trainer.launcher import DEFAULT_CONFIG

    register_command_config("train", train_command)
    parser = subparsers.add_parser(
        "train",
        help="train with STAPO (or a baseline); default: the tiny CPU run",
        description="Train a Qwen3 policy. Without --config: the embedded tiny CPU configuration.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"fields (dotted overrides: FIELD=VALUE):\n{format_fields(train_command())}",
    )
    parser.add_argument("--config", default=None, help=f"YAML config (default: the packaged {DEFAULT_CONFIG})")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        dest="resume",
        action="store_const",
        const="required",
        help="continue from the run's latest complete checkpoint; fail if there is none "
        "(default: continue when one exists); = checkpoint.resume=required",
    )
    resume.add_argument(
        "--no-resume",
        dest="resume",
        action="store_const",
        const="never",
        help="start from the initial weights even if the run has checkpoints; = checkpoint.resume=never",
    )
    parser.set_defaults(resume=None)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a run directory with checkpoints: move the earlier run's outputs (checkpoints, "
        "metrics, config.yaml, logs, dumps) to <run>/archive/<time>/ first; a directory that is not a run "
        "directory is refused, and what no run writes stays in place (implies --no-resume)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides, e.g. algo=grpo optim.lr=2e-6 run.steps=100 (before or after the flags)",
    )
    parser.set_defaults(func=run_train_command)
