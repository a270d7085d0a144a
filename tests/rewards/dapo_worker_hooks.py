"""Test-only hooks run inside dapo reward workers (passed as ``RewardPool(worker_init=...)``).

Module-level functions so that the worker can unpickle them by reference.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def hang_on_marker(marker_dir: str) -> None:
    """Answers "HANG" block SIGALRM and sleep (like a long C call), after noting whether the
    worker has sympy loaded (the dapo verifier must not need it)."""
    from stapo_megatron.rewards.dapo_math import DapoVerifier

    with open(os.path.join(marker_dir, f"modules.{os.getpid()}"), "w", encoding="utf-8") as f:
        f.write("sympy loaded" if "sympy" in sys.modules else "no sympy")
    original = DapoVerifier.check

    def check(self, answer, gold):
        if answer == "HANG":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(600)
        return original(self, answer, gold)

    DapoVerifier.check = check  # type: ignore[method-assign]
