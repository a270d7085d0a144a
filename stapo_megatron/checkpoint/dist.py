"""Megatron distributed checkpoints (``megatron.core.dist_checkpointing``), written atomically.

A checkpoint is written into a hidden sibling directory and renamed into place by rank 0 only
after every rank finished and a ``stapo_complete.json`` marker was written, so a directory with
the final name is always whole. The marker records the size and sha256 of every file
(:mod:`stapo_megatron.checkpoint.integrity`). Loading refuses a directory without the marker, and
reads it without running anything it holds (:mod:`stapo_megatron.checkpoint.safe_load`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from stapo_megatron.config import ConfigError

COMPLETE_MARKER = "stapo_complete.json"
# Tokenizer and generation files carried with a checkpoint, so an export can restore them.
ASSETS_DIR = "hf_assets"


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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def cpu_group():
    """The gloo group of every rank for Python objects and CPU metadata (the runtime's one group,
    :func:`stapo_megatron.runtime.distributed.cpu_group`), or None without a process group."""
    if not dist.is_initialized():
        return None
    from stapo_megatron.runtime.distributed import cpu_group as runtime_cpu_group

    return runtime_cpu_group()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def staging_dir(directory: Path) -> Path:
    return directory.parent / f".{directory.name}.partial"


def save_dist(
    state: dict, directory: str | Path, metadata: dict | None = None, assets: dict[str, Path] | None = None
) -> Path:
    """Collectively save ``state`` (sharded tensors and common objects) to ``directory``.

    ``assets`` (file name -> source path) are copied into its ``hf_assets/`` folder.
    """
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    staging = staging_dir(directory)
    if _rank() == 0:
        if staging.exists():  # left by a write that was killed
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    _barrier()
    _use_fork_results_queue()
    dist_checkpointing.save(state, str(staging))
    _barrier()
    if _rank() == 0 and assets:
        (staging / ASSETS_DIR).mkdir()
        for name, source in assets.items():
            shutil.copy2(source, staging / ASSETS_DIR / name)
    from stapo_megatron.checkpoint.integrity import HASH, record_files

    files = record_files(staging)  # collective: each rank hashes what it wrote
    if _rank() == 0:
        with open(staging / COMPLETE_MARKER, "w", encoding="utf-8") as f:
            json.dump({"time": time.time(), **(metadata or {}), "hash": HASH, "files": files}, f)
        if directory.exists():
            # Replace an older checkpoint of the same name only once the new one is whole.
            trash = directory.parent / f".{directory.name}.old"
            if trash.exists():
                shutil.rmtree(trash)
            directory.rename(trash)
            staging.rename(directory)
            shutil.rmtree(trash)
        else:
            staging.rename(directory)
    _barrier()
    return directory


def check_complete(directory: str | Path) -> dict:
    """The completion marker's contents (refuses a directory without one)."""
    directory = Path(directory)
    marker = directory / COMPLETE_MARKER
    if not directory.is_dir():
        raise ConfigError(f"{directory}: checkpoint directory does not exist")
    if not marker.is_file():
        raise ConfigError(f"{directory}: not a complete stapo checkpoint (no {COMPLETE_MARKER})")
    try:
        with open(marker, encoding="utf-8") as f:
            content = json.load(f)
    except (ValueError, RecursionError):
        raise ConfigError(f"{marker}: damaged completion marker (not JSON)") from None
    if not isinstance(content, dict):
        raise ConfigError(f"{marker}: damaged completion marker (not a JSON object)")
    return content


def load_common(directory: str | Path) -> dict:
    """The non-sharded part of a checkpoint (read on any rank, no model needed), by ``weights_only=True``.

    Not verified against the checksums here (callers verify once, collectively: see
    :func:`stapo_megatron.checkpoint.integrity.verify_checkpoint`).
    """
    from stapo_megatron.checkpoint import safe_load

    check_complete(directory)
    safe_load.check_backend(directory)
    common = safe_load.SafeCommonLoadStrategy().load_common(directory)
    if not isinstance(common, dict):
        raise ConfigError(f"{Path(directory) / 'common.pt'}: holds a {type(common).__name__}, not a state dict")
    return common


def load_dist(sharded_state: dict, directory: str | Path) -> dict:
    """Collectively load into the layout described by ``sharded_state`` (any TP/PP).

    Every requested tensor must be in the checkpoint; what the checkpoint holds beyond them (an
    optimizer, when only the model is wanted) is left unread. Nothing stored is unpickled
    unrestricted (see :mod:`stapo_megatron.checkpoint.safe_load`); a refusal is a one-line
    ConfigError naming the file. Not verified against the checksums here (callers do that once).
    """
    from megatron.core import dist_checkpointing

    from stapo_megatron.checkpoint import safe_load

    check_complete(directory)
    safe_load.check_backend(directory)
    with safe_load.one_line_errors():
        return dist_checkpointing.load(
            sharded_state,
            str(directory),
            sharded_strategy=safe_load.SafeShardedLoadStrategy(),
            common_strategy=safe_load.SafeCommonLoadStrategy(),
        )
