"""PhaseTimer.follow needs a stopped timer: following a running one used to leave ``started`` None,
which failed only later, in stop(), with a TypeError."""

from __future__ import annotations

import pytest

from stapo_megatron.trainer.metrics import PhaseTimer


def test_following_a_running_timer_is_refused_at_once():
    running = PhaseTimer()
    with pytest.raises(RuntimeError, match="previous timer was not stopped"):
        PhaseTimer().follow(running)
    running.stop()
    follower = PhaseTimer().follow(running)
    assert follower.started == running.stopped
    assert follower.stop() >= 0.0
