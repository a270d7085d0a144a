"""The methods of a study: an algorithm preset, or a preset with ``algo`` fields set on top.

A method is written ``preset`` or ``preset:field=value[:field=value ...]`` (``stapo``,
``stapo:q=0.5``, ``stapo:token_rule=s2t_random``); a list of them is comma-separated. Each field
is an :class:`~stapo_megatron.loss.config.AlgoConfig` field set as the dotted override
``algo.field=value``, so a value is read as YAML, as on the ``stapo train`` command line. The
study validates every method into an ``AlgoConfig`` before any run starts (see
:mod:`stapo_megatron.experiment.study`); this module only reads the text.

A method's runs live in ``<out>/<name>``, its name the spec with ``+`` for ``:`` (``stapo+q=0.5``):
a directory name of letters, digits and ``._=+-`` only.
"""

from __future__ import annotations

import dataclasses
import re

from stapo_megatron.config import ConfigError
from stapo_megatron.config.core import PRESET_KEY

FIELD_SEPARATOR = ":"
NAME_SEPARATOR = "+"
_PRESET = re.compile(r"[A-Za-z0-9_-]+")
_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
# No ":", ",", "+" (they separate fields, methods and a name's parts), "=" or "/": a value stays
# readable in a directory name.
_VALUE = re.compile(r"[A-Za-z0-9._-]+")


@dataclasses.dataclass(frozen=True)
class Method:
    preset: str
    fields: tuple[tuple[str, str], ...] = ()  # (AlgoConfig field, value as written), in the spec's order

    @property
    def spec(self) -> str:
        return FIELD_SEPARATOR.join([self.preset, *(f"{key}={value}" for key, value in self.fields)])

    @property
    def name(self) -> str:
        """The run directory's name."""
        return NAME_SEPARATOR.join([self.preset, *(f"{key}={value}" for key, value in self.fields)])

    def algo_overrides(self) -> list[str]:
        """The method's fields as ``stapo train`` overrides (on top of its preset)."""
        return [f"algo.{key}={value}" for key, value in self.fields]


def parse_method(text: str) -> Method:
    """One method spec; a malformed one is a one-line :class:`ConfigError` naming it."""
    spec = text.strip()
    preset, *assignments = spec.split(FIELD_SEPARATOR)
    if not _PRESET.fullmatch(preset):
        raise ConfigError(f"method '{spec}': '{preset}' is not a preset name (letters, digits, '_' and '-')")
    fields: list[tuple[str, str]] = []
    for assignment in assignments:
        key, equals, value = assignment.partition("=")
        if not equals or not key or not value:
            raise ConfigError(f"method '{spec}': '{assignment}' is not field=value")
        if "." in key:
            raise ConfigError(
                f"method '{spec}': {key}: a method sets fields of its algo section only; "
                "settings of every run are dotted overrides of the experiment"
            )
        if key == PRESET_KEY or not _FIELD.fullmatch(key):
            raise ConfigError(f"method '{spec}': '{key}' is not an algo field name")
        if not _VALUE.fullmatch(value):
            raise ConfigError(
                f"method '{spec}': {key}={value}: a value of letters, digits and '._-' only "
                "(it is part of the run directory's name)"
            )
        if any(key == seen for seen, _ in fields):
            raise ConfigError(f"method '{spec}': {key} given more than once")
        fields.append((key, value))
    return Method(preset, tuple(fields))


def parse_methods(text: str) -> tuple[Method, ...]:
    """A comma-separated list of method specs (the study refuses an empty or repeated one)."""
    return tuple(parse_method(item) for item in text.split(",") if item.strip())
