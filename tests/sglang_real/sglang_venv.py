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
the hash covering every pin above and the Python version, built as :mod:`tests.cached_venv` builds
its venvs. ``python -m tests.sglang_real.sglang_venv`` builds it ahead of the tests and prints its
install time and size.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tests.cached_venv import (
    CachedVenv,
    VenvBuildError,
    cache_root,
    digest,
    ensure_cached_venv,
    interpreter_version,
    run_logged,
)

HERE = Path(__file__).resolve().parent
PROJECT_ROOT = HERE.parents[1]
REQUIREMENTS = HERE / "sglang-cpu-requirements.txt"
TORCH_PIN = "torch==2.13.0"
SGLANG_PINS = ("sglang==0.5.23", "apache-tvm-ffi==0.1.11", "torchvision==0.28.0")
PYTHON_VERSION = (3, 11)
CACHE_ENV = "STAPO_SGLANG_VENV_CACHE"
BUILD_RECORD = "stapo_sglang_venv.json"  # written last inside the venv: its presence means complete
LABEL = "sglang"

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


def base_python() -> str:
    """A Python 3.11 interpreter to make the venv from (the one running, when it is 3.11)."""
    if sys.version_info[:2] == PYTHON_VERSION:
        return getattr(sys, "_base_executable", sys.executable)
    found = shutil.which("python{}.{}".format(*PYTHON_VERSION))
    if not found:
        raise VenvBuildError("the sglang venv needs Python {}.{}; none found on PATH".format(*PYTHON_VERSION))
    return found


def venv_hash(python_version: str) -> str:
    """Changes whenever a pin, the guard or the Python version does."""
    return digest((python_version, TORCH_PIN, REQUIREMENTS.read_text(), *SGLANG_PINS, TORCHVISION_GUARD))


def guard_torchvision(venv_root: Path) -> None:
    """Register torchvision's fake kernels only for operators the CPU torch has (see TORCHVISION_GUARD)."""
    (meta,) = venv_root.glob("lib/python*/site-packages/torchvision/_meta_registrations.py")
    text = meta.read_text()
    anchor = "import torchvision.extension  # noqa: F401\n"
    if anchor not in text or TORCHVISION_FAKE not in text:
        raise VenvBuildError(f"{meta} is not torchvision 0.28.0's: its fake-kernel registrations cannot be guarded")
    text = text.replace(anchor, anchor + TORCHVISION_GUARD, 1)
    meta.write_text(text.replace(TORCHVISION_FAKE, '@_register_fake_if_ops("torchvision::'))


def _build(tmp: Path, python: str, log_path: Path) -> None:
    run_logged([python, "-m", "venv", str(tmp)], log_path, LABEL)
    pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "--no-input"]
    run_logged([*pip, TORCH_PIN], log_path, LABEL)
    run_logged([*pip, "--no-deps", "-r", str(REQUIREMENTS)], log_path, LABEL)
    run_logged([*pip, "--no-deps", *SGLANG_PINS], log_path, LABEL)
    guard_torchvision(tmp)
    run_logged([*pip, "--no-deps", "-e", str(PROJECT_ROOT)], log_path, LABEL)


def ensure_sglang_venv(*, log=print) -> CachedVenv:
    """The SGLang venv for these pins, building it first if it does not exist yet."""
    python = base_python()
    return ensure_cached_venv(
        label=LABEL,
        cache=cache_root(CACHE_ENV),
        name=f"sglang-venv-{venv_hash(interpreter_version(python))}",
        python=python,
        record_file=BUILD_RECORD,
        build=lambda tmp, log_path: _build(tmp, python, log_path),
        log=log,
    )


def main() -> None:
    venv = ensure_sglang_venv()
    print(venv.describe())


if __name__ == "__main__":
    main()
