"""Start N ranks of a function on this machine (the conversion tools, tests)."""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp

from stapo_megatron.config import ConfigError


def kill_tree(pid: int, timeout: float = 30.0) -> None:
    """SIGKILL a process and every descendant. torchrun starts each rank in a session of its own,
    so killing torchrun's process group would leave the ranks running."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    processes = [root, *root.children(recursive=True)]
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank, fn, world_size, port, env, errors, args):
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
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
