"""A virtual environment the tests build once per machine and keep under a cache directory: the
real-SGLang servers' venv (tests/sglang_real/sglang_venv.py) and the Python 3.12 one
(tests/py312_env.py). Each is named by a hash of what goes into it, built in a temporary sibling
directory and renamed into place only when complete (a half-built one is never used), under a file
lock so that two processes never build it twice; a record written last inside it holds its build
time and size.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class VenvBuildError(RuntimeError):
    """A cached venv cannot be built or used; the message says what failed and where its log is."""


@dataclass(frozen=True)
class CachedVenv:
    label: str
    root: Path
    install_wall_s: float
    size_bytes: int

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def describe(self) -> str:
        return (
            f"{self.label} venv {self.root}: built in {self.install_wall_s:.0f} s, "
            f"{self.size_bytes / 2**30:.2f} GiB on disk"
        )


def cache_root(env_var: str) -> Path:
    return Path(os.environ.get(env_var) or Path.home() / ".cache" / "stapo_megatron").expanduser()


def interpreter_version(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def digest(parts: Iterable[str]) -> str:
    """A short hash of ``parts`` (pins, files' texts, the interpreter's version)."""
    sha = hashlib.sha256()
    for part in parts:
        sha.update(part.encode())
        sha.update(b"\0")
    return sha.hexdigest()[:16]


def dir_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def run_logged(argv: list[str], log_path: Path, label: str) -> None:
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise VenvBuildError(f"building the {label} venv failed (exit {proc.returncode}): {argv[3:]}; see {log_path}")


def _installed_project_root(python: Path) -> Path | None:
    proc = subprocess.run(
        [str(python), "-c", "import stapo_megatron, pathlib; print(pathlib.Path(stapo_megatron.__file__).parent)"],
        capture_output=True,
        text=True,
        cwd="/",  # not the clone: the venv's own install must be what resolves
    )
    return Path(proc.stdout.strip()).parent if proc.returncode == 0 else None


def ensure_cached_venv(
    *,
    label: str,
    cache: Path,
    name: str,
    python: str,
    record_file: str,
    build: Callable[[Path, Path], None],
    log: Callable[[str], object] = print,
) -> CachedVenv:
    """The venv ``cache/name``, made first by ``build(directory, log_path)`` from ``python`` if it does
    not exist yet; the clone running this is its editable install."""
    version = interpreter_version(python)
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / name
    log_path = cache / f"{name}.build.log"
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here for the first one's build
        if not (final / record_file).is_file():
            for stale in cache.glob(f"{name}.tmp-*"):  # a build killed half-way: never used
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():
                shutil.rmtree(final)
            tmp = cache / f"{name}.tmp-{os.getpid()}"
            log_path.write_text(f"building {final} with Python {version}\n")
            log(f"building the {label} venv {final} (Python {version}; log: {log_path}) ...")
            started = time.monotonic()
            build(tmp, log_path)
            record = {"install_wall_s": round(time.monotonic() - started, 1), "size_bytes": dir_size(tmp)}
            (tmp / record_file).write_text(json.dumps({**record, "python": version}))
            tmp.rename(final)  # everything here runs as `python -m`: the scripts' shebangs naming tmp are not used
        data = json.loads((final / record_file).read_text())
        venv = CachedVenv(label, final, data["install_wall_s"], data["size_bytes"])
        # The venv is shared by every clone on this machine: the editable install must be this one.
        if _installed_project_root(venv.python) != PROJECT_ROOT:
            run_logged(
                [str(venv.python), "-m", "pip", "install", "--no-input", "--no-deps", "-e", str(PROJECT_ROOT)],
                log_path,
                label,
            )
    return venv
