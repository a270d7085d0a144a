"""The trainer's IPC serializer against SGLang's own reader: a CPU bucket serialized by
:func:`~stapo_megatron.rollout.sglang_weights.serialize_for_ipc` (no process-wide patch) loads bit for
bit through SGLang 0.5.23's ``MultiprocessingSerializer.deserialize`` (its allow-listing unpickler) in
the SGLang venv, a process that is not the trainer's child."""

from __future__ import annotations

import subprocess

import pytest

from stapo_megatron.rollout.sglang_weights import serialize_for_ipc
from tests.rollout.test_weight_sync import mixed_cpu_bucket, printed
from tests.sglang_real.conftest import server_env

pytestmark = pytest.mark.sglang

SGLANG_READER = """
import sys, torch
from sglang.srt.utils import MultiprocessingSerializer
for name, tensor in MultiprocessingSerializer.deserialize(sys.stdin.read()):
    print(name, str(tensor.dtype), list(tensor.shape), tensor.float().flatten().tolist())
"""


def test_sglang_reads_the_trainers_ipc_payload_bit_exact(sglang_venv, standin_trace):
    bucket = mixed_cpu_bucket()
    read = subprocess.run(
        [str(sglang_venv.python), "-c", SGLANG_READER],
        input=serialize_for_ipc(bucket.named_tensors()),
        env={**server_env(standin_trace), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert read.returncode == 0, read.stderr[-3000:]
    assert read.stdout.splitlines() == printed(bucket)
