"""Megatron distributed checkpoints (``megatron.core.dist_checkpointing``), written atomically.

A checkpoint is written into a hidden sibling directory and renamed into place by rank 0 only
after every rank finished and a ``stapo_complete.json`` marker was written, so a directory with
the final name is always whole. Loading refuses a directory without the marker.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from stapo_megatron.config import ConfigError

COMPLETE_MARKER = "stapo_complete.json"
# Tokenizer and generation files carried with a checkpoint, so an export can restore them.
ASSETS_DIR = "hf_assets"


def _use_fork_results_queue() -> None:
    """Megatron's writer creates its results queue with a 'spawn' manager, which re-imports
    ``__main__`` (an unguarded entry script runs again) and costs seconds; a fork-context
    manager serves the same purpose."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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
    if _rank() == 0:
        if assets:
            (staging / ASSETS_DIR).mkdir()
            for name, source in assets.items():
                shutil.copy2(source, staging / ASSETS_DIR / name)
        with open(staging / COMPLETE_MARKER, "w", encoding="utf-8") as f:
            json.dump({"time": time.time(), **(metadata or {})}, f)
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
    directory = Path(directory)
    marker = directory / COMPLETE_MARKER
    if not directory.is_dir():
        raise ConfigError(f"{directory}: checkpoint directory does not exist")
    if not marker.is_file():
        raise ConfigError(f"{directory}: not a complete stapo checkpoint (no {COMPLETE_MARKER})")
    with open(marker, encoding="utf-8") as f:
        return json.load(f)


def load_common(directory: str | Path) -> dict:
    """The non-sharded part of a checkpoint (read on any rank, no model needed)."""
    from megatron.core import dist_checkpointing

    check_complete(directory)
    return dist_checkpointing.load_common_state_dict(str(directory))


def load_dist(sharded_state: dict, directory: str | Path) -> dict:
    """Collectively load into the layout described by ``sharded_state`` (any TP/PP).

    Every requested tensor must be in the checkpoint; what the checkpoint holds beyond them (an
    optimizer, when only the model is wanted) is left unread.
    """
    from megatron.core import dist_checkpointing

    check_complete(directory)
    return dist_checkpointing.load(sharded_state, str(directory))
