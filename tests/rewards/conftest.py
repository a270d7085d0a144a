import os
import sys

import pytest

# The worker hooks in code_eval_trap.py are unpickled inside the reward workers, which receive
# this process's sys.path: make sure this directory is on it whatever pytest's import mode.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
# The custom reward functions are named tests.rewards.<module>:<function> and examples.custom_reward.<...>;
# the workers import them with this process's sys.path, which must hold the repository root (the
# editable install does not put it there).
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
if REPO_ROOT not in sys.path:
    sys.path.append(REPO_ROOT)

from stapo_megatron.rewards import RewardPool  # noqa: E402


@pytest.fixture(scope="session")
def math_pool():
    """The production configuration (code-evaluation guard on), shared by the tests that only score."""
    with RewardPool(num_workers=2, timeout_s=5.0) as pool:
        yield pool
