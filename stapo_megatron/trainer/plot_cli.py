"""``stapo plot``'s command line; the curves themselves are :mod:`stapo_megatron.trainer.plot`."""

from __future__ import annotations


def run_plot(args) -> None:
    from stapo_megatron.trainer.plot import plot_runs

    print(f"wrote {plot_runs(args.run_dirs, args.out, args.window)}")


def register(subparsers) -> None:
    plot = subparsers.add_parser(
        "plot",
        help="PNG curves of one or more runs (reward, entropy and its quantiles, gradient-norm quadrants, "
        "masked fraction, length)",
    )
    plot.add_argument("run_dirs", nargs="+", help="run directories (with metrics.jsonl)")
    plot.add_argument("--out", default=None, help="PNG to write (default: <first run>/curves.png)")
    plot.add_argument("--window", type=int, default=10, help="moving-average window in steps")
    plot.set_defaults(func=run_plot)
