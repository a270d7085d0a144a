"""Loading a Megatron distributed checkpoint without running anything it holds.

Three kinds of stored bytes are unpickled on a load, and each is read here without the code
execution that pickle allows:

- ``.metadata`` (torch distributed checkpoint's index, a plain pickle): read by
  :class:`_MetadataUnpickler`, which admits only the names, opcodes and uses of them that a real
  index is made of (:data:`METADATA_GLOBALS`, listed from checkpoints this project writes), and
  then checked against itself and the files beside it (:func:`_check_metadata`) before any data
  is read.
- ``common.pt`` (the non-sharded state): ``torch.load(weights_only=True)``.
- sharded objects (the RNG states, Megatron's ``_extra_state`` entries), stored as byte items
  inside the ``__*.distcp`` files: ``torch.load(weights_only=True)``.

Megatron's defaults load the first with ``pickle.load`` and the last with
``torch.load(weights_only=False)``. The public extension point used here is the pair of load
strategies that ``dist_checkpointing.load`` accepts: :class:`SafeShardedLoadStrategy` (a
:class:`TorchDistLoadShardedStrategy` reading through :class:`SafeFileSystemReader` and
:class:`SafeLoadPlanner`) and :class:`SafeCommonLoadStrategy`. ``metadata.json`` is JSON and is
checked by :func:`check_backend`. Every file is opened only if it is a regular file
(:mod:`stapo_megatron.checkpoint.files`). Every refusal is a one-line :class:`ConfigError` naming
the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import pickle
import pickletools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.futures import Future
from torch.serialization import _get_layout

from stapo_megatron.checkpoint.files import open_regular, regular_size
from stapo_megatron.checkpoint.hf_io import MAX_DIMS
from stapo_megatron.config import ConfigError

METADATA_FILE = ".metadata"
CONFIG_FILE = "metadata.json"

# What a torch distributed checkpoint's ``.metadata`` is made of, and how, as disassembled
# (pickletools) from the checkpoints this project writes (torch 2.13, megatron-core 0.16.1): each
# of these dataclasses is made by NEWOBJ with no arguments and given its fields by one BUILD (a
# dict of some of its fields; TensorProperties: the 5-tuple of its own __setstate__); Megatron
# adds the save plans to Metadata as ``all_local_plans``.
_BUILT_CLASSES: dict[type, frozenset[str]] = {
    cls: frozenset(f.name for f in dataclasses.fields(cls))
    for cls in (
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
        _StorageInfo,
        SavePlan,
        WriteItem,
        TensorWriteData,
        BytesIOWriteData,
    )
}
_BUILT_CLASSES[Metadata] |= {"all_local_plans"}
# ... and these are called by REDUCE, with one argument of the type named.
_CALLED: tuple[tuple[Any, type], ...] = (
    (torch.Size, tuple),
    (WriteItemType, int),
    (_MEM_FORMAT_ENCODING, int),
    (_get_layout, str),
)
# the names pickle writes for them
METADATA_GLOBALS = {(obj.__module__, obj.__qualname__) for obj in [*_BUILT_CLASSES, *(f for f, _ in _CALLED)]}
# Opcodes that only push plain values (None, bools, ints, strings, tuples, lists, dicts) or move
# them through the memo: those of the real indexes, and their variants for other protocols and
# magnitudes (LONG1 for an offset past 2 GiB, BINUNICODE for a long path). GLOBAL/STACK_GLOBAL
# go through find_class; NEWOBJ, REDUCE and BUILD through the rules above; any other is refused.
_VALUE_OPCODES = frozenset(
    "PROTO FRAME STOP MARK MEMOIZE BINPUT LONG_BINPUT BINGET LONG_BINGET NONE NEWTRUE NEWFALSE BININT BININT1 "
    "BININT2 LONG1 SHORT_BINUNICODE BINUNICODE BINUNICODE8 EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_LIST "
    "APPEND APPENDS EMPTY_DICT SETITEM SETITEMS GLOBAL STACK_GLOBAL".split()
)
_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
# Largest ``.metadata`` read (a 235B-parameter checkpoint with its optimizer holds well under 1 GB).
MAX_METADATA_BYTES = 2 * 1024**3
# Megatron's metadata.json is a few hundred bytes.
MAX_CONFIG_BYTES = 1024**2
# torch.save's framing around a tensor's bytes in a data file (about 1.5 KB in torch 2.13).
TORCH_SAVE_FRAMING_BYTES = 64 * 1024


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with a dispatch table of only the admitted opcodes, so that each
    NEWOBJ, REDUCE and BUILD is checked for what it makes, calls or changes before it happens
    (the C unpickler cannot be told: a BUILD there sets attributes on any object, a class too)."""

    # set by pickle._Unpickler.load
    stack: list[Any]
    append: Callable[[Any], None]

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path
        self._built: list[Any] = []  # the objects given their state, kept alive so ids stay unique
        self._built_ids: set[int] = set()

    def _refuse(self, what: str) -> ConfigError:
        return ConfigError(
            f"{self.path}: refused to load: {what}, which a checkpoint index never holds (a crafted or foreign file)"
        )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ConfigError(
            f"{self.path}: refused to load: it refers to {module}.{name}, which a checkpoint index never holds "
            f"(a crafted or foreign file)"
        )

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not (isinstance(cls, type) and cls in _BUILT_CLASSES) or type(args) is not tuple or args:
            raise self._refuse(f"NEWOBJ of {_describe(cls)} with {_describe(args)}")
        self.append(object.__new__(cls))  # what NEWOBJ does for a dataclass

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        kind = next((kind for called, kind in _CALLED if called is func), None)
        if kind is None or type(args) is not tuple or len(args) != 1 or type(args[0]) is not kind:
            raise self._refuse(f"a call of {_describe(func)} with {_describe(args)}")
        self.stack[-1] = func(args[0])

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        fields = _BUILT_CLASSES.get(type(inst))
        # Only an instance made by NEWOBJ above, once: never a class, a function or a dtype.
        if fields is None or id(inst) in self._built_ids:
            raise self._refuse(f"BUILD on {_describe(inst)}")
        if type(inst) is TensorProperties:
            if type(state) is not tuple or len(state) != 5:
                raise self._refuse(f"BUILD of TensorProperties from {_describe(state)}")
            inst.__setstate__(state)
        else:
            if type(state) is not dict or not all(type(k) is str for k in state) or not state.keys() <= fields:
                raise self._refuse(f"BUILD of {type(inst).__name__} from {_describe(state)}")
            vars(inst).update(state)
        self._built.append(inst)
        self._built_ids.add(id(inst))

    @staticmethod
    def _dispatch() -> dict[int, Callable[[Any], None]]:
        plain = pickle._Unpickler.dispatch
        table: dict[int, Callable[[Any], None]] = {}
        for code in range(256):
            name = _OPCODE_NAMES.get(code)
            if name in _VALUE_OPCODES:
                table[code] = plain[code]
            elif name in ("NEWOBJ", "REDUCE", "BUILD"):
                table[code] = getattr(_MetadataUnpickler, f"_load_{name.lower()}")
            else:
                table[code] = _refusing(name or f"0x{code:02x}")
        return table


def _refusing(name: str) -> Callable[[Any], None]:
    def refuse(unpickler: _MetadataUnpickler) -> None:
        raise _refused(unpickler.path, f"pickle opcode {name}, which a checkpoint index never holds")

    return refuse


_MetadataUnpickler.dispatch = _MetadataUnpickler._dispatch()


def _describe(obj: Any) -> str:
    """What a refused pickle handed over, in a few words (never its repr: it may be huge)."""
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    if type(obj) is tuple:
        return f"a {len(obj)}-tuple"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}".replace("builtins.", "")


def _refused(path, reason: str) -> ConfigError:
    return ConfigError(f"{path}: not a valid checkpoint index: {reason}")


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
        raise _refused(path, f"malformed entry for {key}")
    boxes = []
    for chunk in chunks:
        offsets: Any = getattr(chunk, "offsets", None)
        sizes: Any = getattr(chunk, "sizes", None)
        if type(chunk) is not ChunkStorageMetadata or type(offsets) is not torch.Size or type(sizes) is not torch.Size:
            raise _refused(path, f"malformed chunk of {key}")
        if not (
            len(offsets) == len(sizes) == len(size)
            and all(_is_count(o) and _is_count(n) and o + n <= d for o, n, d in zip(offsets, sizes, size))
        ):
            raise _refused(
                path,
                f"{key}: a chunk at offsets {list(offsets)} of sizes {list(sizes)}, not non-negative integers inside "
                f"its size {list(size)}",
            )
        if math.prod(sizes):
            boxes.append((tuple(offsets), tuple(o + n for o, n in zip(offsets, sizes))))
    if not math.prod(size):
        return
    if not boxes:
        raise _refused(path, f"{key}: no chunk holds its {list(size)} elements")
    error = tiling_error(boxes, tuple(size))
    if error:
        raise _refused(path, f"{key}: {error} of its size {list(size)} (each must be in exactly one chunk)")


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
            raise _refused(path, "malformed storage_data")
        where = f"{index.fqn} at {_offset(index.offset)}"
        if (index.fqn, index.offset) not in expected:
            raise _refused(path, f"a storage entry for {where}, which the index does not list")
        name = getattr(info, "relative_path", None)
        # Data files are read from the checkpoint directory itself, never from elsewhere.
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise _refused(path, f"{index.fqn} is stored in {name!r}, outside the checkpoint directory")
        if not all(_is_count(getattr(info, field, None)) for field in ("offset", "length")):
            raise _refused(path, f"{index.fqn} has a bad offset or length")
        if getattr(info, "transform_descriptors", None) is not None:
            raise _refused(path, f"{index.fqn} is stored through transforms (compression), which stapo never writes")
        nbytes = expected.pop((index.fqn, index.offset))
        if nbytes is not None and not nbytes <= info.length <= nbytes + TORCH_SAVE_FRAMING_BYTES:
            raise _refused(
                path,
                f"{where} is stored in {info.length} bytes, but its chunk holds {nbytes} bytes of data (torch.save "
                f"adds at most {TORCH_SAVE_FRAMING_BYTES})",
            )
        by_file.setdefault(name, []).append((info.offset, info.offset + info.length, index.fqn))
    if expected:
        fqn, offset = next(iter(expected))
        raise _refused(path, f"{fqn} at {_offset(offset)} has no storage entry")
    for name, spans in sorted(by_file.items()):
        data_file = path.parent / name
        try:
            file_size = regular_size(data_file)
        except FileNotFoundError:
            raise _refused(path, f"{spans[0][2]} is stored in {name}, which is missing") from None
        spans.sort()
        for begin, end, fqn in spans:
            if end > file_size:
                raise ConfigError(
                    f"{data_file}: {file_size} bytes, but {path.name} stores {fqn} at bytes [{begin}, {end}) "
                    "(truncated or not this index's file)"
                )
        for (_, first_end, first), (second_begin, _, second) in zip(spans, spans[1:]):
            if second_begin < first_end:
                raise _refused(path, f"{second} and {first} share bytes of {name}")


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
        raise _refused(path, f"holds {_describe(metadata)}, not a torch checkpoint Metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    if type(entries) is not dict or not all(
        type(k) is str and type(v) in (TensorStorageMetadata, BytesStorageMetadata) for k, v in entries.items()
    ):
        raise _refused(path, "malformed state_dict_metadata")
    if type(getattr(metadata, "storage_data", None)) is not dict:
        raise _refused(path, "malformed storage_data")
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not (
        type(storage_meta) is StorageMeta
        and all(_is_name(getattr(storage_meta, f, None)) for f in ("checkpoint_id", "save_id", "load_id"))
        and type(getattr(storage_meta, "modules", None)) is list
        and all(type(m) is str for m in storage_meta.modules)
    ):
        raise _refused(path, "malformed storage_meta")
    if (
        not _is_name(getattr(metadata, "version", None))
        or type(getattr(metadata, "planner_data", None)) not in (type(None), dict)
        or not _check_plans(getattr(metadata, "all_local_plans", []))
    ):
        raise _refused(path, "malformed version, planner_data or all_local_plans")
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
                raise _refused(path, f"{size} bytes (more than {MAX_METADATA_BYTES})")
            metadata = _MetadataUnpickler(f, path).load()
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (not a complete distributed checkpoint)") from None
    except (MemoryError, RecursionError) as err:
        raise _refused(path, type(err).__name__) from None
    except Exception as err:  # pickle raises many types for damaged bytes
        raise _refused(path, _first_line(err)) from None
    return _check_metadata(metadata, path)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _weights_only_reason(err: BaseException) -> str:
    """The informative sentence of torch's multi-paragraph weights_only refusal."""
    text = str(err)
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        return f"it refers to {named.group(1)}, which is not plain data (only tensors and plain Python data are loaded)"
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
        text = text.split("Check the documentation", 1)[0]
    else:
        text = "" if text.startswith("Weights only load failed") else text
    reason = " ".join(text.split()).split(". ")[0].rstrip(".")
    return reason or _first_line(err)


def load_stored_object(source: str | os.PathLike | io.BytesIO, name: str, map_location=None) -> Any:
    """``torch.load(weights_only=True)`` of bytes or of a regular file; a refusal or damage is a
    one-line ConfigError naming ``name``."""
    try:
        if isinstance(source, io.BytesIO):
            return torch.load(source, map_location=map_location, weights_only=True)
        with open_regular(source) as f:
            return torch.load(f, map_location=map_location, weights_only=True)
    except ConfigError:
        raise
    except pickle.UnpicklingError as err:
        raise ConfigError(f"{name}: refused to load: {_weights_only_reason(err)}") from None
    except FileNotFoundError:
        raise ConfigError(f"{name}: missing (not a complete distributed checkpoint)") from None
    except Exception as err:  # torch raises RuntimeError, EOFError, ... for damaged files
        raise ConfigError(f"{name}: not a readable torch file: {_first_line(err)}") from None


def check_backend(directory: str | os.PathLike) -> None:
    """``metadata.json`` names the format the strategies here read (torch_dist + torch)."""
    path = Path(directory) / CONFIG_FILE
    try:
        with open_regular(path) as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: more than {MAX_CONFIG_BYTES} bytes (not a Megatron checkpoint's)")
        config = json.loads(text.decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (not a Megatron distributed checkpoint)") from None
    except (ValueError, RecursionError) as err:
        raise ConfigError(f"{path}: not valid JSON ({_first_line(err)})") from None
    if (
        not isinstance(config, dict)
        or config.get("sharded_backend") != "torch_dist"
        or config.get("common_backend") != "torch"
    ):
        raise ConfigError(
            f"{path}: not a torch_dist checkpoint (this project writes sharded_backend torch_dist, common_backend "
            "torch)"
        )


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read by :func:`read_dcp_metadata`, once (then cached)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._cached_metadata: Metadata | None = None
        self._reading: _StorageInfo | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None and self._cached_metadata is not None:
            return self._cached_metadata
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_dcp_metadata(Path(self.path) / name)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        if rank is None:
            self._cached_metadata = metadata
        return metadata

    def _slice_file(self, file, sinfo: _StorageInfo):
        self._reading = sinfo  # the item read_data is at, for an error naming its file
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """FileSystemReader.read_data, with a failure (damaged bytes, a stored tensor of another
        shape) as one line naming the data file and the item instead of torch's traceback."""
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except ConfigError:
            raise
        except Exception as err:
            info = self._reading
            if info is None:
                raise ConfigError(f"{self.path}: cannot read its data: {_first_line(err)}") from None
            end = info.offset + info.length
            raise ConfigError(
                f"{Path(self.path) / info.relative_path}: the item at bytes [{info.offset}, {end}) cannot be read "
                f"(damaged or not written for this index): {_first_line(err)}"
            ) from None


class SafeLoadPlanner(mcore_torch.MCoreLoadPlanner):
    """Megatron's load planner with the byte items (sharded objects) read by ``weights_only=True``."""

    def __init__(self, *args, checkpoint_dir: str | os.PathLike, **kwargs):
        super().__init__(*args, **kwargs)
        self.checkpoint_dir = Path(checkpoint_dir)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
        where = self.checkpoint_dir / info.relative_path if info is not None else self.checkpoint_dir
        obj = load_stored_object(value, f"{where} (object {read_item.dest_index.fqn})")
        # As DefaultLoadPlanner.load_bytes, but with the object loaded above.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeShardedLoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):
    """megatron-core 0.16.1's TorchDistLoadShardedStrategy, reading through the safe reader and planner."""

    def load(self, sharded_state_dict, checkpoint_dir):
        # The body of TorchDistLoadShardedStrategy.load with SafeFileSystemReader and SafeLoadPlanner.
        flexible_shape_sharded_tensors = [
            sh_ten
            for sh_ten in mcore_torch.nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and not sh_ten.allow_shape_mismatch
        ]
        allow_shape_mismatch_sharded_tensors = {
            sh_ten.key: sh_ten
            for sh_ten in mcore_torch.nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and sh_ten.allow_shape_mismatch
        }
        orig_sharded_state_dict = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt_state_dict = mcore_torch.mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = SafeFileSystemReader(checkpoint_dir)
        reader.read_metadata()  # a refusal surfaces here as itself, not inside torch's collective wrapper
        dcp.load_state_dict(
            pyt_state_dict,
            reader,
            planner=SafeLoadPlanner(
                shapes_validation_sharded_tensors=flexible_shape_sharded_tensors,
                allow_shape_mismatch_sharded_tensors=allow_shape_mismatch_sharded_tensors,
                checkpoint_dir=checkpoint_dir,
            ),
        )
        self.cached_global_metadata = reader.read_metadata()
        mcore_state_dict = {k: mcore_torch._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        mcore_state_dict = mcore_torch._replace_sharded_keys_with_state_dict_keys(
            mcore_state_dict, flat_mapping, rename_mapping
        )
        mcore_torch._restore_dict_types(mcore_state_dict, orig_sharded_state_dict)
        return mcore_state_dict

    def load_tensors_metadata(self, checkpoint_dir, metadata: Metadata | None = None):
        if metadata is None:
            metadata = SafeFileSystemReader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir):
        metadata = SafeFileSystemReader(checkpoint_dir).read_metadata()
        sharded_metadata = {}
        for key, storage_metadata in metadata.state_dict_metadata.items():
            if isinstance(storage_metadata, BytesStorageMetadata):
                sh_obj = ShardedObject.empty_from_unique_key(key)
                sharded_metadata[sh_obj.unique_key] = sh_obj
        sharded_metadata.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return sharded_metadata


class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
    """``common.pt`` (and per-object ``.pt`` files, a format this project does not write) by ``weights_only=True``."""

    def load_common(self, checkpoint_dir):
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        return load_stored_object(path, str(path), map_location="cpu")

    def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
        def load_one(sh_obj: ShardedObject):
            path = Path(checkpoint_dir) / f"{sh_obj.unique_key}.pt"
            return load_stored_object(path, str(path))

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)


@contextlib.contextmanager
def one_line_errors(directory: str | os.PathLike):
    """A refusal raised inside torch's distributed-checkpoint collectives comes out as itself, and
    Megatron's refusal of a checkpoint that does not fit the model asked for (a global shape or
    a key that differs: a checkpoint whose ``common.pt`` and tensors disagree, or another
    model's) as one line naming ``directory``."""
    try:
        yield
    except CheckpointException as err:
        for exc, _ in err.failures.values():
            if isinstance(exc, ConfigError):
                raise ConfigError(str(exc)) from None
        for exc, _ in err.failures.values():
            if isinstance(exc, CheckpointingException):
                raise _does_not_fit(directory, exc) from None
        raise
    except CheckpointingException as err:
        raise _does_not_fit(directory, err) from None


def _does_not_fit(directory: str | os.PathLike, err: Exception) -> ConfigError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ConfigError(f"{directory}: cannot be loaded into this model: {reason}")
