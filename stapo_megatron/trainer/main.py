"""One training rank, as torchrun starts it: ``python -m stapo_megatron.trainer.main --config FILE``."""

from __future__ import annotations

import argparse
import sys

from stapo_megatron.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    from stapo_megatron.trainer.launcher import load_train_config, run_rank

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    try:
        run_rank(load_train_config(args.config, args.overrides))
    except ConfigError as err:
        print(f"stapo: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
