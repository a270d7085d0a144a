"""The production rollout engine: SGLang servers driven over their HTTP API.

The engine launches ``python -m sglang.launch_server`` processes (or attaches to running servers),
waits until they generate, sends batched ``/generate`` requests concurrently, and pushes new weights
in bounded buckets through one of SGLang's three update paths:

* ``tensor``: CUDA IPC handles via ``/update_weights_from_tensor`` (servers on the trainer's GPUs),
* ``distributed``: a torch.distributed group the servers join, fed by broadcasts from the trainer,
* ``disk``: a safetensors checkpoint read through ``/update_weights_from_disk``.

Request and response shapes follow SGLang's server source (0.5.15 .. 0.5.23); the version each
server reports through ``/server_info`` decides the weight-update session (0.5.21+).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from stapo_megatron.config.core import ConfigError
from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.engine import Completion, RolloutEngine, SamplingParams
from stapo_megatron.rollout.sglang_client import (
    HttpResponse,
    SGLangError,
    SGLangRequestError,
    SGLangResponseError,
    SGLangServerError,
    SGLangWeightSyncError,
    TransportError,
    error_message,
    parse_version,
    request,
    split_url,
)
from stapo_megatron.rollout.sglang_server import (
    ServerProcess,
    build_launch_command,
    free_port,
    terminate_all,
    url_for,
    wait_healthy,
)
from stapo_megatron.rollout.sglang_weights import (
    NamedTensors,
    TensorSerializer,
    WeightNameCheck,
    WeightUpdateGroup,
    expected_names_from_hf_checkpoint,
    iter_buckets,
    local_address_towards,
    sglang_tensor_serializer,
    write_safetensors_checkpoint,
)

__all__ = [
    "SGLangEngine",
    "SGLangError",
    "SGLangRequestError",
    "SGLangResponseError",
    "SGLangServerError",
    "SGLangWeightSyncError",
    "expected_names_from_hf_checkpoint",
]

logger = logging.getLogger(__name__)

# From 0.5.21 the tensor and distributed update endpoints answer success=false outside a
# /begin_weight_update ... /end_weight_update session; earlier versions have no such routes.
SESSION_VERSION = (0, 5, 21)
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
_SEED_MODULUS = 2**31 - 1
# Every other sampling parameter that shapes the distribution, pinned to "off" in each request:
# SGLang fills what a request leaves out from --preferred-sampling-params (merged under the
# request's own keys), so a server default such as min_p or a repetition penalty would make the
# engine sample from something other than the trainer's softmax at the sampling temperature.
NEUTRAL_SAMPLING = {
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "min_new_tokens": 0,
    "ignore_eos": False,
}
# What each request sets besides NEUTRAL_SAMPLING (sampling_seed only when seeded).
_REQUEST_SAMPLING_KEYS = {"n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed"}
# Server-preferred keys that cannot change which token is sampled or its log-prob.
_OUTPUT_ONLY_SAMPLING_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}


class _AbortedSample(Exception):
    """A sample came back with finish_reason abort (server paused, preempted or restarting)."""


class _Server:
    """What the engine knows about one server."""

    def __init__(self, index: int, url: str, tp_size: int, process: ServerProcess | None):
        self.index = index
        self.url = url
        self.tp_size = tp_size
        self.dp_size = 1
        self.process = process
        self.version: tuple[int, int, int] = (0, 0, 0)
        self.lock = threading.Lock()  # one recovery at a time
        self.epoch = 0  # bumped by each recovery, so concurrent failures trigger a single restart
        self.failures = 0  # consecutive transport failures
        self.recoveries = 0
        self.dead = False  # failed after its one recovery
        self.stale = False  # restarted after a weight update: holds its launch weights

    def describe(self) -> str:
        if self.process is not None:
            return f"{self.url} (log: {self.process.log_path})"
        return f"{self.url} (attached)"


def _stop_processes(processes: list[ServerProcess], grace_s: float) -> None:
    # Runs from weakref.finalize at interpreter exit too: launched servers hold GPUs and must not outlive us.
    terminate_all(processes, grace_s)


class SGLangEngine(RolloutEngine):
    """Rollouts from SGLang servers; see the module docstring.

    ``expected_weight_names`` is the complete set of Hugging Face tensor names :meth:`load_weights`
    must receive (e.g. :func:`expected_names_from_hf_checkpoint`); it is required for weight updates.
    ``tensor_serializer`` turns one bucket into one ``serialized_named_tensors`` entry for colocated
    sync; the default is SGLang's ``MultiprocessingSerializer`` (imported only when needed).
    """

    def __init__(
        self,
        config: SGLangConfig,
        *,
        expected_weight_names: Iterable[str] | None = None,
        tensor_serializer: TensorSerializer | None = None,
    ):
        if not config.urls and not config.model_path:
            raise ConfigError("model_path: required to launch servers (or give urls to attach to running ones)")
        self.config = config
        self._expected = frozenset(expected_weight_names) if expected_weight_names is not None else None
        self._serializer = tensor_serializer
        self._ipc_needs_gpu = tensor_serializer is None  # SGLang's serializer ships CUDA IPC handles
        self._sync_mode = config.resolved_weight_sync
        self._api_key = config.api_key or os.environ.get(config.api_key_env) or None
        if self._api_key is None and config.launches:
            # A fresh secret per run: the weight-update routes must never be open on the network.
            self._api_key = secrets.token_urlsafe(32)
        self._lock = threading.RLock()
        self._closed = False
        self._servers: list[_Server] = []
        self._processes: list[ServerProcess] = []
        self._group: WeightUpdateGroup | None = None
        self._group_valid = False
        self._blocked: str | None = None  # why generate() must not run now
        self._released: set[str] = set()
        self._weights_loaded = False
        self._disk_root: Path | None = None
        self._own_disk_root = False
        self._last_checkpoint: Path | None = None
        self._log_dir: Path | None = None
        n = config.num_servers if config.launches else len(config.urls)
        self._gen_pool = cf.ThreadPoolExecutor(
            max_workers=n * config.max_concurrent_requests_per_server, thread_name_prefix="sglang-generate"
        )
        self._ctl_pool = cf.ThreadPoolExecutor(max_workers=2 * n + 4, thread_name_prefix="sglang-control")
        self._finalizer = weakref.finalize(self, _stop_processes, self._processes, config.shutdown_grace_s)
        try:
            if config.launches:
                self._launch_servers()
            else:
                self._attach_servers()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ public API

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    @property
    def log_files(self) -> list[Path]:
        return [s.process.log_path for s in self._servers if s.process is not None]

    def server_status(self) -> list[dict[str, Any]]:
        """One dict per server: url, version, tp_size, recoveries, stale, dead, log file, pid."""
        return [
            {
                "url": s.url,
                "version": ".".join(map(str, s.version)),
                "tp_size": s.tp_size,
                "recoveries": s.recoveries,
                "stale": s.stale,
                "dead": s.dead,
                "log_file": str(s.process.log_path) if s.process else None,
                "pid": s.process.pid if s.process else None,
            }
            for s in self._servers
        ]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        with self._lock:
            self._check_can_generate()
            prompts = [self._prompt_ids(p, i) for i, p in enumerate(prompts)]
            if not prompts:
                return []
            chunks = self._generate_requests(prompts, params)
            futures = [
                self._gen_pool.submit(self._run_generate, i, body, count, params.n)
                for i, (_, count, body) in enumerate(chunks)
            ]
            results: list[list[Completion] | None] = [None] * len(prompts)
            try:
                for (start, count, _), future in zip(chunks, futures):
                    results[start : start + count] = future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                cf.wait(futures)  # let running requests settle before the error leaves generate()
                raise
            return results  # type: ignore[return-value]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        with self._lock:
            self._check_open()
            if self._expected is None:
                raise SGLangWeightSyncError(
                    "load_weights needs expected_weight_names at construction "
                    "(e.g. expected_names_from_hf_checkpoint(model_path))"
                )
            if not self._api_key:
                raise SGLangWeightSyncError(
                    f"refusing to update weights on {', '.join(self.urls)}: no API key is configured "
                    f"(set sglang.api_key or ${self.config.api_key_env}), so the update routes would be open"
                )
            if "weights" in self._released:
                raise SGLangWeightSyncError("weights are released on the servers; call resume_memory(['weights']) first")
            check = WeightNameCheck(self._expected)
            if isinstance(named_tensors, Mapping):
                named_tensors = list(named_tensors.items())
            elif isinstance(named_tensors, (list, tuple)):
                named_tensors = list(named_tensors)
            if isinstance(named_tensors, list):
                # A materialized stream can be checked whole before anything reaches a server.
                check.check_all([item[0] if isinstance(item, tuple) else item for item in named_tensors])
            for server in self._servers:
                self._ensure_alive(server)
            self._update_weights(named_tensors, check, None if version is None else str(version))

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free server GPU memory (``tags`` from kv_cache, weights, cuda_graph; None = all)."""
        with self._lock:
            self._check_open()
            tags = self._memory_tags(tags)
            self._run_all(self._servers, self._flush)
            self._run_all(self._servers, lambda s: self._control(s, "/release_memory_occupation", {"tags": tags}))
            released = set(tags or MEMORY_TAGS)
            self._released |= released
            if "weights" in released and not self.config.enable_weights_cpu_backup:
                self._blocked = (
                    "weights were released without --enable-weights-cpu-backup, so they are garbage after "
                    "resume; call load_weights before generating"
                )

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back memory released by :meth:`release_memory` (``tags`` as there; None = all)."""
        with self._lock:
            self._check_open()
            tags = self._memory_tags(tags)
            self._run_all(self._servers, lambda s: self._control(s, "/resume_memory_occupation", {"tags": tags}))
            self._released -= set(tags or MEMORY_TAGS)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._teardown_group(notify=not self.config.launches)
        except Exception as err:  # noqa: BLE001 - shutdown must go on
            logger.warning("sglang: tearing down the weight-update group failed: %s", err)
        self._gen_pool.shutdown(wait=False, cancel_futures=True)
        if self._processes:
            logger.info("sglang: stopping %d launched server(s)", len(self._processes))
            terminate_all(self._processes, self.config.shutdown_grace_s)
        self._finalizer.detach()
        self._ctl_pool.shutdown(wait=False, cancel_futures=True)
        if self._own_disk_root and self._disk_root is not None:
            shutil.rmtree(self._disk_root, ignore_errors=True)

    # ------------------------------------------------------------------ servers

    def _launch_servers(self) -> None:
        cfg = self.config
        self._log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="stapo-sglang-logs-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        taken: set[int] = set()
        for i in range(cfg.num_servers):
            port = cfg.base_port + i if cfg.base_port else self._pick_port(taken)
            taken.add(port)
            nccl_port = self._pick_port(taken)
            taken.add(nccl_port)
            argv, env = build_launch_command(cfg, index=i, port=port, nccl_port=nccl_port, api_key=self._api_key)
            proc = ServerProcess(argv, env, self._log_dir / f"sglang-server-{i}.log")
            try:
                proc.start()
            except OSError as err:
                raise SGLangServerError(f"cannot start sglang server {i} with {argv[0]}: {err}") from None
            self._processes.append(proc)
            server = _Server(i, url_for(cfg.host, port), cfg.tp_size, proc)
            self._servers.append(server)
            logger.info("sglang: launched server %d (pid %d) at %s, log %s", i, proc.pid, server.url, proc.log_path)
        self._run_all(self._servers, self._wait_ready)

    def _pick_port(self, taken: set[int]) -> int:
        while True:
            port = free_port(self.config.host if self.config.host not in ("", "::") else "127.0.0.1")
            if port not in taken:
                return port

    def _attach_servers(self) -> None:
        for i, url in enumerate(self.config.urls):
            self._servers.append(_Server(i, url.rstrip("/"), 1, None))
        self._run_all(self._servers, self._wait_ready)

    def _wait_ready(self, server: _Server) -> None:
        wait_healthy(
            server.url, api_key=self._api_key, timeout_s=self.config.startup_timeout_s, process=server.process
        )
        self._read_server_info(server)

    def _read_server_info(self, server: _Server) -> None:
        resp = self._http(server, "GET", "/server_info")
        if resp.status == 404:  # servers older than the /server_info rename
            resp = self._http(server, "GET", "/get_server_info")
        info = self._ok_json(server, "/server_info", resp)
        if not isinstance(info, dict) or "version" not in info:
            raise SGLangResponseError(f"sglang server {server.url}/server_info carries no 'version'")
        server.version = parse_version(info["version"])
        self._check_preferred_sampling(server, info.get("preferred_sampling_params"))
        server.tp_size = int(info.get("tp_size", server.tp_size))
        server.dp_size = int(info.get("dp_size", 1))
        if server.process is not None and server.tp_size != self.config.tp_size:
            raise SGLangServerError(
                f"sglang server {server.describe()} reports tp_size {server.tp_size}, launched with {self.config.tp_size}"
            )
        logger.info("sglang: %s runs SGLang %s (tp %d, dp %d)", server.url, info["version"], server.tp_size,
                    server.dp_size)

    @staticmethod
    def _check_preferred_sampling(server: _Server, preferred: Any) -> None:
        """Refuse a server whose --preferred-sampling-params sets a key the requests do not pin: it
        would silently change the sampling distribution (SGLang merges it under each request).
        /generate's meta_info does not echo the sampling parameters, so /server_info is where the
        server reports them."""
        if isinstance(preferred, str) and preferred.strip():
            try:
                preferred = json.loads(preferred)
            except ValueError:
                raise SGLangResponseError(
                    f"sglang server {server.url}/server_info: preferred_sampling_params is not JSON: {preferred[:200]!r}"
                ) from None
        if not preferred:
            return
        if not isinstance(preferred, dict):
            raise SGLangResponseError(f"sglang server {server.url}/server_info: preferred_sampling_params is {preferred!r}")
        unpinned = sorted(set(preferred) - set(NEUTRAL_SAMPLING) - _REQUEST_SAMPLING_KEYS - _OUTPUT_ONLY_SAMPLING_KEYS)
        if unpinned:
            raise SGLangServerError(
                f"sglang server {server.describe()} sets preferred_sampling_params {unpinned}, which the rollout "
                "requests do not override; they would change the sampling distribution (relaunch without them)"
            )

    def _ensure_alive(self, server: _Server) -> None:
        """Before a weight update: recover a server that died since the last call."""
        if server.dead:
            raise SGLangServerError(f"sglang server {server.describe()} is dead after its one restart")
        with server.lock:
            if server.process is not None:
                rc = server.process.returncode()
                if rc is not None:
                    self._recover_locked(server, f"its process exited with status {rc}")
                return
            try:
                resp = request(server.url, "GET", "/health", api_key=self._api_key, timeout=30.0)
                if resp.status == 200:
                    return
                reason = f"/health answered HTTP {resp.status}"
            except TransportError as err:
                reason = str(err)
            self._recover_locked(server, reason)

    def _on_transport_failure(self, server: _Server, epoch: int, err: TransportError) -> None:
        with server.lock:
            if server.epoch != epoch or self._closed or server.dead:
                return  # another request already handled this failure
            rc = server.process.returncode() if server.process is not None else None
            if rc is not None:
                reason = f"its process exited with status {rc}"
            elif err.status == 503:
                return  # SGLang answers 503 for aborted or not-yet-servable requests: busy, not dead
            else:
                server.failures += 1
                if server.failures < self.config.failure_threshold:
                    return
                reason = f"{server.failures} consecutive failures, last: {err}"
            self._recover_locked(server, reason)

    def _recover_locked(self, server: _Server, reason: str) -> None:
        """Restart a launched server (or wait for an attached one) once; a second failure is fatal."""
        if server.recoveries >= 1:
            server.dead = True
            raise SGLangServerError(f"sglang server {server.describe()} failed again after its one restart: {reason}")
        server.recoveries += 1
        self._group_valid = False  # its ranks left the weight-update group
        logger.warning("sglang: server %s failed (%s); %s", server.describe(), reason,
                       "restarting it" if server.process else "waiting for it to come back")
        try:
            if server.process is not None:
                server.process.terminate(self.config.shutdown_grace_s)  # reap schedulers that outlived the parent
                server.process.start()
            wait_healthy(
                server.url, api_key=self._api_key, timeout_s=self.config.startup_timeout_s, process=server.process
            )
            self._read_server_info(server)
        except (SGLangError, OSError) as err:
            server.dead = True
            raise SGLangServerError(
                f"sglang server {server.describe()} could not be recovered after {reason}: {err}"
            ) from None
        server.epoch += 1
        server.failures = 0
        if self._weights_loaded:
            # It loaded model_path again, not the trainer's weights: keep it out of rollouts until the next update.
            server.stale = True
            logger.warning("sglang: %s holds its launch weights until the next load_weights", server.url)

    # ------------------------------------------------------------------ HTTP helpers

    def _http(self, server: _Server, method: str, path: str, body: Any = None, timeout: float | None = None):
        try:
            return request(server.url, method, path, body, api_key=self._api_key,
                           timeout=timeout or self.config.control_timeout_s)
        except TransportError as err:
            raise SGLangServerError(f"sglang server {server.describe()}: {err}") from None

    def _ok_json(self, server: _Server, path: str, resp: HttpResponse) -> Any:
        if resp.status in (401, 403):
            raise SGLangRequestError(
                f"sglang server {server.url} rejected the API key on {path} (HTTP {resp.status})", status=resp.status
            )
        if resp.status != 200:
            raise SGLangRequestError(
                f"sglang server {server.url}{path} answered HTTP {resp.status}: {error_message(resp)}",
                status=resp.status,
            )
        try:
            data = resp.json()
        except SGLangResponseError:
            return None  # some control routes answer plain text
        if isinstance(data, dict) and data.get("success") is False:
            raise SGLangRequestError(f"sglang server {server.url}{path} refused: {data.get('message', data)}")
        return data

    def _control(self, server: _Server, path: str, body: Any = None, timeout: float | None = None) -> Any:
        return self._ok_json(server, path, self._http(server, "POST", path, {} if body is None else body, timeout))

    def _flush(self, server: _Server) -> None:
        """/flush_cache, retried while it answers 400 (requests still running or waiting)."""
        deadline = time.monotonic() + self.config.flush_timeout_s
        delay = 0.02
        while True:
            resp = self._http(server, "POST", "/flush_cache")
            if resp.status != 400:
                self._ok_json(server, "/flush_cache", resp)
                return
            if time.monotonic() + delay > deadline:
                raise SGLangServerError(
                    f"sglang server {server.describe()} still had requests in flight after "
                    f"{self.config.flush_timeout_s:g}s of /flush_cache retries"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _run_all(self, servers: Sequence[_Server], fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(server, *args)`` on every server at once; waits for all, then raises the first error."""
        futures = [self._ctl_pool.submit(fn, s, *args) for s in servers]
        cf.wait(futures)
        for future in futures:
            future.result()
        return [f.result() for f in futures]

    def _await(self, futures: Sequence[cf.Future], works: Sequence[Any], timeout_s: float, what: str) -> None:
        """Wait for HTTP futures and collective works together; fail fast when any reply is an error.

        A server that refuses a bucket never posts its receives, so waiting on the broadcasts alone
        would hang until the collective timeout.
        """
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        while True:
            for future in futures:
                if future.done() and future.exception() is not None:
                    raise future.exception()
            if all(f.done() for f in futures) and all(w.is_completed() for w in works):
                break
            if time.monotonic() > deadline:
                raise SGLangWeightSyncError(f"{what} did not finish within {timeout_s:g}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        for work in works:
            work.wait()

    # ------------------------------------------------------------------ generation

    def _check_open(self) -> None:
        if self._closed:
            raise SGLangError("the SGLang engine was shut down")

    def _check_can_generate(self) -> None:
        self._check_open()
        dead = [s.describe() for s in self._servers if s.dead]
        if dead:
            raise SGLangServerError(f"sglang server {dead[0]} is dead after its one restart")
        if self._released:
            raise SGLangError(
                f"server memory is released ({', '.join(sorted(self._released))}); call resume_memory() first"
            )
        if self._blocked:
            raise SGLangWeightSyncError(self._blocked)
        if all(s.stale for s in self._servers):
            raise SGLangWeightSyncError(
                "every server was restarted since the last load_weights and holds its launch weights; "
                "call load_weights before generating"
            )

    @staticmethod
    def _prompt_ids(prompt: Sequence[int], index: int) -> list[int]:
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        return ids

    def _generate_requests(self, prompts: list[list[int]], params: SamplingParams) -> list[tuple[int, int, dict]]:
        """(first prompt index, prompt count, /generate body) per chunk of prompts."""
        sampling: dict[str, Any] = {
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang: -1 disables top-k
            "max_new_tokens": params.max_new_tokens,
            # sent even when empty, so a server-preferred list cannot add stops
            "stop_token_ids": [int(t) for t in params.stop_token_ids],
            **NEUTRAL_SAMPLING,
        }
        size = self.config.max_prompts_per_request
        chunks = []
        for start in range(0, len(prompts), size):
            part = prompts[start : start + size]
            if params.seed is None:
                input_ids: list[list[int]] = part
                sampling_params: Any = sampling
            else:
                # One seed shared by n samples would make them identical, so each sample becomes its own
                # n=1 request item with a seed derived from (seed, prompt index, sample index): results
                # then do not depend on chunking or on which server runs them. 'sampling_seed' is SGLang's
                # key (0.5.22+ rejects unknown keys such as 'seed'; earlier versions ignore unknown keys).
                input_ids, sampling_params = [], []
                for j, ids in enumerate(part):
                    for s in range(params.n):
                        input_ids.append(ids)
                        seed = (params.seed * 1_000_003 + (start + j) * params.n + s) % _SEED_MODULUS
                        sampling_params.append({**sampling, "n": 1, "sampling_seed": seed})
            body = {
                "input_ids": input_ids,
                "sampling_params": sampling_params,
                "return_logprob": True,
                "logprob_start_len": -1,  # log-probs of output tokens only
            }
            chunks.append((start, len(part), body))
        return chunks

    def _pick_server(self, preferred: int) -> _Server:
        usable = [s for s in self._servers if not s.dead and not s.stale]
        if not usable:
            dead = [s.describe() for s in self._servers if s.dead]
            if dead:
                raise SGLangServerError(f"sglang server {dead[0]} is dead after its one restart")
            raise SGLangWeightSyncError(
                "every server was restarted since the last load_weights and holds its launch weights; "
                "call load_weights before generating"
            )
        return usable[preferred % len(usable)]

    def _run_generate(self, chunk_index: int, body: dict, count: int, n: int) -> list[list[Completion]]:
        attempts = 0
        while True:
            if self._closed:
                raise SGLangError("the SGLang engine was shut down during generate()")
            server = self._pick_server(chunk_index)
            epoch = server.epoch
            try:
                resp = request(server.url, "POST", "/generate", body, api_key=self._api_key,
                               timeout=self.config.request_timeout_s)
            except TransportError as err:
                last_error = str(err)
                self._on_transport_failure(server, epoch, err)
            else:
                server.failures = 0
                if resp.status == 200:
                    try:
                        return _parse_generate(resp.json(), count, n, server.url)
                    except _AbortedSample as err:
                        last_error = str(err)
                elif resp.status in (401, 403):
                    raise SGLangRequestError(
                        f"sglang server {server.url} rejected the API key on /generate (HTTP {resp.status})",
                        status=resp.status,
                    )
                else:
                    raise SGLangRequestError(
                        f"sglang server {server.url}/generate rejected the request (HTTP {resp.status}): "
                        f"{error_message(resp)}",
                        status=resp.status,
                    )
            attempts += 1
            if attempts > self.config.max_retries:
                raise SGLangServerError(
                    f"sglang server {server.describe()}: /generate failed {attempts} times; last error: {last_error}"
                )
            logger.warning("sglang: retrying /generate (%d/%d): %s", attempts, self.config.max_retries, last_error)
            time.sleep(self.config.retry_backoff_s)

    # ------------------------------------------------------------------ weights

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], check: WeightNameCheck,
                        weight_version: str | None) -> None:
        servers = list(self._servers)
        mode = self._sync_mode
        previous_block = self._blocked
        self._blocked = (
            "the last load_weights did not finish, so the servers may hold a mix of old and new weights; "
            "call load_weights again before generating"
        )
        state = {"paused": False, "session": [], "sent": False}
        try:
            self._run_all(servers, self._control_path, "/pause_generation", {"mode": "abort"})
            state["paused"] = True
            self._run_all(servers, self._flush)
            buckets = iter_buckets(named_tensors, self.config.weight_bucket_bytes, check)
            if mode == "disk":
                self._update_from_disk(servers, buckets, check, weight_version, state)
            else:
                if mode == "distributed":
                    self._ensure_group(servers)
                session = [s for s in servers if s.version >= SESSION_VERSION]
                state["session"] = session  # set first: a begin that fails on one server still gets ended on the rest
                self._run_all(session, self._control_path, "/begin_weight_update", {})
                for bucket in buckets:
                    state["sent"] = True
                    if mode == "tensor":
                        self._send_bucket_tensor(servers, bucket, weight_version)
                    else:
                        self._send_bucket_distributed(servers, bucket, weight_version)
                check.finish()
                state["session"] = []
                self._run_all(session, self._control_path, "/end_weight_update", {})
            self._run_all(servers, self._flush)
            state["paused"] = False
            self._run_all(servers, self._control_path, "/continue_generation", {})
        except BaseException:
            self._abandon_update(servers, mode, state)
            if not state["sent"]:
                self._blocked = previous_block  # nothing reached the servers: their weights are unchanged
            raise
        self._blocked = None
        self._weights_loaded = True
        for server in servers:
            server.stale = False

    def _control_path(self, server: _Server, path: str, body: Any) -> Any:
        return self._control(server, path, body)

    def _abandon_update(self, servers: list[_Server], mode: str, state: dict) -> None:
        """Best effort after a failed update: close the session, resume generation, drop a broken group."""
        if mode == "distributed" and state["sent"]:
            self._group_valid = False
        for path, targets in (("/end_weight_update", state["session"]),
                              ("/continue_generation", servers if state["paused"] else [])):
            for server in targets:
                if server.dead:
                    continue
                try:
                    self._control(server, path, {}, timeout=30.0)
                except SGLangError as err:
                    logger.warning("sglang: %s on %s after a failed update: %s", path, server.url, err)

    def _send_bucket_tensor(self, servers: list[_Server], bucket: NamedTensors, weight_version: str | None) -> None:
        if self._serializer is None:
            self._serializer = sglang_tensor_serializer()
        if self._ipc_needs_gpu:
            # CUDA IPC only: CPU shared-memory handles cannot cross into an unrelated server process.
            bucket = [(name, _on_gpu(t)) for name, t in bucket]
        if any(t.is_cuda for _, t in bucket):
            # The servers read through IPC on their own streams: kernels still writing these tensors must finish.
            torch.cuda.synchronize()
        payload = self._serializer(bucket)

        def send(server: _Server) -> None:
            body: dict[str, Any] = {
                # One entry per server TP rank (rank i reads entry i); all ranks read the same full tensors.
                "serialized_named_tensors": [payload] * server.tp_size,
                "flush_cache": False,
            }
            if weight_version is not None:
                body["weight_version"] = weight_version
            self._control(server, "/update_weights_from_tensor", body)

        # `bucket` stays referenced until every server answered: the IPC handles point into its memory.
        self._run_all(servers, send)
        del bucket

    def _send_bucket_distributed(self, servers: list[_Server], bucket: NamedTensors,
                                 weight_version: str | None) -> None:
        group = self._group
        assert group is not None
        tensors = [group.prepare(t) for _, t in bucket]
        body: dict[str, Any] = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": group.name,
            "flush_cache": False,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        timeout = self.config.weight_sync_timeout_s
        futures = [self._ctl_pool.submit(self._control, s, "/update_weights_from_distributed", body, timeout)
                   for s in servers]
        # Servers post one receive per name, in order, on their side of the group; match that order.
        works = group.broadcast(tensors)
        self._await(futures, works, timeout, f"weight bucket of {len(tensors)} tensors ({tensors[0].dtype}, ...)")

    def _ensure_group(self, servers: list[_Server]) -> None:
        if self._group is not None and self._group_valid:
            return
        self._teardown_group(notify=True)
        for server in servers:
            if server.dp_size != 1:
                raise SGLangWeightSyncError(
                    f"sglang server {server.url} runs dp_size {server.dp_size}; distributed weight sync needs "
                    "dp_size 1 (run several servers instead)"
                )
        cfg = self.config
        world_size = 1 + sum(s.tp_size for s in servers)
        address = cfg.weight_sync_master_address or local_address_towards(split_url(servers[0].url)[1])
        group = WeightUpdateGroup(
            master_address=address,
            port=cfg.weight_sync_port,
            world_size=world_size,
            backend=cfg.weight_sync_backend,
            timeout_s=cfg.weight_sync_timeout_s,
            name=f"stapo-weights-{secrets.token_hex(6)}",
        )
        futures, offset = [], 1
        for server in servers:
            body = {
                "master_address": address,
                "master_port": group.port,
                "rank_offset": offset,  # server TP rank r joins as rank_offset + r; the trainer is rank 0
                "world_size": world_size,
                "group_name": group.name,
                "backend": cfg.weight_sync_backend,
            }
            offset += server.tp_size
            futures.append(self._ctl_pool.submit(self._control, server, "/init_weights_update_group", body,
                                                 cfg.weight_sync_timeout_s))
        # The init calls block until every rank joined, so rank 0 joins while they are in flight.
        futures.append(self._ctl_pool.submit(group.join))
        try:
            self._await(futures, [], cfg.weight_sync_timeout_s, f"joining weight-update group {group.name}")
        except BaseException:
            group.destroy()
            raise
        self._group, self._group_valid = group, True
        logger.info("sglang: weight-update group %s ready (%s, world size %d, store %s:%d)", group.name,
                    cfg.weight_sync_backend, world_size, address, group.port)

    def _teardown_group(self, notify: bool) -> None:
        group, self._group, self._group_valid = self._group, None, False
        if group is None:
            return
        if notify:
            for server in self._servers:
                if server.dead:
                    continue
                try:
                    self._control(server, "/destroy_weights_update_group", {"group_name": group.name}, timeout=30.0)
                except SGLangError as err:
                    logger.warning("sglang: destroy_weights_update_group on %s: %s", server.url, err)
        group.destroy()

    def _update_from_disk(self, servers: list[_Server], buckets: Iterable[NamedTensors], check: WeightNameCheck,
                          weight_version: str | None, state: dict) -> None:
        if self._disk_root is None:
            if self.config.disk_sync_dir:
                self._disk_root = Path(self.config.disk_sync_dir)
            else:
                self._disk_root = Path(tempfile.mkdtemp(prefix="stapo-sglang-weights-"))
                self._own_disk_root = True
        tag = f"weights-{weight_version if weight_version is not None else 'x'}-{secrets.token_hex(4)}"
        path = write_safetensors_checkpoint(
            buckets, self._disk_root, tag, config_from=self.config.model_path or None
        )
        try:
            check.finish()  # the whole stream is on disk: a missing name stops us before any server reads it
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        body: dict[str, Any] = {"model_path": str(path), "flush_cache": False}
        if weight_version is not None:
            body["weight_version"] = weight_version
        state["sent"] = True
        self._run_all(servers, self._control_path, "/update_weights_from_disk", body)
        previous, self._last_checkpoint = self._last_checkpoint, path
        if previous is not None and previous != path:
            shutil.rmtree(previous, ignore_errors=True)

    # ------------------------------------------------------------------ memory

    @staticmethod
    def _memory_tags(tags: Sequence[str] | None) -> list[str] | None:
        if tags is None:
            return None
        if isinstance(tags, str):
            tags = [tags]
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown or not tags:
            raise ValueError(f"memory tags must be a non-empty subset of {MEMORY_TAGS}, got {list(tags)}")
        return list(tags)


def _on_gpu(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_cuda or not torch.cuda.is_available():
        return tensor
    return tensor.to(torch.device("cuda", torch.cuda.current_device()))


def _parse_generate(data: Any, num_prompts: int, n: int, url: str) -> list[list[Completion]]:
    """SGLang's /generate answer (one dict, or a flat list of num_prompts*n grouped by prompt) -> completions."""
    items = [data] if isinstance(data, dict) else data
    if not isinstance(items, list) or len(items) != num_prompts * n:
        got = len(items) if isinstance(items, list) else type(data).__name__
        raise SGLangResponseError(f"{url}/generate returned {got} items for {num_prompts} prompts x n={n}")
    groups: list[list[Completion]] = []
    for p in range(num_prompts):
        group = []
        for s in range(n):
            item = items[p * n + s]
            meta = item.get("meta_info") if isinstance(item, dict) else None
            if not isinstance(meta, dict):
                raise SGLangResponseError(f"{url}/generate item {p * n + s} has no meta_info")
            reason = meta.get("finish_reason")
            kind = reason.get("type") if isinstance(reason, dict) else reason
            if kind == "abort":
                message = reason.get("message", "") if isinstance(reason, dict) else ""
                raise _AbortedSample(f"{url}/generate aborted a sample: {message or reason}")
            if kind not in ("stop", "length"):
                raise SGLangResponseError(f"{url}/generate item {p * n + s} has finish_reason {reason!r}")
            entries = meta.get("output_token_logprobs")
            if not isinstance(entries, list):
                raise SGLangResponseError(f"{url}/generate item {p * n + s} lacks output_token_logprobs")
            try:
                # [logprob, token_id, text_or_null]: the token ids here are what was sampled, stop token
                # included (output_ids may have the matched stop token trimmed).
                token_ids = [int(e[1]) for e in entries]
                logprobs = [float(e[0]) for e in entries]
            except (TypeError, ValueError, IndexError):
                raise SGLangResponseError(
                    f"{url}/generate item {p * n + s} has malformed output_token_logprobs"
                ) from None
            group.append(Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=kind))
        groups.append(group)
    return groups
