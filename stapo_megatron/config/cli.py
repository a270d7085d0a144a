"""``stapo config``: show a resolved training config, or every field with its documentation."""

from __future__ import annotations

import yaml

from stapo_megatron.config.core import describe, load_config, to_dict


def run_config(args) -> None:
    from stapo_megatron.trainer.config import TrainConfig
    from stapo_megatron.trainer.launcher import default_config_path

    if args.docs:
        rows = [r for r in describe(TrainConfig) if not args.section or r[0].startswith(args.section + ".")]
        for name, type_name, default, doc in rows:
            print(f"{name}  ({type_name}, default {default})\n    {doc}")
        return
    cfg = load_config(TrainConfig, args.config or default_config_path(), args.overrides)
    print(yaml.safe_dump(to_dict(cfg, redact=True), sort_keys=False), end="")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "config", help="print a resolved training config, or (--docs) every field with its documentation"
    )
    parser.add_argument("--config", default=None, help="YAML config (default: the packaged tiny CPU run)")
    parser.add_argument("--docs", action="store_true", help="list every field: type, default, documentation")
    parser.add_argument("--section", default=None, help="with --docs: only this section, e.g. algo")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo=grpo")
    parser.set_defaults(func=run_config)
