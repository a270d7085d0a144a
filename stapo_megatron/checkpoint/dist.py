"""Megatron distributed checkpoints (``megatron.core.dist_checkpointing``), written atomically.

A checkpoint is written into a hidden sibling directory and renamed into place by rank 0 only
after every rank finished and a ``stapo_complete.json`` marker (:mod:`~stapo_megatron.checkpoint.marker`)
was written, so a directory with the final name is always whole. The marker records the size and
sha256 of every file (:mod:`stapo_megatron.checkpoint.integrity`). Loading refuses a directory
without the marker, and reads it without running anything it holds
(:mod:`stapo_megatron.checkpoint.safe_load`). The collectives run over the groups of the
:class:`~stapo_megatron.runtime.distributed.ParallelContext` they are given.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from stapo_megatron.checkpoint.integrity import HASH, record_files
from stapo_megatron.checkpoint.marker import COMPLETE_MARKER, check_complete
from stapo_megatron.config import ConfigError

if TYPE_CHECKING:
    from stapo_megatron.runtime.distributed import ParallelContext

# megatron.core.dist_checkpointing's file of the non-sharded state (0.16-0.18; 0.19 keeps that state in
# the .distcp files: safe_load.common_state_source names where it is)
COMMON_FILE = "common.pt"
# Tokenizer and generation files carried with a checkpoint, so an export can restore them.
ASSETS_DIR = "hf_assets"
# What a checkpoint write puts in its directory (torch_dist's index, its temporary and data
# files, Megatron's metadata.json and common.pt, the marker, the assets): the only contents a
# left-over staging or replaced directory may hold for it to be removed without asking.
CHECKPOINT_ENTRY = re.compile(
    rf"^(\.metadata(\.tmp)?|metadata\.json|{re.escape(COMMON_FILE)}|__\d+_\d+\.distcp|{re.escape(COMPLETE_MARKER)}|"
    rf"{ASSETS_DIR})$"
)


def _in_queue_manager(rank_pid: int) -> None:
    """Set-up of the queue's manager process: the rank's stop-request handlers, inherited by the
    fork, would make it ignore SIGTERM; and it must end with the rank rather than outlive it."""
    import signal

    from stapo_megatron.runtime.launch import die_with_parent

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    die_with_parent(rank_pid)


def _use_fork_results_queue() -> None:
    """Megatron's writer creates its results queue with a 'spawn' manager, which re-imports
    ``__main__`` (an unguarded entry script runs again) and costs seconds; a fork-context
    manager serves the same purpose."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=mp.get_context("fork"))
        manager.start(initializer=_in_queue_manager, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


def staging_dir(directory: Path) -> Path:
    return directory.parent / f".{directory.name}.partial"


def replaced_dir(directory: Path) -> Path:
    """Where the checkpoint a write replaces waits until the new one is in place."""
    return directory.parent / f".{directory.name}.old"


def foreign_entry(directory: Path) -> str | None:
    """The first entry of ``directory`` that a checkpoint write does not make (see
    :data:`CHECKPOINT_ENTRY`; ``hf_assets`` must be a folder of regular files), or None."""
    for entry in sorted(directory.iterdir()):
        if not CHECKPOINT_ENTRY.match(entry.name) or entry.is_symlink():
            return entry.name
        if entry.name == ASSETS_DIR and not (
            entry.is_dir() and all(a.is_file() and not a.is_symlink() for a in entry.iterdir())
        ):
            return entry.name
    return None


def remove_leftover(path: Path) -> None:
    """Remove the staging (or replaced) directory of a killed checkpoint write; anything else in
    its place is a one-line ConfigError and stays: only what a checkpoint write made is removed."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        raise ConfigError(f"{path}: in the way of a checkpoint write, and not a directory one left (move it away)")
    foreign = foreign_entry(path)
    if foreign is not None:
        raise ConfigError(
            f"{path}: in the way of a checkpoint write, and holds {foreign}, which a checkpoint write never makes "
            "(move it away)"
        )
    shutil.rmtree(path)


def save_dist(
    state: dict,
    directory: str | Path,
    ctx: ParallelContext,
    metadata: dict | None = None,
    assets: dict[str, Path] | None = None,
) -> Path:
    """Collectively save ``state`` (sharded tensors and common objects) to ``directory``.

    ``assets`` (file name -> source path) are copied into its ``hf_assets/`` folder.
    """
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    staging = staging_dir(directory)
    refusal: str | None = None
    if ctx.rank == 0:
        try:
            remove_leftover(staging)  # left by a write that was killed
            staging.mkdir(parents=True)
        except ConfigError as err:
            refusal = str(err)
    refusal = ctx.broadcast_object(refusal)  # every rank raises alike: none waits for rank 0 in a later collective
    if refusal is not None:
        raise ConfigError(refusal)
    _use_fork_results_queue()
    dist_checkpointing.save(state, str(staging))
    dist.barrier(group=ctx.world_group)
    if ctx.rank == 0 and assets:
        (staging / ASSETS_DIR).mkdir()
        for name, source in assets.items():
            shutil.copy2(source, staging / ASSETS_DIR / name)
    files = record_files(staging, ctx)  # collective: each rank hashes what it wrote
    if ctx.rank == 0:
        with open(staging / COMPLETE_MARKER, "w", encoding="utf-8") as f:
            json.dump({"time": time.time(), **(metadata or {}), "hash": HASH, "files": files}, f)
        if directory.exists():
            # Replace an older checkpoint of the same name only once the new one is whole.
            trash = replaced_dir(directory)
            remove_leftover(trash)
            directory.rename(trash)
            staging.rename(directory)
            shutil.rmtree(trash)
        else:
            staging.rename(directory)
    dist.barrier(group=ctx.world_group)
    return directory


_KIND_NAMES = {bool: "a bool", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a dict"}


def _kind(value: Any) -> str:
    return _KIND_NAMES.get(type(value), f"a {type(value).__name__}")


def common_field(
    container: Mapping[str, Any], key: str, kind: type | tuple[type, ...], source: str, name: str = ""
) -> Any:
    """``container[key]``, a ``kind`` (a bool is no int or float, an int is a float; a dict has str
    keys), from the non-sharded state of a checkpoint. A missing or mistyped field is a one-line
    ConfigError naming ``source`` (the ``common.pt``) and the field's dotted ``name`` (default:
    ``key``), e.g. ``<ckpt>/common.pt: field progress.step is a string, not an integer``."""
    name = name or key
    if key not in container:
        raise ConfigError(f"{source}: field {name} is missing (damaged, or not written by stapo)")
    value = container[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    accepted = (*kinds, int) if float in kinds else kinds
    if isinstance(value, dict) and dict in kinds and not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{source}: field {name} is a dict with keys that are not strings (damaged)")
    if not (isinstance(value, accepted) and (bool in kinds or not isinstance(value, bool))):
        wanted = " or ".join(_KIND_NAMES.get(k, f"a {k.__name__}") for k in kinds)
        raise ConfigError(f"{source}: field {name} is {_kind(value)}, not {wanted} (damaged, or not written by stapo)")
    return value


def load_common(directory: str | Path) -> dict[str, Any]:
    """The non-sharded part of a checkpoint (read on any rank, no model needed), by ``weights_only=True``:
    a dict with str keys, or a one-line ConfigError. Its fields are checked by their readers
    (:func:`common_field`).

    Not verified against the checksums here (callers verify once, collectively: see
    :func:`stapo_megatron.checkpoint.integrity.verify_checkpoint`).
    """
    # here, not at the top: readers of a run directory (the launcher) do not load torch's checkpointing
    from stapo_megatron.checkpoint import safe_load

    check_complete(directory)
    safe_load.check_backend(directory)
    common = safe_load.load_common_state(directory)
    if not isinstance(common, dict) or not all(isinstance(k, str) for k in common):
        raise ConfigError(
            f"{safe_load.common_state_source(directory)}: holds {_kind(common)}"
            f"{' with keys that are not strings' if isinstance(common, dict) else ''}, not a state dict"
        )
    return common


def load_dist(sharded_state: dict, directory: str | Path) -> dict:
    """Collectively load into the layout described by ``sharded_state`` (any TP/PP).

    Every requested tensor must be in the checkpoint; what the checkpoint holds beyond them (an
    optimizer, when only the model is wanted) is left unread. Nothing stored is unpickled
    unrestricted (see :mod:`stapo_megatron.checkpoint.safe_load`); a refusal is a one-line
    ConfigError naming the file. Not verified against the checksums here (callers do that once).
    """
    from stapo_megatron.checkpoint import safe_load

    check_complete(directory)
    safe_load.check_backend(directory)
    with safe_load.one_line_errors(directory):
        return safe_load.load(sharded_state, str(directory))
