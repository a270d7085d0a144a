"""``stapo plot`` and ``stapo inspect``: look at a run."""

from __future__ import annotations

import argparse


def run_plot(args) -> None:
    from stapo_megatron.trainer.plot import plot_runs

    print(f"wrote {plot_runs(args.run_dirs, args.out, args.window)}")


def run_inspect(args) -> None:
    from stapo_megatron.trainer.inspector import summarize

    print(
        summarize(
            args.run_dir,
            top=args.top,
            examples=args.examples,
            per_step_top=args.per_step_top,
            max_step_rows=args.step_rows,
        )
    )


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(subparsers) -> None:
    plot = subparsers.add_parser(
        "plot", help="PNG curves of one or more runs (reward, entropy, masked fraction, length)"
    )
    plot.add_argument("run_dirs", nargs="+", help="run directories (with metrics.jsonl)")
    plot.add_argument("--out", default=None, help="PNG to write (default: <first run>/curves.png)")
    plot.add_argument("--window", type=int, default=10, help="moving-average window in steps")
    plot.set_defaults(func=run_plot)
    inspect = subparsers.add_parser("inspect", help="the most frequently silenced tokens of a run, with contexts")
    inspect.add_argument("run_dir")
    inspect.add_argument("--top", type=int, default=20, help="tokens to list")
    inspect.add_argument("--examples", type=int, default=3, help="example contexts per token")
    inspect.add_argument(
        "--per-step-top",
        type=positive_int,
        default=5,
        help="tokens listed per row of the per-step comparison with the paper's token classes",
    )
    inspect.add_argument(
        "--step-rows",
        type=positive_int,
        default=20,
        help="most rows of the per-step comparison; more dumps are grouped into step ranges",
    )
    inspect.set_defaults(func=run_inspect)
