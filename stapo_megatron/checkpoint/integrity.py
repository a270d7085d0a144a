"""Checksums of a checkpoint's files, recorded in its completion marker and verified before use.

``stapo_complete.json`` lists every file of the checkpoint (relative path, size, sha256). Writing
and verifying are collective when given the ranks' parallel context: the file list is decided on
rank 0, each rank hashes a deterministic share (at save, the ``__<rank>_*.distcp`` files it wrote
itself, still in its page cache), and the results travel as Python objects over the context's CPU
group, so every rank reaches the same verdict.
Files are read in bounded chunks, a few at a time per rank.

A checkpoint whose marker has no ``files`` was written before checksums were recorded: it is
accepted with a warning that its integrity cannot be verified.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stapo_megatron.checkpoint.files import open_regular, regular_size
from stapo_megatron.checkpoint.marker import COMPLETE_MARKER, check_complete
from stapo_megatron.config import ConfigError

if TYPE_CHECKING:
    from stapo_megatron.runtime.distributed import ParallelContext

logger = logging.getLogger(__name__)

HASH = "sha256"
CHUNK_BYTES = 8 * 1024**2
HASH_THREADS = 4
# The data files of a torch distributed checkpoint: ``__<writer rank>_<thread>.distcp``.
_DATA_FILE_RE = re.compile(r"^__(\d+)_\d+\.distcp$")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")


def file_digest(path: str | os.PathLike) -> tuple[int, str]:
    """(size, sha256 hex) of a regular file (a link or a FIFO is a ConfigError), read in
    ``CHUNK_BYTES`` pieces into one reused buffer."""
    digest = hashlib.new(HASH)
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    size = 0
    with open_regular(path, buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def list_files(directory: Path) -> dict[str, int]:
    """Every file below ``directory`` but the marker: relative POSIX path -> size. Anything but a
    regular file or a directory (a link, a FIFO, a device, a socket) is a one-line ConfigError:
    a checkpoint never holds one, and reading a FIFO would wait forever."""
    files = {}
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names + [d for d in dirs if os.path.islink(os.path.join(root, d))]):
            path = Path(root) / name
            relative = path.relative_to(directory).as_posix()
            if relative == COMPLETE_MARKER:
                continue
            files[relative] = regular_size(path)
    return files


def assign_shares(files: dict[str, int], world: int, by_writer: bool = False) -> list[list[str]]:
    """Which rank hashes which file: deterministic, balanced by bytes.

    ``by_writer``: a ``__<r>_*.distcp`` file goes to rank r (who just wrote it); the rest, largest
    first, to the rank with the fewest bytes so far.
    """
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    rest = []
    for name, size in sorted(files.items()):
        match = _DATA_FILE_RE.match(name) if by_writer else None
        if match and int(match.group(1)) < world:
            writer = int(match.group(1))
            shares[writer].append(name)
            load[writer] += size
        else:
            rest.append(name)
    for name in sorted(rest, key=lambda n: (-files[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += files[name]
    return shares


def _hash_share(directory: Path, names: list[str]) -> dict[str, tuple[int, str] | str]:
    """name -> (size, digest), or an error message for a file that cannot be read."""

    def one(name):
        try:
            return name, file_digest(directory / name)
        except ConfigError as err:  # not a regular file (any more)
            return name, str(err)
        except OSError as err:
            return name, f"{directory / name}: cannot be read ({err.strerror or err})"

    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(names))) as pool:
        return dict(pool.map(one, names))


def record_files(directory: str | os.PathLike, ctx: ParallelContext | None = None) -> dict[str, dict] | None:
    """Hash every file of a just-written checkpoint. Collective over ``ctx``'s ranks when given
    (without it, this process alone); the manifest is returned on rank 0
    (``{path: {"size": n, "sha256": hex}}``), None elsewhere."""
    directory = Path(directory)
    ranks = ctx if ctx is not None and ctx.world_size > 1 else None  # who shares the work
    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    files = list_files(directory) if rank == 0 else None
    if ranks is not None:
        files = ranks.broadcast_object(files)
    assert files is not None  # rank 0's listing, on every rank
    share = assign_shares(files, world, by_writer=True)[rank]
    results = _hash_share(directory, share)
    gathered = ranks.all_gather_object(results) if ranks is not None else [results]
    if rank != 0:
        return None
    manifest = {}
    for results in gathered:
        for name, result in results.items():
            if isinstance(result, str):
                raise ConfigError(result)
            manifest[name] = {"size": result[0], HASH: result[1]}
    return {name: manifest[name] for name in sorted(manifest)}


def _recorded_files(marker: dict, marker_path: Path) -> dict[str, dict] | None:
    files = marker.get("files")
    if files is None:
        return None
    well_formed = isinstance(files, dict) and all(
        isinstance(name, str)
        and name
        and not name.startswith("/")
        and ".." not in name.split("/")
        and isinstance(entry, dict)
        and isinstance(entry.get("size"), int)
        and not isinstance(entry.get("size"), bool)
        and entry["size"] >= 0
        and isinstance(entry.get(HASH), str)
        and _HEX_RE.match(entry[HASH])
        for name, entry in files.items()
    )
    if not well_formed:
        raise ConfigError(f"{marker_path}: malformed file list (damaged or not written by stapo)")
    return files


def _inspect(directory: Path, full: bool) -> tuple[dict, list[tuple[str, int, str]] | None]:
    """The marker and the files whose contents are to be hashed, after checking which files exist
    and their sizes. ``None`` files: a checkpoint from before checksums."""
    marker = check_complete(directory)
    recorded = _recorded_files(marker, directory / COMPLETE_MARKER)
    present = list_files(directory)  # also for a checkpoint from before checksums: only regular files
    if recorded is None:
        return marker, None
    for name in recorded:
        if name not in present:
            raise ConfigError(f"{directory / name}: missing (listed in the checkpoint's {COMPLETE_MARKER})")
    for name in present:
        if name not in recorded:
            raise ConfigError(f"{directory / name}: not part of the checkpoint (not listed in its {COMPLETE_MARKER})")
    for name, entry in recorded.items():
        if present[name] != entry["size"]:
            raise ConfigError(
                f"{directory / name}: {present[name]} bytes, but the checkpoint recorded {entry['size']} (truncated "
                "or replaced)"
            )
    to_hash = [(name, entry["size"], entry[HASH]) for name, entry in sorted(recorded.items())]
    if not full:
        to_hash = [item for item in to_hash if not _DATA_FILE_RE.match(item[0])]
    return marker, to_hash


def verify_checkpoint(directory: str | os.PathLike, ctx: ParallelContext | None = None, *, full: bool = True) -> dict:
    """Check every file of a checkpoint against its marker (present, nothing extra, size, sha256);
    returns the marker. Any difference is a one-line ConfigError naming the file.

    Collective over ``ctx``'s ranks when given (every rank calls it and every rank gets the same
    result; the hashing is shared); without it, this process alone, whether or not
    torch.distributed is running (one rank looking at a run directory, as the end-of-run summary
    does). ``full=False`` hashes all but the large ``*.distcp`` data files (their sizes are still
    checked): a cheap check before the ranks do the full one.
    """
    directory = Path(directory)
    ranks = ctx if ctx is not None and ctx.world_size > 1 else None  # who shares the work
    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    # ("ok", marker, files to hash) or ("error", message, None), decided by rank 0
    verdict: tuple[str, Any, list[tuple[str, int, str]] | None] | None = None
    if rank == 0:
        try:
            verdict = ("ok", *_inspect(directory, full))
        except ConfigError as err:
            verdict = ("error", str(err), None)
        except Exception as err:  # an unreadable directory must not leave the other ranks waiting
            verdict = ("error", f"{directory}: cannot be checked: {type(err).__name__}: {err}", None)
    if ranks is not None:
        verdict = ranks.broadcast_object(verdict)
    assert verdict is not None  # rank 0's, on every rank
    status, marker, to_hash = verdict
    if status == "error":
        raise ConfigError(marker)
    if to_hash is None:
        if rank == 0:  # once: every rank verifies the same checkpoint
            logger.warning(
                "%s: written before checkpoints recorded checksums; its integrity cannot be verified", directory
            )
        return marker
    sizes = {name: size for name, size, _ in to_hash}
    share = assign_shares(sizes, world)[rank]
    results = _hash_share(directory, share)
    expected = {name: digest for name, _, digest in to_hash}
    errors = {}
    for name, result in results.items():
        if isinstance(result, str):
            errors[name] = result
        elif result != (sizes[name], expected[name]):
            errors[name] = (
                f"{directory / name}: contents differ from the {HASH} recorded in {COMPLETE_MARKER} (damaged or "
                "modified)"
            )
    if ranks is not None:
        errors = {name: message for part in ranks.all_gather_object(errors) for name, message in part.items()}
    if errors:
        raise ConfigError(errors[min(errors)])
    return marker
