"""YAML configs validated into dataclasses, with dotted command-line overrides.

Every config section is a dataclass whose fields are declared with :func:`option`, which
stores the field's one documentation string. Loading is strict: an unknown key, a value of
the wrong type or a failed check raises :class:`ConfigError` naming the dotted field.

A section whose class sets ``PRESET_DIR`` may be given as a preset name (``algo: grpo``),
a YAML path, or a mapping with a ``preset`` key plus fields that override it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union

import yaml

PRESET_KEY = "preset"

# Upper bounds of size fields, far above any real run and far below what would exhaust memory or
# time before a check further on could fail.
MAX_STEPS = 10_000_000  # rollout or optimizer steps
MAX_BATCH = 1 << 20  # prompts or sequences in a batch
MAX_TOKENS = 1 << 20  # tokens of one prompt or response
MAX_VOCAB = 1 << 22  # vocabulary entries (Qwen3 has 151,936)
MAX_SEED = (1 << 32) - 1
REDACTED = "<redacted>"  # what a secret field's value is replaced with in written configs


class ConfigError(ValueError):
    """A config value is wrong; the message starts with the dotted field at fault."""


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The range a numeric field (or each number of a list field) must lie in; None: unbounded."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def __post_init__(self):
        if self.ge is not None and self.gt is not None or self.le is not None and self.lt is not None:
            raise TypeError("give at most one lower bound (ge or gt) and one upper bound (le or lt)")

    def __bool__(self) -> bool:
        return any(b is not None for b in (self.ge, self.gt, self.le, self.lt))

    def text(self) -> str:
        """The range as error messages and docs show it: ``in [0, 1)``, ``>= 1`` or ``< 10``."""
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        assert high is not None, "text() of an unbounded range (callers check the bounds first)"
        return ("<= " if high[-1] == "]" else "< ") + high[:-1]

    def violation(self, value: float) -> str | None:
        """Why ``value`` is out of range ("must be >= 1"), or None. A fractional range is named whole
        ("must be in [0, 1)"); for a count only the side it misses, as its upper bound is a sanity cap."""
        below = self.ge is not None and value < self.ge or self.gt is not None and value <= self.gt
        above = self.le is not None and value > self.le or self.lt is not None and value >= self.lt
        if not (below or above):
            return None
        if isinstance(value, float):
            return f"must be {self.text()}"
        side = Bounds(ge=self.ge, gt=self.gt) if below else Bounds(le=self.le, lt=self.lt)
        return f"must be {side.text()}"


def option(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    secret: bool = False,
    key: str | None = None,
):
    """A documented config field. Mutable defaults (lists, dicts) are copied per instance.

    ``ge``/``gt``/``le``/``lt`` bound a numeric field (each item of a list of numbers); loading
    checks them before the section's own ``__post_init__`` checks run.
    ``secret``: the value (every value, for a mapping) is shown as ``<redacted>`` by
    ``to_dict(cfg, redact=True)``, which is what goes to files, logs and metrics sinks, and left
    out of the section's repr.
    ``key``: the name the field has in YAML, overrides and docs when it cannot be its Python name
    (``rollout.async`` is the field ``async_``: ``async`` is a Python keyword).
    """
    if not doc:
        raise TypeError("every config field needs its documentation string")
    if isinstance(default, (list, dict, set)):
        value = default
        factory = lambda: type(value)(value)  # noqa: E731
        default = dataclasses.MISSING
    metadata = {"doc": doc, "bounds": Bounds(ge=ge, gt=gt, le=le, lt=lt), "secret": secret, "key": key}
    # repr=False: a secret stays out of reprs, so out of log lines and tracebacks that show the config
    return dataclasses.field(default=default, default_factory=factory, metadata=metadata, repr=not secret)


def config_key(f: dataclasses.Field) -> str:
    """The name of field ``f`` in YAML, overrides and docs (see ``option``'s ``key``)."""
    return f.metadata.get("key") or f.name


def field_doc(cls: type, name: str) -> str:
    return next(f.metadata.get("doc", "") for f in dataclasses.fields(cls) if f.name == name)


def field_default(cls: type, name: str) -> Any:
    """The default value of a field of ``cls``."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def _preset_path(kind: str, name: str, where: str) -> Path:
    """The YAML file of preset ``name`` of ``kind`` (a section's PRESET_DIR), or a file path given as ``name``."""
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"{where}: preset file {name} does not exist")
        return path
    preset_dir = resources.files("stapo_megatron.configs") / kind
    path = Path(str(preset_dir / f"{name}.yaml"))
    if not path.is_file():
        known = sorted(p.stem for p in Path(str(preset_dir)).glob("*.yaml"))
        raise ConfigError(f"{where}: unknown {kind} preset '{name}' (known: {', '.join(known)})")
    return path


# A config is a few hundred YAML nodes; aliases expanding past this are a "billion laughs" document.
MAX_YAML_NODES = 100_000
MAX_YAML_BYTES = 16 << 20
# No field takes an integer near this many digits (every bound is below 2**64); Python refuses to read
# one of more than 4,300 with a traceback.
MAX_INT_DIGITS = 100
_MERGE_TAG = "tag:yaml.org,2002:merge"


class YAMLRefused(yaml.YAMLError):
    """A YAML document that parses but is refused: a duplicate key, or aliases that expand too far."""


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expanded_size(root: yaml.Node) -> None:
    """Refuse a document whose aliases expand past MAX_YAML_NODES, before anything is expanded.

    An alias is the anchored node itself, so the expanded size is computed once per distinct node
    (a depth-first pass, no recursion); a node reached again while it is being sized is a cycle.
    """
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_sized = stack.pop()
        key = id(node)
        if children_sized:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _yaml_children(node))
            if sizes[key] > MAX_YAML_NODES:
                raise YAMLRefused(
                    f"aliases expand to more than {MAX_YAML_NODES} nodes (line {node.start_mark.line + 1})"
                )
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise YAMLRefused(f"an alias refers to a node that contains it (line {node.start_mark.line + 1})")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _yaml_children(node) if id(child) not in sizes)


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and alias bombs."""

    def construct_document(self, node):
        _check_expanded_size(node)
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:  # "<<: *base" entries may be overridden on purpose
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: SafeLoader reports it
                    continue
                if duplicate:
                    raise YAMLRefused(f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
                seen.add(key)
        return super().construct_mapping(node, deep)


def _construct_bounded_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    digits = sum(ch.isdigit() for ch in str(node.value))
    if digits > MAX_INT_DIGITS:
        raise YAMLRefused(
            f"an integer of {digits} digits (line {node.start_mark.line + 1}), more than {MAX_INT_DIGITS}"
        )
    return yaml.SafeLoader.construct_yaml_int(loader, node)


StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_bounded_int)


def _yaml_error_line(err: yaml.YAMLError) -> str:
    """One line: what is wrong and where."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem:
        mark = err.problem_mark
        return f"{err.problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else err.problem
    return str(err).splitlines()[0]


def load_yaml_text(text: str | typing.IO) -> Any:
    """YAML through :class:`StrictLoader`; raises yaml.YAMLError (RecursionError for absurd nesting)."""
    return yaml.load(text, Loader=StrictLoader)


def read_yaml(path: str | os.PathLike) -> dict:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read: {err.strerror}") from None
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_YAML_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"config file {path} is not UTF-8 text (line {line}, byte {err.start + 1})") from None
    try:
        data = load_yaml_text(text)
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_error_line(err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _expand_preset(cls: type, value: Any, where: str) -> Any:
    """Turn a preset reference into the mapping it names, merged with explicit fields."""
    kind: str | None = getattr(cls, "PRESET_DIR", None)
    if kind is None:
        return value
    if isinstance(value, str):
        return read_yaml(_preset_path(kind, value, where))
    if isinstance(value, Mapping) and PRESET_KEY in value:
        merged = read_yaml(_preset_path(kind, str(value[PRESET_KEY]), f"{where}.{PRESET_KEY}"))
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
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(tp: Any, value: Any, where: str) -> Any:
    """``value`` as a field of type ``tp`` (a union, Literal, dataclass, list or tuple, dict, or scalar), or
    a ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _coerce_union(tp, value, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            if origin is list and args and isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            else:
                raise ConfigError(f"{where}: expected a list, got {value!r}")
        item_type = args[0] if args else Any
        items = [coerce(item_type, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    scalar = _SCALARS.get(tp)
    if scalar is None:
        raise TypeError(f"{where}: unsupported config type {tp!r}")
    return scalar(value, where)


def _coerce_union(tp: Any, value: Any, where: str) -> Any:
    """The first member of the union that takes ``value`` (None only when the union admits it)."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(arg, value, where)
        except ConfigError as err:
            errors.append(str(err))
    raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {_type_name(tp)}")


def _to_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def _to_int(value: Any, where: str) -> int:
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


def _to_float(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    number = None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:  # YAML 1.1 reads "1e-6" as a string
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    # NaN passes every comparison-based check, and no field means "no limit" by inf.
    if not math.isfinite(number):
        raise ConfigError(f"{where}: must be a finite number, got {value!r}")
    return number


def _to_str(value: Any, where: str) -> str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        text = str(value)
        if "\x00" in text:  # no path, name or command can hold one (os calls refuse it with a traceback)
            raise ConfigError(f"{where}: contains a NUL character")
        return text
    raise ConfigError(f"{where}: expected a string, got {value!r}")


_SCALARS: dict[Any, Callable[[Any, str], Any]] = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _check_bounds(bounds: Bounds | None, value: Any, where: str) -> None:
    """A one-line error naming the field (or list item) that is not finite or outside its declared range."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_bounds(bounds, item, f"{where}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number, got {value}")
    elif bounds and isinstance(value, (int, float)) and not isinstance(value, bool):
        problem = bounds.violation(value)
        if problem:
            raise ConfigError(f"{where}: {problem}, got {value}")


def check_fields(section: Any) -> None:
    """The declared checks of every field of a section built without :func:`build` (from a file's
    own format, as Hugging Face's config.json): call it first in its ``__post_init__``."""
    for f in dataclasses.fields(section):
        _check_bounds(f.metadata.get("bounds"), getattr(section, f.name), f.name)


def build(cls: type, data: Any, where: str = "") -> Any:
    """Validate ``data`` (a mapping) into an instance of the dataclass ``cls``."""
    data = _expand_preset(cls, {} if data is None else data, where or "config")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping of fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {config_key(f): f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{where}." if where else ""
    unknown = sorted(set(data) - set(fields))
    removed = getattr(cls, "REMOVED_FIELDS", {})  # field -> what replaced it, for old configs
    for name in unknown:
        if name in removed:
            raise ConfigError(f"{prefix}{name}: {removed[name]}")
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown field (known fields of {where or 'the config'}: "
            f"{', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[f.name] = coerce(hints[f.name], data[name], prefix + name)
            _check_bounds(f.metadata.get("bounds"), kwargs[f.name], prefix + name)
            if f.metadata.get("secret"):
                _refuse_redacted(kwargs[f.name], prefix + name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if dataclasses.is_dataclass(hints[f.name]):
                kwargs[f.name] = build(hints[f.name], {}, prefix + name)
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
    try:
        value = load_yaml_text(raw) if raw.strip() else ""
    except RecursionError:
        raise ConfigError(f"override '{key}': value is nested too deeply") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{key}': value is not valid YAML: {_yaml_error_line(err)}") from None
    return path, value


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """Apply ``a.b.c=value`` overrides to a raw config mapping (values parsed as YAML)."""
    for text in overrides:
        path, value = parse_override(text)
        set_field(data, path, value, text)
    return data


def set_field(data: dict, path: list[str], value: Any, text: str) -> None:
    """Set the dotted field ``path`` of a raw config mapping; ``text``: how the user wrote it, for errors."""
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


def load_config(cls: type, path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> Any:
    """Read a YAML file (or nothing), apply overrides, validate into ``cls``."""
    data = read_yaml(path) if path is not None else {}
    return build(cls, apply_overrides(data, overrides))


def _redacted(value: Any) -> Any:
    """A secret field's value as people and tools see it: unset stays unset, a mapping keeps its names."""
    if isinstance(value, dict):
        return {k: REDACTED for k in value}
    return REDACTED if value not in (None, "") else value


def _refuse_redacted(value: Any, where: str) -> None:
    """A secret read back from a written (redacted) config must not become the real value."""
    for name, item in value.items() if isinstance(value, dict) else [(None, value)]:
        if item == REDACTED:
            shown = where if name is None else f"{where}.{name}"
            raise ConfigError(
                f"{shown}: is '{REDACTED}' (copied from a written config, where secrets are hidden); "
                "give the real value or leave it unset"
            )


def to_dict(cfg: Any, *, redact: bool = False) -> Any:
    """A plain, YAML-serializable copy of a config; ``redact``: secret fields shown as ``<redacted>``
    (for everything written for people or tools: files, logs, wandb/TensorBoard)."""
    if dataclasses.is_dataclass(cfg):
        return {
            config_key(f): _redacted(getattr(cfg, f.name))
            if redact and f.metadata.get("secret")
            else to_dict(getattr(cfg, f.name), redact=redact)
            for f in dataclasses.fields(cfg)
        }
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v, redact=redact) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v, redact=redact) for k, v in cfg.items()}
    return cfg


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type with its range, default, doc) for every field, nested sections flattened."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, f"{prefix}{config_key(f)}."))
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        type_name = _type_name(tp)
        bounds = f.metadata.get("bounds")
        if bounds:
            type_name += f" {bounds.text()}"
        rows.append((prefix + config_key(f), type_name, default, f.metadata.get("doc", "")))
    return rows
