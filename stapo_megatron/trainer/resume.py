"""Which checkpoint a run resumes, and what the resume changes, decided before any weights are built.

On the ranks (:func:`resume_point`): the run directory's files checked, the newest intact
checkpoint chosen and its record compared with this run's (:func:`~stapo_megatron.trainer.run_record.plan_resume`).
In the launcher, before any rank starts (:func:`check_resume_early`): the same comparison on the
newest complete checkpoint, so that a resume the ranks would refuse is refused without starting
torchrun. A refusal is one line.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from stapo_megatron.config import ConfigError
from stapo_megatron.trainer.checkpoint_directory import CheckpointDirectory, check_run_files
from stapo_megatron.trainer.checkpointing import read_common
from stapo_megatron.trainer.run_record import ResumePlan, plan_resume, run_record

if TYPE_CHECKING:
    from stapo_megatron.runtime.distributed import ParallelContext
    from stapo_megatron.trainer.config import TrainConfig

logger = logging.getLogger(__name__)

_Decision = TypeVar("_Decision")


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


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes (its files verified against their checksums) and what it changes."""

    checkpoint: Path
    plan: ResumePlan


def resume_point(ctx: ParallelContext, directory: CheckpointDirectory, mode: str, record: dict) -> ResumePoint | None:
    """The checkpoint to resume under ``checkpoint.resume=mode`` (None: start afresh), its record
    compared with this run's ``record``; each change it makes is logged once. Collective; a
    refusal is one line, raised on every rank alike."""
    decided_on_rank0(ctx, lambda: check_run_files(directory.root.parent))
    latest = directory.latest_intact(ctx) if mode != "never" else None
    if latest is None:
        if mode == "required":
            raise ConfigError(f"checkpoint.resume=required but {directory.root} has no complete checkpoint")
        return None
    plan = decided_on_rank0(ctx, lambda: plan_resume(latest, read_common(latest), record))
    if ctx.rank == 0:
        for change in plan.changes:
            logger.warning("%s", change)
    return ResumePoint(latest, plan)


def check_resume_early(cfg: TrainConfig) -> None:
    """Before any rank starts (``stapo train``'s launcher): a resume that the ranks would refuse,
    refused now, in one line, without starting torchrun or hashing the checkpoint. Compares the
    newest complete checkpoint of ``cfg``'s run directory; one whose common state cannot be read is
    left to the ranks, which verify it and fall back to an older one (and compare that)."""
    import tempfile

    from stapo_megatron.data.prompts import load_tokenizer

    if cfg.checkpoint.resume == "never":
        return
    latest = CheckpointDirectory(cfg.run.directory, cfg.checkpoint.keep_last).latest()
    if latest is None:
        return
    try:
        common = read_common(latest)
    except ConfigError:
        return
    with tempfile.TemporaryDirectory(prefix="stapo-tokenizer-") as written:
        tokenizer_dir = cfg.hf_tokenizer_dir
        if cfg.data.is_synthetic:  # the ranks write it into the run directory; the same files, here
            load_tokenizer(cfg.data, "").save_pretrained(written)
            tokenizer_dir = written
        plan_resume(latest, common, run_record(cfg, tokenizer_dir))
