"""Start N ranks of a function on this machine (the conversion tools, tests)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from stapo_megatron.config import ConfigError
from stapo_megatron.runtime.environment import rank_launch_env

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


# What torchrun sets for each of its workers (torch.distributed.elastic's local agent). A process a
# rank starts that is not one of its ranks must not inherit it: SGLang's own tcp:// rendezvous asks
# torch whether an elastic agent hosts the store (TORCHELASTIC_USE_AGENT_STORE), and a server that
# inherited "True" from its rank would wait for a store nobody serves.
RANK_ENV = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def without_rank_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less what makes a process one of torchrun's ranks."""
    return {k: v for k, v in env.items() if k not in RANK_ENV and not k.startswith("TORCHELASTIC_")}


def rendezvous_store(world_size: int, host: str = "127.0.0.1") -> dist.TCPStore:
    """A TCPStore this process serves for ``world_size`` ranks it starts, as torchrun's agent does.

    It listens on a port the kernel gives it at bind time, so no other process can take the port
    between choosing and binding it (a free port handed to rank 0 to bind later can be taken). The
    ranks get its port as MASTER_PORT and ``TORCHELASTIC_USE_AGENT_STORE=True``
    (:func:`agent_store_env`), so every rank, rank 0 included, joins it as a client.
    """
    return dist.TCPStore(host, 0, world_size, True, wait_for_workers=False)


def agent_store_env(store: dist.TCPStore, host: str = "127.0.0.1") -> dict[str, str]:
    return {"MASTER_ADDR": host, "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


_served_stores: list[dist.TCPStore] = []  # the stores of this process's own one-rank worlds, kept alive


def become_single_rank() -> None:
    """torchrun's environment for a world of this process alone, its store served by this process
    (:func:`rendezvous_store`) unless MASTER_PORT names one already."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        _served_stores.append(rendezvous_store(1))
        os.environ.update(agent_store_env(_served_stores[-1]))


PORT_LOCK_DIR = Path(tempfile.gettempdir()) / "stapo_megatron-ports"


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def reservable_ports() -> list[int]:
    """Ports outside the kernel's ephemeral range (``ip_local_port_range``), from which it picks
    for every ``bind(0)`` and outgoing connection of every process: a port chosen from outside it
    can only be taken by a process that names it."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return [*range(max(1024, low - 12000), low), *range(high + 1, 65536)]


class PortReservation:
    """A TCP port held for a server this process starts later, and restarts on the same port.

    Outside the ephemeral range (so a restart finds it free again: no connection takes it while its
    server is down), locked host-wide against every other stapo process (an exclusive ``flock`` of
    ``<tmp>/stapo_megatron-ports/<port>.lock``, held until :meth:`release`), and free to bind when
    reserved (a process that binds it by number later is the one race left).
    """

    def __init__(self, port: int, lock_fd: int):
        self.port = port
        self._lock_fd: int | None = lock_fd

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the lock
            self._lock_fd = None


def reserve_port(host: str = "127.0.0.1") -> PortReservation:
    """A :class:`PortReservation` of a random reservable port that ``host`` can bind now."""
    PORT_LOCK_DIR.mkdir(mode=0o1777, parents=True, exist_ok=True)
    candidates = reservable_ports()
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:512]:
        fd = os.open(PORT_LOCK_DIR / f"{port}.lock", os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # another stapo process holds it
            continue
        if _bindable(host, port):
            return PortReservation(port, fd)
        os.close(fd)
    raise OSError(f"no free TCP port to reserve on {host} outside the ephemeral range (512 tried)")


def _rank_entry(rank, fn, world_size, store_env, env, errors, args):
    # A fork server's child has the server's environment, not its caller's: take the caller's whole.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        **store_env,
    )
    try:
        fn(*args)
    except BaseException as err:
        errors.put((rank, isinstance(err, ConfigError), str(err), traceback.format_exc()))
        raise


# What a rank imports first, imported once by the fork server that starts ranks on a machine without
# CUDA (its CPU layer installed first, as a rank installs it): a rank forked from it starts in a
# fraction of a second instead of importing Megatron anew (4 to 6 s of CPU per rank).
CPU_RANK_PRELOAD = "stapo_megatron.runtime.cpu_rank_imports"


def _rank_start_method() -> str:
    """Spawn on a GPU machine (a process that imported Transformer Engine is not forked); without
    CUDA, a fork server that has imported Megatron once for every rank this process starts."""
    from stapo_megatron.runtime.distributed import accelerator_available

    if accelerator_available():
        return "spawn"
    mp.set_forkserver_preload([CPU_RANK_PRELOAD])  # taken when the server starts, at the first call
    return "forkserver"


def ranks_on_the_cpu(world_size: int) -> bool:
    """Whether ``world_size`` ranks must run on the CPU of a host with CUDA: it has fewer GPUs than
    ranks (each rank takes the GPU of its LOCAL_RANK, and NCCL refuses two ranks on one GPU)."""
    from stapo_megatron.runtime.distributed import accelerator_available

    if not accelerator_available():
        return False
    import torch

    return world_size > torch.cuda.device_count()


@contextlib.contextmanager
def _gpus_hidden_from_children():
    """Processes started meanwhile see no GPU (CUDA reads the variable as a process starts)."""
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


def spawn_ranks(fn, world_size: int, *args, env: dict[str, str] | None = None) -> None:
    """Run ``fn(*args)`` in ``world_size`` fresh processes with this process's environment and
    torchrun's set (``env`` on top). On a host with fewer GPUs than ranks, every rank runs on the
    CPU (gloo, as on a host without CUDA), said once here: a conversion at TP 8 x PP 2 on an
    8-GPU host converts rather than failing on a GPU the host does not have.

    A :class:`ConfigError` raised on any rank is raised here with its one-line message; any
    other failure is raised as ``RuntimeError`` naming the rank, with the traceback attached.
    """
    on_cpu = ranks_on_the_cpu(world_size)
    start_method = _rank_start_method()
    ctx = mp.get_context(start_method)
    errors = ctx.SimpleQueue()
    env = {**os.environ, **rank_launch_env(), **(env or {})}
    if on_cpu:
        import torch

        logger.warning(
            "%d ranks, %d GPUs on this host: the ranks run on the CPU", world_size, torch.cuda.device_count()
        )
        env["CUDA_VISIBLE_DEVICES"] = ""
    store = rendezvous_store(world_size)
    try:
        with _gpus_hidden_from_children() if on_cpu else contextlib.nullcontext():
            mp.start_processes(
                _rank_entry,
                args=(fn, world_size, agent_store_env(store), env, errors, args),
                nprocs=world_size,
                start_method=start_method,
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
