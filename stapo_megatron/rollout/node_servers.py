"""The SGLang servers of a job: each node's local rank 0 launches and owns its node's servers.

* :class:`NodeServers` starts one node's servers, and a supervisor thread restarts a server whose
  process exits (only the node that started a process can see it exit and restart it; the
  controller on another node sees a refused connection);
* :func:`start_job_servers` runs on every rank: the per-run API key goes from global rank 0 to
  all ranks over ``ctx.cpu_group``; the node leaders launch; their endpoint lists are gathered over
  ``ctx.cpu_group`` so every rank holds the same ``list[ServerEndpoint]``.

Layouts (``rollout.sglang.placement``): ``colocated`` puts ``LOCAL_WORLD_SIZE / tp_size`` servers on
the trainer's GPUs of every node; ``disaggregated`` attaches to ``urls``, or launches ``num_servers``
on every node from ``base_gpu_id`` (GPUs the trainer does not use).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import secrets
import threading
from pathlib import Path

from stapo_megatron.config.core import ConfigError
from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.endpoints import ServerEndpoint
from stapo_megatron.rollout.sglang_client import SGLangServerError
from stapo_megatron.rollout.sglang_server import (
    ServerProcess,
    build_launch_command,
    connect_host,
    terminate_all,
    url_for,
    wait_healthy,
)
from stapo_megatron.rollout.sglang_weights import local_address_towards
from stapo_megatron.runtime.launch import PortReservation, reserve_port

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def resolve_api_key(cfg: SGLangConfig) -> str | None:
    """The configured key (field, then environment); for launched servers a fresh per-run secret
    when none is configured, so the weight-update routes are never open on the network."""
    key = cfg.api_key or os.environ.get(cfg.api_key_env) or None
    if key is None and cfg.launches:
        key = secrets.token_urlsafe(32)
    return key


class NodeServers:
    """The servers one node launches, owns and restarts.

    ``first_index`` is the global index of this node's first server (seeds differ across the
    run); ``advertise_host`` is the address other nodes reach them at.
    """

    def __init__(
        self,
        cfg: SGLangConfig,
        *,
        node: int,
        count: int,
        first_index: int,
        api_key: str,
        log_dir: Path,
        advertise_host: str,
    ):
        self.cfg = cfg
        self.node = node
        self.count = count
        self.first_index = first_index
        self.log_dir = log_dir
        self._api_key = api_key
        self._advertise_host = advertise_host
        self.processes: list[ServerProcess] = []
        self.urls: list[str] = []
        self.restarts: list[int] = []
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._ports: list[PortReservation] = []
        self._closed = False
        atexit.register(self.shutdown)  # launched servers hold GPUs and must not outlive this process

    def start(self) -> list[ServerEndpoint]:
        """Launch every server, wait until each generates, start the supervisor; the endpoints carry
        index -1 until :func:`start_job_servers` numbers the run's list."""
        try:
            self._launch()
            for process, url in zip(self.processes, self.urls):
                wait_healthy(url, api_key=self._api_key, timeout_s=self.cfg.startup_timeout_s, process=process)
        except BaseException:
            self.shutdown()
            raise
        self._supervisor = threading.Thread(
            target=self._supervise, name=f"sglang-supervisor-node{self.node}", daemon=True
        )
        self._supervisor.start()
        return [
            ServerEndpoint(
                index=-1,
                url=url,
                node=self.node,
                tp_size=self.cfg.tp_size,
                gpu_ids=self._shared_gpus(i),
                log_path=str(process.log_path),
            )
            for i, (process, url) in enumerate(zip(self.processes, self.urls))
        ]

    def _shared_gpus(self, local_index: int) -> tuple[int, ...]:
        """The trainer GPUs server ``local_index`` runs on: colocated placement only (disaggregated
        servers run on GPUs no trainer rank uses)."""
        return self.cfg.server_gpus(local_index) if self.cfg.colocated else ()

    def _reserve_port(self) -> int:
        """A port for a server, held until shutdown: a restarted server comes back on the same one
        (:class:`~stapo_megatron.runtime.launch.PortReservation`)."""
        reservation = reserve_port(self.cfg.host or "0.0.0.0")
        self._ports.append(reservation)
        return reservation.port

    def _launch(self) -> None:
        cfg = self.cfg
        for i in range(self.count):
            port = cfg.base_port + i if cfg.base_port else self._reserve_port()
            argv, env = build_launch_command(
                cfg,
                local_index=i,
                global_index=self.first_index + i,
                port=port,
                nccl_port=self._reserve_port(),
                api_key=self._api_key,
            )
            process = ServerProcess(argv, env, self.log_dir / f"server-{i}.log")
            try:
                process.start()
            except OSError as err:
                raise SGLangServerError(
                    f"cannot start sglang server {i} of node {self.node} with {argv[0]}: {err}"
                ) from None
            self.processes.append(process)
            self.restarts.append(0)
            self.urls.append(url_for(self._advertise_host, port))
            logger.info(
                "sglang: node %d launched server %d (pid %d) at %s, log %s",
                self.node,
                i,
                process.pid,
                self.urls[-1],
                process.log_path,
            )

    def _supervise(self) -> None:
        """Restart a server whose process exited, up to ``max_restarts`` times each. The controller
        waits for it to answer again and keeps it out of rollouts until it holds current weights."""
        while not self._stop.wait(self.cfg.supervise_interval_s):
            for i, process in enumerate(self.processes):
                code = process.returncode()
                if code is None or self._stop.is_set():
                    continue
                if self.restarts[i] >= self.cfg.max_restarts:
                    continue  # given up: the controller marks it dead when it next fails
                self.restarts[i] += 1
                logger.warning(
                    "sglang: node %d server %s exited with status %s; restart %d/%d (log %s)",
                    self.node,
                    self.urls[i],
                    code,
                    self.restarts[i],
                    self.cfg.max_restarts,
                    process.log_path,
                )
                try:
                    process.terminate(self.cfg.shutdown_grace_s)  # reap schedulers that outlived the parent
                    process.start()
                except OSError as err:
                    logger.error("sglang: restarting %s failed: %s", self.urls[i], err)

    def status(self) -> list[dict]:
        return [
            {
                "url": url,
                "pid": process.pid,
                "restarts": restarts,
                "log_file": str(process.log_path),
                "running": process.returncode() is None,
            }
            for url, process, restarts in zip(self.urls, self.processes, self.restarts)
        ]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self._stop.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join()
        if self.processes:
            logger.info("sglang: node %d stopping %d server(s)", self.node, len(self.processes))
            terminate_all(self.processes, self.cfg.shutdown_grace_s)
        for reservation in self._ports:
            reservation.release()


@dataclasses.dataclass
class JobServers:
    """What :func:`start_job_servers` gives each rank."""

    endpoints: list[ServerEndpoint]  # the same list on every rank
    api_key: str | None
    owned: NodeServers | None  # this rank's node's servers, on its node leader only

    def shutdown(self) -> None:
        if self.owned is not None:
            self.owned.shutdown()


def local_world_size(world_size: int) -> int:
    """Ranks (GPUs) per node, from the launcher (torchrun sets LOCAL_WORLD_SIZE)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        if world_size > 1:
            raise ConfigError("LOCAL_WORLD_SIZE: not set; start multi-rank jobs with torchrun (or stapo train)")
        return 1
    size = int(value)
    if size < 1 or world_size % size:
        raise ConfigError(f"LOCAL_WORLD_SIZE: {size} does not divide the world size {world_size}")
    return size


def plan_node_servers(cfg: SGLangConfig, gpus_per_node: int, nodes: int) -> list[int]:
    """How many servers each node launches; raises ConfigError for a layout that cannot work."""
    if not cfg.launches:
        return [0] * nodes
    if cfg.placement == "colocated":
        if gpus_per_node % cfg.tp_size:
            raise ConfigError(
                f"rollout.sglang.tp_size: {cfg.tp_size} does not divide the {gpus_per_node} GPUs per "
                "node of colocated placement"
            )
        return [gpus_per_node // cfg.tp_size] * nodes
    return [cfg.num_servers] * nodes  # beside the trainer ranks of every node


def advertised_host(cfg: SGLangConfig, nodes: int) -> str:
    """The address other ranks reach this node's servers at."""
    host = cfg.host or "0.0.0.0"
    if host in ("0.0.0.0", "::"):
        # Listening everywhere: advertise the address on the route to the job's master.
        return local_address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1")) if nodes > 1 else connect_host(host)
    if nodes > 1 and host in LOOPBACK_HOSTS:
        raise ConfigError(
            f"rollout.sglang.host: {host} is reachable only from its own node; servers of a "
            f"{nodes}-node job must listen on an address the controller reaches (e.g. 0.0.0.0)"
        )
    return host


def start_job_servers(ctx, cfg: SGLangConfig, run_dir: Path) -> JobServers:
    """Every rank calls this once: node leaders launch their node's servers (``placement``) and
    every rank returns the run's endpoints, numbered in node order, and the API key.

    A launch failure on any node is raised on every rank (after the others stopped theirs), so no
    rank waits in a collective for a node that gave up.
    """
    gpus_per_node = local_world_size(ctx.world_size)
    nodes = ctx.world_size // gpus_per_node
    node = ctx.rank // gpus_per_node
    counts = plan_node_servers(cfg, gpus_per_node, nodes)
    host = advertised_host(cfg, nodes) if any(counts) else ""
    # The key crosses ranks over the gloo group only: never a command line, a file or the environment of others.
    api_key = ctx.broadcast_object(resolve_api_key(cfg) if ctx.rank == 0 else None, src=0)
    owned: NodeServers | None = None
    launched: list[ServerEndpoint] | str = []
    if ctx.local_rank == 0 and counts[node]:
        log_root = Path(cfg.log_dir) if cfg.log_dir else Path(run_dir) / "sglang"
        owned = NodeServers(
            cfg,
            node=node,
            count=counts[node],
            first_index=sum(counts[:node]),
            api_key=api_key,
            log_dir=log_root / f"node{node}",
            advertise_host=host,
        )
        try:
            launched = owned.start()
        except (SGLangServerError, OSError) as err:
            launched, owned = f"node {node}: {err}", None
    gathered = ctx.all_gather_object(launched)
    failures = [entry for entry in gathered if isinstance(entry, str)]
    if failures:
        if owned is not None:
            owned.shutdown()
        raise SGLangServerError(f"sglang servers failed to start on {failures[0]}")
    if cfg.launches:
        found = [endpoint for entry in gathered for endpoint in entry]
    else:
        found = [ServerEndpoint(index=-1, url=url.rstrip("/"), node=-1, tp_size=cfg.tp_size) for url in cfg.urls]
    endpoints = [dataclasses.replace(endpoint, index=i) for i, endpoint in enumerate(found)]
    return JobServers(endpoints, api_key, owned)
