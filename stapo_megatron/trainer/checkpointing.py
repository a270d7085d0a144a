"""Training checkpoints: model, optimizer, scheduler, progress, sampler and RNG, atomically.

``<run>/checkpoints/iter_0000042/`` is a Megatron distributed checkpoint, renamed into place only
when whole (see :mod:`stapo_megatron.checkpoint.dist`); ``latest.txt`` names the newest one and
is replaced atomically after it. Resuming trusts only complete directories, so a kill during a
write falls back to the previous checkpoint. ``history.json`` lists the steps this run saved:
pruning deletes only those, never a checkpoint by its step number alone. A full disk is one
``no space left on <run>/checkpoints`` error, and the partial write is removed.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from stapo_megatron.checkpoint.convert import META_KEY, MODEL_KEY, checkpoint_meta, unwrap
from stapo_megatron.checkpoint.dist import COMPLETE_MARKER, load_dist, save_dist, staging_dir
from stapo_megatron.runtime import rng
from stapo_megatron.runtime.distributed import ParallelContext
from stapo_megatron.runtime.run_files import NoSpaceError, atomic_open, is_no_space, reporting_no_space

logger = logging.getLogger(__name__)

LATEST_FILE = "latest.txt"
HISTORY_FILE = "history.json"
_ITER_RE = re.compile(r"^iter_(\d{7})$")
# Only data-parallel resharding is allowed for the optimizer state; saving is fully parallel.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _layout(ctx: ParallelContext) -> list[int]:
    return [ctx.tp_size, ctx.pp_size, ctx.dp_size]


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
            match = _ITER_RE.match(entry.name)
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

    def save(self, step: int, model, optimizer, scheduler, progress: dict, arch, params_dtype, assets=None) -> Path:
        """Collective: every rank calls it."""
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
        path = self.root / HISTORY_FILE
        if not path.is_file():
            return self.complete_steps()
        with open(path, encoding="utf-8") as f:
            return json.load(f)["steps"]

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

    def load(self, directory: Path, model, optimizer, scheduler) -> dict:
        """Restore everything; returns the saved progress dict. Collective. The checkpoint is
        verified against its checksums first, unless :meth:`latest_intact` just did that."""
        from stapo_megatron.checkpoint.dist import load_common
        from stapo_megatron.checkpoint.integrity import verify_checkpoint

        ctx = self._parallel_context()
        if Path(directory) != getattr(self, "_verified", None):
            verify_checkpoint(directory)
        common = load_common(directory)
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
