"""Starting, watching and stopping SGLang server processes.

Each launched server runs in its own session (process group), because ``sglang.launch_server`` forks
scheduler and detokenizer processes that hold the GPUs: stopping only the parent would leak them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.sglang_client import SGLangServerError, TransportError, request
from stapo_megatron.rollout.sglang_launch import KEY_ENV
from stapo_megatron.runtime.environment import shared_nccl_env
from stapo_megatron.runtime.launch import without_rank_env

logger = logging.getLogger(__name__)


def default_server_command() -> list[str]:
    """``sglang.launch_server`` started through the wrapper that hands it the key from the environment."""
    return [sys.executable, "-m", "stapo_megatron.rollout.sglang_launch", "sglang.launch_server"]


def build_launch_command(
    cfg: SGLangConfig, *, local_index: int, global_index: int, port: int, nccl_port: int, api_key: str
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start server ``local_index`` of its node (``global_index`` of
    the run, which picks its seed) (nothing is executed).

    The key travels in the environment (``KEY_ENV``), readable only by this user, never in argv.
    """
    argv = list(cfg.server_command) or default_server_command()
    argv += [
        "--model-path",
        cfg.model_path,
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--tp-size",
        str(cfg.tp_size),
        "--base-gpu-id",
        str(cfg.server_gpus(local_index)[0]),
        "--mem-fraction-static",
        repr(cfg.mem_fraction_static),
        "--random-seed",
        str(cfg.random_seed + global_index),
        "--dtype",
        cfg.dtype,
        # Fixed per server so that servers starting at the same moment cannot pick the same NCCL port.
        "--nccl-port",
        str(nccl_port),
        # The trainer sends token ids and reads token ids: the server's tokenizer is never needed.
        "--skip-tokenizer-init",
    ]
    if cfg.tokenizer_path:
        argv += ["--tokenizer-path", cfg.tokenizer_path]
    if cfg.context_length is not None:
        argv += ["--context-length", str(cfg.context_length)]
    if cfg.load_format:
        argv += ["--load-format", cfg.load_format]
    if cfg.colocated:
        # Without it /release_memory_occupation only logs a warning and the trainer would run out of memory.
        argv.append("--enable-memory-saver")
    if cfg.enable_weights_cpu_backup:
        argv.append("--enable-weights-cpu-backup")
    if cfg.deterministic_inference:
        argv.append("--enable-deterministic-inference")
    argv += list(cfg.extra_args)
    env = without_rank_env(os.environ)  # a server is not one of the trainer's ranks
    env.update(shared_nccl_env())  # as the trainer's ranks have them, whoever started this process
    env.update(cfg.env)
    env[KEY_ENV] = api_key
    return argv, env


def connect_host(host: str) -> str:
    """Where a client reaches a server listening on ``host`` (wildcard addresses mean this machine)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def url_for(host: str, port: int) -> str:
    host = connect_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def log_tail(path: Path | None, lines: int = 5) -> str:
    if path is None or not path.is_file():
        return ""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4096))
        tail = f.read().decode("utf-8", errors="replace").strip().splitlines()[-lines:]
    return " | ".join(line.strip() for line in tail if line.strip())


class ServerProcess:
    """One launched server: its process group and its log file."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, *, cwd: str | None = None):
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.cwd = cwd
        self.popen: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # 0600: a server's log holds its request errors and SGLang's settings; other users have no business there.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with open(fd, "ab") as log:
            os.fchmod(log.fileno(), 0o600)  # also a log left with wider permissions by an earlier run
            header = f"=== start {self.starts + 1} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(self.argv)}\n"
            log.write(header.encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
                close_fds=True,
            )
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def returncode(self) -> int | None:
        """None while the server's main process runs, else its exit status."""
        return None if self.popen is None else self.popen.poll()

    def terminate(self, grace_s: float) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``grace_s``."""
        if self.popen is None:
            return
        pgid = self.popen.pid  # start_new_session made the server the leader of its own group
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        # Children (schedulers) can outlive the leader, so wait on the group, not just the leader.
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        kill_deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < kill_deadline:
            time.sleep(0.05)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs. Zombies do not count: orphaned children are
    reaped by PID 1, which in containers may be slow or never happen."""
    if os.path.isdir("/proc"):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", encoding="utf-8", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
            except (OSError, IndexError):
                continue
            if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def terminate_all(processes: Sequence[ServerProcess], grace_s: float) -> None:
    """Stop several servers at once (each gets the full grace period)."""
    for proc in processes:
        if proc.popen is not None:
            _signal_group(proc.popen.pid, signal.SIGTERM)
    for proc in processes:
        proc.terminate(grace_s)


def wait_healthy(
    url: str,
    *,
    api_key: str | None,
    timeout_s: float,
    process: ServerProcess | None = None,
    poll_s: float = 0.05,
) -> None:
    """Block until ``/health`` and then ``/health_generate`` answer 200 (the latter runs a real 1-token step)."""
    deadline = time.monotonic() + timeout_s
    where = f"{url} (log: {process.log_path})" if process else url
    delay = poll_s
    for path in ("/health", "/health_generate"):
        while True:
            if process is not None and process.returncode() is not None:
                tail = log_tail(process.log_path)
                raise SGLangServerError(
                    f"sglang server {where} exited with status {process.returncode()} before becoming healthy"
                    + (f"; log ends: {tail}" if tail else "")
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SGLangServerError(f"sglang server {where} did not answer {path} with 200 within {timeout_s:g}s")
            try:
                resp = request(url, "GET", path, api_key=api_key, timeout=min(max(remaining, 0.1), 60.0))
                if resp.status == 200:
                    break
                if resp.status == 401:
                    raise SGLangServerError(f"sglang server {where} rejected the API key on {path} (HTTP 401)")
            except TransportError:
                pass  # still starting (connection refused) or busy (503)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, 1.0)
