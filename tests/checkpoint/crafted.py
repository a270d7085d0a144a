"""Crafted checkpoint contents: pickles that run a command when loaded unsafely, and the tools to
plant them in a real checkpoint (with its checksums recomputed, as an attacker would)."""

from __future__ import annotations

import hashlib
import io
import json
import operator
import os
import pickle
import re
from pathlib import Path

import torch

from stapo_megatron.checkpoint.integrity import HASH, file_digest, list_files
from stapo_megatron.checkpoint.marker import COMPLETE_MARKER


class Touch:
    """Unpickled unsafely, runs ``touch <flag>`` in a shell."""

    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        return os.system, (f"touch {self.flag}",)


class Stealth:
    """Unpickled unsafely, runs ``touch <flag>`` and then returns ``obj``: the load goes on as if nothing happened."""

    def __init__(self, obj, flag: Path):
        self.obj, self.flag = obj, flag

    def __reduce__(self):
        return operator.itemgetter(1), ((Touch(self.flag), self.obj),)


def rehash(directory: Path) -> None:
    """Recompute the marker's file list, so the checksums match the planted contents."""
    marker = directory / COMPLETE_MARKER
    content = json.loads(marker.read_text())
    files = {}
    for name in list_files(directory):
        size, digest = file_digest(directory / name)
        files[name] = {"size": size, HASH: digest}
    content["files"] = files
    marker.write_text(json.dumps(content))


def read_metadata(directory: Path):
    """The checkpoint's torch index, unpickled plainly (the test trusts the file it wrote)."""
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)


COMMON_FILE = "common.pt"  # megatron-core 0.16-0.18; 0.19 stores the common state as this object:
COMMON_OBJECT = "common_state/shard_0_1"


def read_common(directory: Path):
    """The checkpoint's common state, wherever the installed megatron-core wrote it."""
    if (directory / COMMON_FILE).exists():
        return torch.load(directory / COMMON_FILE, weights_only=True)
    metadata = read_metadata(directory)
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == COMMON_OBJECT]
    with open(directory / info.relative_path, "rb") as f:
        f.seek(info.offset)
        (common,) = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    return common


def common_state_file(directory: Path) -> str:
    """The name of the file holding the common state: common.pt, or the data file with 0.19's object."""
    if (directory / COMMON_FILE).exists():
        return COMMON_FILE
    (info,) = [info for index, info in read_metadata(directory).storage_data.items() if index.fqn == COMMON_OBJECT]
    return info.relative_path


def write_common(directory: Path, obj) -> None:
    """Store ``obj`` as the checkpoint's common state, where the installed megatron-core keeps it."""
    if (directory / COMMON_FILE).exists():
        torch.save(obj, directory / COMMON_FILE)
    else:
        replace_object(directory, COMMON_OBJECT, lambda _: [obj])  # Megatron stores a list of the shard's objects


def common_source_pattern(directory: Path) -> str:
    """A regular expression of how a refusal names the common state's file."""
    if (directory / COMMON_FILE).exists():
        return re.escape(f"{directory}/{COMMON_FILE}")
    return re.escape(f"{directory}/") + r"__\d+_\d+\.distcp " + re.escape(f"(object {COMMON_OBJECT})")


def write_metadata(directory: Path, metadata) -> None:
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _append_item(directory: Path, info, data: bytes) -> None:
    """Append ``data`` to the data file of the storage entry ``info`` and point the entry at it."""
    path = directory / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(data)
    info.offset, info.length = offset, len(data)


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def replace_object(directory: Path, key_prefix: str, wrap) -> list[str]:
    """Replace the stored sharded objects whose key starts with ``key_prefix`` by ``wrap(obj)``,
    appended to the data file that held them; the index points at the new bytes. Returns the
    data files changed."""
    metadata = read_metadata(directory)
    changed = []
    for index, info in metadata.storage_data.items():
        if not index.fqn.startswith(key_prefix):
            continue
        with open(directory / info.relative_path, "rb") as f:
            f.seek(info.offset)
            original = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
        _append_item(directory, info, _saved(wrap(original)))
        changed.append(info.relative_path)
    assert changed, f"no stored object {key_prefix}*"
    write_metadata(directory, metadata)
    return sorted(set(changed))


def replace_tensor(directory: Path, fqn: str, tensor: torch.Tensor) -> str:
    """Store ``tensor`` for the first chunk of ``fqn`` (appended to its data file, the index
    pointing at it); returns the data file changed."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata = read_metadata(directory)
    info = metadata.storage_data[MetadataIndex(fqn, metadata.state_dict_metadata[fqn].chunks[0].offsets)]
    _append_item(directory, info, _saved(tensor))
    write_metadata(directory, metadata)
    return info.relative_path


def drop_checksums(directory: Path) -> None:
    """Make the marker one from before checksums were recorded (no file list)."""
    marker = directory / COMPLETE_MARKER
    content = json.loads(marker.read_text())
    del content["files"], content["hash"]
    marker.write_text(json.dumps(content))


def replace_by_fifo(directory: Path, name: str) -> Path:
    """Replace the file ``name`` by a FIFO, recorded in the marker as what reading one gives: 0
    bytes (a marker without a file list stays one)."""
    path = directory / name
    path.unlink()
    os.mkfifo(path)
    marker = directory / COMPLETE_MARKER
    content = json.loads(marker.read_text())
    if "files" in content:
        content["files"][name] = {"size": 0, HASH: hashlib.new(HASH).hexdigest()}
    marker.write_text(json.dumps(content))
    return path


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte (by default the middle one): same size, different contents."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
