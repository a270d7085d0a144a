"""Test harness only: a stand-in for SGLang's ``sgl_kernel`` package, which must never be called.

SGLang 0.5.23 imports ``sgl_kernel`` at module level on its CPU path
(``sglang/kernels/ops/kvcache/cache_move.py``), but PyPI holds only CUDA builds of the kernel
package. The test harness puts this directory on the SERVER's ``PYTHONPATH`` (nowhere else) so
that those imports pass; SGLang's plain-torch CPU paths (``--attention-backend torch_native``,
``--sampling-backend pytorch``, no AMX) then run without it.

Every attribute, of this package and of any ``sgl_kernel.<sub>`` module, is a stand-in. Calling
one (or anything reached from one) appends a line to ``$STAPO_SGL_KERNEL_STANDIN_TRACE``, prints
it to stderr (the server's log) and raises, so a test fails if SGLang ever used a kernel in place
of the code it is meant to exercise: the harness checks that trace file after every test.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import traceback
import types

TRACE_ENV = "STAPO_SGL_KERNEL_STANDIN_TRACE"
MARKER = "sgl_kernel stand-in called"


class StandInCalled(RuntimeError):
    """SGLang called an ``sgl_kernel`` function, which this CPU test setup does not have."""


class KernelStandIn:
    """One ``sgl_kernel`` name: importable, never callable."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str) -> KernelStandIn:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # keep pickling, copying and introspection honest
        return KernelStandIn(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        caller = "".join(traceback.format_stack(limit=6)[:-1])
        line = f"{MARKER}: {self._qualname} (pid {os.getpid()})"
        path = os.environ.get(TRACE_ENV)
        if path:
            with open(path, "a", encoding="utf-8") as trace:
                trace.write(f"{line}\n{caller}\n")
        print(line, file=sys.stderr, flush=True)
        raise StandInCalled(f"{line}: the CPU test harness has no sgl_kernel; SGLang must not need it here")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._qualname}>"


def _stand_in_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"stand-in for {name} (tests/sglang_real)")
    module.__getattr__ = lambda attr: _attribute(name, attr)  # type: ignore[method-assign]
    return module


def _attribute(module: str, attr: str) -> KernelStandIn:
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    return KernelStandIn(f"{module}.{attr}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import sgl_kernel.<anything>`` gives a stand-in module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _stand_in_module(spec.name)
        module.__path__ = []  # a package, so deeper submodules resolve through this finder too
        return module

    def exec_module(self, module):
        pass


def __getattr__(attr: str) -> KernelStandIn:
    return _attribute(__name__, attr)


sys.meta_path.insert(0, _SubmoduleFinder())
