"""Training checkpoints: model, optimizer, scheduler, progress, sampler and RNG, atomically.

A :class:`Checkpointer` is built once with the states it saves (as torchtitan's checkpoint manager
is) and then called with a step: :meth:`Checkpointer.save` writes ``<run>/checkpoints/iter_NNNNNNN/``
(a Megatron distributed checkpoint, renamed into place only when whole: see
:mod:`stapo_megatron.checkpoint.dist`), :meth:`Checkpointer.load` restores one. Which checkpoints
the directory holds and which a save keeps is :mod:`stapo_megatron.trainer.checkpoint_directory`'s;
which one a run resumes, :mod:`stapo_megatron.trainer.resume`'s. A full disk is one
``no space left on <run>/checkpoints`` error, and the partial write is removed.

Every checkpoint carries the run's record (:mod:`stapo_megatron.trainer.run_record`), and the
trainer's own entries of its common state are checked field by field when read
(:func:`check_common`).

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

import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from stapo_megatron.checkpoint.convert import (
    META_KEY,
    MODEL_KEY,
    checkpoint_meta,
    load_model_state,
    model_sharded_state,
)
from stapo_megatron.checkpoint.dist import load_common, load_dist, save_dist, staging_dir
from stapo_megatron.checkpoint.integrity import verify_checkpoint
from stapo_megatron.checkpoint.safe_load import common_state_source
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.runtime import rng
from stapo_megatron.runtime.distributed import ParallelContext
from stapo_megatron.runtime.run_files import NoSpaceError, is_no_space, reporting_no_space
from stapo_megatron.runtime.stateful import Stateful
from stapo_megatron.trainer.checkpoint_directory import CheckpointDirectory
from stapo_megatron.trainer.run_record import RECORD_KEY, check_record, checked_field

# Only data-parallel resharding is allowed for the optimizer state; saving is fully parallel (see above).
_OPTIMIZER_SHARDING = "dp_reshardable"
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": _OPTIMIZER_SHARDING}


def _is_count(value: int) -> bool:
    return value >= 0


def _is_rate(value: float) -> bool:
    return math.isfinite(value) and value >= 0


_COUNT = (int, _is_count, "an integer >= 0")
_RATE = (float, _is_rate, "a finite number >= 0")
_NAME = (str, None, "")
_PROGRESS_FIELDS = {"step": _COUNT, "skipped_steps": _COUNT, "optimizer_steps": _COUNT}
_OPTIONAL_PROGRESS = {"skipped_steps", "optimizer_steps"}  # absent in checkpoints of earlier versions
# What generation beside training had done ahead of the step (RolloutPipeline.state_dict; its
# contents are checked where they are read, against the run).
PIPELINE_KEY = "rollout_pipeline"
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
    source = common_state_source(directory)

    def check(container: dict, name: str, fields: dict, optional=frozenset()) -> None:
        for key, (kind, valid, expected) in fields.items():
            if key not in optional or key in container:
                checked_field(container, key, kind, source, f"{name}.{key}", valid, expected)

    progress = checked_field(common, "progress", dict, source, "progress")
    check(progress, "progress", _PROGRESS_FIELDS, _OPTIONAL_PROGRESS)
    if "sampler" in progress:
        sampler = checked_field(progress, "sampler", dict, source, "progress.sampler")
        check(sampler, "progress.sampler", _SAMPLER_FIELDS)
    if PIPELINE_KEY in progress:
        checked_field(progress, PIPELINE_KEY, dict, source, f"progress.{PIPELINE_KEY}")
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


def read_common(directory: Path) -> dict:
    """A checkpoint's common state, its trainer entries checked (:func:`check_common`)."""
    common = load_common(directory)
    check_common(common, directory)
    return common


def _layout(ctx: ParallelContext) -> list[int]:
    return [ctx.tp_size, ctx.pp_size, ctx.dp_size]


def _rng_object(ctx: ParallelContext, state: dict | None):
    """This rank's RNG states as a sharded object, one per (pp, tp, dp) position."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape, position = (ctx.pp_size, ctx.tp_size, ctx.dp_size), (ctx.pp_rank, ctx.tp_rank, ctx.dp_rank)
    return ShardedObject("rng_state", state, shape, position, replica_id=0)


class Checkpointer:
    """Saves and restores this rank's share of the training state in the run's checkpoint directory.

    Built once with the states it saves: the model and the optimizer (Megatron's sharded state),
    the scheduler and the progress (:class:`~stapo_megatron.runtime.stateful.Stateful`: the
    progress is the step, the update's outcome counts and the sampler's position, the same on
    every rank), the run's record, the model's architecture and dtype (an export reads them), and
    the tokenizer files every checkpoint carries (``assets``: file name -> path; None: none).
    """

    def __init__(
        self,
        directory: CheckpointDirectory,
        ctx: ParallelContext,
        *,
        model,
        optimizer,
        scheduler: Stateful,
        progress: Stateful,
        record: dict,
        arch: Qwen3Config,
        params_dtype: torch.dtype,
        assets: dict[str, Path] | None,
    ):
        self.directory = directory
        self.ctx = ctx
        self.model, self.optimizer, self.scheduler, self.progress = model, optimizer, scheduler, progress
        self.record = record
        self.meta = checkpoint_meta(arch, params_dtype)
        self.assets = assets

    def save(self, step: int) -> Path:
        """Write the checkpoint of ``step``, then prune. Collective: every rank calls it."""
        ctx, root = self.ctx, self.directory.root
        model_state = model_sharded_state(self.model)
        state = {
            MODEL_KEY: model_state,
            "optimizer": self.optimizer.sharded_state_dict(model_state, is_loading=False, metadata=_OPTIMIZER_METADATA),
            "scheduler": self.scheduler.state_dict(),
            "progress": self.progress.state_dict(),
            "layout": _layout(ctx),
            "rng_state": _rng_object(ctx, rng.capture()),
            META_KEY: self.meta,
            RECORD_KEY: self.record,
        }
        target = self.directory.path(step)
        with reporting_no_space(root):
            try:
                if ctx.rank == 0:
                    self.directory.add_to_history(step)
                directory = save_dist(state, target, ctx, metadata={"step": step}, assets=self.assets)
                if ctx.rank == 0:
                    self.directory.saved(step)
            except BaseException as error:  # torch's CheckpointException is not an Exception
                # here, not at the top: the launcher reads the directory without loading torch's checkpointing
                from torch.distributed.checkpoint.api import CheckpointException

                if ctx.rank == 0:
                    shutil.rmtree(staging_dir(target), ignore_errors=True)  # no partial checkpoint stays
                # Every rank raises it at the same point, but only rank 0's holds the causes.
                if isinstance(error, CheckpointException) and ctx.broadcast_object(is_no_space(error)):
                    raise NoSpaceError(root) from None
                raise
        dist.barrier(group=ctx.world_group)
        return directory

    def load(self, checkpoint: Path, *, verified: bool = False) -> None:
        """Restore every state from ``checkpoint``. Collective. Its files are checked against their
        checksums first, unless ``verified`` (:meth:`CheckpointDirectory.latest_intact` just did
        that). The RNG states are restored only into the layout that saved them (they are per
        rank place)."""
        ctx = self.ctx
        if not verified:
            verify_checkpoint(checkpoint, ctx)
        common = read_common(checkpoint)
        same_layout = common.get("layout") == _layout(ctx)
        model_state = model_sharded_state(self.model)
        request = {
            MODEL_KEY: model_state,
            "optimizer": self.optimizer.sharded_state_dict(model_state, is_loading=True, metadata=_OPTIMIZER_METADATA),
        }
        if same_layout:
            request["rng_state"] = _rng_object(ctx, None)
        loaded = load_dist(request, checkpoint)
        load_model_state(self.model, loaded[MODEL_KEY])
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.scheduler.load_state_dict(common["scheduler"])
        if same_layout:
            rng.restore(loaded["rng_state"])
        self.progress.load_state_dict(common["progress"])
