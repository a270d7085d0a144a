"""A torch distributed checkpoint's index (``.metadata``): read without running anything it holds
(:class:`~stapo_megatron.checkpoint.index_unpickler.IndexUnpickler`), then checked against itself
and the data files beside it (:func:`read_dcp_metadata`) before any data is read: every tensor's
chunks tile it exactly once, and every chunk and stored object has one byte range of its own, of the
right length, in a regular file of the checkpoint directory.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from stapo_megatron.checkpoint.files import open_regular, regular_size
from stapo_megatron.checkpoint.hf_io import MAX_DIMS
from stapo_megatron.checkpoint.index_unpickler import IndexUnpickler, describe, not_an_index
from stapo_megatron.config import ConfigError

METADATA_FILE = ".metadata"
# Largest ``.metadata`` read (a 235B-parameter checkpoint with its optimizer holds well under 1 GB).
MAX_METADATA_BYTES = 2 * 1024**3
# torch.save's framing around a tensor's bytes in a data file (about 1.5 KB in torch 2.13).
TORCH_SAVE_FRAMING_BYTES = 64 * 1024


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0  # not a bool


def _is_shape(value: Any) -> bool:
    return type(value) is torch.Size and len(value) <= MAX_DIMS and all(_is_count(v) for v in value)


def _is_name(value: Any) -> bool:
    return value is None or type(value) is str


def _check_properties(props: Any) -> bool:
    return (
        type(props) is TensorProperties
        and isinstance(getattr(props, "dtype", None), torch.dtype)
        and getattr(props, "layout", None) is torch.strided
        and type(getattr(props, "requires_grad", None)) is bool
        and type(getattr(props, "pin_memory", None)) is bool
        and isinstance(getattr(props, "memory_format", None), torch.memory_format)
    )


class _TooIrregular(Exception):
    pass


_Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, end) of a chunk in each dimension


def _sweep(boxes: list[_Box], shape: tuple[int, ...], axis: int, at: tuple[int, ...], budget: list[int]):
    """("overlap" or "gap", an element's coordinates there) where ``boxes`` (each inside
    ``shape``, none empty) do not cover the part of ``shape`` from ``axis`` on exactly once, or
    None. Along ``axis``, between two consecutive chunk boundaries, the chunks spanning the slab
    must cover its cross section exactly once: checked once per boundary, for the set there."""
    budget[0] -= len(boxes)
    if budget[0] < 0:
        raise _TooIrregular
    rest = (0,) * (len(shape) - axis - 1)
    if axis == len(shape) - 1:
        position = 0
        for start, end in sorted((box[0][axis], box[1][axis]) for box in boxes):
            if start != position:
                return ("overlap", (*at, start)) if start < position else ("gap", (*at, position))
            position = end
        return None if position == shape[axis] else ("gap", (*at, position))
    starting: dict[int, list[int]] = {}  # coordinate -> the boxes (by index) starting or ending there
    ending: dict[int, list[int]] = {}
    for number, box in enumerate(boxes):
        starting.setdefault(box[0][axis], []).append(number)
        ending.setdefault(box[1][axis], []).append(number)
    active: dict[int, _Box] = {}
    for boundary in sorted(starting.keys() | ending.keys() | {0}):
        if boundary == shape[axis]:
            break
        for number in ending.get(boundary, ()):
            del active[number]
        for number in starting.get(boundary, ()):
            active[number] = boxes[number]
        if not active:
            return "gap", (*at, boundary, *rest)
        # every boundary but 0 is a start or an end: the set spanning the next slab changed
        found = _sweep(list(active.values()), shape, axis + 1, (*at, boundary), budget)
        if found:
            return found
    return None


def tiling_error(boxes: list[_Box], shape: tuple[int, ...]) -> str | None:
    """Why chunks (``(start, end)`` in each dimension, each inside ``shape``, none empty) do not
    hold every element of ``shape`` exactly once, or None; computed from the chunk boundaries,
    never from the elements. The dimension with the fewest distinct boundaries is swept first:
    chunks on a grid (every layout torch and Megatron write) cost about one visit per chunk and
    dimension. Any other layout gets a bounded amount of work, then is refused as too irregular."""
    order = sorted(range(len(shape)), key=lambda d: len({b[0][d] for b in boxes} | {b[1][d] for b in boxes}))
    permuted = [(tuple(b[0][d] for d in order), tuple(b[1][d] for d in order)) for b in boxes]
    budget = [64 * len(boxes) * len(shape) + 100_000]
    try:
        found = _sweep(permuted, tuple(shape[d] for d in order), 0, (), budget)
    except _TooIrregular:
        return "chunks laid out too irregularly to check (not a layout torch or Megatron writes)"
    if found is None:
        return None
    kind, permuted_at = found
    at = [0] * len(shape)
    for d, position in zip(order, permuted_at):
        at[d] = position
    return f"chunks overlap at element {at}" if kind == "overlap" else f"no chunk holds element {at}"


def _check_tensor(key: str, entry: TensorStorageMetadata, path: Path) -> None:
    size: Any = getattr(entry, "size", None)
    chunks: Any = getattr(entry, "chunks", None)
    if not _check_properties(getattr(entry, "properties", None)) or not _is_shape(size) or type(chunks) is not list:
        raise not_an_index(path, f"malformed entry for {key}")
    boxes = []
    for chunk in chunks:
        offsets: Any = getattr(chunk, "offsets", None)
        sizes: Any = getattr(chunk, "sizes", None)
        if type(chunk) is not ChunkStorageMetadata or type(offsets) is not torch.Size or type(sizes) is not torch.Size:
            raise not_an_index(path, f"malformed chunk of {key}")
        if not (
            len(offsets) == len(sizes) == len(size)
            and all(_is_count(o) and _is_count(n) and o + n <= d for o, n, d in zip(offsets, sizes, size))
        ):
            raise not_an_index(
                path,
                f"{key}: a chunk at offsets {list(offsets)} of sizes {list(sizes)}, not non-negative integers inside "
                f"its size {list(size)}",
            )
        if math.prod(sizes):
            boxes.append((tuple(offsets), tuple(o + n for o, n in zip(offsets, sizes))))
    if not math.prod(size):
        return
    if not boxes:
        raise not_an_index(path, f"{key}: no chunk holds its {list(size)} elements")
    error = tiling_error(boxes, tuple(size))
    if error:
        raise not_an_index(path, f"{key}: {error} of its size {list(size)} (each must be in exactly one chunk)")


def _check_storage(metadata: Metadata, path: Path) -> None:
    """Every chunk and stored object has one storage entry, and every entry belongs to one; each
    names a regular file beside the index and a byte range inside it that no other entry shares,
    of the length its tensor needs (torch.save of the chunk: its bytes plus a small framing)."""
    # (fqn, chunk offsets or None for an object) -> bytes of the chunk's tensor (None: an object)
    expected: dict[tuple[str, torch.Size | None], int | None] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            expected[key, None] = None
            continue
        itemsize = entry.properties.dtype.itemsize
        for chunk in entry.chunks:
            expected[key, chunk.offsets] = math.prod(chunk.sizes) * itemsize
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        if not (
            type(index) is MetadataIndex
            and type(getattr(index, "fqn", None)) is str
            and (getattr(index, "offset", None) is None or _is_shape(index.offset))
            and (getattr(index, "index", None) is None or _is_count(index.index))
            and type(info) is _StorageInfo
        ):
            raise not_an_index(path, "malformed storage_data")
        where = f"{index.fqn} at {_offset(index.offset)}"
        if (index.fqn, index.offset) not in expected:
            raise not_an_index(path, f"a storage entry for {where}, which the index does not list")
        name = getattr(info, "relative_path", None)
        # Data files are read from the checkpoint directory itself, never from elsewhere.
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise not_an_index(path, f"{index.fqn} is stored in {name!r}, outside the checkpoint directory")
        if not all(_is_count(getattr(info, field, None)) for field in ("offset", "length")):
            raise not_an_index(path, f"{index.fqn} has a bad offset or length")
        if getattr(info, "transform_descriptors", None) is not None:
            raise not_an_index(
                path, f"{index.fqn} is stored through transforms (compression), which stapo never writes"
            )
        nbytes = expected.pop((index.fqn, index.offset))
        if nbytes is not None and not nbytes <= info.length <= nbytes + TORCH_SAVE_FRAMING_BYTES:
            raise not_an_index(
                path,
                f"{where} is stored in {info.length} bytes, but its chunk holds {nbytes} bytes of data (torch.save "
                f"adds at most {TORCH_SAVE_FRAMING_BYTES})",
            )
        by_file.setdefault(name, []).append((info.offset, info.offset + info.length, index.fqn))
    if expected:
        fqn, offset = next(iter(expected))
        raise not_an_index(path, f"{fqn} at {_offset(offset)} has no storage entry")
    for name, spans in sorted(by_file.items()):
        data_file = path.parent / name
        try:
            file_size = regular_size(data_file)
        except FileNotFoundError:
            raise not_an_index(path, f"{spans[0][2]} is stored in {name}, which is missing") from None
        spans.sort()
        for begin, end, fqn in spans:
            if end > file_size:
                raise ConfigError(
                    f"{data_file}: {file_size} bytes, but {path.name} stores {fqn} at bytes [{begin}, {end}) "
                    "(truncated or not this index's file)"
                )
        for (_, first_end, first), (second_begin, _, second) in zip(spans, spans[1:]):
            if second_begin < first_end:
                raise not_an_index(path, f"{second} and {first} share bytes of {name}")


def _offset(offset: torch.Size | None) -> str:
    return "its start" if offset is None else str(list(offset))


def _check_plans(plans: Any) -> bool:
    """Megatron's ``all_local_plans`` (the save plans, reused by a later save of the same layout)."""
    return type(plans) is list and all(
        type(plan) is SavePlan
        and type(getattr(plan, "items", None)) is list
        and all(type(item) is WriteItem and type(getattr(item, "index", None)) is MetadataIndex for item in plan.items)
        for plan in plans
    )


def _check_metadata(metadata: Any, path: Path) -> Metadata:
    """The index checked against itself and the data files beside it, before any data is read."""
    if type(metadata) is not Metadata:
        raise not_an_index(path, f"holds {describe(metadata)}, not a torch checkpoint Metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    if type(entries) is not dict or not all(
        type(k) is str and type(v) in (TensorStorageMetadata, BytesStorageMetadata) for k, v in entries.items()
    ):
        raise not_an_index(path, "malformed state_dict_metadata")
    if type(getattr(metadata, "storage_data", None)) is not dict:
        raise not_an_index(path, "malformed storage_data")
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not (
        type(storage_meta) is StorageMeta
        and all(_is_name(getattr(storage_meta, f, None)) for f in ("checkpoint_id", "save_id", "load_id"))
        and type(getattr(storage_meta, "modules", None)) is list
        and all(type(m) is str for m in storage_meta.modules)
    ):
        raise not_an_index(path, "malformed storage_meta")
    if (
        not _is_name(getattr(metadata, "version", None))
        or type(getattr(metadata, "planner_data", None)) not in (type(None), dict)
        or not _check_plans(getattr(metadata, "all_local_plans", []))
    ):
        raise not_an_index(path, "malformed version, planner_data or all_local_plans")
    for key, entry in entries.items():
        if type(entry) is TensorStorageMetadata:
            _check_tensor(key, entry, path)
    _check_storage(metadata, path)
    return metadata


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """A torch distributed checkpoint's ``.metadata``, unpickled admitting only what a real index
    holds (:data:`METADATA_GLOBALS`, used as real indexes use them), then checked against itself
    and its data files; any refusal is a one-line ConfigError naming the file."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_METADATA_BYTES:
                raise not_an_index(path, f"{size} bytes (more than {MAX_METADATA_BYTES})")
            metadata = IndexUnpickler(f, path).load()
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (not a complete distributed checkpoint)") from None
    except (MemoryError, RecursionError) as err:
        raise not_an_index(path, type(err).__name__) from None
    except Exception as err:  # pickle raises many types for damaged bytes
        raise not_an_index(path, first_line(err)) from None
    return _check_metadata(metadata, path)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
