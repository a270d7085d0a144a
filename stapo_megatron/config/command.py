"""One front-end for every command: ``--config FILE``, dotted overrides and short flags, into the
command's own validated dataclass.

A command declares its dataclass and a table of :class:`Flag` aliases (``--data-dir DIR`` is
``eval.data_dir=DIR``). Precedence: the dataclass defaults, the command's own defaults, the file,
then the command line (dotted overrides and flags alike); a flag and its dotted field given
together with different values is an error naming both. Errors about a field name it as the user
spelled it: by its flag when the flag set it or nothing did, by its dotted name otherwise.

``stapo plan`` and ``stapo submit`` read a training config: their own fields live in its
``plan:`` / ``submit:`` section (which every reader of the training config leaves to them, see
:func:`load_training_config`), the rest is the training config.

Each command module registers its dataclass with :func:`register_command_config`, so that
``stapo config --docs <command>`` lists it without importing any command here.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from stapo_megatron.config.core import (
    ConfigError,
    apply_overrides,
    build,
    coerce,
    describe,
    parse_override,
    read_yaml,
    set_field,
)

FlagKind = Literal["value", "true", "false", "bool", "list", "append"]


@dataclasses.dataclass(frozen=True)
class Flag:
    """A short command-line spelling of a field.

    kind: ``value`` (``--flag VALUE``), ``true``/``false`` (``--flag`` alone sets the field to
    true/false), ``bool`` (``--flag``/``--no-flag``), ``list`` (``--flag A B ...``), ``append``
    (``--flag A --flag B``). ``parse`` turns the flag's text into field values, for a flag that is
    not the field's plain text (``--k 8,aime24=16`` sets ``eval.k`` and ``eval.k_by_benchmark``).
    """

    flag: str
    field: str
    kind: FlagKind = "value"
    parse: Callable[[str], dict[str, Any]] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return "flag_" + self.flag.lstrip("-").replace("-", "_")

    def values(self, parsed: Any) -> dict[str, Any]:
        """The field values of what argparse parsed for this flag."""
        return self.parse(parsed) if self.parse else {self.field: parsed}

    def spelled(self, parsed: Any) -> str:
        """How the user wrote it, for error messages."""
        if self.kind in ("true", "false"):
            return self.flag
        if self.kind == "bool":
            return self.flag if parsed else "--no-" + self.flag[2:]
        shown = " ".join(map(str, parsed)) if isinstance(parsed, list) else parsed
        return f"{self.flag} {shown}"


@dataclasses.dataclass(frozen=True)
class CommandConfig:
    """A command's configuration: its dataclass, the key its fields live under, its flags."""

    name: str
    cls: type
    flags: tuple[Flag, ...] = ()
    section: str = ""  # "plan": the fields are plan.* of a training config
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # dotted field -> default of this command
    note: str = ""  # said under the field list, e.g. that the rest is the training config
    default_file: Callable[[], Any] = lambda: None  # the config file used without --config (train: the tiny CPU run)

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(dotted name, type, default, doc) of every field, with this command's defaults."""
        rows = describe(self.cls, f"{self.section}." if self.section else "")
        return [
            (name, tp, repr(self.defaults[name]) if name in self.defaults else default, doc)
            for name, tp, default, doc in rows
        ]


_COMMANDS: dict[str, Callable[[], CommandConfig]] = {}


def register_command_config(name: str, describe_command: Callable[[], CommandConfig]) -> None:
    """Make ``stapo config --docs <name>`` list this command's fields (called by its ``register``)."""
    _COMMANDS[name] = describe_command


def command_config(name: str) -> CommandConfig:
    if name not in _COMMANDS:
        raise ConfigError(f"--docs: no command {name!r} has a config (known: {', '.join(sorted(_COMMANDS))})")
    return _COMMANDS[name]()


def format_fields(command: CommandConfig) -> str:
    """Every field once: dotted name, its flag, type with range, default and documentation."""
    flags: dict[str, list[str]] = {}
    for flag in command.flags:
        flags.setdefault(flag.field, []).append(flag.flag)
    lines = []
    for name, type_name, default, doc in command.rows():
        alias = f" [{', '.join(flags[name])}]" if name in flags else ""
        lines.append(f"{name}{alias}  ({type_name}, default {default})\n    {doc}")
    if command.note:
        lines.append(command.note)
    return "\n".join(lines)


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its message
    return parse


def run_command(func: Callable[[Any], None], args: Any) -> int:
    """``func(args)`` with a configuration error turned into one line, ``stapo: error: ...`` on
    stderr, and exit status 2 (argparse's for a usage error); 0 when it returns."""
    try:
        func(args)
    except ConfigError as err:
        print(f"stapo: error: {err}", file=sys.stderr)
        return 2
    return 0


def add_command_arguments(
    parser: argparse.ArgumentParser, command: CommandConfig, *, config_help: str, overrides_help: str
) -> None:
    """``--config``, the dotted overrides and the flag aliases; the field list goes into ``--help``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = f"fields (dotted overrides: FIELD=VALUE; [short flags]):\n{format_fields(command)}"
    parser.add_argument("--config", default=None, help=config_help)
    parser.add_argument("overrides", nargs="*", help=overrides_help)
    for flag in command.flags:
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": argparse.SUPPRESS, "help": f"= {flag.field}"}
        if flag.kind == "true":
            kwargs.update(action="store_const", const=True)
        elif flag.kind == "false":
            kwargs.update(action="store_const", const=False)
        elif flag.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif flag.kind == "list":
            kwargs["nargs"] = "+"
        elif flag.kind == "append":
            kwargs["action"] = "append"
        if flag.kind in ("value", "list", "append"):
            kwargs["metavar"] = flag.metavar or flag.flag.lstrip("-").replace("-", "_").upper()
        parser.add_argument(flag.flag, **kwargs)


def _field_type(cls: type, path: list[str]) -> Any:
    """The declared type of a dotted field (None: no such field)."""
    tp: Any = cls
    for part in path:
        if not dataclasses.is_dataclass(tp):
            return None
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def _same_value(tp: Any, a: Any, b: Any) -> bool:
    if tp is not None:
        with contextlib.suppress(ConfigError, TypeError):
            return coerce(tp, a, "") == coerce(tp, b, "")
    return a == b


class FieldNames:
    """Renames the leading dotted field of a ConfigError to the flag the user typed for it."""

    def __init__(self, flag_of: dict[str, str]):
        self.flag_of = flag_of  # dotted field -> flag

    def name(self, field: str) -> str:
        return self.flag_of.get(field, field)

    def rename(self, err: ConfigError) -> ConfigError:
        text = str(err)
        head, sep, rest = text.partition(":")
        field, bracket, index = head.partition("[")
        if sep and field in self.flag_of:
            return ConfigError(f"{self.flag_of[field]}{bracket}{index}:{rest}")
        return err

    @contextlib.contextmanager
    def renaming(self):
        try:
            yield
        except ConfigError as err:
            renamed = self.rename(err)
            if renamed is err:
                raise
            raise renamed from None


@dataclasses.dataclass
class Loaded:
    """A command's validated config, its training config's raw mapping (plan, submit) and how to name fields."""

    cfg: Any
    names: FieldNames
    train_overrides: list[str]  # the overrides that are not the command's own (plan, submit)
    train_data: dict | None  # the file's mapping without the command's section (None: no file)


# Keys of a training config file that hold a command's own fields rather than the training run's.
COMMAND_SECTIONS = ("plan", "submit")


def read_training_file(path: str | os.PathLike) -> tuple[dict, dict]:
    """(the commands' sections by name, the training config's mapping) of a training config file."""
    data = read_yaml(path)
    sections = {}
    for name in COMMAND_SECTIONS:
        own = data.pop(name, None) or {}
        if not isinstance(own, dict):
            raise ConfigError(f"{name}: expected a mapping of fields, got {own!r}")
        sections[name] = own
    return sections, data


def load_training_config(cls: type, path: str | os.PathLike, overrides: Iterable[str] = ()) -> Any:
    """A training config file (its commands' sections left to them), with overrides, validated into ``cls``."""
    return build(cls, apply_overrides(read_training_file(path)[1], overrides))


def load_command(
    command: CommandConfig,
    args: argparse.Namespace,
    *,
    extra_overrides: Iterable[str] = (),
    base: dict | None = None,
    complete: Callable[[dict], None] | None = None,
) -> Loaded:
    """Defaults, ``base`` (a mapping under the file), ``args.config``, the dotted overrides and the
    flags, validated into ``command.cls``. ``extra_overrides``: dotted overrides a flag expands to;
    ``complete``: fills, in the raw mapping, defaults that depend on other fields."""
    data: dict = {}
    for name, value in command.defaults.items():
        set_field(data, name.split("."), copy.deepcopy(value), name)
    data = _merge(data, base or {})
    train_data = None
    if command.section:
        if args.config is not None:
            sections, train_data = read_training_file(args.config)
            data = _merge(data, {command.section: sections[command.section]})
    elif args.config is not None:
        data = _merge(data, read_yaml(args.config))

    own_overrides, train_overrides, dotted = [], [], {}
    for text in [*args.overrides, *extra_overrides]:
        path, value = parse_override(text)
        if command.section and path[0] != command.section:
            train_overrides.append(text)
            continue
        own_overrides.append(text)
        dotted[".".join(path)] = (value, text)
    apply_overrides(data, own_overrides)

    flag_of: dict[str, str] = {}
    for flag in command.flags:
        flag_of.setdefault(flag.field, flag.flag)
    for name in dotted:
        flag_of.pop(name, None)  # the user spelled it dotted: errors say so
    for flag in command.flags:
        if not hasattr(args, flag.dest):
            continue
        parsed = getattr(args, flag.dest)
        for name, value in flag.values(parsed).items():
            if name in dotted:
                tp = _field_type(command.cls, name.split(".")[1 if command.section else 0 :])
                if not _same_value(tp, dotted[name][0], value):
                    raise ConfigError(f"{flag.spelled(parsed)} and {dotted[name][1]}: two values for {name}; give one")
            set_field(data, name.split("."), value, name)
            flag_of[name] = flag.flag
    names = FieldNames(flag_of)
    if complete:
        complete(data)
    with names.renaming():
        if command.section:
            cfg = build(command.cls, data.get(command.section, {}), command.section)
        else:
            cfg = build(command.cls, data)
    return Loaded(cfg, names, train_overrides, train_data)


def _merge(base: dict, top: Mapping) -> dict:
    """``top`` over ``base``, section by section."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
