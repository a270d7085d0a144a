"""``<run>/checkpoints/``: which checkpoints it holds, which this run wrote, and which to keep.

``iter_0000042/`` is one checkpoint, renamed into place only when whole (see
:mod:`stapo_megatron.checkpoint.dist`), so a directory with a checkpoint's name and its completion
marker is complete. ``latest.txt`` names the newest one (for people and tools) and is replaced
atomically after it. ``history.json`` lists the steps this run saved: pruning deletes only those,
never a checkpoint by its step number alone. What is written into the checkpoints is
:mod:`stapo_megatron.trainer.checkpointing`'s.

Nothing here loads torch's checkpointing: the launcher reads the directory before any rank starts.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from stapo_megatron.checkpoint.cli import CHECKPOINT_NAME
from stapo_megatron.checkpoint.marker import COMPLETE_MARKER
from stapo_megatron.config import MAX_STEPS, ConfigError
from stapo_megatron.runtime.run_files import atomic_open
from stapo_megatron.trainer.run_record import shown_value

if TYPE_CHECKING:
    from stapo_megatron.runtime.distributed import ParallelContext

logger = logging.getLogger(__name__)

LATEST_FILE = "latest.txt"
HISTORY_FILE = "history.json"
# history.json holds at most keep_last + 1 steps of 7 digits; a larger file is not the trainer's.
_MAX_HISTORY_BYTES = 1 << 20


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def _complete_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = CHECKPOINT_NAME.fullmatch(entry.name)
        if match and (entry / COMPLETE_MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _read_history(root: Path) -> list[int] | None:
    """The steps ``root/history.json`` lists (None: there is none), checked: a damaged history
    cannot be rebuilt from the directory's checkpoints, which may include some this run did not
    write (copied in, or kept on purpose); the history is what keeps pruning off those."""
    path = root / HISTORY_FILE
    if not path.exists() and not path.is_symlink():
        return None

    def damaged(what: str) -> ConfigError:
        complete = _complete_steps(root)
        return ConfigError(
            f"{path}: {what}; it lists the checkpoints this run wrote, the only ones pruning deletes: write their "
            f'steps into it (e.g. {{"steps": {complete}}} if every complete checkpoint there is this run\'s), or '
            f"delete it to count every complete checkpoint in {root} as this run's"
        )

    if path.is_symlink() or not path.is_file():
        raise damaged("not a regular file, as the trainer writes it")
    with open(path, "rb") as f:
        content = f.read(_MAX_HISTORY_BYTES + 1)
    if len(content) > _MAX_HISTORY_BYTES:
        raise damaged(f"larger than {_MAX_HISTORY_BYTES} bytes, not a history the trainer wrote")
    try:
        history = json.loads(content)
    except (ValueError, RecursionError):
        raise damaged("damaged (not JSON: cut off?)") from None
    steps = history.get("steps") if isinstance(history, dict) else None
    if not isinstance(steps, list):
        raise damaged('not {"steps": [...]}, as the trainer writes it')
    for step in steps:
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEPS:
            raise damaged(f"lists {shown_value(step)}, not a step in [0, {MAX_STEPS}]")
    return steps


def check_run_files(run_dir: Path) -> None:
    """The run files that a resume and the next save read, checked before any training (one line
    naming the file and what to do): ``checkpoints/`` a directory, its ``history.json`` (see
    :func:`_read_history`), and its ``latest.txt`` a file naming a checkpoint, since the next save
    replaces it (a file the trainer did not write there would be lost)."""
    root = Path(run_dir) / "checkpoints"
    if root.is_symlink() and not root.exists():
        raise ConfigError(f"{root}: a link to nothing; the run keeps its checkpoints there: point it at a directory")
    if not root.exists():
        return
    if not root.is_dir():
        raise ConfigError(f"{root}: not a directory; the run keeps its checkpoints there: move it away")
    _read_history(root)
    latest = root / LATEST_FILE
    if not latest.exists() and not latest.is_symlink():
        return
    named = None
    if latest.is_file() and not latest.is_symlink():
        with open(latest, "rb") as f:
            named = f.read(64)
    if named is None or not CHECKPOINT_NAME.fullmatch(named.decode("ascii", "replace").removesuffix("\n")):
        raise ConfigError(
            f"{latest}: does not name a checkpoint (iter_NNNNNNN) as the trainer writes it, and the next checkpoint "
            "replaces it: move it away"
        )


class CheckpointDirectory:
    """The checkpoints of the run in ``run_dir``, of which a save keeps the newest ``keep_last``."""

    def __init__(self, run_dir: Path, keep_last: int):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def path(self, step: int) -> Path:
        return self.root / checkpoint_name(step)

    def complete_steps(self) -> list[int]:
        return _complete_steps(self.root)

    def latest(self) -> Path | None:
        """The newest complete checkpoint. Found by a scan: ``latest.txt`` is written after the
        rename, so a kill in between leaves it one checkpoint behind."""
        steps = self.complete_steps()
        return self.path(steps[-1]) if steps else None

    def latest_intact(self, ctx: ParallelContext) -> Path | None:
        """The newest complete checkpoint whose files match the checksums in its marker. Collective:
        every rank gets the same answer (rank 0's list of checkpoints, verdicts shared over the CPU
        group). A damaged one is skipped with a message saying why; damaged ones only are an error."""
        from stapo_megatron.checkpoint.integrity import verify_checkpoint

        steps = ctx.broadcast_object(self.complete_steps() if ctx.rank == 0 else None)
        skipped = []
        for step in reversed(steps):
            directory = self.path(step)
            try:
                verify_checkpoint(directory, ctx)
            except ConfigError as err:
                skipped.append(f"{directory.name}: {err}")
                if ctx.rank == 0:
                    logger.warning("skipping damaged checkpoint %s: %s", directory.name, err)
                continue
            return directory
        if skipped:
            raise ConfigError(
                f"{self.root}: no intact checkpoint to resume from ({len(skipped)} damaged; newest {skipped[0]})"
            )
        return None

    def history(self) -> list[int]:
        """The steps of this run's checkpoints, in the order they were saved. The run is this
        directory's only one (``stapo train`` moves an earlier run away before starting afresh);
        a directory from before the history file starts from its complete checkpoints."""
        steps = _read_history(self.root)
        return self.complete_steps() if steps is None else steps

    def add_to_history(self, step: int) -> None:
        """Before ``step`` is written: a step in the history whose write was killed is harmless."""
        self._write_history([*self.history(), step])

    def _write_history(self, steps: list[int]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with atomic_open(self.root / HISTORY_FILE) as f:
            json.dump({"steps": steps}, f)

    def saved(self, step: int) -> None:
        """After ``step`` is written: ``latest.txt`` names it, and the checkpoints beyond
        ``keep_last`` go (:meth:`_prune`)."""
        with atomic_open(self.root / LATEST_FILE) as f:
            f.write(checkpoint_name(step))
        self._prune(step)

    def _prune(self, saved: int) -> None:
        """Delete this run's checkpoints other than the newest ``keep_last`` it saved, and those of
        steps after ``saved`` (left by a trajectory that a resume from an earlier checkpoint
        abandoned, which a later resume must not jump back to). Checkpoints this run did not write
        are not touched."""
        history = [s for s in dict.fromkeys(reversed(self.history())) if s <= saved]  # newest first, once each
        kept = history[: self.keep_last]
        for step in set(self.history()) - set(kept):
            shutil.rmtree(self.path(step), ignore_errors=True)
        self._write_history(kept[::-1])
        for entry in self.root.iterdir():
            # Staging directories of writes that were killed.
            if entry.name.startswith(".iter_") and entry.name.endswith((".partial", ".old")):
                shutil.rmtree(entry, ignore_errors=True)
