"""A stand-in for an SGLang HTTP server, for contract tests against SGLang's documented API.

It follows the request and response shapes of SGLang's server source (see shared/notes/sglang-api.md)
and validates request bodies strictly: unknown body keys and, from 0.5.22, unknown ``sampling_params``
keys answer 400; a missing or wrong API key answers 401; the weight-update session routes exist from
0.5.21 and are then required around tensor/distributed updates. Unknown keys in control bodies are
stricter than SGLang, which ignores them: here a client's typo fails instead of passing unnoticed.
Tokens and log-probs are a deterministic function of the prompt (:func:`fake_sample`), so tests can
predict every response. ``tests/sglang_real/test_fake_parity.py`` holds the fake's answers against a
real SGLang 0.5.23 server's.

Use it in a thread (:class:`FakeSGLangServer`) or as a process that accepts ``sglang.launch_server``'s
flags (``python fake_sglang.py --model-path m --port 30000 ...``), so an engine can launch it through
its ``server_command`` setting. Process-only behaviour comes from environment variables:

* ``FAKE_SGLANG_VERSION``: version to report (default 0.5.23);
* ``FAKE_SGLANG_DIE_FILE``: file holding a count; while it is > 0, a ``/generate`` decrements it and the
  process exits at once without answering (a crash mid-request); servers sharing the file claim each
  death under a lock of the file, so a count of 1 kills exactly one;
* ``FAKE_SGLANG_RECORD_DIR``: append every request as one JSON line to ``<dir>/<port>.jsonl``;
* ``FAKE_SGLANG_SPAWN_CHILD``: start a child process in the server's process group, as SGLang's
  scheduler processes are, and write its pid to ``<record dir>/<port>.child``;
* ``FAKE_SGLANG_STARTUP_S``: answer 503 on the health routes for this long after start;
* ``FAKE_SGLANG_TOKEN_S``: seconds each ``/generate`` takes per token it may generate (n x
  max_new_tokens per prompt), as a GPU's decode time grows with them; requests overlap;
* ``FAKE_SGLANG_VOCAB``: sampled token ids are below this (default 50; a model's vocabulary when a
  trainer must read the tokens, as benchmarks/async_rollouts.py's scripted server);
* ``FAKE_SGLANG_PAUSED_HEALTH_S``: how long ``/health`` and ``/health_generate`` wait while generation
  is paused before answering 503 (SGLang: 20 s; also the thread mode's default).

As in SGLang, the health routes run a generation: while generation is paused they wait, then answer
503. ``sampling_seed`` acts only when the server runs with ``--enable-deterministic-inference``
(``/server_info`` reports ``enable_deterministic_inference``); without it a seeded sample is a fresh
draw, so the same seeded request sent twice gets different tokens, as from a real server. Unseeded
samples stay a function of the prompt and the sample index, so tests can predict them.

Like SGLang, process mode logs its settings (API keys included) through ``logging`` when it starts,
so a test can see that the launch wrapper keeps the key out of the server's log.

Only the standard library is imported up front; torch is imported when tensors are involved.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import io
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_VERSION = "0.5.23"
VOCAB = int(os.environ.get("FAKE_SGLANG_VOCAB", "50"))  # sampled token ids are below it
PAUSED_HEALTH_S = 20.0  # SGLang's health generation gives up after this long (HEALTH_CHECK_TIMEOUT)

# GenerateReqInput fields a client may send to /generate.
GENERATE_KEYS = {
    "text",
    "input_ids",
    "input_embeds",
    "image_data",
    "audio_data",
    "video_data",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "stream",
    "log_metrics",
    "lora_path",
    "lora_id",
    "custom_logit_processor",
    "return_hidden_states",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "data_parallel_rank",
    "extra_key",
}
# SamplingParams fields accepted by /generate (0.5.22+ answers 400 for any other key).
SAMPLING_KEYS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}
WEIGHT_COMMON = {"flush_cache", "abort_all_requests", "weight_version", "load_format"}
BODY_KEYS = {
    "/update_weights_from_tensor": {"serialized_named_tensors"} | WEIGHT_COMMON,
    "/update_weights_from_distributed": {"names", "dtypes", "shapes", "group_name"} | WEIGHT_COMMON,
    "/update_weights_from_disk": {"model_path"} | WEIGHT_COMMON,
    "/init_weights_update_group": {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "group_name",
        "backend",
    },
    "/destroy_weights_update_group": {"group_name"},
    "/release_memory_occupation": {"tags"},
    "/resume_memory_occupation": {"tags"},
    "/pause_generation": {"mode"},
    "/continue_generation": {"torch_empty_cache"},
    "/begin_weight_update": set(),
    "/end_weight_update": set(),
    "/abort_request": {"rid", "abort_all"},
    "/update_weight_version": {"new_version", "abort_all_requests"},
}
# Routes that only the admin key may call when --admin-api-key is set.
ADMIN_ROUTES = set(BODY_KEYS) | {"/flush_cache"}
OPEN_PREFIXES = ("/health", "/ready", "/metrics", "/fake/")
MEMORY_TAGS = {"kv_cache", "weights", "cuda_graph"}


def parse_version(text: str) -> tuple[int, int, int]:
    parts = (text.split("+")[0].split(".") + ["0", "0", "0"])[:3]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def fake_sample(
    prompt: list[int], sample_index: int, max_new_tokens: int, stop_token_ids: set[int], seed: int | None
) -> tuple[list[int], list[float], dict]:
    """The tokens, log-probs and finish_reason the fake returns for one sample."""
    x = sum((i + 1) * t for i, t in enumerate(prompt)) * 1000003 + sample_index * 7919 + (seed or 0) * 104729
    x %= 2**31
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        x = (x * 1103515245 + 12345) % 2**31
        token = (x >> 7) % VOCAB
        tokens.append(token)
        logprobs.append(-((x >> 11) % 1000) / 128.0 - 0.001)
        if token in stop_token_ids:
            return tokens, logprobs, {"type": "stop", "matched": token}
    return tokens, logprobs, {"type": "length", "length": max_new_tokens}


def serialize_tensors(named_tensors) -> str:
    """Test stand-in for SGLang's MultiprocessingSerializer: base64 of ``torch.save`` (copies, no IPC)."""
    import torch

    buf = io.BytesIO()
    torch.save([(name, t.detach().cpu()) for name, t in named_tensors], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_tensors(data: str):
    import torch

    return torch.load(io.BytesIO(base64.b64decode(data, validate=True)), weights_only=True)


def tensors_to_b64(tensors: dict) -> str:
    import torch

    buf = io.BytesIO()
    torch.save(tensors, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class BadRequest(Exception):
    pass


class InvalidSamplingParams(BadRequest):
    """SGLang rejects sampling_params while decoding the request: HTTP 400 with ``{"error": "..."}``."""


# SGLang runs weight updates one at a time, in the order they arrive (its tokenizer manager takes the
# model-update writer lock for each, its scheduler then serves them in turn): a request waits for every
# one that arrived before it, whichever rank sent it.
SERIAL_UPDATE_PATHS = frozenset(
    {"/update_weights_from_distributed", "/update_weights_from_tensor", "/update_weights_from_disk"}
)


class ArrivalOrder:
    """Turns in the order the requests arrive."""

    def __init__(self):
        self.changed = threading.Condition()
        self.arrived = 0
        self.served = 0

    @contextlib.contextmanager
    def turn(self):
        with self.changed:
            ticket = self.arrived
            self.arrived += 1
            self.changed.wait_for(lambda: self.served == ticket)
        try:
            yield
        finally:
            with self.changed:
                self.served += 1
                self.changed.notify_all()


class FakeState:
    """Everything the fake remembers; tests read it directly (thread mode) or through /fake/state."""

    def __init__(
        self,
        *,
        version: str,
        tp_size: int,
        api_key: str | None,
        admin_api_key: str | None,
        model_path: str,
        port: int,
        record_path: str | None = None,
        startup_s: float = 0.0,
        die_file: str | None = None,
        token_s: float = 0.0,
        deterministic: bool = False,
        paused_health_s: float | None = None,
    ):
        self.version_text = version
        self.version = parse_version(version)
        self.tp_size = tp_size
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.model_path = model_path
        self.port = port
        self.record_path = record_path
        self.die_file = die_file
        self.token_s = token_s
        self.deterministic = deterministic  # --enable-deterministic-inference: only then do seeds act
        self.paused_health_s = (
            float(os.environ.get("FAKE_SGLANG_PAUSED_HEALTH_S", PAUSED_HEALTH_S))
            if paused_health_s is None
            else paused_health_s
        )
        self.started = time.monotonic()
        self.startup_s = startup_s
        self.lock = threading.Lock()
        self.unpaused = threading.Condition(self.lock)
        self.requests: list[dict] = []
        self.updates: list[dict] = []  # one entry per weight-update call
        self.weights: dict = {}  # name -> last received tensor
        self.groups: dict = {}
        self.update_order = ArrivalOrder()
        self.session_open = False
        self.paused = False
        self.released: set[str] = set()
        self.weight_version = "default"
        self.generate_calls = 0
        # Knobs tests may set in thread mode.
        self.abort_next = 0  # answer this many /generate calls with finish_reason abort
        self.flush_busy = 0  # answer this many /flush_cache calls with 400 (requests running)
        # Cleared: every /generate, its answer made, waits until it is set again (a request in flight).
        self.answer_gate = threading.Event()
        self.answer_gate.set()
        # --preferred-sampling-params: reported by /server_info (a JSON string, as ServerArgs holds
        # it) and merged under each request's sampling_params, as SGLang's TokenizerManager does.
        self.preferred_sampling_params: dict | None = None
        self.sampled_with: list[dict] = []  # the effective sampling parameters of every sample served

    def record(self, method: str, path: str, auth: str | None, body: Any) -> None:
        entry = {"method": method, "path": path, "auth": auth, "body": body, "time": time.time()}
        with self.lock:
            self.requests.append(entry)
        if self.record_path:
            if path == "/update_weights_from_tensor":
                entry = dict(entry, body="<tensors>")
            with open(self.record_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")

    def authorized(self, path: str, auth: str | None) -> bool:
        if path.startswith(OPEN_PREFIXES):
            return True
        token = auth[len("Bearer ") :] if auth and auth.startswith("Bearer ") else None
        if path in ADMIN_ROUTES and self.admin_api_key:
            return token == self.admin_api_key
        if self.api_key:
            return token == self.api_key
        return True

    def has_session_routes(self) -> bool:
        return self.version >= (0, 5, 21)

    # -------------------------------------------------------------- routes

    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if path in ("/health", "/health_generate"):
            if time.monotonic() - self.started < self.startup_s:
                return 503, b""
            with self.unpaused:  # the health generation waits for generation to continue, then gives up
                if not self.unpaused.wait_for(lambda: not self.paused, timeout=self.paused_health_s):
                    return 503, b""
            return 200, b""
        if path in ("/server_info", "/get_server_info") and method == "GET":
            preferred = json.dumps(self.preferred_sampling_params) if self.preferred_sampling_params else None
            return 200, {
                "version": self.version_text,
                "tp_size": self.tp_size,
                "dp_size": 1,
                "model_path": self.model_path,
                "port": self.port,
                "skip_tokenizer_init": True,
                "preferred_sampling_params": preferred,
                "enable_deterministic_inference": self.deterministic,
            }
        if path in ("/model_info", "/get_model_info") and method == "GET":
            return 200, {"model_path": self.model_path, "is_generation": True, "weight_version": self.weight_version}
        if path == "/fake/state" and method == "GET":
            with self.lock:
                return 200, {
                    "weights": tensors_to_b64(dict(self.weights)),
                    "updates": self.updates,
                    "generate_calls": self.generate_calls,
                    "weight_version": self.weight_version,
                }
        if method != "POST" and not (
            method == "GET" and path in ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation")
        ):
            return 404, {"detail": "Not Found"}
        if path == "/generate":
            return self.generate(body)
        if path == "/flush_cache":
            with self.lock:
                if self.flush_busy > 0:
                    self.flush_busy -= 1
                    return (
                        400,
                        b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                        b"waiting requests, the operation will not be performed.)\n",
                    )
            return (
                200,
                b"Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                b"requests, the operation will not be performed.)\n",
            )
        if path in ("/begin_weight_update", "/end_weight_update") and not self.has_session_routes():
            return 404, {"detail": "Not Found"}
        if path not in BODY_KEYS:
            return 404, {"detail": "Not Found"}
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise BadRequest(f"{path}: body must be a JSON object")
        unknown = set(body) - BODY_KEYS[path]
        if unknown:
            raise BadRequest(f"{path}: unexpected fields {sorted(unknown)}")
        handler = getattr(self, path.strip("/"))
        return handler(body)

    def generate(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict):
            raise BadRequest("/generate: body must be a JSON object")
        unknown = set(body) - GENERATE_KEYS
        if unknown:
            raise BadRequest(f"/generate: unexpected fields {sorted(unknown)}")
        if body.get("text") is not None or "input_ids" not in body:
            raise BadRequest("/generate: this server runs with --skip-tokenizer-init; send input_ids, not text")
        ids = body["input_ids"]
        single = isinstance(ids, list) and bool(ids) and all(isinstance(t, int) for t in ids)
        prompts = [ids] if single else ids
        if (
            not isinstance(prompts, list)
            or not prompts
            or not all(
                isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                for p in prompts
            )
        ):
            raise BadRequest("/generate: input_ids must be a non-empty list of ints or of lists of ints")
        sp = body.get("sampling_params") or {}
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        if len(sps) != len(prompts) or not all(isinstance(p, dict) for p in sps):
            raise BadRequest("/generate: sampling_params must be one dict or one per prompt")
        for p in sps:
            self._check_sampling(p)
        sps = [{**(self.preferred_sampling_params or {}), **p} for p in sps]
        ns = {p.get("n", 1) for p in sps}
        if len(ns) != 1:
            raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
        n = ns.pop()
        if body.get("return_logprob") is not True or body.get("logprob_start_len", -1) != -1:
            raise BadRequest("/generate: the fake only serves return_logprob=true with logprob_start_len=-1")
        self._maybe_die()
        with self.unpaused:
            while self.paused:  # SGLang holds new requests while generation is paused
                self.unpaused.wait()
            if self.released & {"kv_cache", "weights"}:
                return 400, {"error": {"message": "memory is released; resume_memory_occupation first"}}
            self.generate_calls += 1
            abort = self.abort_next > 0
            if abort:
                self.abort_next -= 1
        items = []
        with self.lock:
            self.sampled_with.extend(p for p in sps for _ in range(n))
        for prompt, p in zip(prompts, sps):
            for s in range(n):
                tokens, logprobs, finish = fake_sample(
                    prompt,
                    s,
                    int(p.get("max_new_tokens", 128)),
                    set(p.get("stop_token_ids") or ()),
                    self._effective_seed(p.get("sampling_seed")),
                )
                if abort:
                    tokens, logprobs = tokens[:1], logprobs[:1]
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                meta = {
                    "id": uuid.uuid4().hex,
                    "finish_reason": finish,
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(tokens),
                    "cached_tokens": 0,
                    "weight_version": self.weight_version,
                    "e2e_latency": 0.001,
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)],
                }
                if self.version >= (0, 5, 23):
                    # Which weights produced which output tokens (end exclusive; the prompt is not counted;
                    # aborted answers too): one segment, as the fake's weights never change while it answers.
                    meta["weight_versions"] = [{"version": self.weight_version, "start": 0, "end": len(tokens)}]
                items.append({"output_ids": tokens, "meta_info": meta})
        self.answer_gate.wait()
        if self.token_s:
            time.sleep(self.token_s * sum(n * int(p.get("max_new_tokens", 128)) for p in sps))
        self.record_completion(prompts, n)
        return 200, items[0] if single and n == 1 else items

    def record_completion(self, prompts: list, n: int) -> None:
        """In process mode, one line per answered /generate (requests are recorded on arrival, so a
        server that dies mid-request has an arrival without a completion)."""
        if self.record_path:
            with open(self.record_path, "a", encoding="utf-8") as f:
                f.write(
                    json.dumps(
                        {"path": "/fake/completed", "input_ids": prompts, "n": n, "weight_version": self.weight_version}
                    )
                    + "\n"
                )

    def _effective_seed(self, seed: int | None) -> int | None:
        """The seed a sample is drawn with: the request's under deterministic inference; otherwise a
        seeded sample gets a fresh draw, as SGLang ignores ``sampling_seed`` then."""
        if seed is None or self.deterministic:
            return seed
        return secrets.randbits(31)

    def _check_sampling(self, p: dict) -> None:
        unknown = set(p) - SAMPLING_KEYS
        if unknown and self.version >= (0, 5, 22):
            raise InvalidSamplingParams(f"unknown field(s) {sorted(unknown)} in sampling_params")
        checks = {
            "n": lambda v: isinstance(v, int) and v >= 1,
            "temperature": lambda v: isinstance(v, (int, float)) and v >= 0,
            "top_p": lambda v: isinstance(v, (int, float)) and 0 < v <= 1,
            "top_k": lambda v: isinstance(v, int) and (v == -1 or v >= 1),
            "max_new_tokens": lambda v: isinstance(v, int) and v >= 0,
            "stop_token_ids": lambda v: isinstance(v, list) and all(isinstance(t, int) for t in v),
            "sampling_seed": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "min_p": lambda v: isinstance(v, (int, float)) and 0 <= v <= 1,
            "repetition_penalty": lambda v: isinstance(v, (int, float)) and 0 < v <= 2,
            "frequency_penalty": lambda v: isinstance(v, (int, float)) and -2 <= v <= 2,
            "presence_penalty": lambda v: isinstance(v, (int, float)) and -2 <= v <= 2,
            # with --skip-tokenizer-init a positive min_new_tokens is an error (sglang-api notes)
            "min_new_tokens": lambda v: isinstance(v, int) and v == 0,
            "ignore_eos": lambda v: isinstance(v, bool),
        }
        for key, ok in checks.items():
            if key in p and not ok(p[key]):
                raise InvalidSamplingParams(f"sampling_params.{key}: invalid value {p[key]!r}")

    def _maybe_die(self) -> None:
        if not self.die_file:
            return
        # Several server processes share the file: the read and the decrement happen under one
        # exclusive lock of the file itself (a thread lock would let two processes both read "1"
        # and both die).
        try:
            f = open(self.die_file, "r+", encoding="utf-8")
        except FileNotFoundError:
            return
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            left = int(f.read().strip() or 0)
            if left > 0:
                f.seek(0)
                f.truncate()
                f.write(str(left - 1))
                f.flush()
                os.fsync(f.fileno())
                print(f"fake sglang on port {self.port}: dying mid-request as told", flush=True)
                os._exit(3)  # the lock goes with the process

    def _need_session(self, path: str) -> tuple[int, Any] | None:
        if self.has_session_routes() and not self.session_open:
            return 400, {"success": False, "message": f"{path} requires an open begin_weight_update session"}
        return None

    def begin_weight_update(self, body: dict) -> tuple[int, Any]:
        with self.lock:
            if self.session_open:
                return 400, {
                    "success": False,
                    "message": "a weight-update session is already open; call end_weight_update() first",
                }
            self.session_open = True
        return 200, {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict) -> tuple[int, Any]:
        with self.lock:
            if not self.session_open:
                return 400, {
                    "success": False,
                    "message": "no weight-update session is open; call begin_weight_update() first",
                }
            self.session_open = False
        return 200, {"success": True, "message": "Success"}

    def _store(self, path: str, named: list, body: dict) -> None:
        with self.lock:
            for name, tensor in named:
                self.weights[name] = tensor
            self.updates.append(
                {
                    "path": path,
                    "names": [name for name, _ in named],
                    "nbytes": sum(t.numel() * t.element_size() for _, t in named),
                    "weight_version": body.get("weight_version"),
                    "session": self.session_open,
                }
            )
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]

    def update_weights_from_tensor(self, body: dict) -> tuple[int, Any]:
        if (refusal := self._need_session("/update_weights_from_tensor")) is not None:
            return refusal
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != self.tp_size:
            raise BadRequest(f"serialized_named_tensors must hold one entry per TP rank ({self.tp_size})")
        decoded = [deserialize_tensors(e) for e in entries]  # rank i reads entry i
        names = [[n for n, _ in d] for d in decoded]
        if any(ns != names[0] for ns in names):
            return 400, {"success": False, "message": "TP ranks received different tensors"}
        self._store("/update_weights_from_tensor", decoded[0], body)
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    def init_weights_update_group(self, body: dict) -> tuple[int, Any]:
        import datetime

        from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

        if self.tp_size != 1:
            return 400, {"success": False, "message": "the fake joins weight-update groups with tp_size 1 only"}
        name = body["group_name"]
        rank = int(body["rank_offset"])  # + TP rank 0
        world = int(body["world_size"])
        timeout = datetime.timedelta(seconds=60)
        # The way SGLang's init_custom_process_group joins: rendezvous, PrefixStore(group_name), helper.
        store, rank, world = next(
            rendezvous(f"tcp://{body['master_address']}:{body['master_port']}", rank, world, timeout=timeout)
        )
        store.set_timeout(timeout)
        pg, _ = _new_process_group_helper(
            world, rank, [], body.get("backend", "nccl"), PrefixStore(name, store), group_name=name, timeout=timeout
        )
        _world.pg_group_ranks[pg] = {i: i for i in range(world)}
        with self.lock:
            self.groups[name] = pg
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, body: dict) -> tuple[int, Any]:
        import torch
        import torch.distributed as dist

        if (refusal := self._need_session("/update_weights_from_distributed")) is not None:
            return refusal
        pg = self.groups.get(body["group_name"])
        if pg is None:
            return 400, {"success": False, "message": f"group {body['group_name']} is not initialized"}
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise BadRequest("names, dtypes and shapes must have one equal, non-zero length")
        received, works = [], []
        for name, dtype, shape in zip(names, dtypes, shapes):
            torch_dtype = getattr(torch, dtype, None)
            if not isinstance(torch_dtype, torch.dtype):
                raise BadRequest(f"unknown dtype {dtype!r}")
            tensor = torch.empty(shape, dtype=torch_dtype)
            works.append(dist.broadcast(tensor, src=0, group=pg, async_op=True))
            received.append((name, tensor))
        for work in works:
            work.wait()
        self._store("/update_weights_from_distributed", received, body)
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def destroy_weights_update_group(self, body: dict) -> tuple[int, Any]:
        import torch.distributed as dist

        with self.lock:
            pg = self.groups.pop(body["group_name"], None)
        if pg is None:
            return 400, {"success": False, "message": f"group {body['group_name']} does not exist"}
        dist.destroy_process_group(pg)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_weights_from_disk(self, body: dict) -> tuple[int, Any]:
        from pathlib import Path

        from safetensors.torch import load_file

        path = Path(body["model_path"])
        index = path / "model.safetensors.index.json"
        if not index.is_file():
            return 400, {
                "success": False,
                "message": f"{path} has no model.safetensors.index.json",
                "num_paused_requests": 0,
            }
        weight_map = json.loads(index.read_text())["weight_map"]
        named = []
        for fname in sorted(set(weight_map.values())):
            named.extend(load_file(str(path / fname)).items())
        self._store("/update_weights_from_disk", named, body)
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def _tags(self, body: dict) -> set[str]:
        tags = body.get("tags")
        if tags is None:
            return set(MEMORY_TAGS)
        if not isinstance(tags, list) or not set(tags) <= MEMORY_TAGS:
            raise BadRequest(f"tags must be null or a subset of {sorted(MEMORY_TAGS)}")
        return set(tags)

    def release_memory_occupation(self, body: dict) -> tuple[int, Any]:
        tags = self._tags(body)
        with self.lock:
            self.released |= tags
        return 200, None

    def resume_memory_occupation(self, body: dict) -> tuple[int, Any]:
        tags = self._tags(body)
        with self.lock:
            never = sorted(tags - self.released)
            if never:
                # SGLang 0.5.23's scheduler raises KeyError here and the whole server exits.
                return 500, {"error": {"message": f"KeyError: {never[0]!r} was never released (the server dies)"}}
            self.released -= tags
        return 200, None

    def pause_generation(self, body: dict) -> tuple[int, Any]:
        if body.get("mode", "abort") not in ("abort", "retract", "in_place"):
            raise BadRequest(f"Invalid mode: {body.get('mode')!r}")
        with self.lock:
            self.paused = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict) -> tuple[int, Any]:
        with self.unpaused:
            self.paused = False
            self.unpaused.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def abort_request(self, body: dict) -> tuple[int, Any]:
        return 200, b""

    def update_weight_version(self, body: dict) -> tuple[int, Any]:
        if not isinstance(body.get("new_version"), str):
            raise BadRequest("new_version must be a string")
        with self.lock:
            self.weight_version = body["new_version"]
            self.updates.append(
                {
                    "path": "/update_weight_version",
                    "names": [],
                    "nbytes": 0,
                    "weight_version": body["new_version"],
                    "session": self.session_open,
                }
            )
        return 200, {
            "success": True,
            "message": f"Weight version updated to {body['new_version']}",
            "new_version": body["new_version"],
        }


def _handler_for(state: FakeState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # keep test output quiet
            pass

        def _serve(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            auth = self.headers.get("Authorization")
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                state.record(method, path, auth, raw.decode("utf-8", "replace"))
                return self._send(
                    400, {"object": "error", "message": "invalid JSON", "type": "Bad Request", "code": 400}
                )
            state.record(method, path, auth, body)
            if not state.authorized(path, auth):
                return self._send(401, {"error": "Unauthorized"})
            try:
                with state.update_order.turn() if path in SERIAL_UPDATE_PATHS else contextlib.nullcontext():
                    status, payload = state.route(method, path, body)
            except InvalidSamplingParams as err:
                status, payload = 400, {"error": str(err)}
            except BadRequest as err:
                status, payload = 400, {"object": "error", "message": str(err), "type": "Bad Request", "code": 400}
            except Exception as err:  # noqa: BLE001 - a server answers 500, it does not crash
                status, payload = 500, {"error": {"message": f"{type(err).__name__}: {err}"}}
            self._send(status, payload)

        def _send(self, status: int, payload: Any) -> None:
            if isinstance(payload, bytes):
                data, ctype = payload, "text/plain"
            else:
                data, ctype = json.dumps(payload).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = True

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def do_PUT(self):
            self._serve("PUT")

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    # uvicorn's listen backlog: a burst of concurrent requests must queue, not be reset (the
    # standard library's default of 5 resets connections under a rollout's fan-out).
    request_queue_size = 2048


class FakeSGLangServer:
    """The fake in a background thread of the test process."""

    def __init__(
        self,
        *,
        port: int = 0,
        version: str = DEFAULT_VERSION,
        tp_size: int = 1,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        model_path: str = "fake/model",
        deterministic: bool = False,
        paused_health_s: float | None = None,
    ):
        self.httpd = _HTTPServer(("127.0.0.1", port), None)  # type: ignore[arg-type]
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.state = FakeState(
            version=version,
            tp_size=tp_size,
            api_key=api_key,
            admin_api_key=admin_api_key,
            model_path=model_path,
            port=self.port,
            deterministic=deterministic,
            paused_health_s=paused_health_s,
        )
        self.httpd.RequestHandlerClass = _handler_for(self.state)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeSGLangServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m sglang.launch_server`` this project may pass; anything else is an error."""
    parser = argparse.ArgumentParser(description="fake sglang.launch_server")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tokenizer-path")
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--api-key")
    parser.add_argument("--admin-api-key")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--random-seed", type=int)
    parser.add_argument("--dtype")
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--load-format")
    parser.add_argument("--base-gpu-id", type=int)
    parser.add_argument("--nccl-port", type=int)
    parser.add_argument("--skip-server-warmup", action="store_true")
    parser.add_argument("--weight-version")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Process mode: serve until killed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(levelname)s: %(message)s")
    logging.getLogger("fake_sglang").info(f"server_args={vars(args)}")  # SGLang logs f"{server_args=}" likewise
    record_dir = os.environ.get("FAKE_SGLANG_RECORD_DIR")
    record_path = os.path.join(record_dir, f"{args.port}.jsonl") if record_dir else None
    if os.environ.get("FAKE_SGLANG_SPAWN_CHILD") and record_dir:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.path.join(record_dir, f"{args.port}.child"), "a", encoding="utf-8") as f:
            f.write(f"{child.pid}\n")
    httpd = _HTTPServer((args.host, args.port), None)  # type: ignore[arg-type]
    httpd.daemon_threads = True
    state = FakeState(
        version=os.environ.get("FAKE_SGLANG_VERSION", DEFAULT_VERSION),
        tp_size=args.tp_size,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        model_path=args.model_path,
        port=args.port,
        record_path=record_path,
        startup_s=float(os.environ.get("FAKE_SGLANG_STARTUP_S", "0")),
        die_file=os.environ.get("FAKE_SGLANG_DIE_FILE"),
        token_s=float(os.environ.get("FAKE_SGLANG_TOKEN_S", "0")),
        deterministic=args.enable_deterministic_inference,
    )
    httpd.RequestHandlerClass = _handler_for(state)
    print(f"fake sglang {state.version_text} serving {args.model_path} on {args.host}:{args.port}", flush=True)
    httpd.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
