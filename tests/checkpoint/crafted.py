"""Crafted checkpoint contents: pickles that run a command when loaded unsafely, and the tools to
plant them in a real checkpoint (with its checksums recomputed, as an attacker would)."""

from __future__ import annotations

import io
import json
import operator
import os
import pickle
from pathlib import Path

import torch

from stapo_megatron.checkpoint.dist import COMPLETE_MARKER
from stapo_megatron.checkpoint.integrity import HASH, file_digest, list_files


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


def replace_object(directory: Path, key_prefix: str, wrap) -> list[str]:
    """Replace the stored sharded objects whose key starts with ``key_prefix`` by ``wrap(obj)``,
    appended to the data file that held them; the index points at the new bytes. Returns the
    data files changed."""
    metadata = read_metadata(directory)
    changed = []
    for index, info in metadata.storage_data.items():
        if not index.fqn.startswith(key_prefix):
            continue
        path = directory / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            original = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
        buffer = io.BytesIO()
        torch.save(wrap(original), buffer)
        data = buffer.getvalue()
        offset = path.stat().st_size
        with open(path, "ab") as f:
            f.write(data)
        info.offset, info.length = offset, len(data)
        changed.append(info.relative_path)
    assert changed, f"no stored object {key_prefix}*"
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return sorted(set(changed))


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte (by default the middle one): same size, different contents."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
