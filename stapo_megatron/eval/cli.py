"""``stapo eval``: score a model on the math benchmarks, or compare finished evaluations.

The command line (``--config FILE``, dotted overrides, the short flags below) becomes one
validated :class:`EvalCommandConfig`; an error is one line naming the field or flag at fault,
before any weights are read. The work is :mod:`stapo_megatron.eval.run`. Rerunning the same
command continues an interrupted evaluation from the responses it already wrote.
"""

from __future__ import annotations

from stapo_megatron.config import ConfigError, read_yaml
from stapo_megatron.config.command import (
    CommandConfig,
    Flag,
    add_command_arguments,
    load_command,
    register_command_config,
)
from stapo_megatron.eval.config import EvalCommandConfig

# The STAPO paper (arXiv 2602.15620 v1) evaluates "with a maximum length of 20,480 tokens", longer than
# its training's responses (about 15k).
DEFAULT_MAX_NEW_TOKENS = 20480


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


def _k_fields(text: str) -> dict:
    k, per_benchmark = parse_k(text)
    return {"eval.k": k, "eval.k_by_benchmark": per_benchmark}


def _chat_kwargs_field(text: str) -> dict:
    import yaml

    from stapo_megatron.config.core import load_yaml_text

    if not text.strip():
        return {"chat_template_kwargs": {}}
    try:
        value = load_yaml_text(text)  # duplicate keys and alias bombs refused
    except (yaml.YAMLError, RecursionError):
        raise ConfigError(f"--chat-template-kwargs: {text!r} is not a YAML mapping") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--chat-template-kwargs: {text!r} is not a mapping (e.g. '{{enable_thinking: false}}')")
    return {"chat_template_kwargs": value}


FLAGS = (
    Flag("--model", "model", metavar="PATH"),
    Flag("--compare", "compare", kind="list", metavar="DIR"),
    Flag("--name", "name"),
    Flag("--out", "out"),
    Flag("--tokenizer", "tokenizer", metavar="DIR"),
    Flag("--export-dir", "export_dir", metavar="DIR"),
    Flag("--device", "device"),
    Flag("--template", "template"),
    Flag("--chat-template", "chat_template", kind="bool"),
    Flag("--chat-template-kwargs", "chat_template_kwargs", parse=_chat_kwargs_field, metavar="YAML"),
    Flag("--overwrite", "overwrite", kind="true"),
    Flag("--benchmarks", "eval.benchmarks", metavar="A,B,..."),
    Flag("--data-dir", "eval.data_dir", metavar="DIR"),
    Flag("--decoding", "eval.decoding"),
    Flag("--k", "eval.k", parse=_k_fields, metavar="N|BENCHMARK=N,..."),
    Flag("--limit", "eval.limit"),
    Flag("--max-new-tokens", "eval.max_new_tokens"),
    Flag("--seed", "eval.seed"),
    Flag("--problems-per-call", "eval.problems_per_call"),
    Flag("--verifier-model", "eval.verifier_model", metavar="PATH"),
    Flag("--engine", "rollout.engine"),
    Flag("--reward-workers", "reward.num_workers"),
)


def eval_command() -> CommandConfig:
    return CommandConfig(
        "eval",
        EvalCommandConfig,
        FLAGS,
        defaults={"eval.max_new_tokens": DEFAULT_MAX_NEW_TOKENS},
        note="--k N,BENCHMARK=N sets eval.k and eval.k_by_benchmark; --rollout KEY=VALUE is rollout.KEY=VALUE.",
    )


def _rollout_base(path: str | None) -> dict:
    """The rollout section of --rollout-config: a file of that section, or a training config holding one."""
    if not path:
        return {}
    data = read_yaml(path)
    return {"rollout": data["rollout"] if isinstance(data.get("rollout"), dict) else data}


def _serve_evaluated_model(data: dict) -> None:
    """Launched SGLang servers load the evaluated model unless the rollout config names a model or URLs."""
    rollout = data.get("rollout")
    if not isinstance(rollout, dict) or rollout.get("engine") != "sglang":
        return
    sglang = rollout.get("sglang")
    if sglang is None or isinstance(sglang, dict):
        sglang = dict(sglang or {})
        if not sglang.get("urls") and not sglang.get("model_path"):
            sglang["model_path"] = data.get("model", "")
        rollout["sglang"] = sglang


def load_eval_config(args):
    return load_command(
        eval_command(),
        args,
        extra_overrides=[f"rollout.{item}" for item in args.rollout],
        base=_rollout_base(args.rollout_config),
        complete=_serve_evaluated_model,
    )


def run_eval(args) -> None:
    from stapo_megatron.eval.run import run_eval_command

    loaded = load_eval_config(args)
    with loaded.names.renaming():
        run_eval_command(loaded.cfg, loaded.names)


def register(subparsers) -> None:
    register_command_config("eval", eval_command)
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a model on the math benchmarks (avg@k, pass@k), or compare evaluations",
        description=(
            "Sample k responses per problem and report avg@k and pass@k per benchmark and their average, "
            "as results.json, table.md and responses.jsonl in the output directory; with --verifier-model, the "
            "responses the rules grade wrong are judged again by that model (verdicts.jsonl) and the rectified "
            "scores reported beside. Running the same command again continues an interrupted evaluation. With "
            "--compare: one table over finished evaluations."
        ),
    )
    add_command_arguments(
        parser,
        eval_command(),
        config_help="YAML of the eval command's fields (listed below)",
        overrides_help="dotted overrides, e.g. eval.k=8 rollout.sglang.tp_size=2",
    )
    parser.add_argument(
        "--rollout-config",
        default=None,
        help="YAML of the rollout section, or a training config holding one; the rollout fields "
        "of --config and the command line override it",
    )
    parser.add_argument(
        "--rollout",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="rollout.KEY=VALUE, e.g. --rollout sglang.tp_size=2 (repeatable)",
    )
    parser.set_defaults(func=run_eval)
