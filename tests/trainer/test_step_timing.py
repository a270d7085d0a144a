"""The step timer's accounting, on a scripted clock: nested phases count once, consecutive steps
leave no gap, and ``time/step`` is the wall time of the whole step."""

from __future__ import annotations

import pytest

from stapo_megatron.trainer import metrics as metrics_module
from stapo_megatron.trainer.metrics import PhaseTimer


class ScriptedClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    scripted = ScriptedClock()
    monkeypatch.setattr(metrics_module.time, "perf_counter", scripted)
    return scripted


def test_nested_phases_count_each_second_once_and_add_up_to_the_step(clock):
    timer = PhaseTimer()
    clock.advance(0.5)  # before any phase: in the step, in no phase
    with timer("rollout"):
        clock.advance(1.0)  # sampling bookkeeping
        with timer("rollout"):
            clock.advance(10.0)  # generation
        with timer("reward"):
            clock.advance(3.0)
        clock.advance(0.25)
    with timer("update"):
        clock.advance(4.0)
        with timer("statistics"):
            clock.advance(2.0)
    assert timer.stop() == 20.75
    row = timer.metrics()
    assert row == {
        "time/rollout": 11.25,
        "time/reward": 3.0,
        "time/update": 4.0,
        "time/statistics": 2.0,
        "time/other": 0.5,
        "time/step": 20.75,
    }
    assert sum(v for k, v in row.items() if k != "time/step") == 20.75  # the 0.5 s outside every phase is "other"


def test_the_next_step_starts_where_the_previous_stopped(clock):
    first = PhaseTimer()
    with first("update"):
        clock.advance(2.0)
    first.stop()
    clock.advance(7.0)  # e.g. the checkpoint written after the row
    second = PhaseTimer().follow(first)
    with second("checkpoint"):
        clock.advance(0.0)
    clock.advance(1.0)
    assert second.stop() == 8.0
    assert first.metrics()["time/step"] + second.metrics()["time/step"] == 10.0


def test_metrics_before_the_step_ends_are_refused(clock):
    timer = PhaseTimer()
    with timer("rollout"):
        clock.advance(1.0)
    with pytest.raises(RuntimeError, match="before stop"):
        timer.metrics()


def test_a_phase_that_raises_is_still_counted(clock):
    timer = PhaseTimer()
    with pytest.raises(ValueError):
        with timer("eval"):
            clock.advance(3.0)
            raise ValueError("engine down")
    timer.stop()
    assert timer.metrics()["time/eval"] == 3.0


def test_what_runs_after_a_row_is_absorbed_by_the_next_step(clock):
    """The trainer writes step 1's row, then agrees to stop and saves under a timer named for
    step 1 (the heartbeat names the right step); step 2's timer takes that stretch over."""
    step1 = PhaseTimer()
    with step1("update"):
        clock.advance(2.0)
    step1.stop()
    after_row = PhaseTimer().follow(step1)
    with after_row("logging"):
        clock.advance(0.5)
    with after_row("checkpoint"):
        clock.advance(6.0)
    step2 = PhaseTimer().absorb(after_row)
    with step2("rollout"):
        clock.advance(3.0)
    assert step2.stop() == 9.5
    assert step2.metrics() == {
        "time/logging": 0.5,
        "time/checkpoint": 6.0,
        "time/rollout": 3.0,
        "time/other": 0.0,
        "time/step": 9.5,
    }
