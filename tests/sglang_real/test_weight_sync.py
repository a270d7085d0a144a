"""Weights reach real SGLang servers through the engine's load_weights in all three modes, bit for
bit by SGLang's own ``/weights_checker`` checksum; a failed sync and its retry; memory release and
resume."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.engine import SamplingParams
from stapo_megatron.rollout.sglang_client import request
from stapo_megatron.rollout.sglang_engine import SGLangEngine, SGLangError, SGLangWeightSyncError
from tests.sglang_real.conftest import checksums, perturbed

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

PROMPTS = [[3, 14, 15], [92, 65], [35, 89, 79, 32]]
BUCKET = 64 << 10  # the 0.55 MB model goes in about ten buckets
# SGLang's Qwen3 fuses these Hugging Face tensors (concatenated along the output dimension).
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def sglang_checksum(tensor: torch.Tensor) -> str:
    """The checksum /weights_checker reports for one CPU tensor: the first 8 bytes of the sha256 of its
    bytes, as hex."""
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).digest()[:8].hex()


def expected_checksums(weights) -> dict[str, str]:
    """Per SGLang parameter, the checksum of the Hugging Face tensors it is made of (tied lm_head is
    the embedding, which SGLang does not list twice)."""
    hf = dict(weights)
    params: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        prefix, _, leaf = name.rpartition(".")  # leaf: weight
        module, _, part = prefix.rpartition(".")
        fused = next((f for f, parts in FUSED.items() if part in parts and module.endswith(f.split(".")[0])), None)
        if fused is None:
            params[name] = tensor
        else:
            layer = module.rpartition(".")[0]
            sources = [hf[f"{layer}.{fused.split('.')[0]}.{p}.{leaf}"] for p in FUSED[fused]]
            params[f"{layer}.{fused}.{leaf}"] = torch.cat(sources)
    return {name: sglang_checksum(tensor) for name, tensor in params.items()}


def attached(engine, api_key: str, tiny_model, **fields) -> SGLangEngine:
    """Another engine on the session's servers, syncing its own way."""
    from stapo_megatron.rollout.sglang_engine import expected_names_from_hf_checkpoint

    cfg = SGLangConfig(urls=engine.urls, api_key=api_key, startup_timeout_s=120, control_timeout_s=120, **fields)
    return SGLangEngine(cfg, expected_weight_names=expected_names_from_hf_checkpoint(tiny_model))


SYNC_FIELDS = {
    "disk": None,  # the session engine's own mode
    "distributed": dict(
        weight_sync="distributed",
        weight_sync_backend="gloo",
        weight_sync_master_address="127.0.0.1",
        weight_bucket_bytes=BUCKET,
        weight_sync_timeout_s=120,
    ),
    # CPU buckets in shared memory: the servers map them (torch.multiprocessing's file_system sharing)
    "tensor": dict(placement="colocated", weight_sync="tensor", weight_bucket_bytes=BUCKET),
}


@pytest.mark.parametrize("mode", list(SYNC_FIELDS))
def test_weights_arrive_bit_exact(mode, served, api_key, tiny_model, launch_weights, reference):
    """The launch weights checksum as the server's own loader read them; new weights through the
    engine give every server exactly their checksums, the version, and log-probs of the new model;
    the launch weights sent back give the launch checksums again."""
    launch = expected_checksums(launch_weights)
    assert all(checksums(url, api_key) == launch for url in served.urls)
    syncing = served if SYNC_FIELDS[mode] is None else attached(served, api_key, tiny_model, **SYNC_FIELDS[mode])
    try:
        new = perturbed(launch_weights, seed=list(SYNC_FIELDS).index(mode))
        syncing.load_weights(new, version=41)
        syncing.load_weights(new, version=42)  # a second update: reused groups, a new disk directory
        wanted = expected_checksums(new)
        assert set(wanted) == set(launch) and all(wanted[n] != launch[n] for n in wanted)
        for url in served.urls:
            assert checksums(url, api_key) == wanted
            info = request(url, "GET", "/model_info", api_key=api_key, timeout=60).json()
            assert info["weight_version"] == "42"
        reference.load(new)
        for prompt, group in zip(PROMPTS, syncing.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5))):
            for sample in group:
                assert sample.logprobs == pytest.approx(reference.logprobs(prompt, sample.token_ids, 1.0), abs=2e-4)
        syncing.load_weights(launch_weights, version=43)
        assert all(checksums(url, api_key) == launch for url in served.urls)
    finally:
        if syncing is not served:
            syncing.shutdown()


def test_a_failed_sync_leaves_generation_paused_and_its_retry_succeeds(served, api_key, tiny_model, launch_weights):
    """A stream that breaks half-way (distributed: half the buckets reached the servers) fails the sync
    and leaves generation paused on purpose; calling load_weights again completes the update on the
    same, healthy servers, without waiting on /health (which a paused server answers 503 after 20 s)."""
    syncing = attached(served, api_key, tiny_model, **SYNC_FIELDS["distributed"])
    new = perturbed(launch_weights, seed=10)

    def breaks_half_way():
        for i, item in enumerate(new):
            if i == len(new) // 2:
                raise RuntimeError("the export failed half-way")
            yield item

    try:
        with pytest.raises(SGLangWeightSyncError, match="half-way"):
            syncing.load_weights(breaks_half_way(), version=5)
        with pytest.raises(SGLangWeightSyncError, match="call load_weights again"):
            syncing.generate(PROMPTS, SamplingParams(max_new_tokens=2))
        started = time.monotonic()
        syncing.load_weights(new, version=6)
        assert time.monotonic() - started < 15.0
        assert not any(row["down"] or row["dead"] or row["stale"] for row in syncing.server_status())
        wanted = expected_checksums(new)
        assert all(checksums(url, api_key) == wanted for url in served.urls)
        groups = syncing.generate(PROMPTS, SamplingParams(max_new_tokens=3))
        assert [len(group[0].token_ids) for group in groups] == [3, 3, 3]
    finally:
        syncing.shutdown()


def test_memory_release_and_resume_as_http_calls(served, api_key, launch_weights):
    """On the CPU SGLang's memory saver does not run (it needs libcuda), so release and resume are only
    the HTTP calls, answered 200 without freeing anything; what is checked is the engine's protocol
    around them against the real server: no generate while released, the weights treated as garbage
    after a full release, and a partial release resumed without asking the server to resume tags it
    never released (SGLang's scheduler dies on a KeyError then)."""
    restarts = [row["restarts"] for row in served.server_status()]
    served.release_memory(["kv_cache"])
    with pytest.raises(SGLangError, match=r"memory is released \(kv_cache\)"):
        served.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    served.resume_memory()
    assert not any(row["down"] or row["dead"] for row in served.server_status())
    groups = served.generate(PROMPTS, SamplingParams(max_new_tokens=2))  # the weights were kept
    assert [len(group[0].token_ids) for group in groups] == [2, 2, 2]
    served.release_memory()
    with pytest.raises(SGLangWeightSyncError, match=r"resume_memory\(\['weights'\]\)"):
        served.load_weights(launch_weights)
    served.resume_memory()
    with pytest.raises(SGLangWeightSyncError, match="call load_weights"):
        served.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    served.load_weights(launch_weights)
    assert all(checksums(url, api_key) == expected_checksums(launch_weights) for url in served.urls)
    assert len(served.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == 3
    for url in served.urls:  # every server is the same process as before: none died on the way
        assert request(url, "GET", "/health_generate", api_key=None, timeout=60).status == 200
    assert [row["restarts"] for row in served.server_status()] == restarts
