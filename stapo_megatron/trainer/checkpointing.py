"""Training checkpoints: model, optimizer, scheduler, progress, sampler and RNG, atomically.

``<run>/checkpoints/iter_0000042/`` is a Megatron distributed checkpoint, renamed into place only
when whole (see :mod:`stapo_megatron.checkpoint.dist`); ``latest.txt`` names the newest one and
is replaced atomically after it. Resuming trusts only complete directories, so a kill during a
write falls back to the previous checkpoint. ``history.json`` lists the steps this run saved:
pruning deletes only those, never a checkpoint by its step number alone. A full disk is one
``no space left on <run>/checkpoints`` error, and the partial write is removed.

Every checkpoint carries the run's record (:mod:`stapo_megatron.trainer.run_record`), and the
trainer's own entries of its common state are checked field by field when read
(:func:`check_common`). The files a resume and the next save read are checked before any training
(:func:`check_run_files`): a damaged one found only at the next save would lose that step.

The distributed optimizer's state is saved ``dp_reshardable``: each rank writes its own shard, so
a resume reshards it to another data-parallel size only. Megatron's ``fully_reshardable`` format
would reshard it across tensor and pipeline sizes too, but its save gathers the whole state of a
model-parallel shard onto every rank: measured on CPU (51 M parameters, 2 data-parallel ranks),
1.27 GB more peak memory on each rank (about 25 bytes per parameter) and 2.3-2.9x the save time
(8.8-14.9 s against 3.8-5.0 s); for Qwen3-8B at tensor_parallel=2 that is about 100 GB of host
memory per rank at every save. A tensor- or pipeline-parallel change is refused instead, naming
the ways out (the replicated optimizer, ``optim.distributed=false``, reshards to any layout).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from stapo_megatron.checkpoint.cli import CHECKPOINT_NAME
from stapo_megatron.checkpoint.convert import META_KEY, MODEL_KEY, checkpoint_meta, unwrap
from stapo_megatron.checkpoint.dist import COMMON_FILE, COMPLETE_MARKER, load_dist, save_dist, staging_dir
from stapo_megatron.config import MAX_STEPS, ConfigError
from stapo_megatron.runtime import rng
from stapo_megatron.runtime.distributed import ParallelContext
from stapo_megatron.runtime.run_files import NoSpaceError, atomic_open, is_no_space, reporting_no_space
from stapo_megatron.trainer.run_record import RECORD_KEY, check_record, checked_field, shown_value

logger = logging.getLogger(__name__)

LATEST_FILE = "latest.txt"
HISTORY_FILE = "history.json"
# Only data-parallel resharding is allowed for the optimizer state; saving is fully parallel (see above).
_OPTIMIZER_SHARDING = "dp_reshardable"
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": _OPTIMIZER_SHARDING}
# history.json holds at most keep_last + 1 steps of 7 digits; a larger file is not the trainer's.
_MAX_HISTORY_BYTES = 1 << 20
_Decision = TypeVar("_Decision")


def _layout(ctx: ParallelContext) -> list[int]:
    return [ctx.tp_size, ctx.pp_size, ctx.dp_size]


def decided_on_rank0(ctx: ParallelContext, decide: Callable[[], _Decision]) -> _Decision:
    """``decide()`` on rank 0, and its result on every rank; its one-line ConfigError is raised on
    every rank alike, so that no rank goes on to a collective the others have left."""
    outcome: tuple[Any, str | None] | None = None
    if ctx.rank == 0:
        try:
            outcome = (decide(), None)
        except ConfigError as err:
            outcome = (None, str(err))
    shared = ctx.broadcast_object(outcome)
    if shared[1] is not None:
        raise ConfigError(shared[1])
    return shared[0]


def _read_history(root: Path) -> list[int] | None:
    """The steps ``root/history.json`` lists (None: there is none), checked: a damaged history
    cannot be rebuilt from the directory's checkpoints, which may include some this run did not
    write (copied in, or kept on purpose); the history is what keeps pruning off those."""
    path = root / HISTORY_FILE
    if not path.exists() and not path.is_symlink():
        return None

    def damaged(what: str) -> ConfigError:
        complete = Checkpointer(root.parent, keep_last=1).complete_steps()
        return ConfigError(
            f"{path}: {what}; it lists the checkpoints this run wrote, the only ones pruning deletes: write their "
            f'steps into it (e.g. {{"steps": {complete}}} if every complete checkpoint there is this run\'s), or '
            f"delete it to count every complete checkpoint in {root} as this run's"
        )

    if path.is_symlink() or not path.is_file():
        raise damaged("not a regular file, as the trainer writes it")
    with open(path, "rb") as f:
        content = f.read(_MAX_HISTORY_BYTES + 1)
    if len(content) > _MAX_HISTORY_BYTES:
        raise damaged(f"larger than {_MAX_HISTORY_BYTES} bytes, not a history the trainer wrote")
    try:
        history = json.loads(content)
    except (ValueError, RecursionError):
        raise damaged("damaged (not JSON: cut off?)") from None
    steps = history.get("steps") if isinstance(history, dict) else None
    if not isinstance(steps, list):
        raise damaged('not {"steps": [...]}, as the trainer writes it')
    for step in steps:
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEPS:
            raise damaged(f"lists {shown_value(step)}, not a step in [0, {MAX_STEPS}]")
    return steps


def check_run_files(run_dir: Path) -> None:
    """The run files that a resume and the next save read, checked before any training (one line
    naming the file and what to do): ``checkpoints/`` a directory, its ``history.json`` (see
    :func:`_read_history`), and its ``latest.txt`` a file naming a checkpoint, since the next save
    replaces it (a file the trainer did not write there would be lost)."""
    root = Path(run_dir) / "checkpoints"
    if root.is_symlink() and not root.exists():
        raise ConfigError(f"{root}: a link to nothing; the run keeps its checkpoints there: point it at a directory")
    if not root.exists():
        return
    if not root.is_dir():
        raise ConfigError(f"{root}: not a directory; the run keeps its checkpoints there: move it away")
    _read_history(root)
    latest = root / LATEST_FILE
    if not latest.exists() and not latest.is_symlink():
        return
    named = None
    if latest.is_file() and not latest.is_symlink():
        with open(latest, "rb") as f:
            named = f.read(64)
    if named is None or not CHECKPOINT_NAME.fullmatch(named.decode("ascii", "replace").removesuffix("\n")):
        raise ConfigError(
            f"{latest}: does not name a checkpoint (iter_NNNNNNN) as the trainer writes it, and the next checkpoint "
            "replaces it: move it away"
        )


def _is_count(value: int) -> bool:
    return value >= 0


def _is_rate(value: float) -> bool:
    return math.isfinite(value) and value >= 0


_COUNT = (int, _is_count, "an integer >= 0")
_RATE = (float, _is_rate, "a finite number >= 0")
_NAME = (str, None, "")
_PROGRESS_FIELDS = {"step": _COUNT, "skipped_steps": _COUNT, "optimizer_steps": _COUNT}
_OPTIONAL_PROGRESS = {"skipped_steps", "optimizer_steps"}  # absent in checkpoints of earlier versions
_SAMPLER_FIELDS = {
    "version": _COUNT,
    "num_items": (int, lambda n: n >= 1, "an integer >= 1"),
    "seed": _COUNT,
    "shuffle": (bool, None, ""),
    "epoch": _COUNT,
    "position": _COUNT,
}
# Megatron's OptimizerParamScheduler.state_dict, as the trainer saves it.
_SCHEDULER_FIELDS = {
    "max_lr": _RATE,
    "min_lr": _RATE,
    "lr_warmup_steps": _COUNT,
    "lr_decay_steps": _COUNT,
    "lr_decay_style": _NAME,
    "num_steps": _COUNT,
    "start_wd": _RATE,
    "end_wd": _RATE,
    "wd_incr_steps": _COUNT,
    "wd_incr_style": _NAME,
}


def check_common(common: dict, directory: Path) -> None:
    """The trainer's entries of a checkpoint's common state, field by field: progress, scheduler,
    layout, the optimizer's common state (its form; its contents are Megatron's) and the run record.
    One ConfigError naming the first wrong field; every rank that reads the same verified file
    reaches the same verdict."""
    source = str(Path(directory) / COMMON_FILE)

    def check(container: dict, name: str, fields: dict, optional=frozenset()) -> None:
        for key, (kind, valid, expected) in fields.items():
            if key not in optional or key in container:
                checked_field(container, key, kind, source, f"{name}.{key}", valid, expected)

    progress = checked_field(common, "progress", dict, source, "progress")
    check(progress, "progress", _PROGRESS_FIELDS, _OPTIONAL_PROGRESS)
    if "sampler" in progress:
        sampler = checked_field(progress, "sampler", dict, source, "progress.sampler")
        check(sampler, "progress.sampler", _SAMPLER_FIELDS)
    check(checked_field(common, "scheduler", dict, source, "scheduler"), "scheduler", _SCHEDULER_FIELDS)
    if "layout" in common:  # [tensor, pipeline, data] parallel sizes
        checked_field(
            common,
            "layout",
            list,
            source,
            "layout",
            lambda sizes: (
                len(sizes) == 3 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)
            ),
            "[tensor, pipeline, data] parallel sizes",
        )
    optimizer = checked_field(common, "optimizer", dict, source, "optimizer")
    if "param_state_sharding_type" in optimizer:
        checked_field(
            optimizer,
            "param_state_sharding_type",
            str,
            source,
            "optimizer.param_state_sharding_type",
            lambda sharding: sharding == _OPTIMIZER_SHARDING,
            f"{_OPTIMIZER_SHARDING!r}, the form the trainer saves and reads",
        )
    if RECORD_KEY in common:
        check_record(common, source)


def _rng_object(ctx: ParallelContext, state: dict | None):
    """This rank's RNG states as a sharded object, one per (pp, tp, dp) position."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape, position = (ctx.pp_size, ctx.tp_size, ctx.dp_size), (ctx.pp_rank, ctx.tp_rank, ctx.dp_rank)
    return ShardedObject("rng_state", state, shape, position, replica_id=0)


class Checkpointer:
    def __init__(self, run_dir: Path, keep_last: int, ctx: ParallelContext | None = None):
        """``ctx``: this rank's parallel context, needed by :meth:`save` and :meth:`load` only."""
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.ctx = ctx

    def _parallel_context(self) -> ParallelContext:
        if self.ctx is None:
            raise RuntimeError("Checkpointer: save and load need this rank's parallel context (ctx=)")
        return self.ctx

    @staticmethod
    def name(step: int) -> str:
        return f"iter_{step:07d}"

    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = []
        for entry in self.root.iterdir():
            match = CHECKPOINT_NAME.fullmatch(entry.name)
            if match and (entry / COMPLETE_MARKER).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest(self) -> Path | None:
        """The newest complete checkpoint. Found by a scan: ``latest.txt`` (for people and tools)
        is written after the rename, so a kill in between leaves it one checkpoint behind."""
        steps = self.complete_steps()
        return self.root / self.name(steps[-1]) if steps else None

    def latest_intact(self) -> Path | None:
        """The newest complete checkpoint whose files match the checksums in its marker. Collective:
        every rank gets the same answer (rank 0's list of checkpoints, verdicts shared over the CPU
        group). A damaged one is skipped with a message saying why; damaged ones only are an error."""
        from stapo_megatron.checkpoint.dist import cpu_group
        from stapo_megatron.checkpoint.integrity import verify_checkpoint
        from stapo_megatron.config import ConfigError

        steps = [self.complete_steps() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(steps, src=0, group=cpu_group())
        assert steps[0] is not None  # rank 0's list, on every rank after the broadcast
        skipped = []
        for step in reversed(steps[0]):
            directory = self.root / self.name(step)
            try:
                verify_checkpoint(directory)
            except ConfigError as err:
                skipped.append(f"{directory.name}: {err}")
                if dist.get_rank() == 0:
                    logger.warning("skipping damaged checkpoint %s: %s", directory.name, err)
                continue
            self._verified = directory
            return directory
        if skipped:
            raise ConfigError(
                f"{self.root}: no intact checkpoint to resume from ({len(skipped)} damaged; newest {skipped[0]})"
            )
        return None

    def save(
        self, step: int, model, optimizer, scheduler, progress: dict, arch, params_dtype, assets=None, record=None
    ) -> Path:
        """Collective: every rank calls it. ``record``: the run's record
        (:func:`stapo_megatron.trainer.run_record.run_record`), the same on every rank."""
        ctx = self._parallel_context()
        model_state = unwrap(model).sharded_state_dict()
        state = {
            MODEL_KEY: model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=False, metadata=_OPTIMIZER_METADATA),
            "scheduler": scheduler.state_dict(),
            "progress": progress,
            "layout": _layout(ctx),
            "rng_state": _rng_object(ctx, rng.capture()),
            META_KEY: checkpoint_meta(arch, params_dtype),
        }
        if record is not None:
            state[RECORD_KEY] = record
        target = self.root / self.name(step)
        with reporting_no_space(self.root):
            try:
                if dist.get_rank() == 0:
                    # Recorded before the write: a step in the history whose write was killed is harmless.
                    self._write_history([*self.history(), step])
                directory = save_dist(state, target, metadata={"step": step}, assets=assets)
                if dist.get_rank() == 0:
                    with atomic_open(self.root / LATEST_FILE) as f:
                        f.write(self.name(step))
                    self._prune(step)
            except BaseException as error:  # torch's CheckpointException is not an Exception
                # here, not at the top: the launcher reads the directory without loading torch's checkpointing
                from torch.distributed.checkpoint.api import CheckpointException

                if dist.get_rank() == 0:
                    shutil.rmtree(staging_dir(target), ignore_errors=True)  # no partial checkpoint stays
                if isinstance(error, CheckpointException):
                    # Every rank raises it at the same point, but only rank 0's holds the causes.
                    full = [is_no_space(error)]
                    dist.broadcast_object_list(full, src=0, group=ctx.cpu_group)
                    if full[0]:
                        raise NoSpaceError(self.root) from None
                raise
        dist.barrier()
        return directory

    def history(self) -> list[int]:
        """The steps of this run's checkpoints, in the order they were saved. The run is this
        directory's only one (``stapo train`` moves an earlier run away before starting afresh);
        a directory from before the history file starts from its complete checkpoints."""
        steps = _read_history(self.root)
        return self.complete_steps() if steps is None else steps

    def _write_history(self, steps: list[int]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with atomic_open(self.root / HISTORY_FILE) as f:
            json.dump({"steps": steps}, f)

    def _prune(self, saved: int) -> None:
        """After ``saved`` is written: delete this run's checkpoints other than the newest
        ``keep_last`` it saved, and those of steps after ``saved`` (left by a trajectory that a
        resume from an earlier checkpoint abandoned, which a later resume must not jump back to).
        Checkpoints this run did not write are not touched."""
        history = [s for s in dict.fromkeys(reversed(self.history())) if s <= saved]  # newest first, once each
        kept = history[: self.keep_last]
        for step in set(self.history()) - set(kept):
            shutil.rmtree(self.root / self.name(step), ignore_errors=True)
        self._write_history(kept[::-1])
        for entry in self.root.iterdir():
            # Staging directories of writes that were killed.
            if entry.name.startswith(".iter_") and entry.name.endswith((".partial", ".old")):
                shutil.rmtree(entry, ignore_errors=True)

    @staticmethod
    def read_common(directory: Path) -> dict:
        """A checkpoint's common state, its trainer entries checked (:func:`check_common`)."""
        from stapo_megatron.checkpoint.dist import load_common

        common = load_common(directory)
        check_common(common, directory)
        return common

    def load(self, directory: Path, model, optimizer, scheduler) -> dict:
        """Restore everything; returns the saved progress dict. Collective. The checkpoint is
        verified against its checksums first, unless :meth:`latest_intact` just did that. The RNG
        states are restored only into the layout that saved them (they are per rank place)."""
        from stapo_megatron.checkpoint.integrity import verify_checkpoint

        ctx = self._parallel_context()
        if Path(directory) != getattr(self, "_verified", None):
            verify_checkpoint(directory)
        common = self.read_common(directory)
        same_layout = common.get("layout") == _layout(ctx)
        model_state = unwrap(model).sharded_state_dict()
        request = {
            MODEL_KEY: model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True, metadata=_OPTIMIZER_METADATA),
        }
        if same_layout:
            request["rng_state"] = _rng_object(ctx, None)
        loaded = load_dist(request, directory)
        unwrap(model).load_state_dict(loaded[MODEL_KEY])
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(common["scheduler"])
        if same_layout:
            rng.restore(loaded["rng_state"])
        return common["progress"]
