"""Hugging Face Qwen3 <-> Megatron distributed checkpoints, at any TP/PP, streaming.

No process holds the whole model: each rank builds its own pipeline stage and tensor-parallel
shards, reads only its slices of the Hugging Face tensors, and on export writes its own share of
them (:mod:`stapo_megatron.checkpoint.export`, the same per-rank iterator the weight sync to the
rollout servers uses).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
import typing
from pathlib import Path

import torch
import torch.distributed as dist

from stapo_megatron.checkpoint.dist import (
    ASSETS_DIR,
    common_field,
    foreign_entry,
    load_common,
    load_dist,
    remove_leftover,
    replaced_dir,
    save_dist,
    staging_dir,
)
from stapo_megatron.checkpoint.export import (
    DEFAULT_BUCKET_BYTES,
    iter_rank_buckets,
    rank_export_names,
    stage_layer_offset,
    unwrap,
)
from stapo_megatron.checkpoint.hf_io import (
    EVAL_EXPORT_MARKER,
    EXPORT_MARKER,
    INDEX_FILE,
    SINGLE_FILE,
    HFCheckpoint,
    SafetensorsStreamWriter,
    dtype_from_name,
    finalize_shards,
)
from stapo_megatron.checkpoint.integrity import verify_checkpoint
from stapo_megatron.checkpoint.marker import COMPLETE_MARKER, check_complete
from stapo_megatron.checkpoint.safe_load import common_state_source
from stapo_megatron.config import ConfigError
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.parallelize import build_stage, check_layout
from stapo_megatron.models.qwen3.state_dict_adapter import hf_tensor_shapes, load_shard, param_mappings

if typing.TYPE_CHECKING:
    from stapo_megatron.runtime.distributed import ParallelContext

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
# Everything an export holds: the config, the shards and their index, the tokenizer files, the markers.
_EXPORT_ENTRY = re.compile(
    "|".join(
        [re.escape(name) for name in ("config.json", SINGLE_FILE, INDEX_FILE, EXPORT_MARKER, EVAL_EXPORT_MARKER)]
        + [re.escape(name) for name in TOKENIZER_FILES]
        + [r"model-\d{5}-of-\d{5}\.safetensors"]
    )
)


def hf_assets(directory: str | Path) -> dict[str, Path]:
    """The tokenizer and generation files of a Hugging Face directory, by file name."""
    directory = Path(directory)
    return {name: directory / name for name in TOKENIZER_FILES if (directory / name).is_file()}


def checkpoint_meta(arch: Qwen3Config, params_dtype: torch.dtype) -> dict:
    return {"arch": dict(vars(arch)), "params_dtype": str(params_dtype).replace("torch.", ""), "format": 1}


def read_meta(directory: str | Path) -> tuple[Qwen3Config, torch.dtype]:
    """The architecture and parameter dtype a stapo Megatron checkpoint was written with; each
    field of its ``stapo`` entry checked, a wrong one a one-line ConfigError naming it."""
    common = load_common(directory)
    if META_KEY not in common:
        raise ConfigError(f"{directory}: has no '{META_KEY}' metadata (not written by stapo_megatron)")
    source = common_state_source(directory)
    meta = common_field(common, META_KEY, dict, source)
    version = common_field(meta, "format", int, source, f"{META_KEY}.format")
    if version != 1:
        raise ConfigError(f"{source}: field {META_KEY}.format is {version}; this stapo reads format 1")
    arch = common_field(meta, "arch", dict, source, f"{META_KEY}.arch")
    kinds = typing.get_type_hints(Qwen3Config)
    unknown = sorted(set(arch) - {f.name for f in dataclasses.fields(Qwen3Config)})
    if unknown:
        raise ConfigError(f"{source}: field {META_KEY}.arch.{unknown[0]} is not a Qwen3 architecture field")
    # every field, typed (Qwen3Config checks ranges, not types); a default for a missing one
    # would build a model of another shape than the stored weights
    for field in dataclasses.fields(Qwen3Config):
        common_field(arch, field.name, kinds[field.name], source, f"{META_KEY}.arch.{field.name}")
    try:
        config = Qwen3Config(**arch)
    except ConfigError as err:
        raise ConfigError(f"{source}: field {META_KEY}.arch.{err}") from None
    dtype_name = common_field(meta, "params_dtype", str, source, f"{META_KEY}.params_dtype")
    try:
        dtype = dtype_from_name(dtype_name)
    except ConfigError:
        raise ConfigError(f"{source}: field {META_KEY}.params_dtype is {dtype_name!r}, not a torch dtype") from None
    return config, dtype


# Transformer Engine's modules add ``_extra_state`` objects (FP8 scaling state: nothing here trains in
# FP8) that Megatron's local layers hold empty or lack (TE's attention and norms), and TE unpickles
# them on load. Checkpoints leave them out, so one format serves both layer specs: a checkpoint
# converted on a host without TE loads on one with it and back. The layer norms need nothing: the
# local spec already names them as TE's fused ones (its sharded_state_dict_keys_map).
EXTRA_STATE_SUFFIX = "._extra_state"


def model_sharded_state(model: torch.nn.Module) -> dict:
    """The stage's sharded state dict as every checkpoint holds it, whichever layer spec built the model."""
    return {k: v for k, v in unwrap(model).sharded_state_dict().items() if not k.endswith(EXTRA_STATE_SUFFIX)}


def model_state(model: torch.nn.Module) -> dict:
    return {MODEL_KEY: model_sharded_state(model)}


def load_model_state(model: torch.nn.Module, state: dict) -> None:
    """Load what :func:`model_sharded_state` gave (filled by the checkpoint) into the stage: every
    parameter, no ``_extra_state`` (modules keep their own)."""
    missing, unexpected = unwrap(model).load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith(EXTRA_STATE_SUFFIX)]
    if missing or unexpected:
        raise RuntimeError(
            f"the checkpoint's model state does not fit the stage: missing {missing}, unexpected {unexpected}"
        )


def load_model(model: torch.nn.Module, directory: str | Path, ctx: ParallelContext, verify: bool = True) -> None:
    """Load a checkpoint's model weights into this rank's stage, whatever layout wrote them.

    Collective over ``ctx``'s ranks. ``verify``: first check every file against the checksums in
    the checkpoint's marker (the hashing is shared by the ranks).
    """
    if verify:
        verify_checkpoint(directory, ctx)
    state = load_dist(model_state(model), directory)
    load_model_state(model, state[MODEL_KEY])


@torch.no_grad()
def fill_from_hf(model: torch.nn.Module, arch: Qwen3Config, hf: HFCheckpoint, ctx: ParallelContext) -> None:
    """Copy this rank's slices (its tensor-parallel rank in ``ctx``) of a Hugging Face checkpoint
    into the stage's parameters."""
    model = unwrap(model)
    params = dict(model.named_parameters())
    for mapping in param_mappings(model, arch, stage_layer_offset(model)):
        param = params[mapping.megatron_name]
        shard = load_shard(mapping, hf.read, arch, param.shape, param.dtype, ctx.tp_rank)
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
    ctx = _init_ranks(tp, pp)
    arch = Qwen3Config.from_hf(hf_dir)
    hf = HFCheckpoint(hf_dir)
    dtype = dtype_from_name(dtype_name) if dtype_name else _hf_dtype(hf)
    model = build_stage(arch, ctx, params_dtype=dtype, perform_initialization=False, device=ctx.device)
    fill_from_hf(model, arch, hf, ctx)
    state = {**model_state(model), META_KEY: checkpoint_meta(arch, dtype)}
    save_dist(state, out_dir, ctx, metadata={"source": str(hf_dir)}, assets=hf_assets(hf_dir))


def megatron_to_hf_rank(
    ckpt_dir: str, tp: int, pp: int, dtype_name: str | None, max_shard_bytes: int, staging: str
) -> None:
    """Every rank writes its own share of the HF tensors (its stage, the parameters it owns in its
    TP group) into its own files; rank 0 names the files and writes the index."""
    ctx = _init_ranks(tp, pp)
    arch, params_dtype = read_meta(ckpt_dir)
    dtype = dtype_from_name(dtype_name) if dtype_name else None
    model = build_stage(arch, ctx, params_dtype=params_dtype, perform_initialization=False, device=ctx.device)
    load_model(model, ckpt_dir, ctx)
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
    gathered: list[list[tuple[str, list[str], int]]] = ctx.all_gather_object(writer.files)  # each rank's files
    if ctx.rank == 0:
        finalize_shards(staging, [f for rank_files in gathered for f in rank_files])
    dist.barrier(group=ctx.cpu_group)


# ---- the entry points: check cheaply, then launch the ranks -----------------------------------


def _not_replaceable(out_dir: Path) -> str | None:
    """Why ``--overwrite`` may not replace ``out_dir``, or None: only an output of ``stapo convert``
    holding nothing it did not write is replaced. A Hugging Face export is known by its
    :data:`EXPORT_MARKER` (or, from before it, ``stapo eval``'s marker), a Megatron checkpoint by
    a completion marker that records the checkpoint it was converted from (a training checkpoint
    records its step instead, and is its run's)."""
    if any((out_dir / marker).is_file() for marker in (EXPORT_MARKER, EVAL_EXPORT_MARKER)):
        for entry in sorted(out_dir.iterdir()):
            if not _EXPORT_ENTRY.fullmatch(entry.name) or entry.is_symlink() or not entry.is_file():
                return f"{entry.name} in it is not a file an export writes"
        return None
    if (out_dir / COMPLETE_MARKER).is_file():
        try:
            marker = check_complete(out_dir)
        except ConfigError as err:
            return str(err)
        if "step" in marker:
            return f"it is a training checkpoint (step {marker['step']}), which belongs to its run"
        if "source" not in marker:
            return f"its {COMPLETE_MARKER} records no checkpoint it was converted from"
        foreign = foreign_entry(out_dir)
        return None if foreign is None else f"{foreign} in it is not a file a checkpoint holds"
    return f"it holds neither {EXPORT_MARKER} (an export) nor {COMPLETE_MARKER} (a checkpoint)"


def _check_output(out_dir: Path, overwrite: bool) -> None:
    """``out_dir`` is free, empty, or (with ``overwrite``) an output of ``stapo convert`` to replace."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise ConfigError(f"--out {out_dir}: exists and is not a directory (give a directory, not a link)")
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"{out_dir}: output directory exists and is not empty (pass --overwrite to replace it)")
    reason = _not_replaceable(out_dir)
    if reason:
        raise ConfigError(
            f"--out {out_dir}: --overwrite replaces only what stapo convert wrote, and {reason} (move it away, or "
            "choose another --out)"
        )


def _replace(new: Path, target: Path) -> None:
    """Put the directory ``new`` at ``target``; what was there is removed only once ``new`` is in place."""
    if not os.path.lexists(target):
        os.replace(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, old / target.name)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(old / target.name, target)
        old.rmdir()
        raise
    shutil.rmtree(old)


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
    # what a killed conversion left beside it (refused, and kept, unless a checkpoint write made it)
    remove_leftover(staging_dir(out_dir))
    remove_leftover(replaced_dir(out_dir))
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
    # The index checked against itself and the data files' sizes here, not once per rank.
    from stapo_megatron.checkpoint.dcp_index import METADATA_FILE, read_dcp_metadata

    read_dcp_metadata(ckpt_dir / METADATA_FILE)
    check_layout(arch, tp, pp)
    if dtype:
        dtype_from_name(dtype)
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise ConfigError(f"--tokenizer {tokenizer_dir}: not a directory")
    _check_output(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # a name of its own: nothing that was there before is ever removed
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        spawn_ranks(megatron_to_hf_rank, tp * pp, str(ckpt_dir), tp, pp, dtype, max_shard_bytes, str(staging))
        hf_config = arch.to_hf_dict()
        if dtype:
            hf_config["torch_dtype"] = dtype
        with open(staging / "config.json", "w", encoding="utf-8") as f:
            json.dump(hf_config, f, indent=2)
        assets = hf_assets(tokenizer_dir) if tokenizer_dir is not None else hf_assets(ckpt_dir / ASSETS_DIR)
        for name, source in assets.items():
            shutil.copy2(source, staging / name)
        with open(staging / EXPORT_MARKER, "w", encoding="utf-8") as f:
            json.dump({"source": str(ckpt_dir), "time": time.time()}, f)
        # Replace a previous export only now that the new one is whole, and if it still may be.
        _check_output(out_dir, overwrite)
        _replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
