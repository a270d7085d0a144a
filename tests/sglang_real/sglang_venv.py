"""The separate virtual environment that runs real SGLang 0.5.23 servers on the CPU (tests only).

SGLang pins torch 2.14.1 and ~45 CUDA packages, so it cannot share the project's venv (torch
2.13.0+cpu). The recipe is the measured one of ``shared/notes/sglang-on-cpu.md``:

1. a Python 3.11 venv and ``pip install torch==2.13.0`` (the CPU wheel on this machine's disk);
2. ``pip install --no-deps -r sglang-cpu-requirements.txt`` (beside this file: SGLang 0.5.23's
   dependency set as pip resolved it, less torch, nvidia-*, flashinfer and sglang-kernel);
3. ``pip install --no-deps sglang==0.5.23 apache-tvm-ffi==0.1.11 torchvision==0.28.0``;
4. the project itself, editable (``pip install --no-deps -e``): the server command is the project's
   key-from-environment wrapper, ``python -m stapo_megatron.rollout.sglang_launch``, which imports
   only the standard library, so none of the project's dependencies are needed there.

The venv lives under ``${STAPO_SGLANG_VENV_CACHE:-~/.cache/stapo_megatron}/sglang-venv-<hash>``,
the hash covering every pin above and the Python version. It is built in a temporary sibling
directory and renamed into place only when complete (a half-built one is never used), under a file
lock so that two test processes never build it twice. ``python -m tests.sglang_real.sglang_venv``
builds it ahead of the tests and prints its install time and size.
"""

from __future__ import annotations

import contextlib
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

HERE = Path(__file__).resolve().parent
PROJECT_ROOT = HERE.parents[1]
REQUIREMENTS = HERE / "sglang-cpu-requirements.txt"
TORCH_PIN = "torch==2.13.0"
SGLANG_PINS = ("sglang==0.5.23", "apache-tvm-ffi==0.1.11", "torchvision==0.28.0")
PYTHON_VERSION = (3, 11)
CACHE_ENV = "STAPO_SGLANG_VENV_CACHE"
BUILD_RECORD = "stapo_sglang_venv.json"  # written last inside the venv: its presence means complete
# PyPI's torchvision 0.28.0 is a CUDA build: beside torch 2.13.0+cpu its C++ operators do not load,
# and its module-level ``@torch.library.register_fake("torchvision::nms")`` (and ``qnms``) then
# raises "operator torchvision::nms does not exist", which stops every ``import torchvision``
# (SGLang's configs and transformers' image utilities import it). The guard registers those fake
# kernels only when the operators exist, as torchvision's own ``register_meta`` already does.
TORCHVISION_FAKE = '@torch.library.register_fake("torchvision::'
TORCHVISION_GUARD = (
    "\n\ndef _register_fake_if_ops(qualname):  # stapo_megatron tests: the CPU torch lacks torchvision's ops\n"
    "    return torch.library.register_fake(qualname) if torchvision.extension._has_ops() else (lambda fn: fn)\n"
)


class SGLangVenvError(RuntimeError):
    """The SGLang venv cannot be built or used; the message says what failed and where its log is."""


@dataclass(frozen=True)
class SGLangVenv:
    root: Path
    install_wall_s: float
    size_bytes: int

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def describe(self) -> str:
        return (
            f"sglang venv {self.root}: built in {self.install_wall_s:.0f} s, {self.size_bytes / 2**30:.2f} GiB on disk"
        )


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "stapo_megatron").expanduser()


def base_python() -> str:
    """A Python 3.11 interpreter to make the venv from (the one running, when it is 3.11)."""
    if sys.version_info[:2] == PYTHON_VERSION:
        return getattr(sys, "_base_executable", sys.executable)
    found = shutil.which("python{}.{}".format(*PYTHON_VERSION))
    if not found:
        raise SGLangVenvError("the sglang venv needs Python {}.{}; none found on PATH".format(*PYTHON_VERSION))
    return found


def interpreter_version(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def venv_hash(python_version: str) -> str:
    """Changes whenever a pin, the guard or the Python version does."""
    digest = hashlib.sha256()
    for part in (python_version, TORCH_PIN, REQUIREMENTS.read_text(), *SGLANG_PINS, TORCHVISION_GUARD):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _dir_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _run_logged(argv: list[str], log_path: Path) -> None:
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SGLangVenvError(f"building the sglang venv failed (exit {proc.returncode}): {argv[3:]}; see {log_path}")


def guard_torchvision(venv_root: Path) -> None:
    """Register torchvision's fake kernels only for operators the CPU torch has (see TORCHVISION_GUARD)."""
    (meta,) = venv_root.glob("lib/python*/site-packages/torchvision/_meta_registrations.py")
    text = meta.read_text()
    anchor = "import torchvision.extension  # noqa: F401\n"
    if anchor not in text or TORCHVISION_FAKE not in text:
        raise SGLangVenvError(f"{meta} is not torchvision 0.28.0's: its fake-kernel registrations cannot be guarded")
    text = text.replace(anchor, anchor + TORCHVISION_GUARD, 1)
    meta.write_text(text.replace(TORCHVISION_FAKE, '@_register_fake_if_ops("torchvision::'))


def _build(tmp: Path, python: str, log_path: Path) -> None:
    _run_logged([python, "-m", "venv", str(tmp)], log_path)
    pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "--no-input"]
    _run_logged([*pip, TORCH_PIN], log_path)
    _run_logged([*pip, "--no-deps", "-r", str(REQUIREMENTS)], log_path)
    _run_logged([*pip, "--no-deps", *SGLANG_PINS], log_path)
    guard_torchvision(tmp)
    _run_logged([*pip, "--no-deps", "-e", str(PROJECT_ROOT)], log_path)


def _record(root: Path) -> SGLangVenv:
    data = json.loads((root / BUILD_RECORD).read_text())
    return SGLangVenv(root=root, install_wall_s=data["install_wall_s"], size_bytes=data["size_bytes"])


def _installed_project_root(venv: SGLangVenv) -> Path | None:
    proc = subprocess.run(
        [str(venv.python), "-c", "import stapo_megatron, pathlib; print(pathlib.Path(stapo_megatron.__file__).parent)"],
        capture_output=True,
        text=True,
        cwd="/",  # not the clone: the venv's own install must be what resolves
    )
    return Path(proc.stdout.strip()).parent if proc.returncode == 0 else None


def ensure_sglang_venv(*, log=print) -> SGLangVenv:
    """The SGLang venv for these pins, building it first if it does not exist yet."""
    python = base_python()
    version = interpreter_version(python)
    cache = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"sglang-venv-{venv_hash(version)}"
    with open(cache / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second test process waits here for the first one's build
        if not (final / BUILD_RECORD).is_file():
            for stale in cache.glob(f"{final.name}.tmp-*"):  # a build killed half-way: never used
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():
                shutil.rmtree(final)
            tmp = cache / f"{final.name}.tmp-{os.getpid()}"
            log_path = cache / f"{final.name}.build.log"
            log_path.write_text(f"building {final} with Python {version}\n")
            log(f"building the sglang venv {final} (Python {version}; log: {log_path}) ...")
            started = time.monotonic()
            _build(tmp, python, log_path)
            wall_s = time.monotonic() - started
            record = {"install_wall_s": round(wall_s, 1), "size_bytes": _dir_size(tmp), "python": version}
            (tmp / BUILD_RECORD).write_text(json.dumps(record))
            tmp.rename(final)
        venv = _record(final)
        # The venv is shared by every clone on this machine: the editable install must be this one.
        if _installed_project_root(venv) != PROJECT_ROOT:
            _run_logged(
                [str(venv.python), "-m", "pip", "install", "--no-input", "--no-deps", "-e", str(PROJECT_ROOT)],
                cache / f"{final.name}.build.log",
            )
    return venv


def main() -> None:
    venv = ensure_sglang_venv()
    print(venv.describe())


if __name__ == "__main__":
    main()
