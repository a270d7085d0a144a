"""``stapo inspect``'s command line; the summary itself is :mod:`stapo_megatron.trainer.inspector`."""

from __future__ import annotations

from stapo_megatron.config.command import int_in, positive_int


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


def register(subparsers) -> None:
    inspect = subparsers.add_parser(
        "inspect", help="the most frequently silenced tokens of a run, with contexts, and its gradient-norm quadrants"
    )
    inspect.add_argument("run_dir")
    inspect.add_argument("--top", type=int_in(1, 1_000_000), default=20, help="tokens to list")
    inspect.add_argument("--examples", type=int_in(0, 10_000), default=3, help="example contexts per token")
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
        help="most rows of the per-step comparison and of the quadrant table; more steps are grouped into ranges",
    )
    inspect.set_defaults(func=run_inspect)
