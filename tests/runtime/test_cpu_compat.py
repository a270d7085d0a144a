"""The CPU layer's view of Megatron, checked in a fresh interpreter (this one may have Megatron loaded)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

_PROBE = """
import json, sys
import torch
from stapo_megatron.runtime import cpu_compat
cpu_compat.install()
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
from stapo_megatron.models.qwen3 import model  # the model's Megatron modules, as a run imports them
print(json.dumps({
    "jit_fuser": jit.jit_fuser.__name__,
    "swiglu": type(fused_bias_swiglu.bias_swiglu).__name__,
    "dynamo_loaded": "torch._dynamo" in sys.modules,
    "current_device": str(jit.torch.cuda.current_device()) if hasattr(jit, "torch") else None,
}))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is installed only without CUDA")
def test_megatron_imports_without_torch_compile_and_sees_a_cpu_device():
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # the fusion decorator is Megatron's no-op: its fused functions stay plain Python functions, and
    # importing Megatron no longer loads TorchDynamo
    expected = {"jit_fuser": "noop_decorator", "swiglu": "function", "dynamo_loaded": False, "current_device": "cpu"}
    assert seen == expected
