"""YAML configs validated into dataclasses, with dotted command-line overrides.

Every config section is a dataclass whose fields are declared with :func:`option`, which
stores the field's one documentation string. Loading is strict: an unknown key, a value of
the wrong type or a failed check raises :class:`ConfigError` naming the dotted field.

A section whose class sets ``PRESET_DIR`` may be given as a preset name (``algo: grpo``),
a YAML path, or a mapping with a ``preset`` key plus fields that override it.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Union

import yaml

PRESET_KEY = "preset"


class ConfigError(ValueError):
    """A config value is wrong; the message starts with the dotted field at fault."""


def option(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = dataclasses.MISSING):
    """A documented config field. Mutable defaults (lists, dicts) are copied per instance."""
    if not doc:
        raise TypeError("every config field needs its documentation string")
    if isinstance(default, (list, dict, set)):
        value = default
        factory = lambda: type(value)(value)  # noqa: E731
        default = dataclasses.MISSING
    return dataclasses.field(default=default, default_factory=factory, metadata={"doc": doc})


def field_doc(cls: type, name: str) -> str:
    return next(f.metadata.get("doc", "") for f in dataclasses.fields(cls) if f.name == name)


def _preset_path(cls: type, name: str, where: str) -> Path:
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"{where}: preset file {name} does not exist")
        return path
    preset_dir = resources.files("stapo_megatron.configs") / cls.PRESET_DIR
    path = Path(str(preset_dir / f"{name}.yaml"))
    if not path.is_file():
        known = sorted(p.stem for p in Path(str(preset_dir)).glob("*.yaml"))
        raise ConfigError(f"{where}: unknown {cls.PRESET_DIR} preset '{name}' (known: {', '.join(known)})")
    return path


def read_yaml(path: str | os.PathLike) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _expand_preset(cls: type, value: Any, where: str) -> Any:
    """Turn a preset reference into the mapping it names, merged with explicit fields."""
    if not hasattr(cls, "PRESET_DIR"):
        return value
    if isinstance(value, str):
        return read_yaml(_preset_path(cls, value, where))
    if isinstance(value, Mapping) and PRESET_KEY in value:
        merged = read_yaml(_preset_path(cls, str(value[PRESET_KEY]), f"{where}.{PRESET_KEY}"))
        merged.update({k: v for k, v in value.items() if k != PRESET_KEY})
        return merged
    return value


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (list, tuple, dict):
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            if origin is list and args and isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            else:
                raise ConfigError(f"{where}: expected a list, got {value!r}")
        item_type = args[0] if args else Any
        items = [_coerce(item_type, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads "1e-6" as a string
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"{where}: unsupported config type {tp!r}")


def build(cls: type, data: Any, where: str = "") -> Any:
    """Validate ``data`` (a mapping) into an instance of the dataclass ``cls``."""
    data = _expand_preset(cls, {} if data is None else data, where or "config")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping of fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{where}." if where else ""
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown field (known fields of {where or 'the config'}: "
            f"{', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], prefix + name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if dataclasses.is_dataclass(hints[name]):
                kwargs[name] = build(hints[name], {}, prefix + name)
            else:
                raise ConfigError(f"{prefix}{name}: required field is missing")
    try:
        return cls(**kwargs)
    except ConfigError as err:
        # __post_init__ checks name the field relative to their own section.
        raise ConfigError(f"{prefix}{err}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.field=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".")]
    if not all(path):
        raise ConfigError(f"override '{text}': empty field name")
    value = yaml.safe_load(raw) if raw.strip() else ""
    return path, value


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """Apply ``a.b.c=value`` overrides to a raw config mapping (values parsed as YAML)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if isinstance(child, str):  # a preset name: keep it, override fields on top
                child = {PRESET_KEY: child}
            elif child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override '{text}': {'.'.join(path[: depth + 1])} is not a section")
            node[part] = child
            node = child
        node[path[-1]] = value
    return data


def load_config(cls: type, path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> Any:
    """Read a YAML file (or nothing), apply overrides, validate into ``cls``."""
    data = read_yaml(path) if path is not None else {}
    return build(cls, apply_overrides(data, overrides))


def to_dict(cfg: Any) -> Any:
    """A plain, YAML-serializable copy of a config."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, doc) for every field, nested sections flattened."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, f"{prefix}{f.name}."))
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        rows.append((prefix + f.name, _type_name(tp), default, f.metadata.get("doc", "")))
    return rows
