import gc
import logging
import os
import sys

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
