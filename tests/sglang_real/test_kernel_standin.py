"""The sgl_kernel stand-in imports as SGLang imports it and fails loudly, with a trace, when called."""

from __future__ import annotations

import subprocess

import pytest

from tests.sglang_real.conftest import server_env

pytestmark = pytest.mark.sglang

CALLER = """
from sgl_kernel import copy_all_layer_kv_cache_cpu
from sgl_kernel.kvcacheio import transfer_kv_all_layer
from sgl_kernel.scalar_type import scalar_types
scalar_types.uint4b8  # attributes of attributes are stand-ins too
try:
    transfer_kv_all_layer(1, 2)
except RuntimeError as err:
    print("raised:", err)
"""


def test_a_call_raises_and_leaves_a_trace(sglang_venv, tmp_path):
    trace = tmp_path / "calls.txt"
    env = {**server_env(trace), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [str(sglang_venv.python), "-c", CALLER], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert "raised: sgl_kernel stand-in called: sgl_kernel.kvcacheio.transfer_kv_all_layer" in done.stdout
    assert "sgl_kernel stand-in called: sgl_kernel.kvcacheio.transfer_kv_all_layer" in done.stderr
    assert trace.read_text().startswith("sgl_kernel stand-in called: sgl_kernel.kvcacheio.transfer_kv_all_layer")
