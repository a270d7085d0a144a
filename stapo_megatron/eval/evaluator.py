"""Periodic evaluation inside ``stapo train``: the same evaluation as ``stapo eval``, on the rollout engine.

The trainer calls :meth:`Evaluator.evaluate_in_training` on rank 0 after it synced the step's
weights to the engine; the files go to ``<run_dir>/eval/step_NNNNNNN/`` and the returned metrics
carry the same names as ``stapo eval``'s results.json (``eval/aime24/avg@32``, ...).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stapo_megatron.data.config import DataConfig
from stapo_megatron.data.prompts import PromptEncoder, default_stop_token_ids
from stapo_megatron.eval.config import EvalConfig
from stapo_megatron.eval.runner import (
    EvalRun,
    Sampling,
    default_problems_per_call,
    engine_kind,
    load_tasks,
    prompt_settings,
)
from stapo_megatron.rewards import RewardConfig
from stapo_megatron.rollout.engine import RolloutEngine

logger = logging.getLogger(__name__)


def step_directory(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "eval" / f"step_{step:07d}"


class Evaluator:
    """Evaluates the engine's current weights on ``eval_cfg``'s benchmarks (subset and limit)."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        eval_cfg: EvalConfig,
        data_cfg: DataConfig,
        reward_cfg: RewardConfig,
        default_max_new_tokens: int,
        stop_token_ids: Sequence[int] | None = None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = eval_cfg
        encoder = PromptEncoder.from_config(data_cfg, tokenizer)
        # Loaded and encoded now, so a bad benchmark file stops the run before its first step.
        self.tasks = load_tasks(eval_cfg, encoder)
        # The benchmarks are math problems whatever the training task is (the synthetic one uses "exact"), and
        # runs trained with different rewards (a custom one too) are compared on the same verifier.
        self.reward_cfg = dataclasses.replace(reward_cfg, kind="math", function="")
        temperature, top_p = eval_cfg.sampling
        kind = engine_kind(engine)
        if stop_token_ids is None:
            stop_token_ids = default_stop_token_ids(tokenizer, data_cfg.chat_template)
        self.sampling = Sampling(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=eval_cfg.max_new_tokens or default_max_new_tokens,
            stop_token_ids=tuple(stop_token_ids),
            seed=eval_cfg.seed,
            problems_per_call=eval_cfg.problems_per_call or default_problems_per_call(kind),
        )
        self.decoding = {"preset": eval_cfg.decoding, "temperature": temperature, "top_p": top_p}
        self.settings = {"engine": kind, **prompt_settings(encoder, self.reward_cfg)}

    def evaluate_in_training(self, step: int, run_dir: str | Path) -> dict[str, float]:
        """Evaluate the weights of ``step``; returns the flat metrics (``eval/<benchmark>/avg@<k>``, ...)."""
        directory = step_directory(run_dir, step)
        settings = {**self.settings, "model": f"{Path(run_dir).resolve()} step {step}"}
        # A directory left by an earlier, interrupted attempt at this step came from weights that a
        # resumed run cannot promise to reproduce: sample it afresh.
        logger.info("eval step %d: sampling into %s", step, directory)
        with EvalRun(directory, self.tasks, self.sampling, settings, fresh=True) as run:
            run.generate(self.engine, self.tokenizer, self.reward_cfg)
            results = run.results(model=f"{Path(run_dir).name} step {step}", decoding=self.decoding)
        return dict(results["metrics"])
