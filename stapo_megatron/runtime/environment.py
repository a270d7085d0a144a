"""The environment: numbers read from it (a launcher's, SLURM's, a batch script's), each wrong value a
one-line :class:`ConfigError` naming the variable and its value instead of a traceback, and what the
run's ranks and servers are started with."""

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


# NCCL settings every process of a run's weight-update groups must share. SGLang's launch sets both to 0
# for its processes unless they are set (srt/entrypoints/engine.py), and a weight-update communicator
# joins a trainer rank with server ranks, possibly on GPUs of the same node: members that disagree on
# cuMem or NVLS fail with "Cuda failure 'invalid argument'" or hang (SkyRL PR 143, NeMo-RL issue 564).
# So the trainer's ranks run with SGLang's values; a value set in the environment is kept, and reaches
# the servers too (they inherit it). NVLS off also spares the NVLS buffers of 8-GPU communicators.
SHARED_NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def shared_nccl_env() -> dict[str, str]:
    """:data:`SHARED_NCCL_ENV` with the values this environment already sets."""
    return {name: os.environ.get(name, value) for name, value in SHARED_NCCL_ENV.items()}


def rank_launch_env() -> dict[str, str]:
    """What every trainer rank starts with, whoever starts it (``stapo train``'s torchrun, ``spawn_ranks``,
    a NeMo-Run job): one CUDA connection, so Megatron's communication kernels run in the order they
    are queued (its overlap of communication and compute relies on it), and :func:`shared_nccl_env`."""
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1", **shared_nccl_env()}
