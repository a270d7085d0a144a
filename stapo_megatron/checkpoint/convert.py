"""Hugging Face Qwen3 <-> Megatron distributed checkpoints, at any TP/PP, streaming.

No process holds the whole model: each rank builds its own pipeline stage and tensor-parallel
shards, reads only its slices of the Hugging Face tensors, and on export writes its own share of
them (:mod:`stapo_megatron.checkpoint.export`, the same per-rank iterator the weight sync to the
rollout servers uses).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from stapo_megatron.checkpoint.dist import ASSETS_DIR, load_common, load_dist, save_dist
from stapo_megatron.checkpoint.export import (
    DEFAULT_BUCKET_BYTES,
    iter_rank_buckets,
    rank_export_names,
    stage_layer_offset,
    unwrap,
)
from stapo_megatron.checkpoint.hf_io import (
    HFCheckpoint,
    SafetensorsStreamWriter,
    dtype_from_name,
    finalize_shards,
)
from stapo_megatron.checkpoint.integrity import verify_checkpoint
from stapo_megatron.config import ConfigError
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.parallelize import build_stage, check_layout
from stapo_megatron.models.qwen3.state_dict_adapter import hf_tensor_shapes, load_shard, param_mappings

MODEL_KEY = "model"
META_KEY = "stapo"
# Files carried from a Hugging Face checkpoint (or a tokenizer directory) into an export.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def hf_assets(directory: str | Path) -> dict[str, Path]:
    """The tokenizer and generation files of a Hugging Face directory, by file name."""
    directory = Path(directory)
    return {name: directory / name for name in TOKENIZER_FILES if (directory / name).is_file()}


def checkpoint_meta(arch: Qwen3Config, params_dtype: torch.dtype) -> dict:
    return {"arch": dict(vars(arch)), "params_dtype": str(params_dtype).replace("torch.", ""), "format": 1}


def read_meta(directory: str | Path) -> tuple[Qwen3Config, torch.dtype]:
    """The architecture and parameter dtype a stapo Megatron checkpoint was written with."""
    meta = load_common(directory).get(META_KEY)
    if not meta:
        raise ConfigError(f"{directory}: has no '{META_KEY}' metadata (not written by stapo_megatron)")
    try:
        return Qwen3Config(**meta["arch"]), dtype_from_name(meta["params_dtype"])
    except (KeyError, TypeError) as err:
        raise ConfigError(f"{directory}: malformed '{META_KEY}' metadata ({type(err).__name__}: {err})") from None


def model_state(model: torch.nn.Module) -> dict:
    return {MODEL_KEY: unwrap(model).sharded_state_dict()}


def load_model(model: torch.nn.Module, directory: str | Path, verify: bool = True) -> None:
    """Load a checkpoint's model weights into this rank's stage, whatever layout wrote them.

    Collective. ``verify``: first check every file against the checksums in the checkpoint's
    marker (the hashing is shared by the ranks).
    """
    if verify:
        verify_checkpoint(directory)
    state = load_dist(model_state(model), directory)
    unwrap(model).load_state_dict(state[MODEL_KEY])


@torch.no_grad()
def fill_from_hf(model: torch.nn.Module, arch: Qwen3Config, hf: HFCheckpoint) -> None:
    """Copy this rank's slices of a Hugging Face checkpoint into the stage's parameters."""
    from megatron.core import parallel_state as ps

    model = unwrap(model)
    tp_rank = ps.get_tensor_model_parallel_rank()
    params = dict(model.named_parameters())
    for mapping in param_mappings(model, arch, stage_layer_offset(model)):
        param = params[mapping.megatron_name]
        shard = load_shard(mapping, hf.read, arch, param.shape, param.dtype, tp_rank)
        if shard.shape != param.shape:
            raise ConfigError(
                f"{hf.path}: {', '.join(mapping.hf_names)} give a {list(shard.shape)} shard for "
                f"{mapping.megatron_name}, expected {list(param.shape)}"
            )
        param.copy_(shard)


# ---- the two conversions, each run by every rank of a TP x PP launch --------------------------


def _init_ranks(tp: int, pp: int):
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    return init_distributed(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp))


def _hf_dtype(hf: HFCheckpoint) -> torch.dtype:
    return hf.dtype("model.embed_tokens.weight")


def hf_to_megatron_rank(hf_dir: str, out_dir: str, tp: int, pp: int, dtype_name: str | None) -> None:
    from stapo_megatron.runtime.distributed import device

    _init_ranks(tp, pp)
    arch = Qwen3Config.from_hf(hf_dir)
    hf = HFCheckpoint(hf_dir)
    dtype = dtype_from_name(dtype_name) if dtype_name else _hf_dtype(hf)
    model = build_stage(arch, params_dtype=dtype, perform_initialization=False, device=device())
    fill_from_hf(model, arch, hf)
    state = {**model_state(model), META_KEY: checkpoint_meta(arch, dtype)}
    save_dist(state, out_dir, metadata={"source": str(hf_dir)}, assets=hf_assets(hf_dir))


def megatron_to_hf_rank(
    ckpt_dir: str, tp: int, pp: int, dtype_name: str | None, max_shard_bytes: int, staging: str
) -> None:
    """Every rank writes its own share of the HF tensors (its stage, the parameters it owns in its
    TP group) into its own files; rank 0 names the files and writes the index."""
    ctx = _init_ranks(tp, pp)
    arch, params_dtype = read_meta(ckpt_dir)
    dtype = dtype_from_name(dtype_name) if dtype_name else None
    model = build_stage(arch, params_dtype=params_dtype, perform_initialization=False, device=ctx.device)
    load_model(model, ckpt_dir)
    names = rank_export_names(model, arch, ctx.tp_size, ctx.tp_rank)
    shapes = hf_tensor_shapes(arch)
    out_dtype = dtype or params_dtype
    writer = SafetensorsStreamWriter(
        staging, [(name, shapes[name], out_dtype) for name in names], max_shard_bytes, prefix=f"rank{ctx.rank:05d}-"
    )
    for bucket in iter_rank_buckets(
        model, arch, ctx, bucket_bytes=min(max_shard_bytes, DEFAULT_BUCKET_BYTES), dtype=dtype
    ):
        for name, tensor in bucket.named_tensors():
            writer.write(name, tensor)
    writer.close()
    gathered: list[list[tuple[str, list[str], int]]] = [[] for _ in range(ctx.world_size)]  # each rank's files
    dist.all_gather_object(gathered, writer.files, group=ctx.cpu_group)
    if ctx.rank == 0:
        finalize_shards(staging, [f for rank_files in gathered for f in rank_files])
    dist.barrier(group=ctx.cpu_group)


# ---- the entry points: check cheaply, then launch the ranks -----------------------------------


def _check_output(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir}: output directory exists and is not empty (pass --overwrite to replace it)")


def convert_hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Hugging Face Qwen3 safetensors -> Megatron distributed checkpoint at TP x PP."""
    from stapo_megatron.runtime.launch import spawn_ranks

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    arch = Qwen3Config.from_hf(hf_dir)
    check_layout(arch, tp, pp)
    hf = HFCheckpoint(hf_dir)
    ignorable = ["lm_head.weight"] if arch.tie_word_embeddings else []
    hf.check(hf_tensor_shapes(arch), ignorable=ignorable)
    if dtype:
        dtype_from_name(dtype)
    _check_output(out_dir, overwrite)
    spawn_ranks(hf_to_megatron_rank, tp * pp, str(hf_dir), str(out_dir), tp, pp, dtype)
    return out_dir


def convert_megatron_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Megatron checkpoint (any layout) -> sharded Hugging Face safetensors, loaded at TP x PP."""
    from stapo_megatron.runtime.launch import spawn_ranks

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    # Every file present with its recorded size, the small ones hashed; the ranks hash the rest.
    verify_checkpoint(ckpt_dir, full=False)
    arch, _ = read_meta(ckpt_dir)
    check_layout(arch, tp, pp)
    if dtype:
        dtype_from_name(dtype)
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise ConfigError(f"--tokenizer {tokenizer_dir}: not a directory")
    _check_output(out_dir, overwrite)
    staging = out_dir.parent / f".{out_dir.name}.partial"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    spawn_ranks(megatron_to_hf_rank, tp * pp, str(ckpt_dir), tp, pp, dtype, max_shard_bytes, str(staging))
    hf_config = arch.to_hf_dict()
    if dtype:
        hf_config["torch_dtype"] = dtype
    with open(staging / "config.json", "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)
    assets = hf_assets(tokenizer_dir) if tokenizer_dir is not None else hf_assets(ckpt_dir / ASSETS_DIR)
    for name, source in assets.items():
        shutil.copy2(source, staging / name)
    # Replace a previous export only now that the new one is whole.
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
    return out_dir
