"""``stapo plot`` and ``stapo inspect``: look at a run."""

from __future__ import annotations


def run_plot(args) -> None:
    from stapo_megatron.trainer.plot import plot_runs

    print(f"wrote {plot_runs(args.run_dirs, args.out, args.window)}")


def run_inspect(args) -> None:
    from stapo_megatron.trainer.inspector import summarize

    print(summarize(args.run_dir, top=args.top, examples=args.examples))


def register(subparsers) -> None:
    plot = subparsers.add_parser("plot", help="PNG curves of one or more runs (reward, entropy, masked fraction, length)")
    plot.add_argument("run_dirs", nargs="+", help="run directories (with metrics.jsonl)")
    plot.add_argument("--out", default=None, help="PNG to write (default: <first run>/curves.png)")
    plot.add_argument("--window", type=int, default=10, help="moving-average window in steps")
    plot.set_defaults(func=run_plot)
    inspect = subparsers.add_parser("inspect", help="the most frequently silenced tokens of a run, with contexts")
    inspect.add_argument("run_dir")
    inspect.add_argument("--top", type=int, default=20, help="tokens to list")
    inspect.add_argument("--examples", type=int, default=3, help="example contexts per token")
    inspect.set_defaults(func=run_inspect)
