"""The production rollout engine: SGLang servers driven over their HTTP API (a thin facade).

Where the servers come from is :mod:`~stapo_megatron.rollout.node_servers` (each node launches and
restarts its own); what the controller knows about them, and its HTTP to them, is
:mod:`~stapo_megatron.rollout.server_pool`; which server takes a request is
:mod:`~stapo_megatron.rollout.balancer`. This module turns rollouts into batched ``/generate``
requests spread over every usable server. New weights reach the servers through
:mod:`~stapo_megatron.rollout.weight_sync` (CUDA IPC, broadcasts or a safetensors checkpoint): from
every trainer rank (:meth:`SGLangEngine.weight_sync_plan`), or from this one process
(:meth:`SGLangEngine.load_weights`, e.g. to evaluate a checkpoint).

Every sampled token carries the weight version that produced it (``Completion.versions``, from the
servers' answers). An answer may span versions only where the engine synced weights while the
request ran (a sync pauses every server first); otherwise every token must be of the version last
sent, so a server that restarted, and holds its launch weights, is caught by its answer and kept
out until the next update reaches it.

Request and response shapes follow SGLang's server source (0.5.15 .. 0.5.23; ``/generate``'s are
:mod:`~stapo_megatron.rollout.sglang_generate`); the version each server reports through
``/server_info`` decides the weight-update session (0.5.21+).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

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
)
from stapo_megatron.rollout.sglang_generate import (
    AbortedSample,
    StaleAnswer,
    VersionWindow,
    generate_requests,
    parse_generate,
)
from stapo_megatron.rollout.sglang_server import connect_host
from stapo_megatron.rollout.sglang_weights import TensorSerializer, expected_names_from_hf_checkpoint
from stapo_megatron.rollout.weight_sync.plan import WeightSyncPlan
from stapo_megatron.rollout.weight_sync.session import WeightSync
from stapo_megatron.rollout.weight_sync.transport import name_problems

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
    sync; the default (:func:`~stapo_megatron.rollout.sglang_weights.serialize_for_ipc`) is what SGLang's
    ``MultiprocessingSerializer`` reads.
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
        self._sync_mode = config.resolved_weight_sync
        self._lock = threading.RLock()
        self._revive_lock = threading.Lock()  # one wait for down servers at a time
        self._closed = False
        self._owned: NodeServers | None = None
        self._pool: ServerPool | None = None
        self._sync: WeightSync | None = None  # load_weights' update, kept while its plan holds (groups reused)
        self._blocked: str | None = None  # why generate() must not run now
        self._released: set[str] = set()
        self._weights_loaded = False
        # Weight versions: what every usable server holds (None: launch weights), every version synced
        # so far in order, and whether a sync is under way; generate() reads them from its own threads.
        self._versions_lock = threading.Lock()
        self._weight_version: int | None = None
        self._synced_versions: list[int] = []
        self._sync_open = False
        self._disk_root: Path | None = None  # load_weights' disk sync directory when none is configured
        self._gen_pool: cf.ThreadPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None
        try:
            if endpoints is None:
                api_key = resolve_api_key(config)
                if config.launches:
                    assert api_key is not None  # resolve_api_key makes a secret for launched servers
                    endpoints = self._launch_own(api_key)
                else:
                    endpoints = [
                        ServerEndpoint(index=i, url=url.rstrip("/"), node=-1, tp_size=config.tp_size)
                        for i, url in enumerate(config.urls)
                    ]
            self._api_key = api_key
            self._pool = ServerPool(config, endpoints, api_key)
            self._gen_pool = cf.ThreadPoolExecutor(
                max_workers=len(endpoints) * config.max_concurrent_requests_per_server,
                thread_name_prefix="sglang-generate",
            )
            self._pool.wait_all_ready()
        except BaseException:
            self.shutdown()
            raise
        self._warn_if_seeds_do_not_act()

    def _launch_own(self, api_key: str) -> list[ServerEndpoint]:
        cfg = self.config
        log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="stapo-sglang-logs-"))
        self._owned = NodeServers(
            cfg,
            node=0,
            count=cfg.num_servers,
            first_index=0,
            api_key=api_key,
            log_dir=log_dir,
            advertise_host=connect_host(cfg.host),
        )
        self._finalizer = weakref.finalize(self, _stop_node_servers, self._owned)
        endpoints = self._owned.start()
        return [
            ServerEndpoint(index=i, url=e.url, node=e.node, tp_size=e.tp_size, gpu_ids=e.gpu_ids, log_path=e.log_path)
            for i, e in enumerate(endpoints)
        ]

    # ------------------------------------------------------------------ public API

    @property
    def _server_pool(self) -> ServerPool:
        assert self._pool is not None, "set by __init__, which raises when it cannot make one"
        return self._pool

    @property
    def _servers(self) -> list[PooledServer]:
        return self._server_pool.servers

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    @property
    def log_files(self) -> list[Path]:
        return [Path(s.endpoint.log_path) for s in self._servers if s.endpoint.log_path]

    @property
    def routed_tokens(self) -> list[int]:
        """Per server: prompt + max_new_tokens of every request sent to it so far."""
        return list(self._server_pool.balancer.routed)

    @property
    def seeds_act(self) -> bool:
        """Whether every server that is not dead samples seeded requests reproducibly: SGLang uses a
        request's ``sampling_seed`` only under deterministic inference (``/server_info``)."""
        return all(s.deterministic for s in self._servers if not s.dead)

    def server_status(self) -> list[dict[str, Any]]:
        """One dict per server: url, node, version, tp_size, recoveries, down, stale, dead, deterministic
        (seeds act), log file, and the pid and restarts of servers this engine launched itself."""
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
                "deterministic": s.deterministic,
                "log_file": s.endpoint.log_path or None,
                "pid": owned.get(s.url, {}).get("pid"),
                "restarts": owned.get(s.url, {}).get("restarts"),
            }
            for s in self._servers
        ]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample; a weight sync may run while the requests are in flight (from another thread), and the
        tokens then carry the versions that produced them."""
        with self._lock:  # the state checks and the submission; the wait is outside, so syncs can run
            self._check_can_generate()
            prompt_ids = [self._prompt_ids(p, i) for i, p in enumerate(prompts)]
            if not prompt_ids:
                return []
            self._server_pool.revive(wait=False, weights_sent=self._weights_loaded)
            self._wait_for_a_server()
            chunks = generate_requests(prompt_ids, params, self.config.max_prompts_per_request)
            assert self._gen_pool is not None  # made by __init__ with the server pool
            futures = [
                self._gen_pool.submit(
                    self._run_generate,
                    body,
                    count,
                    params.n,
                    sum(len(p) + params.n * params.max_new_tokens for p in prompt_ids[start : start + count]),
                )
                for start, count, body in chunks
            ]
        results: list[list[Completion]] = []
        try:
            for future in futures:  # chunks are consecutive, in prompt order
                results.extend(future.result())
        except BaseException:
            for future in futures:
                future.cancel()
            cf.wait(futures)  # let running requests settle before the error leaves generate()
            raise
        return results

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """This process sends the whole model to every server: the single-process case of
        :class:`~stapo_megatron.rollout.weight_sync.session.WeightSync` (one rank, every server its target).
        ``version=None``: one more than the last version sent (0 at first)."""
        with self._lock:
            self._check_open()
            if isinstance(named_tensors, Mapping):
                named_tensors = list(named_tensors.items())
            elif isinstance(named_tensors, tuple):
                named_tensors = list(named_tensors)
            names = None
            if isinstance(named_tensors, list) and self._expected is not None:
                # A materialized stream is checked whole before anything reaches a server.
                names = [item[0] if isinstance(item, tuple) else item for item in named_tensors]
                problems = name_problems(self._expected, names)
                if problems:
                    raise SGLangWeightSyncError(f"load_weights: the stream {problems}")
            if version is None:
                version = 0 if self._weight_version is None else self._weight_version + 1
            if self._disk_root is None and self._sync_mode == "disk" and not self.config.disk_sync_dir:
                self._disk_root = Path(tempfile.mkdtemp(prefix="stapo-sglang-weights-"))
            plan = self.weight_sync_plan(disk_dir=str(self._disk_root) if self._disk_root else None)
            if self._sync is not None and self._sync.plan != plan:
                self._sync.close()
                self._sync = None
            if self._sync is None:
                self._sync = WeightSync(None, plan, serializer=self._serializer)
            # On a GPU, IPC handles and broadcasts come straight from device memory, so pack there.
            on_gpu = self._sync_mode != "disk" and torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
            try:
                self._sync.push(named_tensors, version, names=names, device=device)
            except BaseException:
                if self._sync.paused:
                    self._blocked = (
                        "the last load_weights did not finish, so the servers may hold a mix of old and new "
                        "weights; call load_weights again before generating"
                    )
                raise
            self.weights_synced(version)

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free server GPU memory (``tags`` from kv_cache, weights, cuda_graph; None = all)."""
        with self._lock:
            self._check_open()
            tags = self._memory_tags(tags)
            live = self._live()
            pool = self._server_pool
            pool.run_all(live, pool.flush)
            pool.run_all(live, lambda s: pool.control(s, "/release_memory_occupation", {"tags": tags}))
            released = set(tags or MEMORY_TAGS)
            self._released |= released
            if "weights" in released and not self.config.enable_weights_cpu_backup:
                self._blocked = (
                    "weights were released without --enable-weights-cpu-backup, so they are garbage after "
                    "resume; call load_weights before generating"
                )

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back memory released by :meth:`release_memory` (``tags`` as there; None = all released)."""
        with self._lock:
            self._check_open()
            tags = self._memory_tags(tags)
            # Only what was released: SGLang's scheduler dies (KeyError) resuming a tag it never released.
            resumed = [t for t in (tags or MEMORY_TAGS) if t in self._released]
            if not resumed:
                return
            pool = self._server_pool
            pool.run_all(self._live(), lambda s: pool.control(s, "/resume_memory_occupation", {"tags": resumed}))
            self._released -= set(resumed)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sync is not None:
            self._sync.close()  # leaves the servers' weight-update groups while they still run
        if self._gen_pool is not None:
            self._gen_pool.shutdown(wait=False, cancel_futures=True)
        if self._owned is not None:
            self._owned.shutdown()
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._pool is not None:
            self._pool.shutdown()
        if self._disk_root is not None:
            shutil.rmtree(self._disk_root, ignore_errors=True)

    # ------------------------------------------------------------------ server state

    def _warn_if_seeds_do_not_act(self) -> None:
        """Said once, at connect: without deterministic inference SGLang ignores sampling seeds."""
        plain = [s.url for s in self._servers if not s.deterministic]
        if plain:
            logger.warning(
                "sglang: %d of %d servers (%s) run without deterministic inference, so SGLang ignores the "
                "sampling seeds: seeded rollouts are not reproducible, and a resumed evaluation samples "
                "different responses than an uninterrupted one would; deterministic_inference: true in the "
                "sglang settings launches servers with --enable-deterministic-inference (slower generation)",
                len(plain),
                len(self._servers),
                plain[0] + (", ..." if len(plain) > 1 else ""),
            )

    def _live(self) -> list[PooledServer]:
        return [s for s in self._servers if not (s.down or s.dead)]

    def _probe(self, server: PooledServer) -> None:
        """Before a weight update: a server that died since the last call is taken down (and waited for).

        Asked through /server_info, which does not generate: /health runs a generation, which a server
        whose generation is paused holds (SGLang answers 503 after 20 s), so after a failed update, left
        paused on purpose, /health would take a healthy server down and then call it dead."""
        try:
            # any answer will do (a 404 from a server older than the route's rename too); 5xx raises
            self._server_pool.http(server, "GET", "/server_info", timeout=30.0)
            return
        except SGLangServerError as err:
            reason = str(err)
        with server.lock:
            if not (server.down or server.dead):
                self._server_pool._take_down_locked(server, reason)

    def _wait_for_a_server(self) -> None:
        """When every server is down, wait for them to come back (their nodes restart them)."""
        if self._server_pool.usable():
            return
        with self._revive_lock:
            if not self._server_pool.usable():
                self._server_pool.revive(wait=True, weights_sent=self._weights_loaded)
        self._server_pool.check_some_usable()

    def _acquire(self, cost: int, tried: set[int]) -> PooledServer:
        """The least-loaded usable server, avoiding those this request already failed on when possible."""
        usable = self._server_pool.usable()
        if not usable:
            self._wait_for_a_server()
            usable = self._server_pool.usable()
        candidates = [s.index for s in usable if s.index not in tried] or [s.index for s in usable]
        return self._servers[self._server_pool.balancer.acquire(candidates, cost)]

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
            self._server_pool.check_some_usable()

    @staticmethod
    def _prompt_ids(prompt: Sequence[int], index: int) -> list[int]:
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        return ids

    def _window_start(self) -> tuple[int | None, int, bool]:
        """Before a request is sent: the version the servers hold, how many syncs completed, whether one is open."""
        with self._versions_lock:
            return self._weight_version, len(self._synced_versions), self._sync_open

    def _window(self, start: tuple[int | None, int, bool]) -> VersionWindow:
        """After its answer came: the versions the request may have been served with (see VersionWindow)."""
        sent, synced_before, open_at_send = start
        with self._versions_lock:
            synced = tuple(self._synced_versions[synced_before:])
            return VersionWindow(sent=sent, synced=synced, open=open_at_send or self._sync_open)

    def _run_generate(self, body: dict, count: int, n: int, cost: int) -> list[list[Completion]]:
        """One chunk: sent to the least-loaded server; after a failure it goes to another server
        (the failed one never answered it, so nothing is generated twice into the result)."""
        attempts = 0
        tried: set[int] = set()
        while True:
            if self._closed:
                raise SGLangError("the SGLang engine was shut down during generate()")
            server = self._acquire(cost, tried)
            window_start = self._window_start()
            try:
                resp = request(
                    server.url, "POST", "/generate", body, api_key=self._api_key, timeout=self.config.request_timeout_s
                )
            except TransportError as err:
                last_error = str(err)
                tried.add(server.index)
                self._server_pool.on_transport_failure(server, err)
            else:
                server.failures = 0
                if resp.status == 200:
                    try:
                        return parse_generate(resp.json(), count, n, server.url, self._window(window_start))
                    except AbortedSample as err:
                        last_error = str(err)
                    except StaleAnswer as err:
                        last_error = str(err)
                        tried.add(server.index)
                        self._server_pool.mark_stale(server, str(err))
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
                self._server_pool.balancer.release(server.index, cost)
            self._wait_for_a_server()  # raises when no server can take it any more (dead, or stale)
            attempts += 1
            if attempts > self.config.max_retries:
                raise SGLangServerError(
                    f"sglang server {server.describe()}: /generate failed {attempts} times; last error: {last_error}"
                )
            logger.warning("sglang: retrying /generate (%d/%d): %s", attempts, self.config.max_retries, last_error)
            time.sleep(self.config.retry_backoff_s)

    # ------------------------------------------------------------------ weights

    def weight_sync_plan(self, disk_dir: str | None = None) -> WeightSyncPlan:
        """What every trainer rank needs to push its own share of the weights to these servers
        (:class:`~stapo_megatron.rollout.weight_sync.session.WeightSync`; the controller broadcasts it).
        ``disk_dir`` overrides ``disk_sync_dir`` (load_weights' own directory). From here until
        :meth:`weights_synced`, answers may carry the coming version (the servers take it first)."""
        with self._lock:
            self._check_open()
            if self._expected is None:
                raise SGLangWeightSyncError(
                    "a weight update needs expected_weight_names at construction "
                    "(e.g. expected_names_from_hf_checkpoint(model_path))"
                )
            if not self._api_key:
                raise SGLangWeightSyncError(
                    f"refusing to update weights on {', '.join(self.urls)}: no API key is configured "
                    f"(set sglang.api_key or ${self.config.api_key_env}), so the update routes would be open"
                )
            if "weights" in self._released:
                raise SGLangWeightSyncError(
                    "weights are released on the servers; call resume_memory(['weights']) first"
                )
            # Every server that can come back gets the weights: a down one is waited for.
            self._server_pool.run_all([s for s in self._servers if not (s.down or s.dead)], self._probe)
            self._server_pool.revive(wait=True, weights_sent=self._weights_loaded)
            servers = [s for s in self._servers if not s.dead]
            if not servers:
                self._server_pool.check_some_usable()
            for server in servers:
                if self._sync_mode == "distributed" and server.dp_size != 1:
                    raise SGLangWeightSyncError(
                        f"sglang server {server.url} runs dp_size {server.dp_size}; distributed weight sync needs "
                        "dp_size 1 (run several servers instead)"
                    )
            cfg = self.config
            # tp_size as the server reports it (attached servers: the config may not know it).
            endpoints = tuple(dataclasses.replace(s.endpoint, tp_size=s.tp_size) for s in servers)
            with self._versions_lock:
                # A sync follows the plan: answers arriving from now on may carry its version, not yet known.
                self._sync_open = True
            return WeightSyncPlan(
                mode=self._sync_mode,
                endpoints=endpoints,
                expected_names=self._expected,
                api_key=self._api_key,
                config=cfg,
                session_servers=frozenset(s.index for s in servers if s.version >= SESSION_VERSION),
                disk_dir=disk_dir or cfg.disk_sync_dir,
                server_restarts=sum(s.recoveries for s in self._servers),
            )

    def weights_synced(self, version: int) -> None:
        """The trainer ranks' :meth:`WeightSync.sync` put ``version`` on every server of the plan."""
        with self._lock:
            self._blocked = None
            self._weights_loaded = True
            with self._versions_lock:
                self._weight_version = version
                self._synced_versions.append(version)
                self._sync_open = False
            for server in self._servers:
                if not server.dead:
                    server.stale = False

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
