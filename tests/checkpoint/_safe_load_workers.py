"""Rank function of tests/checkpoint/test_safe_load.py: the safe loader against the installed
megatron-core's own ``dist_checkpointing.load``, on a checkpoint the test wrote (trusted here)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch


def _leaves(tree, path=()):
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from _leaves(tree[key], (*path, str(key)))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _leaves(value, (*path, str(index)))
    else:
        yield "/".join(path), tree


def _same(ours, theirs) -> bool:
    if isinstance(ours, torch.Tensor):
        return isinstance(theirs, torch.Tensor) and ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    if isinstance(ours, io.BytesIO):
        return isinstance(theirs, io.BytesIO) and ours.getvalue() == theirs.getvalue()
    return type(ours) is type(theirs) and ours == theirs


def compare_with_megatron_load(ckpt_dir: str, out_dir: str) -> None:
    from megatron.core import dist_checkpointing

    from stapo_megatron.checkpoint import safe_load
    from stapo_megatron.checkpoint.convert import _init_ranks, model_state, read_meta
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.trainer.checkpointing import _rng_object

    ctx = _init_ranks(2, 1)
    arch, params_dtype = read_meta(ckpt_dir)
    model = build_stage(arch, ctx, params_dtype=params_dtype, perform_initialization=False, device=ctx.device)
    # the model (tensors) and this rank's RNG states (a stored object), as a resume asks for them
    ours = dict(_leaves(safe_load.load({**model_state(model), "rng_state": _rng_object(ctx, None)}, ckpt_dir)))
    theirs = dict(
        _leaves(dist_checkpointing.load({**model_state(model), "rng_state": _rng_object(ctx, None)}, ckpt_dir))
    )
    differing = sorted(key for key in ours.keys() & theirs.keys() if not _same(ours[key], theirs[key]))
    result = {
        "only_ours": sorted(ours.keys() - theirs.keys()),
        "only_theirs": sorted(theirs.keys() - ours.keys()),
        "differing": differing,
        "tensors": sum(isinstance(v, torch.Tensor) for v in ours.values()),
        "others": sorted(k for k, v in ours.items() if not isinstance(v, torch.Tensor)),
    }
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(result))
