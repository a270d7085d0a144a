"""Every command's front-end: ``--config FILE`` + dotted overrides + short flags into its own
validated dataclass, alias/field conflicts, the field list of ``--help`` and ``stapo config
--docs <command>``, and eval's vocabulary check before any weights are read."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from stapo_megatron.cli import main, parse_args
from stapo_megatron.config import describe
from stapo_megatron.eval.cli import load_eval_config
from stapo_megatron.eval.config import EvalCommandConfig
from stapo_megatron.launch.plan_command import load_plan
from stapo_megatron.launch.plan_config import PlanConfig
from stapo_megatron.launch.submission import SubmitConfig, prepare
from stapo_megatron.launch.submit import options_from_args
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.launcher import default_config_path
from tests.helpers import save_tiny_qwen3


def write_yaml(path, data) -> str:
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


def error_line(capsys, argv) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_eval_config_file_overrides_and_flags(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    path = write_yaml(
        tmp_path / "eval.yaml",
        {
            "model": str(tmp_path / "model"),
            "template": "raw",
            "eval": {"data_dir": str(data_dir), "k": 4, "limit": 9, "benchmarks": ["aime24", "amc23"]},
            "rollout": {"engine": "sglang", "sglang": {"tp_size": 2}},
        },
    )
    loaded = load_eval_config(
        parse_args(
            [
                "eval",
                "--config",
                path,
                "eval.limit=3",
                "--seed",
                "7",
                "--k",
                "8,aime24=16",
                "--reward-workers",
                "5",
                "--rollout",
                "sglang.mem_fraction_static=0.5",
                "--chat-template-kwargs",
                "{enable_thinking: false}",
            ]
        )
    )
    cfg = loaded.cfg
    assert isinstance(cfg, EvalCommandConfig)
    assert (cfg.eval.limit, cfg.eval.seed, cfg.eval.k, cfg.eval.k_by_benchmark) == (3, 7, 8, {"aime24": 16})
    assert cfg.eval.benchmarks == ["aime24", "amc23"] and cfg.template == "raw"
    assert cfg.eval.max_new_tokens == 20480  # the eval command's default, not the training section's 0
    assert cfg.reward.num_workers == 5 and cfg.chat_template_kwargs == {"enable_thinking": False}
    sglang = cfg.rollout.sglang
    assert (cfg.rollout.engine, sglang.tp_size, sglang.mem_fraction_static) == ("sglang", 2, 0.5)
    # launched servers load the evaluated model unless the rollout config names one
    assert cfg.rollout.sglang.model_path == str(tmp_path / "model")
    assert loaded.names.name("eval.seed") == "--seed" and loaded.names.name("eval.limit") == "eval.limit"


def test_plan_reads_its_section_of_a_training_config(tmp_path, capsys):
    path = write_yaml(
        tmp_path / "train.yaml",
        {
            "model": "qwen3_8b",
            "parallel": {"tensor_parallel": 4, "data_parallel": 2},
            "plan": {"gpu_memory_gb": 141, "recompute": "full"},
        },
    )
    argv = [
        "plan",
        "--config",
        path,
        "batch.max_tokens_per_microbatch=4096",
        "batch.max_new_tokens=3072",
        "data.max_prompt_tokens=1024",
        "plan.reserve_gb=6",
        "--tp",
        "2",
    ]
    cfg, names, train = load_plan(parse_args(argv))
    assert isinstance(cfg, PlanConfig) and isinstance(train, TrainConfig)
    assert (cfg.gpu_memory_gb, cfg.recompute, cfg.reserve_gb, cfg.tp, cfg.seq_len) == (141.0, "full", 6.0, 2, None)
    assert train.batch.max_tokens_per_microbatch == 4096 and train.parallel.world_size == 8
    assert names.name("plan.tp") == "--tp" and names.name("plan.reserve_gb") == "plan.reserve_gb"
    assert main(argv) == 0
    out = capsys.readouterr().out
    # 8 GPUs from the config's layout, TP 2 from the flag (so PP 1, DP 4), the rest from the plan: section
    assert "8 GPUs of 141 GiB; sequence 4096 tokens x micro-batch 1; recompute full" in out
    # plan.reserve_gb is the fragmentation term: + a CUDA context 0.6 + 4 communicators (world, TP, DP,
    # model parallel) x 0.4
    assert "TP=2 PP=1 DP=4" in out and "reserve 8.2" in out


def test_readme_plan_command_works_as_written(capsys):
    assert main(["plan", "--model", "qwen3_32b", "--gpus", "16"]) == 0
    out = capsys.readouterr().out
    # without a training config the sequence is batch.max_tokens_per_microbatch's default
    assert out.startswith("32,762,123,264 parameters; 16 GPUs of 79.6 GiB; sequence 18432 tokens")


def test_submit_reads_its_section_of_a_training_config(tmp_path, capsys):
    train = yaml.safe_load(default_config_path().read_text(encoding="utf-8"))  # the tiny CPU run: 2 ranks
    train["run"]["name"] = "sectioned"
    train["submit"] = {"account": "rl", "gpus_per_node": 0, "procs_per_node": 2, "env": ["A=1"]}
    path = write_yaml(tmp_path / "train.yaml", train)
    options, names = options_from_args(
        parse_args(["submit", "--config", path, "run.steps=3", "--partition", "batch", "submit.time=00:30:00"])
    )
    assert isinstance(options, SubmitConfig)
    assert (options.account, options.gpus_per_node, options.procs_per_node, options.env) == ("rl", 0, 2, ["A=1"])
    assert (options.partition, options.time, options.overrides) == ("batch", "00:30:00", ["run.steps=3"])
    assert names.name("submit.partition") == "--partition" and names.name("submit.time") == "submit.time"
    sub = prepare(options)  # the training part comes without the submit: section
    assert (sub.cfg.run.steps, sub.cfg.run.name, sub.processes.per_node, sub.title) == (3, "sectioned", 2, "sectioned")
    # the training config's readers leave the command sections to their commands
    assert main(["config", "--config", path]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["run"]["name"] == "sectioned" and "submit" not in shown


@pytest.mark.parametrize(
    "argv,expected",
    [
        (
            ["plan", "--model", "qwen3_8b", "--gpus", "8", "plan.gpus=16"],
            "--gpus 8 and plan.gpus=16: two values for plan.gpus; give one",
        ),
        (
            ["submit", "--account", "a", "--nodes", "2", "submit.nodes=1"],
            "--nodes 2 and submit.nodes=1: two values for submit.nodes; give one",
        ),
        (
            ["submit", "--account", "a", "--dryrun", "submit.dryrun=false"],
            "--dryrun and submit.dryrun=false: two values for submit.dryrun; give one",
        ),
        (
            ["eval", "--model", "m", "--limit", "2", "eval.limit=3"],
            "--limit 2 and eval.limit=3: two values for eval.limit; give one",
        ),
        (["eval", "--model", "m", "--k", "8", "eval.k=4"], "--k 8 and eval.k=4: two values for eval.k; give one"),
        # an error names the field as it was spelled
        (["plan", "--model", "qwen3_8b", "plan.gpus=0"], "plan.gpus: must be >= 1, got 0"),
        (["plan", "--model", "qwen3_8b", "--gpus", "0"], "--gpus: must be >= 1, got 0"),
        (["plan", "--model", "qwen3_8b", "plan.nope=1"], "plan.nope: unknown field"),
        (
            ["plan", "--model", "qwen3_8b", "--gpus", "8", "batch.group_size=4"],
            "override 'batch.group_size=4': sets a training config field, but no --config is given",
        ),
        (["submit", "--account", "a", "submit.executor=pbs"], "submit.executor: 'pbs' is not one of 'slurm', 'local'"),
        (["eval", "--model", "m", "eval.limit=-1"], "eval.limit: must be >= 0, got -1"),
        (["eval", "--model", "m", "eval.every=5"], "eval.every: only for training (stapo eval evaluates once), got 5"),
        (
            ["eval", "--model", "m", "--compare", "d"],
            "--model: give a model to evaluate or finished evaluations to compare, not both",
        ),
        (
            ["train", "--no-resume", "checkpoint.resume=required"],
            "--no-resume and checkpoint.resume=required: two values for checkpoint.resume; give one",
        ),
        (
            ["train", "checkpoint.resume=auto", "--overwrite"],
            "--overwrite and checkpoint.resume=auto: two values for checkpoint.resume; give one",
        ),
        (["eval", "eval.limit=1"], "--model: required (or compare: finished evaluations to tabulate)"),
    ],
)
def test_errors_are_one_line_naming_the_spelling(capsys, argv, expected):
    line = error_line(capsys, argv)
    assert line.startswith(f"stapo: error: {expected}"), line


def test_same_value_by_flag_and_field_is_accepted(tmp_path):
    loaded = load_eval_config(
        parse_args(
            [
                "eval",
                "--model",
                "m",
                "--data-dir",
                str(tmp_path),
                "--benchmarks",
                "aime24,amc23",
                "eval.benchmarks=[aime24, amc23]",
                "--limit",
                "2",
                "eval.limit=2",
            ]
        )
    )
    assert loaded.cfg.eval.benchmarks == ["aime24", "amc23"] and loaded.cfg.eval.limit == 2


def _listed_fields(help_text: str) -> list[str]:
    """The dotted names of the field list that --help ends with (one unindented line per field)."""
    fields = help_text.split("fields (dotted overrides", 1)[1].splitlines()[1:]
    return [match[1] for match in map(re.compile(r"(\S+)(?: \[[^]]*\])?  \(").match, fields) if match]


@pytest.mark.parametrize(
    "command,cls,prefix",
    [
        ("eval", EvalCommandConfig, ""),
        ("plan", PlanConfig, "plan."),
        ("submit", SubmitConfig, "submit."),
        ("train", TrainConfig, ""),
    ],
)
def test_help_lists_every_field_once(capsys, command, cls, prefix):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    listed = _listed_fields(capsys.readouterr().out)
    expected = [name for name, *_ in describe(cls, prefix)]
    assert listed == expected and len(set(listed)) == len(listed) > 10


def test_config_docs_of_a_command(capsys):
    assert main(["config", "--docs", "eval"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines() if not line.startswith(" ")]
    assert names == [name for name, *_ in describe(EvalCommandConfig)]
    assert "eval.max_new_tokens  (int in [0, 1048576], default 20480)" in out
    assert main(["config", "--docs", "plan", "--section", "plan"]) == 0
    assert "plan.gpus  (int | None in [1, 1048576], default None)" in capsys.readouterr().out
    assert main(["config", "--docs", "--section", "algo"]) == 0  # train's, as before
    assert all(line.startswith(("algo.", " ")) for line in capsys.readouterr().out.splitlines())


def _tokenizer_of(directory, tokens: int) -> None:
    """A word-level tokenizer of ``tokens`` entries in Hugging Face's format."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, tokens)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<unk>"}),
        encoding="utf-8",
    )


def test_eval_refuses_a_tokenizer_larger_than_the_embedding(tmp_path, capsys):
    model = save_tiny_qwen3(tmp_path / "model", tie=True, vocab_size=64)
    _tokenizer_of(model, 300)
    capsys.readouterr()  # what saving the model printed
    data_dir, out = tmp_path / "data", tmp_path / "out"
    data_dir.mkdir()
    line = error_line(capsys, ["eval", "--model", str(model), "--data-dir", str(data_dir), "--out", str(out)])
    assert line == (
        f"stapo: error: --tokenizer: the tokenizer in {model} has 300 tokens, more than the 64 embedding "
        f"rows of the model {model}; give the model's own tokenizer"
    )
    assert not out.exists()  # no settings file, no directory
    # a tokenizer that fits gets past the check (to the benchmark files, absent here)
    _tokenizer_of(model, 64)
    assert "benchmark aime24" in error_line(
        capsys, ["eval", "--model", str(model), "--data-dir", str(data_dir), "--out", str(out)]
    )
    assert not out.exists()
