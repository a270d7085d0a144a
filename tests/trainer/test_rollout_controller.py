"""The rollout side behind one facade: Rank0Rollouts, built as rank 0 builds it (synthetic prompts,
the local engine, real reward pool and metrics logger), and RolloutController, which every rank
holds and which reaches rank 0's side only on rank 0."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from stapo_megatron.data.prompts import build_prompt_dataset
from stapo_megatron.data.sampler import PromptSampler
from stapo_megatron.data.synthetic import synthetic_tokenizer
from stapo_megatron.runtime.run_files import RESOLVED_CONFIG, STOP_FILE
from stapo_megatron.trainer import controller as controller_module
from stapo_megatron.trainer.controller import Rank0Rollouts, RolloutController
from stapo_megatron.trainer.heartbeat import Heartbeat
from stapo_megatron.trainer.launcher import load_train_config
from stapo_megatron.trainer.metrics import PhaseTimer, read_metrics


def _config(tmp_path):
    return load_train_config(None, [f"run.output_dir={tmp_path}", "run.name=controller", "rollout.engine=local"])


def _ctx(rank: int, rank0_object=None, other_rank_stops: bool = False):
    """A ParallelContext of ``rank`` in a world whose rank 0 broadcasts ``rank0_object`` and whose
    other ranks ask to stop when ``other_rank_stops``."""
    return SimpleNamespace(
        rank=rank,
        cpu_group=None,
        any_rank=lambda flag: flag or other_rank_stops,
        broadcast_object=lambda obj, src=0: obj if rank == 0 else rank0_object,
    )


def test_rank0_resumes_its_sampler_writes_rows_and_closes_everything_it_owns(tmp_path):
    import torch

    cfg = _config(tmp_path)
    tokenizer = synthetic_tokenizer(cfg.data.synthetic_distractors)
    reference = PromptSampler(
        len(build_prompt_dataset(cfg.data, tokenizer)), seed=cfg.data.seed, shuffle=cfg.data.shuffle
    )
    reference.next_indices(5)  # where a checkpoint of step 2 left the sampler
    run_dir = cfg.run.directory
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.25}\n{"step": 3, "reward/mean": 0.75}\n')

    rank0 = Rank0Rollouts.build(cfg, tokenizer, torch.device("cpu"), None, sampler_state=reference.state_dict(), step=2)
    rollouts = RolloutController(_ctx(0), cfg.model, Heartbeat(60, 0, saved_step=2), rank0)
    try:
        assert (run_dir / RESOLVED_CONFIG).is_file()
        assert rank0.evaluator is None  # eval.every=0
        assert rollouts.sampler_state() == reference.state_dict()
        assert rank0.collector.sampler.next_indices(4) == reference.next_indices(4)
        assert rollouts.sampler_state() == reference.state_dict()

        rollouts.write_row(3, {"reward/mean": 0.5, "time/step": 1.5})
        # the logger resumed at step 2: the old row of step 3 is gone, the new one follows step 1
        assert read_metrics(run_dir) == [
            {"step": 1, "reward/mean": 0.25},
            {"step": 3, "reward/mean": 0.5, "time/step": 1.5},
        ]

        assert not rollouts.agree_to_stop(False)
        (run_dir / STOP_FILE).touch()
        assert rollouts.agree_to_stop(False)  # the stop file asks
        assert not (run_dir / STOP_FILE).exists()
        assert rollouts.agree_to_stop(True)  # a signal asks; a file removed meanwhile is no error
    finally:
        rollouts.close()
    assert rank0.collector.engine.model is None  # the engine shut down
    assert rank0.collector.reward_pool._closed


def test_a_synchronous_resume_of_an_async_checkpoint_says_what_it_discards(tmp_path, caplog):
    import torch

    cfg = _config(tmp_path)  # max_staleness 0: no generation thread to hand the state to
    tokenizer = synthetic_tokenizer(cfg.data.synthetic_distractors)
    state = {"version": 1, "lag": 1, "next_step": 4, "ready": {"3": {}}, "pool": {"groups": [{}, {}]}}
    rank0 = Rank0Rollouts.build(cfg, tokenizer, torch.device("cpu"), None, None, step=2, pipeline_state=state)
    try:
        assert rank0.pipeline is None
        assert "its 1 batches generated ahead and 2 groups in flight are discarded" in caplog.text
    finally:
        rank0.close()
    with pytest.raises(OSError):
        os.fstat(rank0.metrics_logger._fd)  # the metrics file is closed


class _Recorder:
    def __init__(self):
        self.calls = []

    def resume_memory(self):
        self.calls.append("resume")

    def release_memory(self):
        self.calls.append("release")

    def shutdown(self):
        self.calls.append("shutdown")


def test_only_rank0_reaches_the_rollout_side(tmp_path, monkeypatch):
    """Rank 0 acts on its side; another rank gets rank 0's answers from the collectives and touches
    nothing of it (the stop file, the engine, the sampler, the metrics rows are rank 0's)."""
    barriers, synced, links_closed = [], [], []
    monkeypatch.setattr(controller_module.dist, "barrier", lambda group=None: barriers.append(group))
    monkeypatch.setattr(
        "stapo_megatron.rollout.weight_sync.session.sync_engine_weights",
        lambda ctx, model, arch, engine, version, sync: (
            synced.append((engine, version)) or SimpleNamespace(close=lambda: links_closed.append(ctx.rank))
        ),
    )
    (tmp_path / STOP_FILE).touch()
    engine = _Recorder()
    rows = []
    rank0_side = Rank0Rollouts(
        collector=SimpleNamespace(
            engine=engine,
            sampler=PromptSampler(10, seed=3),
            reward_pool=SimpleNamespace(close=lambda: engine.calls.append("rewards closed")),
            collect=lambda step, timer: ("batch", {"reward/mean": 0.5}),
        ),
        evaluator=SimpleNamespace(evaluate_in_training=lambda step, run_dir: {"eval/step": float(step)}),
        metrics_logger=SimpleNamespace(log=lambda step, metrics: rows.append(step), close=lambda: None),
        run_dir=tmp_path,
    )
    sampler_state = PromptSampler(10, seed=3).state_dict()
    timer = PhaseTimer()

    other = RolloutController(
        _ctx(1, rank0_object=sampler_state, other_rank_stops=True), None, Heartbeat(60, 1, saved_step=0), None
    )
    assert other.collect(1, timer) == (None, {})
    assert other.evaluate(1, timer) == {}
    assert other.sampler_state() == sampler_state  # rank 0's, broadcast
    other.release_engine()
    other.resume_engine()
    other.write_row(1, {"reward/mean": 0.5})
    other.sync_weights("model", version=1, timer=timer)
    assert other.agree_to_stop(False)  # rank 0 asked (any_rank): every rank stops
    assert (tmp_path / STOP_FILE).exists()  # only rank 0 removes the file
    other.close()
    assert engine.calls == [] and rows == [] and synced == [(None, 1)] and links_closed == [1]

    rank0 = RolloutController(_ctx(0), None, Heartbeat(60, 0, saved_step=0), rank0_side)
    assert rank0.collect(2, timer) == ("batch", {"reward/mean": 0.5})
    assert rank0.evaluate(2, timer) == {"eval/step": 2.0}
    assert rank0.sampler_state() == sampler_state
    rank0.release_engine()
    rank0.resume_engine()
    rank0.write_row(2, {"reward/mean": 0.5})
    rank0.sync_weights("model", version=2, timer=timer)
    assert rank0.agree_to_stop(False)
    assert not (tmp_path / STOP_FILE).exists()
    rank0.close()
    assert engine.calls == ["release", "resume", "shutdown", "rewards closed"]
    assert rows == [2] and synced == [(None, 1), (engine, 2)] and links_closed == [1, 0]
    assert len(barriers) == 4  # every rank waits for rank 0's rollouts and evaluation
    timer.stop()
    assert {"time/rollout", "time/eval"} <= set(timer.metrics())
