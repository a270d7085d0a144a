"""The second test environment: Python 3.12 with the newest tested megatron-core (0.19.2).

megatron-core 0.17 and later need Python >= 3.12, so the main environment (Python 3.11) can only
test 0.16.1. This venv is built from a 3.12 interpreter (``$STAPO_PY312``, ``python3.12`` on the
PATH, or pyenv's 3.12), with torch from the package index (on 3.12 PyPI's torch 2.13.0 is a CUDA
build that also runs on the CPU; a ``--no-deps`` torch does not import without its CUDA libraries),
``megatron-core==0.19.2`` and this clone editable with its ``dev`` extra.

It lives under ``${STAPO_PY312_VENV_CACHE:-~/.cache/stapo_megatron}/py312-venv-<hash>``, the hash
covering the interpreter's version, the pins and ``setup.py``; it is built in a temporary sibling
and renamed into place when complete, under a file lock. ``python -m tests.py312_env`` builds it
and prints its build time and size; ``python -m tests.py312_env --ci`` then runs the fast tests of
:data:`CI_FAST_TESTS` and :data:`CI_RESUME_TESTS` in it (the part of ``.ci/run`` after the main
suite), failing if either fails.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.sglang_real.sglang_venv import _dir_size, interpreter_version

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PYTHON_VERSION = (3, 12)
PINS = ("torch==2.13.0", "megatron-core==0.19.2")
CACHE_ENV = "STAPO_PY312_VENV_CACHE"
INTERPRETER_ENV = "STAPO_PY312"
BUILD_RECORD = "stapo_py312_venv.json"  # written last inside the venv: its presence means complete
# What CI runs here: the tests of the places where the releases differ (the safe checkpoint loader
# against the installed release's own load, the optimizer fixes, the CPU layer, the model's build and
# logits) and one exact resume after SIGKILL (the judge of the optimizer fixes). Not the whole fast
# suite of those directories: in this venv (PyPI's CUDA torch on the CPU) it took over an hour on this
# 2-core machine under load, past CI's budget. The main environment runs everything.
CI_FAST_TESTS = (
    "tests/checkpoint/test_safe_load.py",
    "tests/runtime/test_megatron_fixes.py",
    "tests/runtime/test_cpu_compat.py",
    "tests/models/test_qwen3_logits.py",
)
CI_RESUME_TESTS = ("tests/trainer/test_resume.py::test_resume_after_sigkill_following_step_3",)


class Py312EnvError(RuntimeError):
    """The venv cannot be built; the message says what failed and where its log is."""


@dataclass(frozen=True)
class Py312Venv:
    root: Path
    install_wall_s: float
    size_bytes: int

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def describe(self) -> str:
        return (
            f"python 3.12 venv {self.root}: built in {self.install_wall_s:.0f} s, "
            f"{self.size_bytes / 2**30:.2f} GiB on disk"
        )


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "stapo_megatron").expanduser()


def base_python() -> str:
    """A Python 3.12 interpreter to make the venv from."""
    wanted = "{}.{}".format(*PYTHON_VERSION)
    candidates = [os.environ.get(INTERPRETER_ENV, ""), shutil.which(f"python{wanted}") or ""]
    if shutil.which("pyenv"):
        prefix = subprocess.run(["pyenv", "prefix", wanted], capture_output=True, text=True)
        if prefix.returncode == 0:
            candidates.append(str(Path(prefix.stdout.strip().splitlines()[0]) / "bin" / "python"))
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "--version"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.split()[-1].startswith(wanted + "."):
            return candidate
    raise Py312EnvError(
        f"the Python 3.12 test venv needs a Python {wanted}: set ${INTERPRETER_ENV}, or put python{wanted} on PATH"
    )


def venv_hash(python_version: str) -> str:
    """Changes whenever the interpreter, a pin or the project's requirements (setup.py) do."""
    digest = hashlib.sha256()
    for part in (python_version, *PINS, (PROJECT_ROOT / "setup.py").read_text()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _run_logged(argv: list[str], log_path: Path) -> None:
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise Py312EnvError(
            f"building the Python 3.12 venv failed (exit {proc.returncode}): {argv[3:]}; see {log_path}"
        )


def _build(tmp: Path, python: str, log_path: Path) -> None:
    _run_logged([python, "-m", "venv", str(tmp)], log_path)
    pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "--no-input"]
    _run_logged([*pip, PINS[0]], log_path)  # torch first: the project's requirement admits other builds
    _run_logged([*pip, *PINS[1:], "-e", f"{PROJECT_ROOT}[dev]"], log_path)


def _installed_project_root(venv: Py312Venv) -> Path | None:
    proc = subprocess.run(
        [str(venv.python), "-c", "import stapo_megatron, pathlib; print(pathlib.Path(stapo_megatron.__file__).parent)"],
        capture_output=True,
        text=True,
        cwd="/",  # not the clone: the venv's own install must be what resolves
    )
    return Path(proc.stdout.strip()).parent if proc.returncode == 0 else None


def ensure_py312_venv(*, log=print) -> Py312Venv:
    """The venv for these pins, building it first if it does not exist yet."""
    python = base_python()
    version = interpreter_version(python)
    cache = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"py312-venv-{venv_hash(version)}"
    log_path = cache / f"{final.name}.build.log"
    with open(cache / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here for the first one's build
        if not (final / BUILD_RECORD).is_file():
            for stale in cache.glob(f"{final.name}.tmp-*"):  # a build killed half-way: never used
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():
                shutil.rmtree(final)
            tmp = cache / f"{final.name}.tmp-{os.getpid()}"
            log_path.write_text(f"building {final} with Python {version}\n")
            log(f"building the Python 3.12 venv {final} (log: {log_path}) ...")
            started = time.monotonic()
            _build(tmp, python, log_path)
            record = {"install_wall_s": round(time.monotonic() - started, 1), "size_bytes": _dir_size(tmp)}
            (tmp / BUILD_RECORD).write_text(json.dumps({**record, "python": version}))
            tmp.rename(final)  # everything here runs as `python -m`: the scripts' shebangs naming tmp are not used
        data = json.loads((final / BUILD_RECORD).read_text())
        venv = Py312Venv(root=final, install_wall_s=data["install_wall_s"], size_bytes=data["size_bytes"])
        # The venv is shared by every clone on this machine: the editable install must be this one.
        if _installed_project_root(venv) != PROJECT_ROOT:
            _run_logged(
                [str(venv.python), "-m", "pip", "install", "--no-input", "--no-deps", "-e", str(PROJECT_ROOT)], log_path
            )
    return venv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ci", action="store_true", help="then run the CI subset of the tests in it")
    args = parser.parse_args()
    started = time.monotonic()
    venv = ensure_py312_venv()
    print(venv.describe(), flush=True)
    if not args.ci:
        return
    pytest = [str(venv.python), "-m", "pytest", "-p", "no:cacheprovider"]
    fast = subprocess.run([*pytest, "-m", "not slow", *CI_FAST_TESTS], cwd=PROJECT_ROOT)
    resume = subprocess.run([*pytest, *CI_RESUME_TESTS], cwd=PROJECT_ROOT)
    print(f"python 3.12 part: {time.monotonic() - started:.0f} s in all (venv included)", flush=True)
    sys.exit(fast.returncode or resume.returncode)


if __name__ == "__main__":
    main()
