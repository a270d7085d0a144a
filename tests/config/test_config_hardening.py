"""Config hardening: non-finite numbers, declared ranges, size caps, duplicate YAML keys, alias bombs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stapo_megatron.config import ConfigError, describe, load_config, read_yaml
from stapo_megatron.config.core import MAX_YAML_NODES, parse_override
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.rewards.config import RewardConfig
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.validation import check_train_config
from tests.helpers import REPO_ROOT

ROWS = describe(TrainConfig)
FLOAT_FIELDS = [name for name, type_name, _, _ in ROWS if type_name.split()[0] == "float"]
INT_FIELDS = [name for name, type_name, _, _ in ROWS if type_name.split()[0] == "int"]


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, overrides)
    return str(info.value)


def test_the_field_lists_cover_the_config():
    # The parametrized tests below are generated from the config itself; make sure they see it all.
    assert {
        "optim.lr",
        "optim.beta1",
        "optim.beta2",
        "optim.eps",
        "optim.weight_decay",
        "optim.clip_grad",
        "batch.temperature",
        "algo.eps_high",
        "algo.entropy_coef",
        "model.rope_theta",
        "model.rms_norm_eps",
        "reward.timeout_s",
        "reward.kill_grace_s",
        "algo.tau_h",
    } <= set(FLOAT_FIELDS)
    assert {
        "data.synthetic_distractors",
        "batch.group_size",
        "batch.max_new_tokens",
        "model.vocab_size",
        "reward.num_workers",
        "rollout.sglang.weight_bucket_bytes",
        "parallel.data_parallel",
    } <= set(INT_FIELDS)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_every_float_field_rejects_nan_and_inf(field):
    for text, shown in ((".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf"), ("nan", "'nan'")):
        assert _error([f"{field}={text}"]) == f"{field}: must be a finite number, got {shown}"


def test_every_numeric_field_declares_its_range():
    # Floats: at least a lower bound; counts and sizes: both, so a huge value fails before anything allocates.
    for name, type_name, _, _ in ROWS:
        if name in FLOAT_FIELDS:
            assert any(mark in type_name for mark in (">", " in [", " in (")), f"{name}: {type_name}"
        if name in INT_FIELDS:
            assert " in [" in type_name or " in (" in type_name, f"{name}: {type_name}"


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.beta1=1", "optim.beta1: must be in [0, 1), got 1.0"),
        ("optim.beta2=-0.1", "optim.beta2: must be in [0, 1), got -0.1"),
        ("optim.eps=0", "optim.eps: must be in (0, 1], got 0.0"),
        ("optim.weight_decay=-0.01", "optim.weight_decay: must be in [0, 1], got -0.01"),
        ("optim.lr=0", "optim.lr: must be > 0, got 0.0"),
        ("optim.clip_grad=-1", "optim.clip_grad: must be >= 0, got -1.0"),
        ("batch.temperature=0", "batch.temperature: must be in (0, 100], got 0.0"),
        ("batch.top_p=1.5", "batch.top_p: must be in (0, 1], got 1.5"),
        ("algo.eps_high=-0.1", "algo.eps_high: must be >= 0, got -0.1"),
        ("algo.q=1.01", "algo.q: must be in [0, 1], got 1.01"),
        ("algo.tau_h=-1", "algo.tau_h: must be >= 0, got -1.0"),
        ("model.rope_theta=0", "model.rope_theta: must be > 0, got 0.0"),
        ("model.rms_norm_eps=1", "model.rms_norm_eps: must be in (0, 1), got 1.0"),
        ("reward.kill_grace_s=-1", "reward.kill_grace_s: must be in [0, 3600], got -1.0"),
        ("rollout.sglang.request_timeout_s=0", "rollout.sglang.request_timeout_s: must be in (0, 604800.0], got 0.0"),
        ("rollout.sglang.mem_fraction_static=1", "rollout.sglang.mem_fraction_static: must be in (0, 1), got 1.0"),
        ("batch.stop_token_ids=[2,-1]", "batch.stop_token_ids[1]: must be >= 0, got -1"),
        ("run.steps=0", "run.steps: must be >= 1, got 0"),
    ],
)
def test_declared_ranges_name_the_field_and_the_bound(override, message):
    assert _error([override]) == message


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.synthetic_distractors=100000000", "data.synthetic_distractors: must be <= 65536, got 100000000"),
        ("batch.max_new_tokens=1000000000", "batch.max_new_tokens: must be <= 1048576, got 1000000000"),
        ("batch.group_size=100000", "batch.group_size: must be <= 4096, got 100000"),
        ("model.vocab_size=1.0e+12", "model.vocab_size: must be <= 4194304, got 1000000000000"),
        (
            "rollout.sglang.weight_bucket_bytes=1.0e+15",
            "rollout.sglang.weight_bucket_bytes: must be <= 1099511627776, got 1000000000000000",
        ),
        ("parallel.tensor_parallel=1000000", "parallel.tensor_parallel: must be <= 65536, got 1000000"),
        ("reward.max_answer_chars=100000000", "reward.max_answer_chars: must be <= 1048576, got 100000000"),
    ],
)
def test_size_fields_have_an_upper_bound(override, message):
    assert _error([override]) == message


def test_cross_section_sizes_are_bounded_before_anything_starts():
    cfg = load_config(
        TrainConfig,
        None,
        ["batch.prompts_per_step=65536", "batch.prompts_per_minibatch=65536", "batch.group_size=4096"],
    )
    with pytest.raises(ConfigError, match=r"^batch.group_size: prompts_per_step x group_size = 268435456 responses"):
        check_train_config(cfg, files=False)
    cfg = load_config(TrainConfig, None, [f"parallel.{name}=1024" for name in ("tensor_parallel", "data_parallel")])
    with pytest.raises(ConfigError, match=r"^parallel: .* = 1048576 ranks, more than 65536"):
        check_train_config(cfg, files=False)


def test_sections_built_without_build_check_their_fields():
    # RewardPool builds RewardConfig from its arguments; a checkpoint's config.json builds Qwen3Config.
    with pytest.raises(ConfigError, match=r"^timeout_s: must be a finite number, got nan$"):
        RewardConfig(timeout_s=float("nan"))
    with pytest.raises(ConfigError, match=r"^num_workers: must be <= 1024, got 5000$"):
        RewardConfig(num_workers=5000)
    hf = Qwen3Config().to_hf_dict()
    with pytest.raises(ConfigError, match=r"^config.json: rope_theta: must be a finite number, got nan$"):
        Qwen3Config.from_hf_dict(json.loads(json.dumps({**hf, "rope_theta": float("nan")})))
    with pytest.raises(ConfigError, match=r"^config.json: rms_norm_eps: must be in \(0, 1\), got -1.0$"):
        Qwen3Config.from_hf_dict({**hf, "rms_norm_eps": -1})
    with pytest.raises(ConfigError, match=r"^config.json: malformed architecture field"):
        Qwen3Config.from_hf_dict({**hf, "head_dim": None, "num_attention_heads": 0})


def test_malformed_hf_config_json_gives_one_line(tmp_path):
    file = tmp_path / "config.json"
    file.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=r"config.json: JSON nested too deeply$"):
        Qwen3Config.from_hf(tmp_path)
    file.write_bytes(b'{"model_type": "qwen3\xff"}')
    with pytest.raises(ConfigError, match=r"config.json: not UTF-8 text$"):
        Qwen3Config.from_hf(tmp_path)
    file.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json: expected a JSON object, got list$"):
        Qwen3Config.from_hf(tmp_path)


def test_docs_show_each_fields_range():
    types = {name: type_name for name, type_name, _, _ in ROWS}
    assert types["optim.beta1"] == "float in [0, 1)"
    assert types["optim.lr"] == "float > 0"
    assert types["data.synthetic_distractors"] == "int in [0, 65536]"
    assert types["algo.name"] == "str"


# --- YAML ---


def test_duplicate_keys_are_an_error_naming_key_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  name: first\n  steps: 3\nbatch:\n  group_size: 4\nrun:\n  steps: 5\n")
    with pytest.raises(ConfigError) as info:
        read_yaml(path)
    assert str(info.value) == f"config file {path} is not valid YAML: duplicate key 'run' (line 6)"
    path.write_text("optim:\n  lr: 1.0e-6\n  beta1: 0.9\n  lr: 2.0e-6\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'lr' \(line 4\)$"):
        load_config(TrainConfig, path)
    with pytest.raises(
        ConfigError,
        match=r"^override 'data.chat_template_kwargs': value is not valid YAML: "
        r"duplicate key 'a' \(line 1\)$",
    ):
        parse_override("data.chat_template_kwargs={a: 1, a: 2}")
    # Merge keys override on purpose: not duplicates.
    path.write_text("base: &base {lr: 1.0e-6, beta1: 0.9}\noptim:\n  <<: *base\n  lr: 3.0e-6\n")
    assert read_yaml(path)["optim"] == {"lr": 3.0e-6, "beta1": 0.9}


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path):
    # "Billion laughs": 9 levels of 9 aliases each expand to 9^9 (387 million) strings.
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    lines += ["data:", "  chat_template_kwargs: {bomb: *l9}"]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, path)
    assert str(info.value) == (
        f"config file {path} is not valid YAML: aliases expand to more than {MAX_YAML_NODES} nodes (line 6)"
    )
    path.write_text("a: &a [1, *a]\n")
    with pytest.raises(ConfigError, match=r"an alias refers to a node that contains it \(line 1\)$"):
        read_yaml(path)
    with pytest.raises(ConfigError, match=r"^override 'data.chat_template_kwargs': value is not valid YAML: aliases"):
        parse_override(
            "data.chat_template_kwargs={"
            + ", ".join(
                [f"l0: &l0 [{', '.join(['x'] * 10)}]"]
                + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 6)]
            )
            + "}"
        )
    # Aliases within the bound still work.
    path.write_text("x: &x {a: 1}\ny: [*x, *x]\n")
    assert read_yaml(path)["y"] == [{"a": 1}, {"a": 1}]


def test_malformed_yaml_files_give_one_line(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError, match=r"^config file .*deep.yaml is nested too deeply$"):
        read_yaml(deep)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"run:\n  name: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"^config file .*binary.yaml is not UTF-8 text \(line 2, byte 14\)$"):
        read_yaml(binary)
    with pytest.raises(ConfigError, match=r"^config file /dev/zero is larger than 16 MiB$"):
        read_yaml("/dev/zero")
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [1\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: expected ',' or '\]', but got '<stream end>' \(line 2"):
        read_yaml(broken)


def _stapo_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``stapo ARGS`` in a process of its own, ``env`` on top of this one's."""
    return subprocess.run(
        [sys.executable, "-m", "stapo_megatron.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
        timeout=120,
    )


def test_stapo_config_reports_a_duplicate_key_in_one_line(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("run:\n  name: kept\nrun:\n  steps: 2\n")
    result = _stapo_process("config", "--config", str(path))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"stapo: error: config file {path} is not valid YAML: duplicate key 'run' (line 3)\n"


def test_huge_integers_and_nul_characters_are_one_line_naming_the_field(tmp_path):
    """An integer of 5,000 digits (Python refuses to read one over 4,300 with a traceback) and a NUL
    in a string (every os call refuses it with a traceback) are refused as they load."""
    huge = "9" * 5000
    with pytest.raises(
        ConfigError, match=r"^override 'run.steps': .*an integer of 5000 digits \(line 1\), more than 100$"
    ):
        load_config(TrainConfig, None, [f"run.steps={huge}"])
    path = tmp_path / "huge.yaml"
    path.write_text(f"run:\n  steps: {huge}\n")
    with pytest.raises(ConfigError, match=r"an integer of 5000 digits \(line 2\), more than 100$"):
        load_config(TrainConfig, path)
    assert load_config(TrainConfig, None, ["run.steps=12"]).run.steps == 12  # ordinary integers still load
    for field in ("name", "output_dir"):
        path = tmp_path / f"nul_{field}.yaml"
        path.write_text(f'run:\n  {field}: "a\\0b"\n')
        with pytest.raises(ConfigError, match=rf"^run.{field}: contains a NUL character$"):
            load_config(TrainConfig, path)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("RANK", "abc", "RANK: expected an integer, got 'abc'"),
        ("RANK", "5000000", "RANK: must be in [0, 1048575], got '5000000'"),
        ("STAPO_LOG_ALL_RANKS", "maybe", "STAPO_LOG_ALL_RANKS: expected 1 or 0 (true or false), got 'maybe'"),
    ],
)
def test_a_bad_console_variable_is_one_line(name, value, message):
    # a process of its own: the console is configured once per process
    result = _stapo_process("plan", "--model", "qwen3_1.7b", "--gpus", "8", env={name: value})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"stapo: error: {message}\n"
