"""Run Megatron-Core on machines without CUDA (CPU tensors, gloo collectives).

Megatron-Core (0.16 to 0.19) assumes CUDA in a handful of spots: its RNG tracker reads and writes the
CUDA generator, about 160 places ask ``torch.cuda.current_device()`` for a device, the causal
mask, pipeline schedules, the optimizer and gradient clipping build tensors with
``device="cuda"``, point-to-point code calls ``torch.cuda.synchronize()``, and the optimizer
and clipping check ``tensor.type()`` for ``torch.cuda.*Tensor`` strings.

:func:`install` is called by the distributed entry point only when CUDA is absent; on a GPU
nothing here runs. It gives every ``megatron.core`` module (loaded now or later) a view of
``torch`` in which:

- ``torch.cuda`` answers with the CPU: the current device is ``cpu``, synchronisation is a
  no-op, and the RNG calls act on the CPU generator, so the model-parallel RNG tracker swaps
  CPU generator states the way it swaps CUDA ones on a GPU;
- tensor factories given a CUDA device build the tensor on the CPU;

Megatron's torch.compile fusion decorator is a no-op (the model does not fuse on the CPU), a
function that a Megatron module compiles as it is imported (0.17+'s MoE router compiles a static
method at class definition) is compiled when first called instead, so that importing Megatron does
not load TorchDynamo; and it makes ``tensor.type()`` report CUDA type names to Megatron's optimizer package, whose
parameter classification is written against those names, and ``tensor.cuda()`` called from
Megatron leave the tensor where it is.

Nothing here corrects a bug of Megatron: those corrections, needed on every device, are in
:mod:`stapo_megatron.runtime.megatron_fixes`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
import types

import torch

_CPU = torch.device("cpu")
_FACTORIES = frozenset(
    {
        "arange",
        "as_tensor",
        "empty",
        "empty_like",
        "empty_strided",
        "eye",
        "full",
        "full_like",
        "linspace",
        "ones",
        "ones_like",
        "rand",
        "rand_like",
        "randint",
        "randn",
        "randn_like",
        "randperm",
        "tensor",
        "zeros",
        "zeros_like",
    }
)
_installed = False


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _factory_on_cpu(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    factory.__name__ = fn.__name__
    factory.__doc__ = fn.__doc__
    return factory


class _NoStream:
    """Stands in for CUDA streams and events: work on the CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record(self, *args):
        pass

    def record_event(self, *args):
        return _NoStream()

    def synchronize(self):
        pass

    def query(self):
        return True


def _build_cuda_view() -> types.SimpleNamespace:
    def get_rng_state(device=None):
        return torch.get_rng_state()

    def set_rng_state(state, device=None):
        torch.set_rng_state(state)

    def manual_seed(seed):
        torch.manual_seed(seed)

    random = types.SimpleNamespace(get_rng_state=get_rng_state, set_rng_state=set_rng_state, manual_seed=manual_seed)
    view = types.SimpleNamespace(
        is_available=lambda: False,
        device_count=lambda: 0,
        current_device=lambda: _CPU,
        set_device=lambda device: None,
        synchronize=lambda device=None: None,
        empty_cache=lambda: None,
        memory_allocated=lambda device=None: 0,
        max_memory_allocated=lambda device=None: 0,
        memory_reserved=lambda device=None: 0,
        current_stream=lambda device=None: _NoStream(),
        default_stream=lambda device=None: _NoStream(),
        stream=lambda stream=None: contextlib.nullcontext(),
        Stream=_NoStream,
        Event=_NoStream,
        get_rng_state=get_rng_state,
        set_rng_state=set_rng_state,
        manual_seed=manual_seed,
        manual_seed_all=manual_seed,
        random=random,
        nvtx=torch.cuda.nvtx,
        amp=torch.amp,
        FloatTensor=torch.FloatTensor,
        HalfTensor=torch.HalfTensor,
        BFloat16Tensor=torch.BFloat16Tensor,
        OutOfMemoryError=torch.cuda.OutOfMemoryError,
    )
    return view


class _TorchOnCpu(types.ModuleType):
    """``torch`` as Megatron modules see it on a CPU-only machine."""

    def __init__(self):
        super().__init__("torch")
        self.__dict__["cuda"] = _build_cuda_view()

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in _FACTORIES:
            value = _factory_on_cpu(value)
        # Cache so the next lookup is a plain attribute access.
        self.__dict__[name] = value
        return value


_TORCH_ON_CPU: _TorchOnCpu | None = None


def _cpu_rng_get(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_rng_set(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _patch_module(module: types.ModuleType) -> None:
    # vars(module): the module's globals, which typing cannot name
    if getattr(module, "torch", None) is torch:
        vars(module)["torch"] = _TORCH_ON_CPU
    if module.__name__ == "megatron.core.jit":
        # Megatron wraps its fusions in torch.compile as its modules are imported, which loads
        # TorchDynamo (over a second per process); the model turns the fusions off on the CPU, so
        # they stay plain functions. Megatron's own switch, before any module takes jit_fuser.
        module.disable_jit_fuser()
    if module.__name__ == "megatron.core.tensor_parallel.random":
        # These helpers reach the CUDA generator through objects imported from torch.cuda.
        vars(module).update(_get_cuda_rng_state=_cpu_rng_get, _set_cuda_rng_state=_cpu_rng_set)


_torch_compile = torch.compile


def _compile_when_first_called(model=None, **options):
    """``torch.compile`` for a function compiled while a Megatron module is imported: the same
    compilation, done at the function's first call (nn.Modules are compiled at once, as asked)."""
    if model is None:  # @torch.compile(...) with options
        return functools.partial(_compile_when_first_called, **options)
    if not inspect.isfunction(model):
        return _torch_compile(model, **options)
    compiled = None

    @functools.wraps(model)
    def first_call_compiles(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = _torch_compile(model, **options)
        return compiled(*args, **kwargs)

    return first_call_compiles


@contextlib.contextmanager
def _compile_deferred():
    """``torch.compile`` is :func:`_compile_when_first_called` while a Megatron module executes."""
    if torch.compile is _compile_when_first_called:  # a nested import: the outer one restores it
        yield
        return
    torch.compile = _compile_when_first_called  # the import's decorators only
    try:
        yield
    finally:
        torch.compile = _torch_compile


class _PatchMegatronOnImport(importlib.abc.MetaPathFinder):
    """Gives each ``megatron.core`` module imported after :func:`install` the same view."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("megatron.core"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            with _compile_deferred():
                exec_module(module)
            _patch_module(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]  # this spec's loader only
        return spec


_tensor_type = torch.Tensor.type
_tensor_cuda = torch.Tensor.cuda


def _called_from(prefix: str) -> bool:
    return sys._getframe(2).f_globals.get("__name__", "").startswith(prefix)


def _type_as_megatron_expects(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu" and _called_from("megatron.core.optimizer"):
        return _tensor_type(self).replace("torch.", "torch.cuda.", 1)
    return _tensor_type(self, dtype, non_blocking, **kwargs)


def _cuda_stays_on_cpu(self, *args, **kwargs):
    # Megatron moves tensors it built itself (tied output weights, loaded shards) with .cuda().
    if _called_from("megatron.core"):
        return self
    return _tensor_cuda(self, *args, **kwargs)


class _TrackerSwapsCpuState(logging.Filter):
    """On the CPU the RNG tracker swaps the CPU generator itself, so Megatron's warning that the
    CPU state changed inside a tracker context is always true and never a problem."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def install() -> None:
    """Make Megatron-Core run on the CPU. Call only when CUDA is absent; idempotent."""
    global _installed, _TORCH_ON_CPU
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat.install() called on a machine with CUDA")
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_TrackerSwapsCpuState())
    _TORCH_ON_CPU = _TorchOnCpu()
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None:
            _patch_module(module)
    sys.meta_path.insert(0, _PatchMegatronOnImport())
    torch.Tensor.type = _type_as_megatron_expects  # type: ignore[method-assign]  # the CPU patch itself
    torch.Tensor.cuda = _cuda_stays_on_cpu  # type: ignore[method-assign]
    _installed = True


def installed() -> bool:
    return _installed
