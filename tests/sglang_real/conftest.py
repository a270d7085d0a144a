"""Real SGLang 0.5.23 servers on the CPU, started through the project's own launch path.

The group (marker ``sglang``; ``-m "not sglang"`` deselects it) builds its own venv first
(:mod:`tests.sglang_real.sglang_venv`, cached) and fails, never skips, when it cannot: a missing
prerequisite must not pass CI silently. Servers serve a tiny random Qwen3 saved with transformers
and are started by :class:`~stapo_megatron.rollout.sglang_engine.SGLangEngine` (or ``stapo train``)
with ``rollout.sglang.server_command`` pointing at that venv's python and the CPU flags of
``shared/notes/sglang-on-cpu.md``. Start-ups are few: one session engine with two servers serves
most tests, other engines attach to those servers.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import secrets
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.sglang_client import request, split_url
from stapo_megatron.rollout.sglang_engine import SGLangEngine, expected_names_from_hf_checkpoint
from tests.cached_venv import CachedVenv
from tests.helpers import save_tiny_qwen3
from tests.sglang_real.sglang_venv import ensure_sglang_venv

STANDIN_DIR = Path(__file__).resolve().parent / "sgl_kernel_standin"
STANDIN_TRACE_ENV = "STAPO_SGL_KERNEL_STANDIN_TRACE"
# SGLang's CPU path (measured in shared/notes/sglang-on-cpu.md): plain-torch attention and sampling,
# no CUDA graphs, a KV cache small enough for 2 cores' memory; --sleep-on-idle, or each idle
# scheduler spins one core at 100% and two servers starve everything else on 2 cores.
CPU_SERVER_FLAGS = [
    "--sleep-on-idle",
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--max-total-tokens",
    "2048",
]
CONTEXT_LENGTH = 512
MAX_SERVERS = 8  # servers one test may launch on this machine
# The served model: the note's tiny Qwen3 (hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16,
# tied) with 1,024 tokens: the servers never tokenize (--skip-tokenizer-init), so no tokenizer bounds
# the vocabulary, and a multiple of 64 (SGLang pads its embedding to one with zero rows) makes the
# served embedding exactly the Hugging Face one, checksum included.
VOCAB = 1024
TINY_MODEL = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=CONTEXT_LENGTH)


def server_command(venv: CachedVenv) -> list[str]:
    """Production's launch wrapper (the key from the environment), run by the SGLang venv's python."""
    return [str(venv.python), "-m", "stapo_megatron.rollout.sglang_launch", "sglang.launch_server"]


def server_env(trace: Path) -> dict[str, str]:
    every_core = f"0-{(os.cpu_count() or 1) - 1}"
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "OMP_NUM_THREADS": "1",
        # SGLang's CPU engine binds server i (its --base-gpu-id) to NUMA node i unless told otherwise,
        # and refuses a second server on a one-node machine: every server may use every core.
        "SGLANG_CPU_OMP_THREADS_BIND": "|".join([every_core] * MAX_SERVERS),
        # The stand-in reaches the servers only; the project itself is installed in their venv.
        "PYTHONPATH": str(STANDIN_DIR),
        STANDIN_TRACE_ENV: str(trace),
    }


def real_sglang_settings(venv: CachedVenv, model: Path, trace: Path, log_dir: Path, **overrides) -> dict:
    """``rollout.sglang`` fields that launch real CPU servers on ``model`` (as a dict: also for YAML)."""
    fields = dict(
        model_path=str(model),
        server_command=server_command(venv),
        extra_args=list(CPU_SERVER_FLAGS),
        env=server_env(trace),
        context_length=CONTEXT_LENGTH,
        dtype="float32",  # the trainer's dtype: weights arrive and are checked bit for bit
        mem_fraction_static=0.5,
        log_dir=str(log_dir),
        startup_timeout_s=300.0,
        control_timeout_s=120.0,
        flush_timeout_s=60.0,
        shutdown_grace_s=10.0,
        retry_backoff_s=0.2,
        supervise_interval_s=0.5,
    )
    fields.update(overrides)
    return fields


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    described = getattr(config, "_stapo_sglang_venv", None)
    if described:
        terminalreporter.write_line(described)


@pytest.fixture(scope="session")
def sglang_venv(pytestconfig) -> CachedVenv:
    venv = ensure_sglang_venv(log=lambda line: print(line, flush=True))
    pytestconfig._stapo_sglang_venv = venv.describe()  # type: ignore[attr-defined]
    return venv


@pytest.fixture(scope="session")
def standin_trace(tmp_path_factory) -> Path:
    """Where the sgl_kernel stand-in reports a call (it must stay absent)."""
    return tmp_path_factory.mktemp("sgl_kernel_standin") / "calls.txt"


@pytest.fixture(autouse=True)
def no_kernel_stand_in_called(standin_trace):
    """After every test: SGLang called no sgl_kernel function (the stand-in writes each call down)."""
    yield
    if standin_trace.exists() and standin_trace.read_text().strip():
        pytest.fail(f"SGLang called the sgl_kernel stand-in:\n{standin_trace.read_text()[:4000]}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), tie=True, **TINY_MODEL)


@pytest.fixture(scope="session")
def launch_weights(tiny_model) -> list[tuple[str, torch.Tensor]]:
    """The served model's Hugging Face tensors, as the servers loaded them at launch."""
    from safetensors.torch import load_file

    return sorted(load_file(str(tiny_model / "model.safetensors")).items())


@pytest.fixture(scope="session")
def api_key() -> str:
    return secrets.token_urlsafe(24)


@pytest.fixture(scope="session")
def engine(sglang_venv, tiny_model, standin_trace, api_key, tmp_path_factory):
    """Two real servers launched by the engine itself (node 0's supervisor restarts them), disk sync."""
    root = tmp_path_factory.mktemp("launched")
    cfg = SGLangConfig(
        **real_sglang_settings(
            sglang_venv,
            tiny_model,
            standin_trace,
            root / "logs",
            num_servers=2,
            api_key=api_key,
            weight_sync="disk",
            disk_sync_dir=str(root / "sync"),
            max_restarts=3,
            max_prompts_per_request=2,
        )
    )
    launched = SGLangEngine(cfg, expected_weight_names=expected_names_from_hf_checkpoint(tiny_model))
    yield launched
    launched.shutdown()


def generate_body(prompts, **sampling) -> dict:
    """A raw /generate body as the engine sends it (token ids in, log-probs of the output tokens out)."""
    return {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 8, **sampling},
        "return_logprob": True,
        "logprob_start_len": -1,
    }


class StreamedGenerate:
    """One ``/generate`` streamed (``stream: true``) in a thread: the test sees the request's progress
    as the server reports it, chunk by chunk, and takes the last chunk, which is the whole answer
    (SGLang streams cumulative output by default), as the answer."""

    def __init__(self, url: str, body: dict, api_key: str, timeout: float = 300.0):
        _, host, port = split_url(url)
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout)
        self._chunks: queue.Queue = queue.Queue()
        self._last: dict | None = None
        self._done = False
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
        self._conn.request("POST", "/generate", json.dumps({**body, "stream": True}), headers)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            resp = self._conn.getresponse()
            if resp.status != 200:
                self._chunks.put(RuntimeError(f"/generate answered HTTP {resp.status}: {resp.read()[:300]!r}"))
                return
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    self._chunks.put(json.loads(line[5:]))
            self._chunks.put(None)
        except Exception as err:  # noqa: BLE001 - handed to the test's thread
            self._chunks.put(err)
        finally:
            self._conn.close()

    def next_chunk(self, timeout: float = 300.0) -> dict | None:
        """The next chunk as it arrives; None once the answer is complete."""
        if self._done:
            return None
        item = self._chunks.get(timeout=timeout)
        if isinstance(item, Exception):
            raise item
        if item is None:
            self._done = True
            return None
        self._last = item
        return item

    def wait_for_tokens(self, count: int) -> dict:
        """Blocks until the server reports ``count`` output tokens, unfinished (the chunk saying so)."""
        while (chunk := self.next_chunk()) is not None:
            if chunk["meta_info"]["finish_reason"] is None and chunk["meta_info"]["completion_tokens"] >= count:
                return chunk
        raise AssertionError(f"the request finished before {count} tokens: {self._last}")

    def answer(self) -> dict:
        """The complete answer (its last chunk), once the request finished."""
        while self.next_chunk() is not None:
            pass
        assert self._last is not None and self._last["meta_info"]["finish_reason"] is not None, self._last
        return self._last


def checksums(url: str, api_key: str) -> dict[str, str]:
    """SGLang's own per-tensor checksum of the weights a server holds (``/weights_checker``)."""
    resp = request(url, "POST", "/weights_checker", {"action": "checksum"}, api_key=api_key, timeout=120)
    assert resp.status == 200, resp.body[:500]
    (rank,) = resp.json()["ranks"]  # tp 1: one scheduler
    return rank["checksums"]


def perturbed(weights: Iterable[tuple[str, torch.Tensor]], seed: int) -> list[tuple[str, torch.Tensor]]:
    """Other weights of the same shapes: every tensor changes."""
    gen = torch.Generator().manual_seed(seed)
    return [(name, t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype)) for name, t in weights]


class Reference:
    """The served model in transformers (float64): the log-probs a server must report for its tokens."""

    def __init__(self, model_dir: Path):
        from transformers import Qwen3ForCausalLM

        self.model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Reference:
        state = {name: t.to(torch.float64) for name, t in weights}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        self.model.tie_weights()
        return self

    @torch.no_grad()
    def logprobs(self, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
        """log softmax(logits / T) of each completion token, over the whole vocabulary."""
        ids = torch.tensor([prompt + completion])
        logits = self.model(ids).logits[0, len(prompt) - 1 : -1] / temperature
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


@pytest.fixture(scope="session")
def reference(tiny_model) -> Reference:
    return Reference(tiny_model)


@pytest.fixture
def served(engine, launch_weights, api_key):
    """The session engine, given back as the next test expects it: generation running and the launch
    weights loaded (a test may pause, kill or load other weights; one that releases memory resumes it)."""
    yield engine
    for url in engine.urls:
        try:
            request(url, "POST", "/continue_generation", {}, api_key=api_key, timeout=60)
        except Exception:  # noqa: BLE001 - a server the test killed is restarting; load_weights waits for it
            pass
    engine.load_weights(launch_weights)
