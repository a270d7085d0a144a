"""Hugging Face safetensors checkpoints, read by slices and written as a stream.

Reading reads only the bytes of the rows or columns asked for, so a rank never holds a tensor
it does not own. Writing lays out each file's header from the list of tensors
it will hold, then appends each tensor as it arrives: the writer holds one tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import torch

from stapo_megatron.config import ConfigError

# Written into every Hugging Face export (last, before it is renamed into place): how
# ``--overwrite`` knows a directory for an export of its own.
EXPORT_MARKER = "stapo_export.json"
# Written by ``stapo eval`` beside the export it made (:mod:`stapo_megatron.eval.model`);
# exports from before EXPORT_MARKER carry only this one.
EVAL_EXPORT_MARKER = "stapo_export_source.json"

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype: unknown torch dtype {name!r}")
    return dtype


class HFCheckpoint:
    """A Hugging Face checkpoint directory: one ``model.safetensors`` or shards with an index.

    Tensors are read with plain file reads of exactly the bytes asked for (no memory map, so a
    rank's memory holds only what it keeps).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                with open(index, encoding="utf-8") as f:
                    content = json.load(f)
            except (ValueError, RecursionError) as err:
                raise ConfigError(
                    f"{index}: not valid JSON ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                ) from None
            weight_map = content.get("weight_map") if isinstance(content, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConfigError(f"{index}: has no weight_map")
            for name, file in weight_map.items():
                # Shards are files of this directory, never paths elsewhere.
                if not isinstance(file, str) or not file or "/" in file or "\\" in file or file in (".", ".."):
                    raise ConfigError(f"{index}: tensor {name} is mapped to {file!r}, not a file of this directory")
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_FILE).is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise ConfigError(
                f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE} (not a Hugging Face safetensors checkpoint)"
            )
        self._entries: dict[str, _Entry] = {}
        for file in files:
            if not (self.path / file).is_file():
                raise ConfigError(f"{index}: names shard {file}, which does not exist")
            for name, entry in _read_header(self.path / file).items():
                if weight_map is None or weight_map.get(name) == file:
                    self._entries[name] = entry
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self._entries))
            if absent:
                raise ConfigError(f"{index}: tensor {absent[0]} is not in {weight_map[absent[0]]}")

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def check(self, expected: dict[str, tuple[int, ...]], ignorable: Iterable[str] = ()) -> None:
        """Every expected tensor present with its shape, and nothing else (but ``ignorable``)."""
        missing = [n for n in expected if n not in self._entries]
        if missing:
            raise ConfigError(f"{self.path}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
        ignorable = set(ignorable)
        extra = [n for n in self._entries if n not in expected and n not in ignorable]
        if extra:
            raise ConfigError(f"{self.path}: unexpected tensor {extra[0]} ({len(extra)} unexpected in all)")
        for name, shape in expected.items():
            if tuple(self.shape(name)) != tuple(shape):
                raise ConfigError(
                    f"{self.path}: tensor {name} has shape {list(self.shape(name))}, expected {list(shape)}"
                )

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor; all of it if start is None; stop None:
        to the end of ``dim``."""
        entry = self._entries.get(name)
        if entry is None:
            raise ConfigError(f"{self.path}: tensor {name} is missing")
        shape = list(entry.shape)
        rows = shape[0] if shape else 1
        row_bytes = entry.nbytes // max(rows, 1)
        if start is None:
            start, stop, dim = 0, rows, 0
        elif stop is None:
            stop = rows if dim == 0 else shape[dim]
        with open(entry.file, "rb", buffering=0) as f:
            if dim == 0:
                out = torch.empty([stop - start] + shape[1:], dtype=entry.dtype)
                _read_into(f, entry.offset + start * row_bytes, out)
                return out if entry.shape else out.reshape(())
            # Columns: read blocks of whole rows and keep the slice, so memory stays bounded.
            out = torch.empty([rows, stop - start] + shape[2:], dtype=entry.dtype)
            block_rows = max(1, _COLUMN_READ_BLOCK // max(row_bytes, 1))
            for first in range(0, rows, block_rows):
                last = min(rows, first + block_rows)
                block = torch.empty([last - first] + shape[1:], dtype=entry.dtype)
                _read_into(f, entry.offset + first * row_bytes, block)
                out[first:last] = block[:, start:stop]
            return out


_COLUMN_READ_BLOCK = 64 * 1024**2


class _Entry:
    __slots__ = ("file", "shape", "dtype", "offset", "nbytes")

    def __init__(self, file: Path, shape: tuple[int, ...], dtype: torch.dtype, offset: int, nbytes: int):
        self.file, self.shape, self.dtype, self.offset, self.nbytes = file, shape, dtype, offset, nbytes


def _read_into(f, offset: int, out: torch.Tensor) -> None:
    # numpy's stubs declare ndarray.__buffer__ for Python >= 3.12 only
    view = memoryview(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ConfigError(f"{f.name}: truncated safetensors file")
        done += n


# Bounds on what a safetensors header may claim, checked before anything is allocated.
MAX_HEADER_BYTES = 100 * 1024**2
MAX_DIMS = 64
_ITEM_SIZES = {code: torch.empty((), dtype=dtype).element_size() for code, dtype in _CODE_DTYPES.items()}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicate = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"tensor {duplicate} appears twice")
    return dict(pairs)


def _read_header(path: Path) -> dict[str, _Entry]:
    """The tensors of a safetensors file, every claim of its header checked against the file:
    bounded header, known dtypes, non-negative shapes, offsets inside the data, sizes that match
    the shape, no two tensors sharing bytes. Each violation is a one-line ConfigError."""
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError(f"{path}: truncated safetensors file ({file_size} bytes, no header)")
        (size,) = struct.unpack("<Q", raw)
        if size > min(MAX_HEADER_BYTES, file_size - 8):
            raise ConfigError(
                f"{path}: safetensors header of {size} bytes claimed, but the file holds {file_size - 8} after the "
                f"length (and at most {MAX_HEADER_BYTES} are accepted)"
            )
        encoded = f.read(size)
    try:
        header = json.loads(encoded.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{path}: corrupt safetensors header ({reason})") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: corrupt safetensors header (not a JSON object)")
    if not isinstance(header.get("__metadata__", {}), dict):
        raise ConfigError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
    data_start = 8 + size
    data_size = file_size - data_start
    entries, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise ConfigError(f"{where}: needs dtype, shape and data_offsets")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(code, str) or code not in _CODE_DTYPES:
            raise ConfigError(f"{where} has unsupported dtype {code!r}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
            raise ConfigError(
                f"{where}: shape must be a list of at most {MAX_DIMS} non-negative integers, got {shape!r}"
            )
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise ConfigError(f"{where}: data_offsets must be two integers, got {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise ConfigError(f"{where}: data_offsets [{begin}, {end}] are outside the file's {data_size} data bytes")
        nbytes = math.prod(shape) * _ITEM_SIZES[code]
        if nbytes != end - begin:
            needs = nbytes if nbytes <= data_size else "more than the file holds"
            raise ConfigError(
                f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but shape {shape} of {code} needs "
                f"{needs}"
            )
        entries[name] = _Entry(path, tuple(shape), _CODE_DTYPES[code], data_start + begin, end - begin)
        if end > begin:
            spans.append((begin, end, name))
    spans.sort()
    for (_, first_end, first), (second_begin, _, second) in zip(spans, spans[1:]):
        if second_begin < first_end:
            raise ConfigError(f"{path}: tensor {second} overlaps tensor {first} (data_offsets share bytes)")
    return entries


class SafetensorsStreamWriter:
    """Writes a known sequence of tensors into safetensors files, one tensor in memory at a time.

    ``plan`` lists (name, shape, dtype) in the order :meth:`write` will receive them; files are
    cut so that none exceeds ``max_file_bytes`` (a tensor larger than that gets its own file).
    Files are named ``{prefix}{k}.safetensors`` in ``directory``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        plan: list[tuple[str, tuple[int, ...], torch.dtype]],
        max_file_bytes: int,
        prefix: str = "part-",
    ):
        self.directory = Path(directory)
        self.files: list[tuple[str, list[str], int]] = []  # (file name, tensor names, bytes)
        groups: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = []
        size = 0
        for entry in plan:
            nbytes = _nbytes(entry[1], entry[2])
            if not groups or (size + nbytes > max_file_bytes and groups[-1]):
                groups.append([])
                size = 0
            groups[-1].append(entry)
            size += nbytes
        self._groups = groups
        self._names = [name for group in groups for name, _, _ in group]
        self._position = 0
        self._group_index = -1
        self._left_in_group = 0
        self._file: BinaryIO | None = None
        for k, group in enumerate(groups):
            self.files.append(
                (f"{prefix}{k}.safetensors", [n for n, _, _ in group], sum(_nbytes(s, d) for _, s, d in group))
            )

    def _open_next(self):
        self._group_index += 1
        group = self._groups[self._group_index]
        header, offset = {}, 0
        for name, shape, dtype in group:
            nbytes = _nbytes(shape, dtype)
            header[name] = {
                "dtype": _DTYPE_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned, as safetensors does
        file = self._file = open(self.directory / self.files[self._group_index][0], "wb")
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        self._left_in_group = len(group)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._position >= len(self._names):
            raise ValueError(f"tensor {name} was not planned (all {len(self._names)} tensors already written)")
        if self._left_in_group == 0:
            if self._file is not None:
                self._file.close()
            self._open_next()
        group = self._groups[self._group_index]
        planned_name, shape, dtype = group[len(group) - self._left_in_group]
        if name != planned_name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(
                f"tensor {name} {list(tensor.shape)} {tensor.dtype} arrived where {planned_name} "
                f"{list(shape)} {dtype} was planned"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        assert self._file is not None  # opened above for this tensor's group
        self._file.write(data.numpy().data)
        self._left_in_group -= 1
        self._position += 1

    def close(self) -> None:
        if self._position != len(self._names):
            raise ValueError(f"only {self._position} of {len(self._names)} planned tensors were written")
        if self._file is not None:
            self._file.close()
            self._file = None


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * torch.empty((), dtype=dtype).element_size()


def finalize_shards(directory: str | os.PathLike, files: list[tuple[str, list[str], int]]) -> None:
    """Rename part files to ``model-0000k-of-0000n.safetensors`` and write the index (or a single file)."""
    directory = Path(directory)
    total = len(files)
    if total == 1:
        os.replace(directory / files[0][0], directory / SINGLE_FILE)
        return
    weight_map, total_size = {}, 0
    for k, (part, names, nbytes) in enumerate(files, start=1):
        final = f"model-{k:05d}-of-{total:05d}.safetensors"
        os.replace(directory / part, directory / final)
        weight_map.update({name: final for name in names})
        total_size += nbytes
    with open(directory / INDEX_FILE, "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
