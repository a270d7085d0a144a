"""Rank function of tests/runtime/test_megatron_fixes.py (its own process: init_distributed installs
the CPU compatibility layer, which must not reach the pytest process)."""

from __future__ import annotations

import json
from pathlib import Path


def fixes_after_init(out_dir: str) -> None:
    """What init_distributed leaves patched, with nothing else having applied the fixes."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from stapo_megatron.runtime import megatron_fixes
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed, shutdown_distributed

    before = {fix.name: fix.bug_present(DistributedOptimizer) for fix in megatron_fixes.FIXES}
    applied_before = dict(megatron_fixes._applied)
    init_distributed(ParallelConfig(timeout_minutes=1), seed=0)
    after = {fix.name: fix.bug_present(DistributedOptimizer) for fix in megatron_fixes.FIXES}
    methods = {fix.method: getattr(DistributedOptimizer, fix.method).__module__ for fix in megatron_fixes.FIXES}
    shutdown_distributed()
    result = {"before": before, "applied_before": applied_before, "after": after, "methods": methods}
    Path(out_dir, "fixes.json").write_text(json.dumps(result))
