"""The ``stapo`` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from stapo_megatron.config.command import run_command
from stapo_megatron.runtime import console


def build_parser() -> argparse.ArgumentParser:
    from stapo_megatron.checkpoint import cli as convert_cli
    from stapo_megatron.config import cli as config_cli
    from stapo_megatron.eval import cli as eval_cli
    from stapo_megatron.experiment import cli as experiment_cli
    from stapo_megatron.launch import cli as launch_cli
    from stapo_megatron.launch import train_cli
    from stapo_megatron.trainer import inspect_cli, plot_cli

    parser = argparse.ArgumentParser(prog="stapo", description="STAPO reinforcement learning of Qwen3 on Megatron-Core")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in (train_cli, convert_cli, eval_cli, plot_cli, inspect_cli, config_cli, launch_cli, experiment_cli):
        module.register(subparsers)
    return parser


def run(func, args) -> int:
    """Run a command: a configuration error is one line and exit status 2, an interrupt 130."""

    def configured(args) -> None:
        # inside the one-line error handling: a bad RANK or STAPO_LOG_ALL_RANKS is one line too
        console.configure()  # the messages' channel (stderr); a command's product goes to stdout
        func(args)

    try:
        return run_command(configured, args)
    except KeyboardInterrupt:
        print("stapo: interrupted", file=sys.stderr)
        return 130


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Dotted overrides may come before, between and after the flags (``stapo train a=b --no-resume
    c=d``). argparse fills a command's ``overrides`` with the first run of them only and leaves
    the later ones over; they are appended, in order."""
    parser = build_parser()
    args, left_over = parser.parse_known_args(argv)
    if left_over:
        if not hasattr(args, "overrides") or any(item.startswith("-") for item in left_over):
            parser.error(f"unrecognized arguments: {' '.join(left_over)}")
        args.overrides = [*args.overrides, *left_over]
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            args = parse_args(argv)
            return run(args.func, args)
        finally:
            sys.stdout.flush()  # a reader that left (``stapo config --docs | head``) shows up here at the latest
    except BrokenPipeError:
        # The reader has what it wanted. Python would try the flush again at exit and print a
        # traceback, so what is left of stdout goes nowhere; the status is a shell's for SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
