"""The production rollout engine: SGLang servers driven over their HTTP API (a thin facade).

Where the servers come from is :mod:`~stapo_megatron.rollout.node_servers` (each node launches and
restarts its own); what the controller knows about them, and its HTTP to them, is
:mod:`~stapo_megatron.rollout.server_pool`; which server takes a request is
:mod:`~stapo_megatron.rollout.balancer`. This module turns rollouts into batched ``/generate``
requests spread over every usable server, and pushes new weights in bounded buckets through one of
SGLang's three update paths:

* ``tensor``: CUDA IPC handles via ``/update_weights_from_tensor`` (servers on the trainer's GPUs),
* ``distributed``: a torch.distributed group the servers join, fed by broadcasts from the trainer,
* ``disk``: a safetensors checkpoint read through ``/update_weights_from_disk``.

No ``/generate`` is served on a mix of weight versions: updates pause every server, a server that
restarted holds its launch weights and is kept out until the next update reaches it, and every
answer's ``meta_info.weight_version`` must be the version last sent.

Request and response shapes follow SGLang's server source (0.5.15 .. 0.5.23); the version each
server reports through ``/server_info`` decides the weight-update session (0.5.21+).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from stapo_megatron.config.core import ConfigError
from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.endpoints import ServerEndpoint
from stapo_megatron.rollout.engine import Completion, RolloutEngine, SamplingParams
from stapo_megatron.rollout.node_servers import NodeServers, resolve_api_key
from stapo_megatron.rollout.server_pool import NEUTRAL_SAMPLING, PooledServer, ServerPool
from stapo_megatron.rollout.sglang_client import (
    SGLangError,
    SGLangRequestError,
    SGLangResponseError,
    SGLangServerError,
    SGLangWeightSyncError,
    TransportError,
    error_message,
    request,
    split_url,
)
from stapo_megatron.rollout.sglang_server import connect_host
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
    "NEUTRAL_SAMPLING",
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


class _AbortedSample(Exception):
    """A sample came back with finish_reason abort (server paused, preempted or restarting)."""


class _StaleAnswer(Exception):
    """A server answered with weights other than the version last sent (it restarted unnoticed)."""


def _stop_node_servers(owned: NodeServers) -> None:
    # An engine dropped without shutdown() still stops its servers (NodeServers also stops them at exit).
    owned.shutdown()


class SGLangEngine(RolloutEngine):
    """Rollouts from SGLang servers; see the module docstring.

    In a run, every rank got ``endpoints`` and ``api_key`` from
    :func:`~stapo_megatron.rollout.node_servers.start_job_servers` (the node leaders own the
    processes); standalone (evaluation, tests) the engine launches ``num_servers`` on this machine,
    and owns them, or attaches to ``urls``.

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
        endpoints: Sequence[ServerEndpoint] | None = None,
        api_key: str | None = None,
    ):
        if not config.urls and not config.model_path and endpoints is None:
            raise ConfigError("model_path: required to launch servers (or give urls to attach to running ones)")
        self.config = config
        self._expected = frozenset(expected_weight_names) if expected_weight_names is not None else None
        self._serializer = tensor_serializer
        self._ipc_needs_gpu = tensor_serializer is None  # SGLang's serializer ships CUDA IPC handles
        self._sync_mode = config.resolved_weight_sync
        self._lock = threading.RLock()
        self._revive_lock = threading.Lock()  # one wait for down servers at a time
        self._closed = False
        self._owned: NodeServers | None = None
        self._pool: ServerPool | None = None
        self._group: WeightUpdateGroup | None = None
        self._group_valid = False
        self._group_members: tuple[int, ...] = ()  # server indices the group was built for
        self._blocked: str | None = None  # why generate() must not run now
        self._released: set[str] = set()
        self._weights_loaded = False
        self._weight_version: str | None = None  # what every usable server holds, when versions were sent
        self._disk_root: Path | None = None
        self._own_disk_root = False
        self._last_checkpoint: Path | None = None
        self._gen_pool: cf.ThreadPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None
        try:
            if endpoints is None:
                api_key = resolve_api_key(config)
                endpoints = self._launch_own(api_key) if config.launches else [
                    ServerEndpoint(index=i, url=url.rstrip("/"), node=-1, tp_size=config.tp_size)
                    for i, url in enumerate(config.urls)
                ]
            self._api_key = api_key
            self._pool = ServerPool(config, endpoints, api_key)
            self._pool.on_recovery = self._on_recovery
            self._gen_pool = cf.ThreadPoolExecutor(
                max_workers=len(endpoints) * config.max_concurrent_requests_per_server,
                thread_name_prefix="sglang-generate",
            )
            self._pool.wait_all_ready()
        except BaseException:
            self.shutdown()
            raise

    def _launch_own(self, api_key: str) -> list[ServerEndpoint]:
        cfg = self.config
        log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="stapo-sglang-logs-"))
        self._owned = NodeServers(cfg, node=0, count=cfg.num_servers, first_index=0, api_key=api_key,
                                  log_dir=log_dir, advertise_host=connect_host(cfg.host))
        self._finalizer = weakref.finalize(self, _stop_node_servers, self._owned)
        endpoints = self._owned.start()
        return [ServerEndpoint(index=i, url=e.url, node=e.node, tp_size=e.tp_size, gpu_ids=e.gpu_ids,
                               log_path=e.log_path) for i, e in enumerate(endpoints)]

    # ------------------------------------------------------------------ public API

    @property
    def _servers(self) -> list[PooledServer]:
        return self._pool.servers

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    @property
    def log_files(self) -> list[Path]:
        return [Path(s.endpoint.log_path) for s in self._servers if s.endpoint.log_path]

    @property
    def routed_tokens(self) -> list[int]:
        """Per server: prompt + max_new_tokens of every request sent to it so far."""
        return list(self._pool.balancer.routed)

    def server_status(self) -> list[dict[str, Any]]:
        """One dict per server: url, node, version, tp_size, recoveries, down, stale, dead, log file, and the
        pid and restarts of servers this engine launched itself."""
        owned = {row["url"]: row for row in self._owned.status()} if self._owned else {}
        return [
            {
                "url": s.url,
                "node": s.endpoint.node,
                "version": ".".join(map(str, s.version)),
                "tp_size": s.tp_size,
                "recoveries": s.recoveries,
                "down": s.down,
                "stale": s.stale,
                "dead": s.dead,
                "log_file": s.endpoint.log_path or None,
                "pid": owned.get(s.url, {}).get("pid"),
                "restarts": owned.get(s.url, {}).get("restarts"),
            }
            for s in self._servers
        ]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        with self._lock:
            self._check_can_generate()
            prompts = [self._prompt_ids(p, i) for i, p in enumerate(prompts)]
            if not prompts:
                return []
            self._pool.revive(wait=False, weights_sent=self._weights_loaded)
            self._wait_for_a_server()
            chunks = self._generate_requests(prompts, params)
            futures = [
                self._gen_pool.submit(self._run_generate, body, count, params.n,
                                      sum(len(p) + params.n * params.max_new_tokens
                                          for p in prompts[start : start + count]))
                for start, count, body in chunks
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
            # Every server that can come back must get these weights: a down one is waited for.
            self._pool.run_all([s for s in self._servers if not (s.down or s.dead)], self._probe)
            self._pool.revive(wait=True, weights_sent=self._weights_loaded)
            servers = [s for s in self._servers if not s.dead]
            if not servers:
                self._pool.check_some_usable()
            self._update_weights(servers, named_tensors, check, None if version is None else str(version))

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free server GPU memory (``tags`` from kv_cache, weights, cuda_graph; None = all)."""
        with self._lock:
            self._check_open()
            tags = self._memory_tags(tags)
            live = self._live()
            self._pool.run_all(live, self._pool.flush)
            self._pool.run_all(live, lambda s: self._pool.control(s, "/release_memory_occupation", {"tags": tags}))
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
            self._pool.run_all(self._live(),
                               lambda s: self._pool.control(s, "/resume_memory_occupation", {"tags": tags}))
            self._released -= set(tags or MEMORY_TAGS)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            try:
                self._teardown_group(notify=self._owned is None)
            except Exception as err:  # noqa: BLE001 - shutdown must go on
                logger.warning("sglang: tearing down the weight-update group failed: %s", err)
        if self._gen_pool is not None:
            self._gen_pool.shutdown(wait=False, cancel_futures=True)
        if self._owned is not None:
            self._owned.shutdown()
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._pool is not None:
            self._pool.shutdown()
        if self._own_disk_root and self._disk_root is not None:
            shutil.rmtree(self._disk_root, ignore_errors=True)

    # ------------------------------------------------------------------ server state

    def _live(self) -> list[PooledServer]:
        return [s for s in self._servers if not (s.down or s.dead)]

    def _on_recovery(self, server: PooledServer) -> None:
        self._group_valid = False  # a fresh process is not a member of the weight-update group

    def _probe(self, server: PooledServer) -> None:
        """Before a weight update: a server that died since the last call is taken down (and waited for)."""
        try:
            resp = self._pool.http(server, "GET", "/health", timeout=30.0)
            if resp.status == 200:
                return
            reason = f"/health answered HTTP {resp.status}"
        except SGLangServerError as err:
            reason = str(err)
        with server.lock:
            if not (server.down or server.dead):
                self._pool._take_down_locked(server, reason)

    def _wait_for_a_server(self) -> None:
        """When every server is down, wait for them to come back (their nodes restart them)."""
        if self._pool.usable():
            return
        with self._revive_lock:
            if not self._pool.usable():
                self._pool.revive(wait=True, weights_sent=self._weights_loaded)
        self._pool.check_some_usable()

    def _acquire(self, cost: int, tried: set[int]) -> PooledServer:
        """The least-loaded usable server, avoiding those this request already failed on when possible."""
        usable = self._pool.usable()
        if not usable:
            self._wait_for_a_server()
            usable = self._pool.usable()
        candidates = [s.index for s in usable if s.index not in tried] or [s.index for s in usable]
        return self._servers[self._pool.balancer.acquire(candidates, cost)]

    # ------------------------------------------------------------------ generation

    def _check_open(self) -> None:
        if self._closed:
            raise SGLangError("the SGLang engine was shut down")

    def _check_can_generate(self) -> None:
        self._check_open()
        if self._released:
            raise SGLangError(
                f"server memory is released ({', '.join(sorted(self._released))}); call resume_memory() first"
            )
        if self._blocked:
            raise SGLangWeightSyncError(self._blocked)
        if all(s.dead for s in self._servers) or all(s.stale or s.dead for s in self._servers):
            self._pool.check_some_usable()

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

    def _run_generate(self, body: dict, count: int, n: int, cost: int) -> list[list[Completion]]:
        """One chunk: sent to the least-loaded server; after a failure it goes to another server
        (the failed one never answered it, so nothing is generated twice into the result)."""
        attempts = 0
        tried: set[int] = set()
        while True:
            if self._closed:
                raise SGLangError("the SGLang engine was shut down during generate()")
            server = self._acquire(cost, tried)
            try:
                resp = request(server.url, "POST", "/generate", body, api_key=self._api_key,
                               timeout=self.config.request_timeout_s)
            except TransportError as err:
                last_error = str(err)
                tried.add(server.index)
                self._pool.on_transport_failure(server, err)
            else:
                server.failures = 0
                if resp.status == 200:
                    try:
                        return _parse_generate(resp.json(), count, n, server.url, self._weight_version)
                    except _AbortedSample as err:
                        last_error = str(err)
                    except _StaleAnswer as err:
                        last_error = str(err)
                        tried.add(server.index)
                        self._pool.mark_stale(server, str(err))
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
            finally:
                self._pool.balancer.release(server.index, cost)
            self._wait_for_a_server()  # raises when no server can take it any more (dead, or stale)
            attempts += 1
            if attempts > self.config.max_retries:
                raise SGLangServerError(
                    f"sglang server {server.describe()}: /generate failed {attempts} times; last error: {last_error}"
                )
            logger.warning("sglang: retrying /generate (%d/%d): %s", attempts, self.config.max_retries, last_error)
            time.sleep(self.config.retry_backoff_s)

    # ------------------------------------------------------------------ weights

    def weight_sync_plan(self):
        """What every trainer rank needs to push its own share of the weights to these servers
        (:class:`~stapo_megatron.rollout.weight_sync.WeightSync`; the controller broadcasts it)."""
        from stapo_megatron.rollout.weight_sync import WeightSyncPlan

        with self._lock:
            self._check_open()
            if self._expected is None or not self._api_key:
                raise SGLangWeightSyncError("a weight sync needs expected_weight_names and an API key on the engine")
            if "weights" in self._released:
                raise SGLangWeightSyncError("weights are released on the servers; call resume_memory(['weights']) first")
            # As for load_weights: every server that can come back gets the weights; a down one is waited for.
            self._pool.run_all([s for s in self._servers if not (s.down or s.dead)], self._probe)
            self._pool.revive(wait=True, weights_sent=self._weights_loaded)
            servers = [s for s in self._servers if not s.dead]
            cfg = self.config
            return WeightSyncPlan(
                mode=self._sync_mode, endpoints=tuple(s.endpoint for s in servers), expected_names=self._expected,
                api_key=self._api_key, session_servers=frozenset(s.index for s in servers if s.version >= SESSION_VERSION),
                bucket_bytes=cfg.weight_bucket_bytes, control_timeout_s=cfg.control_timeout_s,
                transfer_timeout_s=cfg.weight_sync_timeout_s, flush_timeout_s=cfg.flush_timeout_s,
                group_backend=cfg.weight_sync_backend, master_address=cfg.weight_sync_master_address,
                disk_dir=cfg.disk_sync_dir, config_from=cfg.model_path,
            )

    def weights_synced(self, version: int) -> None:
        """The trainer ranks' :meth:`WeightSync.sync` put ``version`` on every server of the plan."""
        with self._lock:
            self._blocked = None
            self._weights_loaded = True
            self._weight_version = str(version)
            for server in self._servers:
                if not server.dead:
                    server.stale = False

    def _update_weights(self, servers: list[PooledServer], named_tensors: Iterable[tuple[str, torch.Tensor]],
                        check: WeightNameCheck, weight_version: str | None) -> None:
        mode = self._sync_mode
        previous_block = self._blocked
        self._blocked = (
            "the last load_weights did not finish, so the servers may hold a mix of old and new weights; "
            "call load_weights again before generating"
        )
        state = {"paused": False, "session": [], "sent": False}
        try:
            self._pool.run_all(servers, self._pool.control, "/pause_generation", {"mode": "abort"})
            state["paused"] = True
            self._pool.run_all(servers, self._pool.flush)
            buckets = iter_buckets(named_tensors, self.config.weight_bucket_bytes, check)
            if mode == "disk":
                self._update_from_disk(servers, buckets, check, weight_version, state)
            else:
                if mode == "distributed":
                    self._ensure_group(servers)
                session = [s for s in servers if s.version >= SESSION_VERSION]
                state["session"] = session  # set first: a begin that fails on one server still gets ended on the rest
                self._pool.run_all(session, self._pool.control, "/begin_weight_update", {})
                for bucket in buckets:
                    state["sent"] = True
                    if mode == "tensor":
                        self._send_bucket_tensor(servers, bucket, weight_version)
                    else:
                        self._send_bucket_distributed(servers, bucket, weight_version)
                check.finish()
                state["session"] = []
                self._pool.run_all(session, self._pool.control, "/end_weight_update", {})
            self._pool.run_all(servers, self._pool.flush)
            state["paused"] = False
            self._pool.run_all(servers, self._pool.control, "/continue_generation", {})
        except BaseException:
            self._abandon_update(servers, mode, state)
            if not state["sent"]:
                self._blocked = previous_block  # nothing reached the servers: their weights are unchanged
            raise
        self._blocked = None
        self._weights_loaded = True
        self._weight_version = weight_version
        for server in servers:
            server.stale = False

    def _abandon_update(self, servers: list[PooledServer], mode: str, state: dict) -> None:
        """Best effort after a failed update: close the session, resume generation, drop a broken group."""
        if mode == "distributed" and state["sent"]:
            self._group_valid = False
        for path, targets in (("/end_weight_update", state["session"]),
                              ("/continue_generation", servers if state["paused"] else [])):
            for server in targets:
                if server.dead:
                    continue
                try:
                    self._pool.control(server, path, {}, timeout=30.0)
                except SGLangError as err:
                    logger.warning("sglang: %s on %s after a failed update: %s", path, server.url, err)

    def _send_bucket_tensor(self, servers: list[PooledServer], bucket: NamedTensors, weight_version: str | None) -> None:
        if self._serializer is None:
            self._serializer = sglang_tensor_serializer()
        if self._ipc_needs_gpu:
            # CUDA IPC only: CPU shared-memory handles cannot cross into an unrelated server process.
            bucket = [(name, _on_gpu(t)) for name, t in bucket]
        if any(t.is_cuda for _, t in bucket):
            # The servers read through IPC on their own streams: kernels still writing these tensors must finish.
            torch.cuda.synchronize()
        payload = self._serializer(bucket)

        def send(server: PooledServer) -> None:
            body: dict[str, Any] = {
                # One entry per server TP rank (rank i reads entry i); all ranks read the same full tensors.
                "serialized_named_tensors": [payload] * server.tp_size,
                "flush_cache": False,
            }
            if weight_version is not None:
                body["weight_version"] = weight_version
            self._pool.control(server, "/update_weights_from_tensor", body)

        # `bucket` stays referenced until every server answered: the IPC handles point into its memory.
        self._pool.run_all(servers, send)
        del bucket

    def _send_bucket_distributed(self, servers: list[PooledServer], bucket: NamedTensors,
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
        futures = [self._pool.submit(self._pool.control, s, "/update_weights_from_distributed", body, timeout)
                   for s in servers]
        # Servers post one receive per name, in order, on their side of the group; match that order.
        works = group.broadcast(tensors)
        self._await(futures, works, timeout, f"weight bucket of {len(tensors)} tensors ({tensors[0].dtype}, ...)")

    def _ensure_group(self, servers: list[PooledServer]) -> None:
        members = tuple(s.index for s in servers)
        if self._group is not None and self._group_valid and self._group_members == members:
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
            futures.append(self._pool.submit(self._pool.control, server, "/init_weights_update_group", body,
                                             cfg.weight_sync_timeout_s))
        # The init calls block until every rank joined, so rank 0 joins while they are in flight.
        futures.append(self._pool.submit(group.join))
        try:
            self._await(futures, [], cfg.weight_sync_timeout_s, f"joining weight-update group {group.name}")
        except BaseException:
            group.destroy()
            raise
        self._group, self._group_valid, self._group_members = group, True, members
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
                    self._pool.control(server, "/destroy_weights_update_group", {"group_name": group.name}, timeout=30.0)
                except SGLangError as err:
                    logger.warning("sglang: destroy_weights_update_group on %s: %s", server.url, err)
        group.destroy()

    def _update_from_disk(self, servers: list[PooledServer], buckets: Iterable[NamedTensors], check: WeightNameCheck,
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
        self._pool.run_all(servers, self._pool.control, "/update_weights_from_disk", body)
        previous, self._last_checkpoint = self._last_checkpoint, path
        if previous is not None and previous != path:
            shutil.rmtree(previous, ignore_errors=True)

    @staticmethod
    def _await(futures: Sequence[cf.Future], works: Sequence[Any], timeout_s: float, what: str) -> None:
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


def _parse_generate(data: Any, num_prompts: int, n: int, url: str,
                    weight_version: str | None = None) -> list[list[Completion]]:
    """SGLang's /generate answer (one dict, or a flat list of num_prompts*n grouped by prompt) -> completions.

    With ``weight_version``, every sample must report it in ``meta_info.weight_version``."""
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
            served = meta.get("weight_version")
            if weight_version is not None and served is not None and str(served) != weight_version:
                raise _StaleAnswer(f"{url} answered with weight version {served!r}, expected {weight_version!r}")
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
