"""The controller rank's rollout side behind one facade: RolloutController, built as rank 0 builds it
(synthetic prompts, the local engine, real reward pool and metrics logger), and the Trainer's one
helper that runs it on the controller rank only."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from stapo_megatron.data.prompts import build_prompt_dataset
from stapo_megatron.data.sampler import PromptSampler
from stapo_megatron.data.synthetic import synthetic_tokenizer
from stapo_megatron.trainer.controller import RolloutController
from stapo_megatron.trainer.launcher import RESOLVED_CONFIG, STOP_FILE, load_train_config
from stapo_megatron.trainer.metrics import read_metrics
from stapo_megatron.trainer.trainer import Trainer


def _config(tmp_path):
    return load_train_config(None, [f"run.output_dir={tmp_path}", "run.name=controller", "rollout.engine=local"])


def test_the_controller_resumes_its_sampler_writes_rows_and_closes_everything_it_owns(tmp_path):
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

    controller = RolloutController.build(
        cfg, tokenizer, cfg.model, torch.device("cpu"), None, [1], progress={"sampler": reference.state_dict()}, step=2
    )
    try:
        assert (run_dir / RESOLVED_CONFIG).is_file()
        assert controller.evaluator is None  # eval.every=0
        assert controller.sampler_state() == reference.state_dict()
        assert controller.collector.sampler.next_indices(4) == reference.next_indices(4)
        assert controller.sampler_state() == reference.state_dict()

        controller.log(3, {"reward/mean": 0.5, "time/step": 1.5})
        # the logger resumed at step 2: the old row of step 3 is gone, the new one follows step 1
        assert read_metrics(run_dir) == [
            {"step": 1, "reward/mean": 0.25},
            {"step": 3, "reward/mean": 0.5, "time/step": 1.5},
        ]

        assert not controller.stop_file_present()
        (run_dir / STOP_FILE).touch()
        assert controller.stop_file_present()
        controller.remove_stop_file()
        assert not (run_dir / STOP_FILE).exists()
        controller.remove_stop_file()  # a file removed by hand meanwhile is no error
    finally:
        controller.close()
    assert controller.engine.model is None  # the engine shut down
    assert controller.collector.reward_pool._closed
    with pytest.raises(OSError):
        os.fstat(controller.logger._fd)  # the metrics file is closed


class _Recorder:
    def __init__(self):
        self.calls = []

    def resume_memory(self):
        self.calls.append("resume")

    def release_memory(self):
        self.calls.append("release")


def test_only_the_controller_rank_reaches_the_rollout_side(tmp_path):
    """Rank 0 holds the controller and acts on it; another rank gets the default and touches nothing
    (its STOP file check, the engine, the sampler are rank 0's)."""
    (tmp_path / STOP_FILE).touch()
    engine = _Recorder()
    controller = RolloutController(
        SimpleNamespace(engine=engine, sampler=PromptSampler(10, seed=3)), None, None, tmp_path
    )

    def trainer(rank_controller):
        holder = SimpleNamespace(
            controller=rank_controller,
            stop_requested=False,
            ctx=SimpleNamespace(any_rank=lambda requested: requested or True),
        )
        holder._on_controller = lambda action, default=None: Trainer._on_controller(holder, action, default)
        return holder

    other = trainer(None)
    assert Trainer._on_controller(other, RolloutController.sampler_state, default="none") == "none"
    assert Trainer._agree_to_stop(other)  # rank 0 asked (any_rank): every rank stops
    assert (tmp_path / STOP_FILE).exists()  # only the controller rank removes the file

    rank0 = trainer(controller)
    assert Trainer._on_controller(rank0, RolloutController.sampler_state) == PromptSampler(10, seed=3).state_dict()
    assert Trainer._on_controller(rank0, lambda c: c.engine) is engine
    Trainer._on_controller(rank0, RolloutController.release_engine)
    Trainer._on_controller(rank0, RolloutController.resume_engine)
    assert engine.calls == ["release", "resume"]
    assert Trainer._agree_to_stop(rank0)
    assert not (tmp_path / STOP_FILE).exists()
