"""Rank function for test_console.py (2 ranks on CPU, gloo): what each rank's console shows."""

from __future__ import annotations

import io
import logging
import os
import sys
from pathlib import Path


def console_of_each_rank(out: str) -> None:
    """Log at each level before and after ``logging.all_ranks`` is turned on; the rank shown is the
    one ``init_distributed`` gave the console (the one taken from RANK is reset to 0 first)."""
    import torch.distributed as dist

    from stapo_megatron.runtime import console
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed, shutdown_distributed

    console.configure()  # as a command's start: the rank comes from RANK
    rank = int(os.environ["RANK"])
    console.configure(rank=0)  # forgets it, so that only init_distributed can set it back
    captured = io.StringIO()
    sys.stderr = captured
    try:
        init_distributed(ParallelConfig(data_parallel=2))
        log = logging.getLogger("stapo_megatron.tests.console")
        log.info("info by default")
        log.warning("warning by default")
        log.error("error by default")
        console.configure(all_ranks=True)
        log.info("info with all_ranks")
        dist.barrier()
    finally:
        sys.stderr = sys.__stderr__
        shutdown_distributed()
    Path(out, f"rank{rank}.txt").write_text(captured.getvalue(), encoding="utf-8")
