"""Start N ranks of a function on this machine (the conversion tools, tests)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import traceback

import torch.multiprocessing as mp

from stapo_megatron.config import ConfigError

logger = logging.getLogger(__name__)


def kill_tree(pid: int, timeout: float = 30.0, include_root: bool = True) -> None:
    """SIGKILL a process (unless ``include_root`` is false) and every descendant. torchrun starts
    each rank in a session of its own, so killing torchrun's process group would leave the ranks
    running."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    processes = [root, *root.children(recursive=True)] if include_root else root.children(recursive=True)
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=timeout)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when the thread that started it ends (Linux).

    ``parent`` is the pid of the process that started this one: if it died before the request was
    made (a fork racing a kill of its parent), no signal would ever come, so this process ends now.
    """
    import ctypes

    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def watch_launcher(pid: int, interval: float = 1.0) -> None:
    """End this rank, and every process it started, once the launcher ``pid`` is gone.

    A parent-death signal cannot do it: torchrun sits between the launcher and the ranks, and a
    launcher killed with SIGKILL cannot forward anything. A daemon thread polls instead.
    """
    import psutil

    def alive(launcher: psutil.Process) -> bool:
        try:  # a killed launcher whose parent has not reaped it yet is a zombie
            return launcher.is_running() and launcher.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def watch():
        try:
            launcher = psutil.Process(pid)
        except psutil.NoSuchProcess:
            launcher = None
        while launcher is not None and alive(launcher):
            time.sleep(interval)
        logger.warning("the launcher (pid %d) is gone; ending rank %s", pid, os.environ.get("RANK", "?"))
        kill_tree(os.getpid(), timeout=5.0, include_root=False)
        os._exit(1)

    threading.Thread(target=watch, name="stapo-launcher-watch", daemon=True).start()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` right now (another process may still take it first)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _rank_entry(rank, fn, world_size, port, env, errors, args):
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        fn(*args)
    except BaseException as err:
        errors.put((rank, isinstance(err, ConfigError), str(err), traceback.format_exc()))
        raise


def spawn_ranks(fn, world_size: int, *args, env: dict[str, str] | None = None) -> None:
    """Run ``fn(*args)`` in ``world_size`` fresh processes with torchrun's environment set.

    A :class:`ConfigError` raised on any rank is raised here with its one-line message; any
    other failure is raised as ``RuntimeError`` naming the rank, with the traceback attached.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", **(env or {})}
    try:
        mp.start_processes(
            _rank_entry,
            args=(fn, world_size, free_port(), env, errors, args),
            nprocs=world_size,
            start_method="spawn",
        )
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as failure:
        reports = []
        while not errors.empty():
            reports.append(errors.get())
        config_errors = [r for r in reports if r[1]]
        if config_errors:
            raise ConfigError(config_errors[0][2]) from None
        if reports:
            rank, _, message, tb = min(reports)
            raise RuntimeError(f"rank {rank} failed: {message}\n{tb}") from None
        raise RuntimeError(str(failure)) from None
