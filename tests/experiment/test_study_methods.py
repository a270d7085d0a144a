"""A study's methods and seeds: specs read, every method validated into the config of its runs
before any run starts (a bad one is one line naming it), off-policy mini-batches, without training."""

from __future__ import annotations

import re

import pytest

from stapo_megatron.config import ConfigError, load_config
from stapo_megatron.experiment.methods import Method, parse_method, parse_methods
from stapo_megatron.experiment.paper import OUTSIDE_ALGO_SETTINGS, PAPER_COMPARISON
from stapo_megatron.experiment.study import ABLATIONS, DEFAULT_METHODS, SWEEP, Study, parse_seeds, seeds_text
from stapo_megatron.loss.token_rules import TOKEN_RULES
from stapo_megatron.trainer.config import TrainConfig
from stapo_megatron.trainer.launcher import default_config_path


def test_a_spec_is_a_preset_with_fields_on_top():
    assert parse_method("stapo") == Method("stapo")
    method = parse_method(" stapo:q=0.5:tau_p=0.012 ")
    assert method.fields == (("q", "0.5"), ("tau_p", "0.012"))
    assert method.spec == "stapo:q=0.5:tau_p=0.012"
    assert method.name == "stapo+q=0.5+tau_p=0.012"
    assert method.algo_overrides() == ["algo.q=0.5", "algo.tau_p=0.012"]
    assert [m.spec for m in parse_methods("grpo, stapo:token_rule=s2t_random,")] == [
        "grpo",
        "stapo:token_rule=s2t_random",
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("stapo:q", "method 'stapo:q': 'q' is not field=value"),
        ("stapo:q=", "method 'stapo:q=': 'q=' is not field=value"),
        (":q=0.5", "method ':q=0.5': '' is not a preset name"),
        ("configs/x.yaml", "method 'configs/x.yaml': 'configs/x.yaml' is not a preset name"),
        ("stapo:optim.lr=1", "method 'stapo:optim.lr=1': optim.lr: a method sets fields of its algo section only"),
        ("stapo:preset=grpo", "method 'stapo:preset=grpo': 'preset' is not an algo field name"),
        ("stapo:q=0.5:q=0.6", "method 'stapo:q=0.5:q=0.6': q given more than once"),
        ("stapo:token_rule=../x", "method 'stapo:token_rule=../x': token_rule=../x: a value of letters"),
    ],
)
def test_a_malformed_spec_is_one_line(text, message):
    with pytest.raises(ConfigError) as error:
        parse_method(text)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    "methods, message",
    [
        ("stapo:nope=1", "--methods stapo:nope=1: algo.nope: unknown field (known fields of algo: "),
        ("stapo:q=2", "--methods stapo:q=2: algo.q: "),
        ("nope", "--methods nope: algo: unknown algo preset 'nope' (known: "),
        ("stapo:token_rule=nope", "--methods stapo:token_rule=nope: algo.token_rule: unknown rule 'nope' (known: "),
        # the tiny task's stapo section already sets tau_p 0.006
        ("stapo,stapo:tau_p=0.006", "--methods stapo:tau_p=0.006: the same runs as stapo (the same algo settings)"),
        ("stapo,stapo", "--methods: stapo given more than once"),
    ],
)
def test_a_method_that_is_not_valid_fails_before_any_run(tmp_path, methods, message):
    with pytest.raises(ConfigError) as error:
        Study(tmp_path / "study", methods=parse_methods(methods)).method_overrides()
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert not (tmp_path / "study").exists()


def test_the_default_methods_are_the_papers_set_its_ablations_and_a_sweep_all_valid(tmp_path):
    """Every default method resolves to a valid run config; the ablations name registered rules;
    the STAPO variants keep the tiny task's tau_p unless they set their own."""
    assert DEFAULT_METHODS == (*PAPER_COMPARISON, *ABLATIONS, *SWEEP)
    assert {parse_method(m).fields[0][1] for m in ABLATIONS} <= set(TOKEN_RULES)
    study = Study(tmp_path)
    plans = study.method_overrides()
    assert list(plans) == [method.name for method in study.methods]
    task = load_config(TrainConfig, default_config_path())
    for method in study.methods:
        cfg = load_config(TrainConfig, default_config_path(), study.run_overrides(plans, method, 3))
        assert (cfg.run.seed, cfg.run.steps, cfg.parallel.tensor_parallel) == (3, study.steps, 1)
        assert cfg.run.output_dir == str(tmp_path / method.name / "seed_3")
        # four optimizer steps per rollout step, as the paper's 256 prompts in mini-batches of 64
        assert cfg.batch.prompts_per_step // cfg.batch.prompts_per_minibatch == 4 == study.minibatches
        for key, value in OUTSIDE_ALGO_SETTINGS.get(method.preset, {}).items():
            section, field = key.split(".")
            assert getattr(getattr(cfg, section), field) == value
        if method.preset == "stapo":
            fields = dict(method.fields)
            assert cfg.algo.tau_p == float(fields.get("tau_p", task.algo.tau_p))
            assert cfg.algo.q == float(fields.get("q", task.algo.q))
            assert cfg.algo.token_rule == fields.get("token_rule", "s2t")
        else:
            preset = load_config(TrainConfig, None, [f"algo={method.preset}"]).algo
            assert cfg.algo.token_rule == preset.token_rule and cfg.algo.q == preset.q
            assert not cfg.algo.dynamic_sampling  # none in the paper's comparison


def test_the_minibatches_must_divide_the_prompts_of_a_step(tmp_path):
    with pytest.raises(ConfigError, match=r"^--minibatches 5: does not divide batch.prompts_per_step 64$"):
        Study(tmp_path, methods=(Method("grpo"),), minibatches=5).method_overrides()
    plans = Study(tmp_path, methods=(Method("grpo"),), minibatches=1).method_overrides()
    assert "batch.prompts_per_minibatch=64" in plans["grpo"]


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "batch.prompts_per_minibatch=8",
            "the study sets batch.prompts_per_minibatch for every run; use --minibatches",
        ),
        ("run.seed=3", "the study sets run.seed for every run; use --seeds"),
        ("algo.q=0.5", "the study sets algo.q for every run; use --methods (a method such as stapo:q=0.5)"),
        ("optim.weight_decay=0.1", "the clip_cov runs set optim.weight_decay themselves"),
    ],
)
def test_an_override_of_what_the_study_or_a_method_sets_is_refused(tmp_path, override, message):
    with pytest.raises(ConfigError, match="^" + re.escape(f"{override}: {message}")):
        Study(tmp_path, methods=parse_methods("justrl,stapo,clip_cov"), overrides=(override,))


def test_seeds():
    assert parse_seeds("0-4") == (0, 1, 2, 3, 4)
    assert parse_seeds("0-2,7, 9") == (0, 1, 2, 7, 9)
    assert seeds_text((0, 1, 2, 7, 9, 10)) == "0-2,7,9-10" and seeds_text((5,)) == "5"
    for text, message in [
        ("4-2", "'4-2': seeds are from 0 to"),
        ("a", "'a' is not a seed or a range low-high"),
        ("0-2,1", "1 given more than once"),
        ("-1", "'-1' is not a seed"),
    ]:
        with pytest.raises(ConfigError, match=f"^--seeds {text}: {message}"):
            parse_seeds(text)
