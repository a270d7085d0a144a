"""The controller's view of the rollout servers: attach, health, failure and recovery, HTTP.

The processes belong to their nodes (:mod:`stapo_megatron.rollout.node_servers`); the pool only
talks HTTP. A server that stops answering is taken *down* (requests go to the others) and
waited for; when it answers again it is a fresh process holding its launch weights, so once the
trainer has sent weights it is *stale*, and kept out of rollouts until the next weight update
reaches it. A server that goes down again after ``max_restarts`` recoveries is *dead* for the run.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from stapo_megatron.rollout.balancer import TokenBalancer
from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.endpoints import ServerEndpoint
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
)
from stapo_megatron.rollout.sglang_server import wait_healthy

logger = logging.getLogger(__name__)

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
REQUEST_SAMPLING_KEYS = {"n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed"}
# Server-preferred keys that cannot change which token is sampled or its log-prob.
OUTPUT_ONLY_SAMPLING_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
PROBE_TIMEOUT_S = 2.0  # one /health of a down server before a rollout: a refused connection answers at once


class PooledServer:
    """What the controller knows about one server."""

    def __init__(self, endpoint: ServerEndpoint):
        self.endpoint = endpoint
        self.index = endpoint.index
        self.url = endpoint.url
        self.tp_size = endpoint.tp_size
        self.dp_size = 1
        self.version: tuple[int, int, int] = (0, 0, 0)
        self.lock = threading.Lock()  # one state change at a time
        self.failures = 0  # consecutive failures that may be transient (reset, timeout, 5xx)
        self.recoveries = 0  # times it came back after being down
        self.down = False  # not answering: routed around until it answers again
        self.dead = False  # down after its last allowed recovery
        self.stale = False  # came back after a weight update: holds its launch weights
        self.deterministic = False  # runs with deterministic inference: only then do sampling seeds act

    def describe(self) -> str:
        if self.endpoint.log_path:
            return f"{self.url} (node {self.endpoint.node}, log: {self.endpoint.log_path})"
        return f"{self.url} (attached)"


class ServerPool:
    """HTTP to every server of the run, and which of them may serve ``/generate`` now."""

    def __init__(self, config: SGLangConfig, endpoints: Sequence[ServerEndpoint], api_key: str | None):
        if not endpoints:
            raise SGLangServerError("no SGLang server to use: the endpoint list is empty")
        self.config = config
        self.api_key = api_key
        self.servers = [PooledServer(e) for e in endpoints]
        self.balancer = TokenBalancer(len(self.servers))
        self._ctl = cf.ThreadPoolExecutor(max_workers=2 * len(self.servers) + 4, thread_name_prefix="sglang-control")

    def shutdown(self) -> None:
        self._ctl.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ readiness

    def wait_all_ready(self) -> None:
        self.run_all(self.servers, self._wait_ready)

    def _wait_ready(self, server: PooledServer) -> None:
        wait_healthy(server.url, api_key=self.api_key, timeout_s=self.config.startup_timeout_s)
        self._read_server_info(server)

    def _read_server_info(self, server: PooledServer) -> None:
        resp = self.http(server, "GET", "/server_info")
        if resp.status == 404:  # servers older than the /server_info rename
            resp = self.http(server, "GET", "/get_server_info")
        info = control_reply(server.url, "/server_info", resp)
        if not isinstance(info, dict) or "version" not in info:
            raise SGLangResponseError(f"sglang server {server.url}/server_info carries no 'version'")
        server.version = parse_version(info["version"])
        _check_preferred_sampling(server, info.get("preferred_sampling_params"))
        server.tp_size = int(info.get("tp_size", server.tp_size))
        server.dp_size = int(info.get("dp_size", 1))
        server.deterministic = info.get("enable_deterministic_inference") is True
        if server.endpoint.log_path and server.tp_size != server.endpoint.tp_size:
            raise SGLangServerError(
                f"sglang server {server.describe()} reports tp_size {server.tp_size}, launched with "
                f"{server.endpoint.tp_size}"
            )
        logger.info(
            "sglang: %s runs SGLang %s (tp %d, dp %d)", server.url, info["version"], server.tp_size, server.dp_size
        )

    # ------------------------------------------------------------------ routing state

    def usable(self) -> list[PooledServer]:
        return [s for s in self.servers if not (s.down or s.dead or s.stale)]

    def check_some_usable(self) -> None:
        """Raise when no server may serve ``/generate`` (naming why)."""
        if self.usable():
            return
        dead = [s.describe() for s in self.servers if s.dead]
        if len(dead) == len(self.servers):
            raise SGLangServerError(f"sglang server {dead[0]} is dead: it failed again after its restarts")
        if all(s.stale or s.dead for s in self.servers):
            raise SGLangWeightSyncError(
                "every server was restarted since the last load_weights and holds its launch weights; "
                "call load_weights before generating"
            )
        down = [s.describe() for s in self.servers if s.down and not s.dead]
        raise SGLangServerError(
            f"no sglang server answers; {down[0]} did not come back within {self.config.startup_timeout_s:g}s"
        )

    def on_transport_failure(self, server: PooledServer, err: TransportError) -> None:
        """Count a failed request; a refused connection (nothing listens: the process is gone or
        restarting) or ``failure_threshold`` consecutive failures take the server down."""
        with server.lock:
            if server.down or server.dead:
                return
            if err.status == 503:
                return  # SGLang answers 503 for aborted or not-yet-servable requests: busy, not dead
            server.failures += 1
            if err.kind != "refused" and server.failures < self.config.failure_threshold:
                return
            self._take_down_locked(server, f"{server.failures} consecutive failure(s), last: {err}")

    def _take_down_locked(self, server: PooledServer, reason: str) -> None:
        server.down = True
        if server.recoveries >= self.config.max_restarts:
            server.dead = True
            logger.error(
                "sglang: server %s is dead (%s) after %d recoveries; going on without it",
                server.describe(),
                reason,
                server.recoveries,
            )
        else:
            logger.warning(
                "sglang: server %s is down (%s); routing around it until it answers again", server.describe(), reason
            )

    def mark_stale(self, server: PooledServer, reason: str) -> None:
        with server.lock:
            if not server.stale:
                server.stale = True
                logger.warning(
                    "sglang: %s is kept out of rollouts until the next weight update: %s", server.url, reason
                )

    def revive(self, *, wait: bool, weights_sent: bool) -> None:
        """Bring back down servers that answer again: a quick probe each (``wait`` false) or up to
        ``startup_timeout_s`` (``wait`` true; one that stays silent is dead). A server back after
        the trainer sent weights is stale until the next update."""
        down = [s for s in self.servers if s.down and not s.dead]
        if down:
            self.run_all(down, self._revive_one, wait, weights_sent)

    def _revive_one(self, server: PooledServer, wait: bool, weights_sent: bool) -> None:
        try:
            if not wait:
                resp = request(server.url, "GET", "/health", api_key=self.api_key, timeout=PROBE_TIMEOUT_S)
                if resp.status != 200:
                    return
            wait_healthy(server.url, api_key=self.api_key, timeout_s=self.config.startup_timeout_s)
            self._read_server_info(server)
        except TransportError:
            return  # the quick probe: still restarting
        except SGLangError as err:
            if wait:
                with server.lock:
                    server.dead = True
                logger.error("sglang: server %s did not come back: %s", server.describe(), err)
            return
        with server.lock:
            server.down = False
            server.failures = 0
            server.recoveries += 1
            if weights_sent:
                server.stale = True
        logger.warning(
            "sglang: server %s answers again (recovery %d)%s",
            server.url,
            server.recoveries,
            "; it holds its launch weights until the next weight update" if weights_sent else "",
        )

    # ------------------------------------------------------------------ HTTP

    def http(
        self, server: PooledServer, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> HttpResponse:
        try:
            return request(
                server.url, method, path, body, api_key=self.api_key, timeout=timeout or self.config.control_timeout_s
            )
        except TransportError as err:
            raise SGLangServerError(f"sglang server {server.describe()}: {err}") from None

    def control(self, server: PooledServer, path: str, body: Any = None, timeout: float | None = None) -> Any:
        return control_reply(server.url, path, self.http(server, "POST", path, {} if body is None else body, timeout))

    def flush(self, server: PooledServer) -> None:
        """/flush_cache, retried while it answers 400 (requests still running or waiting)."""
        deadline = time.monotonic() + self.config.flush_timeout_s
        delay = 0.02
        while True:
            resp = self.http(server, "POST", "/flush_cache")
            if resp.status != 400:
                control_reply(server.url, "/flush_cache", resp)
                return
            if time.monotonic() + delay > deadline:
                raise SGLangServerError(
                    f"sglang server {server.describe()} still had requests in flight after "
                    f"{self.config.flush_timeout_s:g}s of /flush_cache retries"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        return self._ctl.submit(fn, *args)

    def run_all(self, servers: Sequence[PooledServer], fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(server, *args)`` on every server at once; waits for all, then raises the first error."""
        futures = [self._ctl.submit(fn, s, *args) for s in servers]
        cf.wait(futures)
        return [f.result() for f in futures]


def control_reply(url: str, path: str, resp: HttpResponse) -> Any:
    """A control route's answer: its JSON (None for plain text), or one line naming the server and the
    route (rejected key, HTTP error, or ``success: false``)."""
    if resp.status in (401, 403):
        raise SGLangRequestError(
            f"sglang server {url} rejected the API key on {path} (HTTP {resp.status})", status=resp.status
        )
    if resp.status != 200:
        raise SGLangRequestError(
            f"sglang server {url}{path} answered HTTP {resp.status}: {error_message(resp)}", status=resp.status
        )
    try:
        data = resp.json()
    except SGLangResponseError:
        return None  # some control routes answer plain text
    if isinstance(data, dict) and data.get("success") is False:
        raise SGLangRequestError(f"sglang server {url}{path} refused: {data.get('message', data)}")
    return data


def _check_preferred_sampling(server: PooledServer, preferred: Any) -> None:
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
    unpinned = sorted(set(preferred) - set(NEUTRAL_SAMPLING) - REQUEST_SAMPLING_KEYS - OUTPUT_ONLY_SAMPLING_KEYS)
    if unpinned:
        raise SGLangServerError(
            f"sglang server {server.describe()} sets preferred_sampling_params {unpinned}, which the rollout "
            "requests do not override; they would change the sampling distribution (relaunch without them)"
        )
