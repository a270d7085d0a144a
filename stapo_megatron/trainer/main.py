"""One training rank, as torchrun starts it: ``python -m stapo_megatron.trainer.main --config FILE``."""

from __future__ import annotations

import argparse
import sys

from stapo_megatron.config.command import run_command


def main(argv: list[str] | None = None) -> int:
    from stapo_megatron.runtime import console
    from stapo_megatron.trainer.launcher import load_train_config, run_rank

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)

    def run(args) -> None:
        console.configure()  # the rank torchrun gave; run_rank applies logging.all_ranks
        run_rank(load_train_config(args.config, args.overrides))

    return run_command(run, args)


if __name__ == "__main__":
    sys.exit(main())
