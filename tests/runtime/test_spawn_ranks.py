"""spawn_ranks starts each rank as a fresh process with its caller's environment and working directory
as they are at the call; without CUDA, every rank is forked from one fork server that has imported
Megatron once, so a rank does not pay Megatron's import again (tests and ``stapo convert`` call it
many times in one process)."""

from __future__ import annotations

import json
import os

import pytest

from stapo_megatron.runtime.distributed import accelerator_available
from stapo_megatron.runtime.launch import spawn_ranks
from tests.runtime import _workers


def _start(out, world_size: int) -> list[dict]:
    out.mkdir()
    spawn_ranks(_workers.what_a_rank_starts_with, world_size, str(out))
    return [json.loads((out / f"start_rank{rank}.json").read_text()) for rank in range(world_size)]


@pytest.mark.skipif(accelerator_available(), reason="the fork server serves machines without CUDA")
def test_ranks_get_the_callers_environment_and_directory_at_each_call(tmp_path, monkeypatch):
    monkeypatch.setenv("STAPO_TEST_CALLER_VAR", "first")
    monkeypatch.setenv("STAPO_TEST_REMOVED_VAR", "present")
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the caller's value is kept (and its servers get it too)
    monkeypatch.chdir(tmp_path)
    first = _start(tmp_path / "first", 2)
    nccl = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "1"}
    assert [r["env"] for r in first] == [
        {"STAPO_TEST_CALLER_VAR": "first", "STAPO_TEST_REMOVED_VAR": "present", "WORLD_SIZE": "2", **nccl}
    ] * 2
    # the server started at the first call; the second call's ranks see the caller as it is now
    monkeypatch.setenv("STAPO_TEST_CALLER_VAR", "second")
    monkeypatch.delenv("STAPO_TEST_REMOVED_VAR")
    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    second = _start(tmp_path / "second", 3)
    nccl = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}  # SGLang's values, which its servers set
    assert [r["env"] for r in second] == [
        {"STAPO_TEST_CALLER_VAR": "second", "STAPO_TEST_REMOVED_VAR": None, "WORLD_SIZE": "3", **nccl}
    ] * 3
    assert {r["cwd"] for r in first} == {str(tmp_path)} and {r["cwd"] for r in second} == {str(tmp_path / "elsewhere")}
    # one server, not this process, started all five, with the CPU layer and Megatron already loaded
    parents = {r["parent"] for r in first + second}
    assert len(parents) == 1 and parents != {os.getpid()}
    assert all(r["megatron_loaded"] and r["cpu_layer_installed"] for r in first + second)
