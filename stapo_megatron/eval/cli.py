"""``stapo eval``: score a model on the math benchmarks, or compare finished evaluations.

Every argument is checked (benchmark files, model and tokenizer files, output directory) before
any weights are read; an error is one line naming the flag at fault. Rerunning the same command
continues an interrupted evaluation from the responses it already wrote.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from stapo_megatron.config import ConfigError, apply_overrides, build, read_yaml
from stapo_megatron.data.benchmarks import PAPER_BENCHMARKS
from stapo_megatron.data.config import PROMPT_TEMPLATES
from stapo_megatron.eval.config import DECODING, EvalConfig

# Long enough for the paper's responses (its training allows about 15k tokens).
DEFAULT_MAX_NEW_TOKENS = 16384
DEFAULT_OUT_ROOT = "eval_results"
# EvalConfig field -> the flag that sets it, so config errors name what the user typed.
_FLAGS = {
    "benchmarks": "--benchmarks",
    "data_dir": "--data-dir",
    "k": "--k",
    "k_by_benchmark": "--k",
    "limit": "--limit",
    "max_new_tokens": "--max-new-tokens",
    "seed": "--seed",
    "problems_per_call": "--problems-per-call",
}


def _as_flag_error(err: ConfigError) -> ConfigError:
    field, sep, rest = str(err).partition(":")
    if sep and field in _FLAGS:
        return ConfigError(f"{_FLAGS[field]}:{rest}")
    return err


def parse_k(text: str | None) -> tuple[int, dict[str, int]]:
    """``32`` (every benchmark), ``aime24=16,math500=8`` (those benchmarks), or both: ``8,aime24=16``."""
    k, per_benchmark = 0, {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, _, value = item.rpartition("=")
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"--k: cannot read {item!r} (give N, or benchmark=N, comma-separated)") from None
        if name:
            per_benchmark[name.strip()] = number
        else:
            k = number
    return k, per_benchmark


def eval_config_from_args(args: argparse.Namespace) -> EvalConfig:
    k, per_benchmark = parse_k(args.k)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    if not args.data_dir:
        raise ConfigError("--data-dir: required (the directory holding aime24.jsonl, math500.jsonl, ...)")
    if not Path(args.data_dir).is_dir():
        raise ConfigError(f"--data-dir: {args.data_dir} is not a directory")
    try:
        return EvalConfig(
            benchmarks=[b.strip() for b in args.benchmarks.split(",") if b.strip()],
            data_dir=args.data_dir,
            decoding=args.decoding,
            k=k,
            k_by_benchmark=per_benchmark,
            limit=args.limit,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            problems_per_call=args.problems_per_call,
        )
    except ConfigError as err:
        raise _as_flag_error(err) from None


def rollout_config_from_args(args: argparse.Namespace, hf_dir: Path):
    from stapo_megatron.rollout.config import RolloutConfig

    data: dict = {}
    if args.rollout_config:
        data = read_yaml(args.rollout_config)
        # A training config works too: take its rollout section.
        if isinstance(data.get("rollout"), dict):
            data = data["rollout"]
    data = apply_overrides(data, args.rollout)
    if args.engine:
        data["engine"] = args.engine
    sglang = data.get("sglang")
    if data.get("engine") == "sglang" and (sglang is None or isinstance(sglang, dict)):
        sglang = dict(sglang or {})
        if not sglang.get("urls") and not sglang.get("model_path"):
            sglang["model_path"] = str(hf_dir)
        data["sglang"] = sglang
    return build(RolloutConfig, data, "rollout")


def _log(text: str) -> None:
    print(f"[stapo eval] {text}", file=sys.stderr, flush=True)


def run_compare(args: argparse.Namespace) -> None:
    from stapo_megatron.eval.report import load_results, markdown_table
    from stapo_megatron.eval.store import write_atomic

    table = markdown_table([load_results(path) for path in args.compare])
    if args.out:
        write_atomic(args.out, table)
    print(table, end="")


def run_eval(args: argparse.Namespace) -> None:
    if args.compare:
        run_compare(args)
        return
    import torch

    from stapo_megatron.data.prompts import PromptEncoder, render_prompt
    from stapo_megatron.eval.model import (
        HFExport,
        default_model_name,
        inspect_model,
        load_tokenizer,
        start_engine,
    )
    from stapo_megatron.eval.report import markdown_table
    from stapo_megatron.eval.runner import (
        RESULTS_FILE,
        EvalRun,
        Sampling,
        default_problems_per_call,
        load_tasks,
        prompt_settings,
    )
    from stapo_megatron.data.prompts import default_stop_token_ids
    from stapo_megatron.rewards import RewardConfig

    cfg = eval_config_from_args(args)
    try:
        render_prompt("", args.template)
    except ValueError as err:
        raise ConfigError(f"--template: {err} (known: {', '.join(PROMPT_TEMPLATES)})") from None
    chat_kwargs = {}
    if args.chat_template_kwargs:
        chat_kwargs = read_yaml_text(args.chat_template_kwargs, "--chat-template-kwargs")
    if args.reward_workers is not None and args.reward_workers < 1:
        raise ConfigError(f"--reward-workers: must be >= 1, got {args.reward_workers}")
    reward_cfg = RewardConfig() if args.reward_workers is None else RewardConfig(num_workers=args.reward_workers)
    source = inspect_model(args.model, args.tokenizer)
    export = HFExport(source, args.export_dir)
    try:
        rollout_cfg = rollout_config_from_args(args, export.hf_dir)
        tokenizer = load_tokenizer(source.tokenizer_dir)
        try:
            encoder = PromptEncoder(tokenizer, args.template, args.chat_template, chat_kwargs)
        except ValueError as err:
            raise ConfigError(f"--chat-template: {err}") from None
        try:
            tasks = load_tasks(cfg, encoder)
        except ConfigError as err:
            raise _as_flag_error(err) from None
        name = args.name or default_model_name(source.path)
        out = Path(args.out) if args.out else Path(DEFAULT_OUT_ROOT) / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}-{args.decoding}"
        temperature, top_p = cfg.sampling
        sampling = Sampling(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=tuple(default_stop_token_ids(tokenizer, args.chat_template)),
            seed=cfg.seed,
            problems_per_call=cfg.problems_per_call or default_problems_per_call(rollout_cfg.engine),
        )
        settings = {
            "model": str(source.path.resolve()),
            "engine": rollout_cfg.engine,
            **prompt_settings(encoder, reward_cfg),
        }
        try:
            run = EvalRun(out, tasks, sampling, settings, fresh=args.overwrite)
        except ConfigError as err:
            raise ConfigError(f"--out: {err}") from None
        with run:
            pending = run.pending()
            if pending:
                _log(f"{pending} responses to sample into {out}")
                hf_dir = export.materialize(log=_log)
                device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
                engine = start_engine(rollout_cfg, source, hf_dir, device, out)
                try:
                    run.generate(engine, tokenizer, reward_cfg, log=_log)
                finally:
                    engine.shutdown()
            results = run.results(name, {"preset": args.decoding, "temperature": temperature, "top_p": top_p})
    finally:
        export.cleanup()
    print(markdown_table([results]), end="")
    _log(f"results in {out / RESULTS_FILE}")


def read_yaml_text(text: str, flag: str) -> dict:
    import yaml

    from stapo_megatron.config.core import load_yaml_text

    try:
        value = load_yaml_text(text)  # duplicate keys and alias bombs refused
    except (yaml.YAMLError, RecursionError):
        raise ConfigError(f"{flag}: {text!r} is not a YAML mapping") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: {text!r} is not a mapping (e.g. '{{enable_thinking: false}}')")
    return value


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a model on the math benchmarks (avg@k, pass@k), or compare evaluations",
        description=(
            "Sample k responses per problem and report avg@k and pass@k per benchmark and their average, "
            "as results.json, table.md and responses.jsonl in --out. Running the same command again continues "
            "an interrupted evaluation. With --compare: one table over finished evaluations."
        ),
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="Hugging Face Qwen3 directory, or a stapo Megatron checkpoint (exported first)")
    what.add_argument("--compare", nargs="+", metavar="DIR", help="print one table over these evaluation directories")
    parser.add_argument("--name", default=None, help="model name in the table (default: the model's directory name)")
    parser.add_argument("--engine", choices=("local", "sglang"), default=None,
                        help="rollout engine (default: --rollout-config's, else local)")
    parser.add_argument("--benchmarks", default=",".join(PAPER_BENCHMARKS), help="comma-separated benchmark names")
    parser.add_argument("--decoding", choices=tuple(DECODING), default="train",
                        help="train: temperature 1.0, top-p 1.0; justrl: temperature 0.7, top-p 0.9")
    parser.add_argument("--k", default=None,
                        help="samples per problem: N for all, or benchmark=N,... (default: 32 for AIME24, AIME25, "
                             "AMC23; 4 for MATH-500, Minerva, OlympiadBench)")
    parser.add_argument("--limit", type=int, default=0, help="only the first N problems of each benchmark (0: all)")
    parser.add_argument("--out", default=None,
                        help=f"output directory (default: {DEFAULT_OUT_ROOT}/<name>-<decoding>); with --compare: "
                             "a file for the table")
    parser.add_argument("--data-dir", default=None, help="directory holding the benchmark files (aime24.jsonl, ...)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="longest response in tokens")
    parser.add_argument("--template", default="stapo",
                        help="prompt template: stapo, raw, or a text containing {problem}")
    parser.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=False,
                        help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--chat-template-kwargs", default="",
                        help="YAML mapping passed to apply_chat_template, e.g. '{enable_thinking: false}'")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory (default: the model's, or the Megatron checkpoint's hf_assets/)")
    parser.add_argument("--export-dir", default=None,
                        help="where a Megatron checkpoint is exported (kept and reused; default: a temporary directory)")
    parser.add_argument("--device", default=None, help="device of the local engine (default: cuda when available)")
    parser.add_argument("--problems-per-call", type=int, default=0,
                        help="problems per engine call (0: 1 for local, 64 for sglang); keep it when resuming")
    parser.add_argument("--rollout-config", default=None,
                        help="YAML of the rollout section (engine, local, sglang), or a training config holding one")
    parser.add_argument("--rollout", action="append", default=[], metavar="KEY=VALUE",
                        help="override a rollout setting, e.g. sglang.tp_size=2 (repeatable)")
    parser.add_argument("--reward-workers", type=int, default=None, help="answer-verification processes (default: 2)")
    parser.add_argument("--overwrite", action="store_true", help="discard responses already in --out and start over")
    parser.set_defaults(func=run_eval)
