"""Hugging Face Qwen3 <-> Megatron distributed checkpoints, at any TP/PP, streaming.

No process holds the whole model: each rank builds its own pipeline stage and tensor-parallel
shards, reads only its slices of the Hugging Face tensors, and on export gathers one parameter
at a time across its tensor-parallel group. :func:`export_hf_tensors` is the same stream that
weight sync to a rollout engine uses.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from stapo_megatron.checkpoint.dist import ASSETS_DIR, load_common, load_dist, save_dist
from stapo_megatron.checkpoint.integrity import verify_checkpoint
from stapo_megatron.checkpoint.hf_io import (
    HFCheckpoint,
    SafetensorsStreamWriter,
    dtype_from_name,
    finalize_shards,
)
from stapo_megatron.config import ConfigError
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.parallelize import build_stage, check_layout
from stapo_megatron.models.qwen3.state_dict_adapter import (
    ParamMapping,
    gather_dim,
    hf_tensor_shapes,
    load_shard,
    param_mappings,
    to_hf,
)

MODEL_KEY = "model"
META_KEY = "stapo"
# Files carried from a Hugging Face checkpoint (or a tokenizer directory) into an export.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def hf_assets(directory: str | Path) -> dict[str, Path]:
    """The tokenizer and generation files of a Hugging Face directory, by file name."""
    directory = Path(directory)
    return {name: directory / name for name in TOKENIZER_FILES if (directory / name).is_file()}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def stage_layer_offset(model: torch.nn.Module) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(unwrap(model).config)


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


def _exported(mapping: ParamMapping, arch: Qwen3Config) -> bool:
    # With tied embeddings the last stage's output layer is a copy; stage 0 exports the original.
    return not (mapping.megatron_name == "output_layer.weight" and arch.tie_word_embeddings)


def export_plan(model: torch.nn.Module, arch: Qwen3Config, dtype: torch.dtype | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(Hugging Face name, shape, dtype) of every tensor this stage exports, in export order."""
    model = unwrap(model)
    shapes = hf_tensor_shapes(arch)
    params = dict(model.named_parameters())
    plan = []
    for mapping in param_mappings(model, arch, stage_layer_offset(model)):
        if _exported(mapping, arch):
            out_dtype = dtype or params[mapping.megatron_name].dtype
            plan.extend((name, shapes[name], out_dtype) for name in mapping.hf_names)
    return plan


@torch.no_grad()
def _stage_tensors(model: torch.nn.Module, arch: Qwen3Config, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's Hugging Face tensors, TP-gathered; yielded on every TP rank of the stage."""
    from megatron.core import parallel_state as ps

    model = unwrap(model)
    tp_group = ps.get_tensor_model_parallel_group()
    tp_size = ps.get_tensor_model_parallel_world_size()
    params = dict(model.named_parameters())
    for mapping in param_mappings(model, arch, stage_layer_offset(model)):
        if not _exported(mapping, arch):
            continue
        local = params[mapping.megatron_name].detach()
        if mapping.layout == "replicated" or tp_size == 1:
            full = local
        else:
            # Gather straight into one buffer: a single full-size tensor, no list of shards.
            stacked = local.new_empty((tp_size * local.shape[0], *local.shape[1:]))
            dist.all_gather_into_tensor(stacked, local.contiguous(), group=tp_group)
            full = stacked
            if gather_dim(mapping) == 1:
                full = stacked.reshape(tp_size, *local.shape).transpose(0, 1).reshape(local.shape[0], -1)
        for name, tensor in to_hf(mapping, full, arch, tp_size):
            yield name, tensor.to(dtype or tensor.dtype).contiguous()


def export_hf_tensors(
    model: torch.nn.Module, arch: Qwen3Config, *, dtype: torch.dtype | None = None, destination: str = "first_rank"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the model as (Hugging Face name, full tensor) pairs, one tensor at a time.

    Collective over one data-parallel replica's model-parallel group: every rank of it must
    exhaust the iterator. ``destination="stage"``: each stage's TP-rank-0 receives its own
    stage's tensors (for writing files). ``destination="first_rank"``: the replica's first rank
    receives every tensor, stage by stage (for weight sync). Other ranks receive nothing.
    """
    from megatron.core import parallel_state as ps

    if destination not in ("stage", "first_rank"):
        raise ValueError(f"destination must be 'stage' or 'first_rank', got {destination!r}")
    tp_rank = ps.get_tensor_model_parallel_rank()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    if destination == "stage" or pp_size == 1:
        for name, tensor in _stage_tensors(model, arch, dtype):
            if tp_rank == 0:
                yield name, tensor
        return
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    pp_group = ps.get_pipeline_model_parallel_group()
    first = pp_ranks[0]
    for stage in range(pp_size):
        if stage == 0:
            for name, tensor in _stage_tensors(model, arch, dtype):
                if tp_rank == 0:
                    yield name, tensor
            continue
        if tp_rank != 0:
            if pp_rank == stage:
                for _ in _stage_tensors(model, arch, dtype):
                    pass
            continue
        # TP-rank-0 of each stage: the stage tells the first rank what it will send, then sends it.
        plan = [export_plan(model, arch, dtype) if pp_rank == stage else None]
        dist.broadcast_object_list(plan, src=pp_ranks[stage], group=pp_group)
        if pp_rank == stage:
            for _, tensor in _stage_tensors(model, arch, dtype):
                dist.send(tensor, dst=first)
        elif pp_rank == 0:
            for name, shape, out_dtype in plan[0]:
                tensor = torch.empty(shape, dtype=out_dtype, device=next(unwrap(model).parameters()).device)
                dist.recv(tensor, src=pp_ranks[stage])
                yield name, tensor


# ---- the two conversions, each run by every rank of a TP x PP launch --------------------------


def _init_ranks(tp: int, pp: int) -> None:
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp))


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
    from megatron.core import parallel_state as ps

    from stapo_megatron.runtime.distributed import device

    _init_ranks(tp, pp)
    arch, params_dtype = read_meta(ckpt_dir)
    dtype = dtype_from_name(dtype_name) if dtype_name else None
    model = build_stage(arch, params_dtype=params_dtype, perform_initialization=False, device=device())
    load_model(model, ckpt_dir)
    writer = None
    if ps.get_tensor_model_parallel_rank() == 0:
        writer = SafetensorsStreamWriter(
            staging, export_plan(model, arch, dtype), max_shard_bytes, prefix=f"stage{ps.get_pipeline_model_parallel_rank():04d}-"
        )
    for name, tensor in export_hf_tensors(model, arch, dtype=dtype, destination="stage"):
        writer.write(name, tensor)
    files = []
    if writer is not None:
        writer.close()
        files = writer.files
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, files)
    if dist.get_rank() == 0:
        finalize_shards(staging, [f for rank_files in gathered for f in rank_files])
    dist.barrier()


# ---- the entry points: check cheaply, then launch the ranks -----------------------------------


def _check_output(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir}: output directory exists and is not empty (pass --overwrite to replace it)")


def convert_hf_to_megatron(
    hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, dtype: str | None = None, overwrite: bool = False
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
