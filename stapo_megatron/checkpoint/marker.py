"""The completion marker of a checkpoint, ``stapo_complete.json``: written last, read first.

A directory holding it is a whole checkpoint (:mod:`stapo_megatron.checkpoint.dist` renames it
into place only after writing it); it records the size and sha256 of every file
(:mod:`stapo_megatron.checkpoint.integrity`).
"""

from __future__ import annotations

import json
from pathlib import Path

from stapo_megatron.checkpoint.files import open_regular
from stapo_megatron.config import ConfigError

COMPLETE_MARKER = "stapo_complete.json"
# A marker lists every file with its size and hash: a few hundred bytes per file.
MAX_MARKER_BYTES = 64 * 1024**2


def check_complete(directory: str | Path) -> dict:
    """The completion marker's contents (refuses a directory without one)."""
    directory = Path(directory)
    marker = directory / COMPLETE_MARKER
    if not directory.is_dir():
        raise ConfigError(f"{directory}: checkpoint directory does not exist")
    try:
        with open_regular(marker) as f:
            raw = f.read(MAX_MARKER_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{directory}: not a complete stapo checkpoint (no {COMPLETE_MARKER})") from None
    if len(raw) > MAX_MARKER_BYTES:
        raise ConfigError(f"{marker}: damaged completion marker (more than {MAX_MARKER_BYTES} bytes)")
    try:
        content = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ConfigError(f"{marker}: damaged completion marker (not JSON)") from None
    if not isinstance(content, dict):
        raise ConfigError(f"{marker}: damaged completion marker (not a JSON object)")
    return content
