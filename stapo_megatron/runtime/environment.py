"""Numbers read from the environment (a launcher's, SLURM's, a batch script's), each wrong value a
one-line :class:`ConfigError` naming the variable and its value instead of a traceback."""

from __future__ import annotations

import math
import os

from stapo_megatron.config import ConfigError


def env_int(name: str, *, low: int, high: int, default: int | None = None) -> int:
    """``$name`` as a decimal integer in ``[low, high]``; ``default`` when unset (None: required)."""
    text = os.environ.get(name)
    if text is None:
        if default is None:
            raise ConfigError(f"{name}: required in the environment, but not set")
        return default
    # isdecimal() alone admits other scripts' digits ('٤٢'), which int() reads too
    digits = text.strip().removeprefix("-")
    if not (digits.isascii() and digits.isdecimal()):
        raise ConfigError(f"{name}: expected an integer, got {text!r}")
    value = int(text)
    if not low <= value <= high:
        raise ConfigError(f"{name}: must be in [{low}, {high}], got {text!r}")
    return value


def env_seconds(name: str) -> float | None:
    """``$name`` as a finite, non-negative time in seconds (``date +%s``); None when unset."""
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        value = float(text) if text.isascii() else math.nan  # float() reads other scripts' digits too
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name}: expected a time in seconds since 1970 (as date +%s prints), got {text!r}")
    return value
