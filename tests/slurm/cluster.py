"""A real single-node SLURM cluster on localhost, with accounting, for end-to-end tests.

    python tests/slurm/cluster.py install        # apt-get install the Debian packages (as root)
    python tests/slurm/cluster.py start DIR      # start the daemons; prints `export SLURM_CONF=...`
    python tests/slurm/cluster.py stop DIR       # cancel jobs, stop every daemon started in DIR

Debian 12's slurm-wlm (22.05), munge, slurmdbd and MariaDB. NeMo-Run reads job states only
through sacct, so accounting is on: slurmdbd backed by MariaDB. Everything lives in DIR (configs,
state, spool, logs, pid files, the munge socket and key, the database) and every daemon listens
on a port reserved for it (outside the ephemeral range, locked host-wide), so a test cluster
shares nothing with another one on the same machine. Start order: munged -> mariadbd -> slurmdbd
-> slurmctld -> slurmd, each waited for; stop is the reverse, by pid file. Needs root
(SlurmUser=root, the daemons' users). CPU only: the node has this machine's CPUs, and no GPUs
(gres) are configured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from stapo_megatron.runtime.launch import reserve_port

PACKAGES = ["slurm-wlm", "munge", "slurmdbd", "mariadb-server"]
BINARIES = [
    "munged",
    "mariadbd",
    "mariadb-install-db",
    "mariadb",
    "slurmdbd",
    "slurmctld",
    "slurmd",
    "sbatch",
    "sacct",
    "sacctmgr",
]
PARTITION = "debug"
DB_PASSWORD = "stapo-test"
REQUEUE_HOLD_S = 10
# stop order: the reverse of start
DAEMONS = ["slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged"]


class ClusterError(RuntimeError):
    pass


def which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(Path(d) / name) for d in ("/usr/sbin", "/usr/bin", "/sbin") if (Path(d) / name).exists()), None
    )


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if which(b) is None]


def install() -> None:
    """apt-get install the packages (update the index first if the plain install fails)."""
    if not missing_binaries():
        return
    if os.geteuid() != 0:
        raise ClusterError("installing slurm-wlm needs root")
    if shutil.which("apt-get") is None:
        raise ClusterError("apt-get is not available: cannot install " + " ".join(PACKAGES))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    if subprocess.run(command, env=env, capture_output=True, check=False).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=False)
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ClusterError(
                "apt-get install " + " ".join(PACKAGES) + " failed: " + done.stderr.strip().splitlines()[-1]
            )
    still = missing_binaries()
    if still:
        raise ClusterError("installed, but these are missing: " + ", ".join(still))


def wait_for(what: str, check, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    tail = ""
    if log is not None and log.exists():
        tail = " | " + " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
    raise ClusterError(f"{what} did not come up within {timeout:.0f} s{tail}")


class Cluster:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.conf = self.root / "etc" / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        # daemons that stay our children (MariaDB): waited for, or they would linger as zombies
        self._children: dict[str, subprocess.Popen] = {}

    # ---- paths and environment ----

    def path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *command: str, check: bool = False, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    # ---- configuration ----

    def _ensure_host_resolves(self) -> None:
        try:
            socket.gethostbyname(self.host)
        except OSError:
            with open("/etc/hosts", "a", encoding="utf-8") as f:
                f.write(f"127.0.0.1 {self.host}\n")

    def _write_configs(self, ports: dict[str, int]) -> None:
        for d in ("etc", "state", "spool", "log", "run", "munge", "mysql"):
            self.path(d).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 1
        with open("/proc/meminfo", encoding="utf-8") as f:
            mem_mb = int(f.readline().split()[1]) // 1024
        munge_socket = self.path("munge", "munge.socket")
        auth = f"AuthInfo=socket={munge_socket}"
        cluster = f"stapo{os.getpid()}"
        self.conf.write_text(
            "\n".join(
                [
                    f"ClusterName={cluster}",
                    f"SlurmctldHost={self.host}(127.0.0.1)",
                    f"SlurmctldPort={ports['slurmctld']}",
                    f"SlurmdPort={ports['slurmd']}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    # cred_expire also holds a requeued job back (default 120 s); a test cluster's queue need not wait
                    f"{auth},cred_expire={REQUEUE_HOLD_S}",
                    # container-friendly: no cgroups, no CPU binding, no accounting samplers
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "MpiDefault=none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "ReturnToService=2",
                    f"StateSaveLocation={self.path('state')}",
                    f"SlurmdSpoolDir={self.path('spool')}",
                    f"SlurmctldPidFile={self.path('run', 'slurmctld.pid')}",
                    f"SlurmdPidFile={self.path('run', 'slurmd.pid')}",
                    f"SlurmctldLogFile={self.path('log', 'slurmctld.log')}",
                    f"SlurmdLogFile={self.path('log', 'slurmd.log')}",
                    "AccountingStorageType=accounting_storage/slurmdbd",
                    "AccountingStorageHost=localhost",
                    f"AccountingStoragePort={ports['slurmdbd']}",
                    # clients authenticate to slurmdbd through the munge socket named here, not AuthInfo's
                    f"AccountingStoragePass={munge_socket}",
                    "InactiveLimit=0",
                    "KillWait=5",
                    "MinJobAge=300",
                    "SchedulerType=sched/backfill",
                    # a requeued job, its cred_expire hold over, starts at the next scheduling pass: every 2 s
                    # here, not every 30 s (backfill) or 60 s (main loop): requeue to restart took 13-61 s, now 12 s
                    "SchedulerParameters=bf_interval=2,sched_interval=2",
                    f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={int(mem_mb * 0.9)} State=UNKNOWN",
                    f"PartitionName={PARTITION} Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        dbd = self.path("etc", "slurmdbd.conf")
        dbd.write_text(
            "\n".join(
                [
                    "AuthType=auth/munge",
                    auth,
                    "DbdHost=localhost",
                    f"DbdPort={ports['slurmdbd']}",
                    "SlurmUser=root",
                    f"LogFile={self.path('log', 'slurmdbd.log')}",
                    f"PidFile={self.path('run', 'slurmdbd.pid')}",
                    "StorageType=accounting_storage/mysql",
                    "StorageHost=127.0.0.1",
                    f"StoragePort={ports['mysql']}",
                    "StorageUser=slurm",
                    f"StoragePass={DB_PASSWORD}",
                    f"StorageLoc=slurm_acct_db_{cluster}",
                    "",
                ]
            )
        )
        dbd.chmod(0o600)  # slurmdbd refuses a config others can read (it holds the password)

    # ---- daemons ----

    def _start_munge(self) -> None:
        key = self.path("munge", "munge.key")
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        # munged refuses to run as root without --force; everything else is in our directory
        subprocess.run(
            [
                which("munged"),
                "--force",
                f"--socket={self.path('munge', 'munge.socket')}",
                f"--key-file={key}",
                f"--pid-file={self.path('run', 'munged.pid')}",
                f"--log-file={self.path('log', 'munged.log')}",
                f"--seed-file={self.path('munge', 'munge.seed')}",
            ],
            check=True,
            capture_output=True,
        )
        wait_for("munged", lambda: self.path("munge", "munge.socket").exists(), 10, self.path("log", "munged.log"))

    def _mysql(self, sql: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [which("mariadb"), "--no-defaults", f"--socket={self.path('mysql.sock')}", "-u", "root", "-e", sql],
            capture_output=True,
            text=True,
            check=False,
        )

    def _start_mariadb(self, port: int) -> None:
        datadir = self.path("mysql")
        if not (datadir / "mysql").exists():
            done = subprocess.run(
                [
                    which("mariadb-install-db"),
                    "--no-defaults",
                    f"--datadir={datadir}",
                    "--user=root",
                    "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode:
                raise ClusterError(
                    "mariadb-install-db failed: " + (done.stderr or done.stdout).strip().splitlines()[-1]
                )
        with open(self.path("log", "mariadb.log"), "ab") as log:  # the daemon keeps its own copy of the descriptor
            self._children["mariadbd"] = subprocess.Popen(
                [
                    which("mariadbd"),
                    "--no-defaults",
                    f"--datadir={datadir}",
                    "--user=root",
                    f"--port={port}",
                    "--bind-address=127.0.0.1",
                    f"--socket={self.path('mysql.sock')}",
                    f"--pid-file={self.path('run', 'mariadbd.pid')}",
                    "--skip-log-bin",
                    "--innodb-buffer-pool-size=64M",
                    # a throwaway database: stop without flushing it
                    "--innodb-fast-shutdown=2",
                ],
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        wait_for("mariadbd", lambda: self._mysql("SELECT 1").returncode == 0, 60, self.path("log", "mariadb.log"))
        done = self._mysql(
            f"CREATE USER IF NOT EXISTS 'slurm'@'%' IDENTIFIED BY '{DB_PASSWORD}'; "
            f"CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '{DB_PASSWORD}'; "
            "GRANT ALL ON *.* TO 'slurm'@'%'; GRANT ALL ON *.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
        )
        if done.returncode:
            raise ClusterError("creating the slurm database user failed: " + done.stderr.strip())

    def _start_daemon(self, name: str, *args: str) -> None:
        done = subprocess.run([which(name), *args], env=self.env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise ClusterError(f"{name} failed to start: {(done.stderr or done.stdout).strip()}")

    def start(self) -> None:
        if os.geteuid() != 0:
            raise ClusterError("the test cluster runs its daemons as root")
        missing = missing_binaries()
        if missing:
            raise ClusterError("not installed: " + ", ".join(missing) + " (python tests/slurm/cluster.py install)")
        self.root.mkdir(parents=True, exist_ok=True)
        self._ensure_host_resolves()
        # Held until the daemons listen: a port from bind(0), bound by a daemon seconds later, could
        # be taken meanwhile by any process's bind(0) or outgoing connection (reserve_port).
        reservations = {name: reserve_port() for name in ("slurmctld", "slurmd", "slurmdbd", "mysql")}
        ports = {name: reservation.port for name, reservation in reservations.items()}
        self._write_configs(ports)
        try:
            self._start_munge()
            self._start_mariadb(ports["mysql"])
            self._start_daemon("slurmdbd")
            wait_for(
                "slurmdbd",
                lambda: self.run("sacctmgr", "-n", "show", "cluster").returncode == 0,
                60,
                self.path("log", "slurmdbd.log"),
            )
            self._start_daemon("slurmctld")
            wait_for(
                "slurmctld",
                lambda: self.run("scontrol", "ping").returncode == 0 and "UP" in self.run("scontrol", "ping").stdout,
                30,
                self.path("log", "slurmctld.log"),
            )
            self._start_daemon("slurmd")
            wait_for(
                "slurmd",
                lambda: self.run("sinfo", "-h", "-o", "%T").stdout.strip().startswith("idle"),
                60,
                self.path("log", "slurmd.log"),
            )
        except BaseException:
            self.stop()
            raise
        finally:
            for reservation in reservations.values():
                reservation.release()

    def _alive(self, daemon: str, pid: int) -> bool:
        child = self._children.get(daemon)
        if child is not None and child.pid == pid:
            return child.poll() is None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _pid(self, daemon: str) -> int | None:
        try:
            return int(self.path("run", f"{daemon}.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this directory started (by their pid files)."""
        if self.conf.exists() and self._pid("slurmctld"):
            try:
                self.run("scancel", "--full", "--user=root", timeout=10)
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    if not self.run("squeue", "-h", timeout=5).stdout.strip():
                        break
                except subprocess.TimeoutExpired:
                    break
                time.sleep(0.5)
        for daemon in DAEMONS:
            pid = self._pid(daemon)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self._alive(daemon, pid):
                time.sleep(0.1)
            if self._alive(daemon, pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if daemon in self._children:
                    self._children[daemon].wait(timeout=10)
            self.path("run", f"{daemon}.pid").unlink(missing_ok=True)

    def __enter__(self) -> Cluster:  # noqa: PYI034 (typing.Self needs Python 3.11)
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["install", "start", "stop"])
    parser.add_argument("directory", nargs="?", help="the cluster's directory (start, stop)")
    args = parser.parse_args(argv)
    try:
        if args.action == "install":
            install()
            return 0
        if not args.directory:
            parser.error("start and stop need the cluster's directory")
        cluster = Cluster(args.directory)
        if args.action == "start":
            cluster.start()
            print(f"export SLURM_CONF={cluster.conf}")
        else:
            cluster.stop()
    except ClusterError as err:
        print(f"cluster: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
