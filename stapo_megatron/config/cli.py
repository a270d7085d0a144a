"""``stapo config``: show a resolved training config, or every field of a command's config with its documentation.

The commands' configs come from the registry their own modules fill when they register
(:func:`stapo_megatron.config.command.register_command_config`); nothing here imports them.
"""

from __future__ import annotations

import yaml

from stapo_megatron.config.command import command_config, load_training_config
from stapo_megatron.config.core import ConfigError, to_dict

DEFAULT_COMMAND = "train"


def run_config(args) -> None:
    command = command_config(args.docs or DEFAULT_COMMAND)
    if args.docs:
        rows = [r for r in command.rows() if not args.section or r[0].startswith(args.section + ".")]
        if not rows:
            raise ConfigError(f"--section: {args.docs} has no section {args.section!r}")
        for name, type_name, default, doc in rows:
            print(f"{name}  ({type_name}, default {default})\n    {doc}")
        return
    cfg = load_training_config(command.cls, args.config or command.default_file(), args.overrides)
    print(yaml.safe_dump(to_dict(cfg, redact=True), sort_keys=False), end="")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "config",
        help="print a resolved training config, or (--docs [COMMAND]) every field of a command with its documentation",
    )
    parser.add_argument("--config", default=None, help="YAML config (default: the packaged tiny CPU run)")
    parser.add_argument(
        "--docs",
        nargs="?",
        const=DEFAULT_COMMAND,
        default=None,
        metavar="COMMAND",
        help=f"list every field of COMMAND's config (default {DEFAULT_COMMAND}): type, default, documentation",
    )
    parser.add_argument("--section", default=None, help="with --docs: only this section, e.g. algo")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo=grpo")
    parser.set_defaults(func=run_config)
