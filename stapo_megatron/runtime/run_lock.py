"""One run per directory: ``<run>/.lock`` is held by the run for its whole life.

The lock is a file created exclusively (``O_EXCL``) that names its holder (host, pid, start time
and a token) and whose mtime the holder refreshes every :data:`HEARTBEAT_S` seconds. ``flock``
alone would not do: on the shared filesystems of a cluster (NFS, Lustre) it is unreliable or
local to one node, and a lock on a dead node would never be freed. A lock is stale, and a new
run takes it over with a message, when its holder's pid is gone on this host (or is another
process now), when its heartbeat is older than :data:`STALE_AFTER_S` (a holder on another
host; the bound assumes clocks agree within a minute), or when it was taken by an earlier
allocation of the same SLURM job (a requeued job, on any node). On one host, takeovers are
serialised with ``flock`` on ``.lock.guard``.

Who holds it: ``stapo train`` when it starts the ranks (its ranks end with it, see
:func:`stapo_megatron.runtime.launch.watch_launcher`, and learn through :data:`TOKEN_ENV` that
the lock is theirs), or global rank 0 when an outside launcher (torchrun, SLURM) started them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from stapo_megatron.config import ConfigError

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
GUARD_FILE = ".lock.guard"
TOKEN_ENV = "STAPO_RUN_LOCK_TOKEN"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0


@dataclasses.dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    started: float
    token: str
    job: str = ""  # the SLURM job, if any, and how many times it was requeued before
    restarts: int = 0

    @classmethod
    def me(cls) -> LockHolder:
        return cls(
            socket.gethostname(),
            os.getpid(),
            time.time(),
            uuid.uuid4().hex,
            os.environ.get("SLURM_JOB_ID", ""),
            int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        )

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}, started {when}"


def _read_holder(path: Path) -> LockHolder | None:
    """The holder written in ``path``; None while its creator has not written it yet."""
    try:
        with open(path, encoding="utf-8") as f:
            return LockHolder(**json.load(f))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def _pid_runs(pid: int, started: float) -> bool:
    """Whether ``pid`` is the process that took the lock at ``started`` (not a reuse of its pid)."""
    import psutil

    try:
        return psutil.Process(pid).create_time() <= started + 1.0
    except psutil.NoSuchProcess:
        return False


def _stale_reason(holder: LockHolder | None, heartbeat_age: float) -> str | None:
    """Why a lock held by ``holder`` is stale, or None while its holder may still be running."""
    if heartbeat_age > STALE_AFTER_S:
        return f"no heartbeat for {heartbeat_age:.0f} s"
    me = LockHolder.me()
    if holder is not None and holder.job and holder.job == me.job and holder.restarts < me.restarts:
        # Slurm runs one allocation of a job at a time: the earlier one of a requeued job has ended.
        return f"an earlier allocation of SLURM job {holder.job}"
    if holder is not None and holder.host == socket.gethostname() and not _pid_runs(holder.pid, holder.started):
        return f"pid {holder.pid} is no longer running"
    return None


@contextlib.contextmanager
def _host_guard(run_dir: Path):
    with open(run_dir / GUARD_FILE, "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        yield


class RunLock:
    """The held lock of ``run_dir``: ``with RunLock.acquire(run_dir): ...``."""

    def __init__(self, path: Path, holder: LockHolder):
        self.path = path
        self.holder = holder
        self._stopped = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="stapo-run-lock", daemon=True)
        self._heartbeat.start()

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike) -> RunLock:
        """Take the lock, or raise :class:`ConfigError` naming the run that holds it."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        me = LockHolder.me()
        with _host_guard(run_dir):
            while True:
                try:
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                except FileExistsError:
                    holder = _read_holder(path)
                    try:
                        age = time.time() - path.stat().st_mtime
                    except FileNotFoundError:  # its holder just released it
                        continue
                    reason = _stale_reason(holder, age)
                    if reason is None:
                        who = holder.describe() if holder else "a run that is starting"
                        raise ConfigError(
                            f"{run_dir}: in use by another run ({who}); wait for it to end or choose another "
                            "run.output_dir"
                        ) from None
                    logger.warning(
                        "%s: taking over the lock of a run that is gone (%s: %s)",
                        run_dir,
                        holder.describe() if holder else "holder unknown",
                        reason,
                    )
                    path.unlink(missing_ok=True)
                    continue
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(dataclasses.asdict(me), f)
                return cls(path, me)

    def held(self) -> bool:
        """Whether the lock file still names this holder (not taken over after a long stall)."""
        holder = _read_holder(self.path)
        return holder is not None and holder.token == self.holder.token

    def _beat(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stopped.set()
        self._heartbeat.join()
        if self.held():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
