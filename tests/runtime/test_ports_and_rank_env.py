"""Ports that nothing else takes between choosing and binding, and servers that are not ranks.

A port handed out by ``bind(0)`` and bound later by another process can be taken in between by any
``bind(0)`` or outgoing connection on the machine; a server restarted on its port can find it taken
by a connection made while it was down. Server ports are therefore reserved outside the kernel's
ephemeral range and locked host-wide; the ranks' rendezvous store is served by the process that
starts them, bound at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.sglang_server import build_launch_command
from stapo_megatron.runtime.environment import SHARED_NCCL_ENV, rank_launch_env
from stapo_megatron.runtime.launch import PORT_LOCK_DIR, RANK_ENV, reservable_ports, reserve_port


def _ephemeral_range() -> tuple[int, int]:
    low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
    return int(low), int(high)


def test_reserved_ports_are_outside_the_ephemeral_range_bindable_and_exclusive_across_processes():
    low, high = _ephemeral_range()
    assert reservable_ports() and not any(low <= port <= high for port in reservable_ports())
    mine = [reserve_port() for _ in range(40)]
    ports = [r.port for r in mine]
    assert len(set(ports)) == 40 and not any(low <= port <= high for port in ports)
    try:
        for port in ports[:5]:  # free to bind now (the server binds it next)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
        # Another process reserving many ports at the same time never gets one of these.
        script = textwrap.dedent(
            """
            import json
            from stapo_megatron.runtime.launch import reserve_port
            print(json.dumps([reserve_port().port for _ in range(200)]))
            """
        )
        other = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, check=True).stdout)
        assert len(set(other)) == 200 and not set(other) & set(ports)
        # The lock is held while reserved, and dropped by release().
        fd = os.open(PORT_LOCK_DIR / f"{ports[0]}.lock", os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mine[0].release()
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        for reservation in mine:
            reservation.release()


def test_a_port_someone_listens_on_is_never_reserved(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", reservable_ports()[0]))
        listener.listen()
        taken = listener.getsockname()[1]
        monkeypatch.setattr("stapo_megatron.runtime.launch.reservable_ports", lambda: [taken, taken + 1])
        reservation = reserve_port()
        try:
            assert reservation.port == taken + 1
        finally:
            reservation.release()


def test_a_server_started_by_a_torchrun_rank_can_host_its_own_rendezvous(monkeypatch):
    """torchrun gives its ranks TORCHELASTIC_USE_AGENT_STORE=True; SGLang's TP workers rendezvous over
    tcp://, where torch reads that variable, and rank 0 of a server that inherited it would wait for a
    store nobody serves. The launch environment is the rank's less torchrun's variables."""
    for name in RANK_ENV:
        monkeypatch.setenv(name, "0" if name != "MASTER_ADDR" else "127.0.0.1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("STAPO_KEPT", "yes")
    cfg = SGLangConfig(model_path="m", env={"FROM_CONFIG": "1"})
    port = reserve_port()
    nccl_port = reserve_port()
    try:
        argv, env = build_launch_command(
            cfg, local_index=0, global_index=0, port=port.port, nccl_port=nccl_port.port, api_key="k"
        )
        assert not [name for name in env if name in RANK_ENV or name.startswith("TORCHELASTIC_")]
        assert env["STAPO_KEPT"] == "yes" and env["FROM_CONFIG"] == "1"
        # the weight-update group's NCCL settings: the same on the server as on the trainer's ranks
        assert {k: env[k] for k in SHARED_NCCL_ENV} == {k: rank_launch_env()[k] for k in SHARED_NCCL_ENV}
        assert f"--nccl-port {nccl_port.port}" in " ".join(argv)
        nccl_port.release()  # what SGLang's rank 0 does with it: host the store of its TP group
        script = textwrap.dedent(
            f"""
            import datetime, torch.distributed as dist
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{nccl_port.port}", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=20))
            print("joined", dist.get_world_size())
            """
        )
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "joined 1", done.stderr[-2000:]
    finally:
        port.release()
        nccl_port.release()


def test_trainer_ranks_and_servers_share_the_weight_update_groups_nccl_settings(monkeypatch):
    """SGLang sets NCCL_CUMEM_ENABLE=0 and NCCL_NVLS_ENABLE=0 for itself unless they are set; the ranks
    that join its weight-update groups get the same, and a value the user exported reaches both."""
    cfg = SGLangConfig(model_path="m")
    for exported, expected in (
        ({}, {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}),
        ({"NCCL_NVLS_ENABLE": "1"}, {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "1"}),
    ):
        for name in SHARED_NCCL_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in exported.items():
            monkeypatch.setenv(name, value)
        ranks = rank_launch_env()
        _, server = build_launch_command(cfg, local_index=0, global_index=0, port=1, nccl_port=2, api_key="k")
        assert ranks == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", **expected}
        assert {k: server[k] for k in expected} == expected
