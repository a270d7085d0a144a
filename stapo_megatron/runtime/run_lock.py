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

A ``.lock`` that no run of this release wrote is never followed, looped on or read as a holder: a
symbolic link, a directory or another non-regular file is refused in one line (it is not the
project's to remove); a regular file whose content names no valid holder (cut off, not a JSON
object, fields of the wrong type) is a holder unknown, taken over like any other once its heartbeat
is older than :data:`STALE_AFTER_S`, refused until then.

Who holds it: ``stapo train`` when it starts the ranks (its ranks end with it, see
:func:`stapo_megatron.runtime.launch.watch_launcher`, and learn through :data:`TOKEN_ENV` that
the lock is theirs), or global rank 0 when an outside launcher (torchrun, SLURM) started them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
from pathlib import Path

from stapo_megatron.config import ConfigError
from stapo_megatron.runtime.environment import env_int
from stapo_megatron.runtime.run_files import run_directory_error

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
GUARD_FILE = ".lock.guard"
TOKEN_ENV = "STAPO_RUN_LOCK_TOKEN"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0
# Slurm counts a job's restarts in 16 bits (restart_cnt of its job record): SLURM_RESTART_COUNT
# never exceeds this.
SLURM_MAX_RESTART_COUNT = 65535
# A holder's JSON is about 200 bytes; a bigger .lock is not one.
_MAX_LOCK_BYTES = 4096
# Takeovers and releases racing this acquisition make it try again; a bound, so that it cannot spin.
_MAX_ATTEMPTS = 100


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
            slurm_restart_count(),
        )

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}, started {when}"


def slurm_restart_count() -> int:
    """How many times SLURM requeued this job before this allocation (0 outside SLURM)."""
    return env_int("SLURM_RESTART_COUNT", low=0, high=SLURM_MAX_RESTART_COUNT, default=0)


# The holder's fields and the JSON types each must have (bool is excluded from the numbers below).
_HOLDER_TYPES: dict[str, tuple[type, ...]] = {
    "host": (str,),
    "pid": (int,),
    "started": (int, float),
    "token": (str,),
    "job": (str,),
    "restarts": (int,),
}
_OPTIONAL_FIELDS = {"job", "restarts"}
# pids: Linux's pid_max is at most 2**22; times: up to the year 5138, which localtime() still shows.
_HOLDER_RANGES = (("pid", 1, 2**31 - 1), ("started", 0, 1e11), ("restarts", 0, SLURM_MAX_RESTART_COUNT))


def _holder_problem(data) -> str | None:
    """Why ``data`` (a parsed lock file) names no holder, or None when it does."""
    if not isinstance(data, dict):
        return f"holds a JSON {type(data).__name__}, not an object"
    for name, types in _HOLDER_TYPES.items():
        if name not in data:
            if name in _OPTIONAL_FIELDS:
                continue
            return f"has no {name}"
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"{name} is {value!r}, not {' or '.join(t.__name__ for t in types)}"
    for name, low, high in _HOLDER_RANGES:
        if name in data and not low <= data[name] <= high:
            return f"{name} {data[name]!r} is out of range"
    return None


@dataclasses.dataclass(frozen=True)
class _LockFile:
    """What a ``.lock`` held when read: its holder (None: unreadable, with ``problem`` saying why,
    '' while its creator has not written it yet) and the age of its heartbeat."""

    holder: LockHolder | None
    problem: str
    heartbeat_age: float


def _read_lock(path: Path) -> _LockFile:
    """The lock file at ``path``, never following a link; FileNotFoundError once it is gone.
    Anything but a regular file is refused with :class:`ConfigError`."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        kind = (
            f"a symbolic link (to {os.readlink(path)!r})"
            if stat.S_ISLNK(st.st_mode)
            else "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "not a regular file"
        )
        raise ConfigError(
            f"{path}: {kind}, not a lock file stapo_megatron writes; remove it yourself once no run uses "
            f"{path.parent}, or choose another run.output_dir"
        )
    # O_NONBLOCK: should it have become a FIFO since, opening it does not wait for a writer
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        age = time.time() - st.st_mtime
        data = f.read(_MAX_LOCK_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
    if not data:
        return _LockFile(None, "", age)
    if len(data) > _MAX_LOCK_BYTES:
        return _LockFile(None, f"over {_MAX_LOCK_BYTES} bytes", age)
    try:
        parsed = json.loads(data)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError both are
        return _LockFile(None, "not JSON (cut off, or not a lock)", age)
    problem = _holder_problem(parsed)
    if problem is not None:
        return _LockFile(None, problem, age)
    return _LockFile(LockHolder(**{name: parsed[name] for name in _HOLDER_TYPES if name in parsed}), "", age)


def held_with(run_dir: str | os.PathLike, token: str) -> bool:
    """Whether ``run_dir``'s lock is held now by the holder whose token is ``token``."""
    try:
        holder = _read_lock(Path(run_dir) / LOCK_FILE).holder
    except (OSError, ConfigError):
        return False
    return holder is not None and holder.token == token


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


def _cannot(run_dir: Path, what: str, err: OSError) -> ConfigError:
    return run_directory_error(run_dir, f"cannot {what} ({err.strerror or err})")


@contextlib.contextmanager
def _host_guard(run_dir: Path):
    path = run_dir / GUARD_FILE
    try:
        # never through a link: the guard is created here, not wherever a link points
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(
                f"{path}: a symbolic link, not the lock guard stapo_megatron writes; remove it yourself once no run "
                f"uses {run_dir}, or choose another run.output_dir"
            ) from None
        raise _cannot(run_dir, f"open its {GUARD_FILE}", err) from None
    with os.fdopen(fd, "w") as guard:
        if not stat.S_ISREG(os.fstat(guard.fileno()).st_mode):
            raise ConfigError(f"{path}: not a regular file; remove it yourself, or choose another run.output_dir")
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
        except OSError as err:  # a file system without locks (ENOLCK)
            raise _cannot(run_dir, f"lock its {GUARD_FILE}", err) from None
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
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise _cannot(run_dir, "create it", err) from None
        path = run_dir / LOCK_FILE
        me = LockHolder.me()
        with _host_guard(run_dir):
            for _ in range(_MAX_ATTEMPTS):
                try:
                    # O_EXCL creates a file and never follows a link (an existing link is EEXIST)
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                except FileExistsError:
                    pass
                except OSError as err:
                    raise _cannot(run_dir, f"create its {LOCK_FILE}", err) from None
                else:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        json.dump(dataclasses.asdict(me), f)
                    return cls(path, me)
                try:
                    found = _read_lock(path)
                except FileNotFoundError:  # its holder just released it
                    continue
                except OSError as err:
                    raise _cannot(run_dir, f"read its {LOCK_FILE}", err) from None
                holder = found.holder
                reason = _stale_reason(holder, found.heartbeat_age)
                unknown = f"holder unknown: {path.name} {found.problem}" if found.problem else "holder unknown"
                if reason is None:
                    who = holder.describe() if holder else unknown if found.problem else "a run that is starting"
                    raise ConfigError(
                        f"{run_dir}: in use by another run ({who}); wait for it to end or choose another run.output_dir"
                    ) from None
                logger.warning(
                    "%s: taking over the lock of a run that is gone (%s: %s)",
                    run_dir,
                    holder.describe() if holder else unknown,
                    reason,
                )
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
                except OSError as err:
                    raise _cannot(run_dir, f"remove the stale {LOCK_FILE}", err) from None
            raise ConfigError(
                f"{run_dir}: its {LOCK_FILE} kept changing while this run tried to take it ({_MAX_ATTEMPTS} tries); "
                "another run is starting there: wait for it, or choose another run.output_dir"
            )

    def held(self) -> bool:
        """Whether the lock file still names this holder (not taken over after a long stall)."""
        return held_with(self.path.parent, self.holder.token)

    def _beat(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path, follow_symlinks=False)

    def release(self) -> None:
        self._stopped.set()
        self._heartbeat.join()
        if self.held():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
