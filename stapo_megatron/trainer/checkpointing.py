"""Training checkpoints: model, optimizer, scheduler, progress, sampler and RNG, atomically.

``<run>/checkpoints/iter_0000042/`` is a Megatron distributed checkpoint, renamed into place only
when whole (see :mod:`stapo_megatron.checkpoint.dist`); ``latest.txt`` names the newest one and
is replaced atomically after it. Resuming trusts only complete directories, so a kill during a
write falls back to the previous checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from stapo_megatron.checkpoint.convert import META_KEY, MODEL_KEY, checkpoint_meta, unwrap
from stapo_megatron.checkpoint.dist import COMPLETE_MARKER, load_dist, save_dist
from stapo_megatron.runtime import rng

LATEST_FILE = "latest.txt"
_ITER_RE = re.compile(r"^iter_(\d{7})$")
# Only data-parallel resharding is allowed for the optimizer state; saving is fully parallel.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _layout() -> list[int]:
    from megatron.core import parallel_state as ps

    return [
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
    ]


def _rng_object(state: dict | None):
    """This rank's RNG states as a sharded object, one per (pp, tp, dp) position."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tp, pp, dp = _layout()
    return ShardedObject(
        "rng_state",
        state,
        (pp, tp, dp),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()),
        replica_id=0,
    )


class Checkpointer:
    def __init__(self, run_dir: Path, keep_last: int):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

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

    def save(self, step: int, model, optimizer, scheduler, progress: dict, arch, params_dtype, assets=None) -> Path:
        """Collective: every rank calls it."""
        model_state = unwrap(model).sharded_state_dict()
        state = {
            MODEL_KEY: model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=False, metadata=_OPTIMIZER_METADATA),
            "scheduler": scheduler.state_dict(),
            "progress": progress,
            "layout": _layout(),
            "rng_state": _rng_object(rng.capture()),
            META_KEY: checkpoint_meta(arch, params_dtype),
        }
        directory = save_dist(state, self.root / self.name(step), metadata={"step": step}, assets=assets)
        if dist.get_rank() == 0:
            temporary = self.root / f".{LATEST_FILE}.tmp"
            temporary.write_text(self.name(step))
            os.replace(temporary, self.root / LATEST_FILE)
            self._prune()
        dist.barrier()
        return directory

    def _prune(self) -> None:
        for old in self.complete_steps()[: -self.keep_last]:
            shutil.rmtree(self.root / self.name(old), ignore_errors=True)
        for entry in self.root.iterdir():
            # Staging directories of writes that were killed.
            if entry.name.startswith(".iter_") and entry.name.endswith((".partial", ".old")):
                shutil.rmtree(entry, ignore_errors=True)

    def load(self, directory: Path, model, optimizer, scheduler) -> dict:
        """Restore everything; returns the saved progress dict. Collective."""
        from stapo_megatron.checkpoint.dist import load_common

        common = load_common(directory)
        same_layout = common.get("layout") == _layout()
        model_state = unwrap(model).sharded_state_dict()
        request = {
            MODEL_KEY: model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True, metadata=_OPTIMIZER_METADATA),
        }
        if same_layout:
            request["rng_state"] = _rng_object(None)
        loaded = load_dist(request, directory)
        unwrap(model).load_state_dict(loaded[MODEL_KEY])
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(common["scheduler"])
        if same_layout:
            rng.restore(loaded["rng_state"])
        return common["progress"]
