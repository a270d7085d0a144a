"""``stapo eval``'s work: check the model and tokenizer, sample what is missing, write the results.

Everything that can be checked without weights is checked first (the model's files, the
tokenizer and that its vocabulary fits the model's embedding, the verifier's files and tokenizer,
the benchmark files, the output directory); only then is a checkpoint exported and an engine
started. The verifier's engine starts after the evaluated model's has shut down, so the two never
hold an accelerator at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stapo_megatron.config import ConfigError
from stapo_megatron.config.command import FieldNames
from stapo_megatron.eval.config import EvalCommandConfig
from stapo_megatron.models.qwen3.config import Qwen3Config

if TYPE_CHECKING:  # imported where they run: they bring in torch and transformers
    from stapo_megatron.data.prompts import PromptEncoder
    from stapo_megatron.eval.model import HFExport, ModelSource
    from stapo_megatron.eval.runner import BenchmarkTask, EvalRun
    from stapo_megatron.eval.verifier import Verifier
    from stapo_megatron.rollout.config import RolloutConfig

DEFAULT_OUT_ROOT = "eval_results"

logger = logging.getLogger(__name__)


def check_table_path(out: Path) -> None:
    """Refuse, in one line naming ``out``, a comparison table that would write over a file stapo
    eval did not write as a comparison: only a new file, or a table of results, outside the files
    of an evaluation directory (its own table.md included), may be written."""
    from stapo_megatron.eval.report import is_results_table
    from stapo_megatron.eval.store import EVALUATION_FILES, SETTINGS_FILE

    if not out.parent.is_dir():
        raise ConfigError(f"out: {out}: {out.parent} is not a directory")
    if out.name in EVALUATION_FILES and (out.parent / SETTINGS_FILE).is_file():
        raise ConfigError(f"out: {out} is a file of the evaluation in {out.parent}; write the table elsewhere")
    if os.path.lexists(out) and not is_results_table(out):
        raise ConfigError(
            f"out: {out} exists and is not a table stapo eval wrote; remove it or write the table elsewhere"
        )


def compare(cfg: EvalCommandConfig) -> None:
    """One table over finished evaluations (printed, and written to ``cfg.out`` when given)."""
    from stapo_megatron.eval.report import load_results, markdown_table
    from stapo_megatron.eval.store import write_atomic

    if cfg.out:
        check_table_path(Path(cfg.out))
    table = markdown_table([load_results(path) for path in cfg.compare])
    if cfg.out:
        write_atomic(cfg.out, table)
    print(table, end="")


def check_vocabulary_fits(tokenizer: Any, arch: Qwen3Config, tokenizer_dir: Path, model: str, field: str) -> None:
    """A token id at or past the embedding's rows would index outside it once the model runs."""
    tokens = len(tokenizer)
    if tokens > arch.vocab_size:
        raise ConfigError(
            f"{field}: the tokenizer in {tokenizer_dir} has {tokens:,} tokens, more than the "
            f"{arch.vocab_size:,} embedding rows of the model {model}; give the model's own tokenizer"
        )


def with_engine_model(cfg: EvalCommandConfig, hf_dir: Path):
    """The rollout config whose launched SGLang servers load ``hf_dir``: the config's loader points
    them at the evaluated model, and a Megatron checkpoint is served by its Hugging Face export."""
    sglang = cfg.rollout.sglang
    if cfg.rollout.engine != "sglang" or sglang.model_path != cfg.model:
        return cfg.rollout
    return dataclasses.replace(cfg.rollout, sglang=dataclasses.replace(sglang, model_path=str(hf_dir)))


@dataclasses.dataclass
class EvalInputs:
    """What an evaluation reads, checked before any weights are loaded."""

    source: ModelSource
    tokenizer: Any
    verifier: Verifier | None
    encoder: PromptEncoder
    tasks: list[BenchmarkTask]


def check_inputs(cfg: EvalCommandConfig, names: FieldNames) -> EvalInputs:
    """The model, its tokenizer, the verifier, the prompt template and the benchmark files, each
    error named by the field the user set."""
    from stapo_megatron.data.prompts import PromptEncoder
    from stapo_megatron.eval.model import inspect_model, load_tokenizer
    from stapo_megatron.eval.runner import load_tasks
    from stapo_megatron.eval.verifier import inspect_verifier

    source = inspect_model(cfg.model, cfg.tokenizer or None)
    tokenizer = load_tokenizer(source.tokenizer_dir)
    check_vocabulary_fits(tokenizer, source.arch, source.tokenizer_dir, cfg.model, names.name("tokenizer"))
    verifier = (
        inspect_verifier(cfg.eval.verifier_model, cfg.rollout.engine, names.name("eval.verifier_model"))
        if cfg.eval.verifier_model
        else None
    )
    try:
        chat = bool(getattr(tokenizer, "chat_template", None)) if cfg.chat_template is None else cfg.chat_template
        encoder = PromptEncoder(tokenizer, cfg.template, chat, cfg.chat_template_kwargs)
    except ValueError as err:
        raise ConfigError(f"{names.name('chat_template')}: {err}") from None
    try:
        tasks = load_tasks(cfg.eval, encoder)
    except ConfigError as err:  # named relative to the eval section
        raise names.rename(ConfigError(f"eval.{err}")) from None
    return EvalInputs(source, tokenizer, verifier, encoder, tasks)


def output_dir(cfg: EvalCommandConfig, name: str) -> Path:
    """``out``, or ``eval_results/<model name>-<decoding>``."""
    if cfg.out:
        return Path(cfg.out)
    return Path(DEFAULT_OUT_ROOT) / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}-{cfg.eval.decoding}"


def evaluate(cfg: EvalCommandConfig, names: FieldNames) -> None:
    from stapo_megatron.data.prompts import default_stop_token_ids
    from stapo_megatron.eval.model import HFExport, default_model_name
    from stapo_megatron.eval.report import markdown_table
    from stapo_megatron.eval.runner import RESULTS_FILE, EvalRun, Sampling, default_problems_per_call, prompt_settings

    inputs = check_inputs(cfg, names)
    export = HFExport(inputs.source, cfg.export_dir or None)
    try:
        rollout_cfg = with_engine_model(cfg, export.hf_dir)
        name = cfg.name or default_model_name(inputs.source.path)
        out = output_dir(cfg, name)
        temperature, top_p = cfg.eval.sampling
        sampling = Sampling(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=cfg.eval.max_new_tokens,
            stop_token_ids=tuple(default_stop_token_ids(inputs.tokenizer, inputs.encoder.chat_template)),
            seed=cfg.eval.seed,
            problems_per_call=cfg.eval.problems_per_call or default_problems_per_call(rollout_cfg.engine),
        )
        settings = {
            "model": str(inputs.source.path.resolve()),
            "engine": rollout_cfg.engine,
            **prompt_settings(inputs.encoder, cfg.reward),
        }
        verifier_settings = inputs.verifier.settings(rollout_cfg.engine) if inputs.verifier is not None else None
        try:
            run = EvalRun(out, inputs.tasks, sampling, settings, fresh=cfg.overwrite, verifier=verifier_settings)
        except ConfigError as err:
            raise ConfigError(f"{names.name('out')}: {err}") from None
        with run:
            fill_missing(run, cfg, inputs, export, rollout_cfg, out)
            results = run.results(name, {"preset": cfg.eval.decoding, "temperature": temperature, "top_p": top_p})
    finally:
        export.cleanup()
    print(markdown_table([results]), end="")
    logger.info("results in %s", out / RESULTS_FILE)


def fill_missing(
    run: EvalRun, cfg: EvalCommandConfig, inputs: EvalInputs, export: HFExport, rollout_cfg: RolloutConfig, out: Path
) -> None:
    """Sample the responses ``run`` lacks, then have the verifier judge the rule-wrong ones it has not
    judged; each engine starts only when it has work and shuts down before the next one starts."""
    import torch

    from stapo_megatron.eval.model import start_engine
    from stapo_megatron.eval.verifier import start_verifier_engine

    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pending = run.pending()
    if pending:
        logger.info("%d responses to sample into %s", pending, out)
        hf_dir = export.materialize()
        engine = start_engine(rollout_cfg, inputs.source, hf_dir, device, out)
        try:
            run.generate(engine, inputs.tokenizer, cfg.reward)
        finally:
            engine.shutdown()
    verifier = inputs.verifier
    if verifier is not None and run.pending_verdicts():
        logger.info("%d rule-wrong responses for the verifier %s", run.pending_verdicts(), verifier.name)
        engine = start_verifier_engine(verifier, cfg.rollout, device, out)
        try:
            run.verify(engine, verifier)
        finally:
            engine.shutdown()


def run_eval_command(cfg: EvalCommandConfig, names: FieldNames) -> None:
    if cfg.compare:
        compare(cfg)
    else:
        evaluate(cfg, names)
