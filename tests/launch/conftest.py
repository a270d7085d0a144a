import gc
import logging
import os
import shutil
import sys
import tempfile

import pytest


@pytest.fixture
def nemorun_home(tmp_path, monkeypatch):
    """NeMo-Run's home (its experiments) in this test's directory, for in-process commands."""
    pytest.importorskip("nemo_run", reason="NeMo-Run is not importable: pip install -e '.[launch]'")
    # NeMo-Run runs shell commands through invoke, which forwards stdin: pytest's capture refuses reads
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    home = tmp_path / "nemo_home"
    monkeypatch.setenv("NEMORUN_HOME", str(home))
    previous = get_nemorun_home()
    set_nemorun_home(str(home))
    # an Experiment reconfigures the root logger (basicConfig(force=True)) and, when collected,
    # removes its first handler: collect it here and give other tests their logging back
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)
        yield home
        monkeypatch.setattr(sys, "stdin", sys.__stdin__)
    gc.collect()
    root.handlers[:] = handlers
    root.setLevel(level)
    set_nemorun_home(previous)


@pytest.fixture(scope="session")
def slurm_cluster():
    """One real SLURM cluster for the session's tests (tests/slurm/cluster.py); skips where it cannot be had."""
    pytest.importorskip("nemo_run", reason="NeMo-Run is not importable: pip install -e '.[launch]'")
    from tests.slurm.cluster import Cluster, ClusterError, install

    if os.geteuid() != 0:
        pytest.skip("the SLURM test cluster needs root (its daemons run as root)")
    try:
        install()
    except ClusterError as err:
        pytest.skip(f"no SLURM test cluster: {err}")
    # short: munge's and MariaDB's unix sockets live here (paths are limited to 108 bytes)
    root = tempfile.mkdtemp(prefix="stapo-slurm-", dir="/tmp")
    cluster = Cluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        daemons = [p for p in (cluster.path("run").glob("*.pid") if cluster.path("run").exists() else [])]
        shutil.rmtree(root, ignore_errors=True)
        assert not daemons, f"daemons left running: {daemons}"
