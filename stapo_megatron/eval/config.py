"""Evaluation settings: benchmarks, samples per problem, decoding, and periodic evaluation in training;
and the whole ``stapo eval`` command's config."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from stapo_megatron.config import MAX_BATCH, MAX_SEED, MAX_STEPS, MAX_TOKENS, ConfigError, option
from stapo_megatron.config.core import check_fields
from stapo_megatron.data.benchmarks import BENCHMARKS, PAPER_BENCHMARKS
from stapo_megatron.data.config import PROMPT_TEMPLATES
from stapo_megatron.rewards.config import RewardConfig
from stapo_megatron.rewards.pool import check_reward_function
from stapo_megatron.rollout.config import RolloutConfig

MAX_K = 1 << 16  # samples per problem

# (temperature, top_p) of each decoding preset.
DECODING = {
    "train": (1.0, 1.0),  # training-aligned
    "justrl": (0.7, 0.9),  # JustRL's evaluation setting
}


@dataclasses.dataclass
class EvalConfig:
    every: int = option(0, "In training: evaluate every this many rollout steps (0: never).", ge=0, le=MAX_STEPS)
    benchmarks: list[str] = option(list(PAPER_BENCHMARKS), "Benchmarks to evaluate, by name.")
    data_dir: str = option("", "Directory holding the benchmark files (aime24.jsonl, math500.jsonl, ...).")
    decoding: Literal["train", "justrl"] = option(
        "train", "train: temperature 1.0, top-p 1.0; justrl: temperature 0.7, top-p 0.9."
    )
    k: int = option(
        0, "Samples per problem for avg@k and pass@k (0: each benchmark's default, 32 or 4).", ge=0, le=MAX_K
    )
    limit: int = option(0, "Problems per benchmark (0: all), for quick checks.", ge=0, le=MAX_BATCH)
    max_new_tokens: int = option(0, "Longest response (0: the training batch.max_new_tokens).", ge=0, le=MAX_TOKENS)
    seed: int = option(0, "Sampling seed of evaluation.", ge=0, le=MAX_SEED)
    k_by_benchmark: dict = option(
        {}, "Samples per problem of single benchmarks, e.g. {aime24: 16}; overrides k (and the default) for them."
    )
    problems_per_call: int = option(
        0,
        "Problems sampled by one engine call; their samples derive from one seed, so keep it when resuming "
        "(0: 1 with the local engine, so each problem's samples depend only on its own seed; 64 with SGLang, "
        "to keep the servers busy).",
        ge=0,
        le=MAX_BATCH,
    )
    verifier_model: str = option(
        "",
        "stapo eval only: a Hugging Face causal LM directory (e.g. CompassVerifier-3B) that judges again every "
        "response the rules grade wrong, in CompassVerifier's prompt; the table then gives rule-based and rectified "
        "accuracy and the flips ('': the rules alone). Served by the evaluation's engine after the evaluated model "
        "(the local engine runs Qwen3 models only; SGLang any it serves); read from the path, never downloaded.",
    )

    def __post_init__(self):
        check_fields(self)  # `stapo eval` builds this section from its flags, not through build()
        unknown = [b for b in self.benchmarks if b not in BENCHMARKS]
        if unknown:
            raise ConfigError(f"benchmarks: unknown benchmark '{unknown[0]}' (known: {', '.join(BENCHMARKS)})")
        if not self.benchmarks:
            raise ConfigError("benchmarks: name at least one benchmark")
        if len(set(self.benchmarks)) != len(self.benchmarks):
            twice = next(b for b in self.benchmarks if self.benchmarks.count(b) > 1)
            raise ConfigError(f"benchmarks: '{twice}' is listed twice")
        for name, k in self.k_by_benchmark.items():
            if name not in BENCHMARKS:
                raise ConfigError(f"k_by_benchmark: unknown benchmark '{name}' (known: {', '.join(BENCHMARKS)})")
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ConfigError(f"k_by_benchmark: {name}: must be an integer >= 1, got {k!r}")
            if k > MAX_K:
                raise ConfigError(f"k_by_benchmark: {name}: must be <= {MAX_K}, got {k}")

    @property
    def sampling(self) -> tuple[float, float]:
        return DECODING[self.decoding]

    def k_for(self, benchmark: str) -> int:
        """Samples per problem of ``benchmark``: its own override, else k, else the paper's default."""
        return self.k_by_benchmark.get(benchmark) or self.k or BENCHMARKS[benchmark].default_k


@dataclasses.dataclass
class EvalCommandConfig:
    """``stapo eval``: one model on the benchmarks, or one table over finished evaluations."""

    model: str = option(
        "",
        "Model to evaluate: a Hugging Face Qwen3 directory, or a stapo Megatron checkpoint "
        "(exported to Hugging Face format first).",
    )
    compare: list[str] = option([], "Instead of evaluating: finished evaluation directories to put in one table.")
    name: str = option("", "Model name in the table ('': the model's directory name).")
    out: str = option(
        "",
        "Output directory ('': eval_results/<name>-<decoding>): new, empty, or one stapo eval made (it holds "
        "its settings.json); with compare: a file for the table, new or a table stapo eval wrote.",
    )
    tokenizer: str = option("", "Tokenizer directory ('': the model's, or the Megatron checkpoint's hf_assets/).")
    export_dir: str = option(
        "", "Where a Megatron checkpoint is exported, kept and reused ('': a temporary directory)."
    )
    device: str = option("", "Device of the local engine ('': cuda when available, else cpu).")
    template: str = option(
        "justrl",
        "Prompt template: justrl (JustRL's evaluation prompt, '{problem} Please reason ...'), stapo (the training "
        "prompt, '{problem}\\nPlease reason ...'), raw, or a text containing {problem}.",
    )
    chat_template: bool | None = option(
        None,
        "Wrap the prompt in the tokenizer's chat template, as JustRL's evaluation does (default: when the "
        "tokenizer has one; false: the plain prompt).",
    )
    chat_template_kwargs: dict = option({}, "Mapping passed to apply_chat_template, e.g. {enable_thinking: false}.")
    overwrite: bool = option(
        False,
        "Discard the responses already in out and start over: removes its responses.jsonl, results.json, "
        "table.md, verdicts.jsonl and verifier.json, nothing else, and only in a directory stapo eval made "
        "(default: continue them).",
    )
    eval: EvalConfig = option(doc="Benchmarks, samples per problem, decoding.", factory=EvalConfig)
    rollout: RolloutConfig = option(
        doc="The engine that samples (local, or SGLang servers launched on the model or attached by URL).",
        factory=RolloutConfig,
    )
    reward: RewardConfig = option(
        doc="Answer verification (the rules of reward.kind, or a reward function of your own with kind custom).",
        factory=RewardConfig,
    )

    def __post_init__(self):
        if bool(self.model) == bool(self.compare):
            raise ConfigError(
                "model: give a model to evaluate or finished evaluations to compare, not both"
                if self.model
                else "model: required (or compare: finished evaluations to tabulate)"
            )
        if self.compare:
            if self.eval.verifier_model:
                raise ConfigError("eval.verifier_model: compare tabulates finished evaluations; it judges nothing")
            return
        from stapo_megatron.data.prompts import render_prompt

        try:
            render_prompt("", self.template)
        except ValueError as err:
            raise ConfigError(f"template: {err} (known: {', '.join(PROMPT_TEMPLATES)})") from None
        if self.eval.every:
            raise ConfigError(f"eval.every: only for training (stapo eval evaluates once), got {self.eval.every}")
        if self.eval.max_new_tokens < 1:  # 0 means the training batch's, which an evaluation has not
            raise ConfigError(f"eval.max_new_tokens: must be >= 1, got {self.eval.max_new_tokens}")
        if not self.eval.data_dir:
            raise ConfigError("eval.data_dir: required (the directory holding aime24.jsonl, math500.jsonl, ...)")
        if not Path(self.eval.data_dir).is_dir():
            raise ConfigError(f"eval.data_dir: {self.eval.data_dir} is not a directory")
        if self.eval.verifier_model and self.rollout.engine == "sglang" and self.rollout.sglang.urls:
            raise ConfigError(
                "eval.verifier_model: rollout.sglang.urls attaches to servers of the evaluated model; the verifier "
                "needs servers launched on it (drop urls)"
            )
        # Last: it starts a reward worker (the function's module is imported there, never here).
        check_reward_function(self.reward)
