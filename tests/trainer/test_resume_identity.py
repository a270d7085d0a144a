"""Resume that knows what it resumes: every checkpoint records the run (model, layout, tokenizer,
data, algorithm); a resume refuses another model or tokenizer and a layout the distributed
optimizer cannot reshard, in one line on every rank, reshards what Megatron can, and applies other
algorithm and data settings with a warning per change. The run files a resume reads are checked
before any training, and the trainer's entries of ``common.pt`` field by field.

The fast tests build records from the real config; the slow ones resume real `stapo train` runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from stapo_megatron.checkpoint.safe_load import common_state_source
from stapo_megatron.config import ConfigError
from stapo_megatron.data.synthetic import synthetic_tokenizer
from stapo_megatron.trainer.checkpoint_directory import HISTORY_FILE, LATEST_FILE, CheckpointDirectory, check_run_files
from stapo_megatron.trainer.checkpointing import check_common, read_common
from stapo_megatron.trainer.launcher import default_config_path, load_train_config
from stapo_megatron.trainer.resume import check_resume_early
from stapo_megatron.trainer.run_record import (
    RECORD_KEY,
    ResumePlan,
    plan_resume,
    run_record,
    tokenizer_digests,
)
from tests.checkpoint import crafted
from tests.checkpoint.crafted import rehash
from tests.trainer.runs import checkpoint_tensors, metrics, run, torchrun_command, train_command

STEPS = ["run.steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=10"]


def _config(run_dir, *overrides):
    return load_train_config(None, [f"run.output_dir={run_dir}", *overrides])


def _tokenizer(directory, free_words: int = 9):
    synthetic_tokenizer(free_words).save_pretrained(directory)
    return str(directory)


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# ---- the run files, before any training --------------------------------------------------------


def _checkpoints(run_dir, steps=(1, 2)):
    root = run_dir / "checkpoints"
    for step in steps:
        (root / f"iter_{step:07d}").mkdir(parents=True)
        (root / f"iter_{step:07d}" / "stapo_complete.json").write_text(json.dumps({"step": step}))
    (root / HISTORY_FILE).write_text(json.dumps({"steps": list(steps)}))
    (root / LATEST_FILE).write_text(f"iter_{steps[-1]:07d}")
    return root


HISTORY_DAMAGE = {
    "cut-off": ('{"steps": [1,', r"history\.json: damaged \(not JSON: cut off\?\)"),
    "not-an-object": ("[1, 2]", r'history\.json: not \{"steps": \[\.\.\.\]\}'),
    "steps-not-a-list": ('{"steps": 2}', r'history\.json: not \{"steps": \[\.\.\.\]\}'),
    "a-string-step": ('{"steps": [1, "2"]}', r"history\.json: lists '2', not a step"),
    "a-bool-step": ('{"steps": [1, true]}', r"history\.json: lists True, not a step"),
    "a-negative-step": ('{"steps": [-1]}', r"history\.json: lists -1, not a step"),
    "not-utf8": (b"\xff\xfe", r"history\.json: damaged \(not JSON"),
}


@pytest.mark.parametrize("kind", list(HISTORY_DAMAGE))
def test_a_damaged_history_is_one_line_at_start_and_at_a_save(tmp_path, kind):
    content, message = HISTORY_DAMAGE[kind]
    root = _checkpoints(tmp_path)
    history = root / HISTORY_FILE
    history.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=message) as error:
        check_run_files(tmp_path)
    said = _one_line(error)
    # What to do, and the steps there are: nothing is rebuilt from them (they may not all be this run's).
    assert '(e.g. {"steps": [1, 2]} if every complete checkpoint there is this run\'s)' in said
    assert f"or delete it to count every complete checkpoint in {root} as this run's" in said
    with pytest.raises(ConfigError, match=message):
        CheckpointDirectory(tmp_path, keep_last=1).history()  # what a save reads before pruning
    assert history.read_bytes() == (content if isinstance(content, bytes) else content.encode())


def test_run_files_in_the_way_of_the_next_save_are_refused(tmp_path):
    check_run_files(tmp_path / "fresh")  # nothing there yet: nothing to check
    root = _checkpoints(tmp_path)
    check_run_files(tmp_path)
    (root / LATEST_FILE).write_text("iter_0000002\n")
    check_run_files(tmp_path)

    (root / LATEST_FILE).write_text("my notes on this run")
    with pytest.raises(ConfigError, match=r"latest\.txt: does not name a checkpoint .* move it away") as error:
        check_run_files(tmp_path)
    _one_line(error)
    (root / LATEST_FILE).unlink()
    (root / LATEST_FILE).mkdir()
    with pytest.raises(ConfigError, match=r"latest\.txt: does not name a checkpoint"):
        check_run_files(tmp_path)
    (root / LATEST_FILE).rmdir()
    os.symlink(tmp_path / "elsewhere", root / LATEST_FILE)
    with pytest.raises(ConfigError, match=r"latest\.txt: does not name a checkpoint"):
        check_run_files(tmp_path)
    (root / LATEST_FILE).unlink()

    (root / HISTORY_FILE).unlink()
    (root / HISTORY_FILE).mkdir()
    with pytest.raises(ConfigError, match=r"history\.json: not a regular file"):
        check_run_files(tmp_path)
    (root / HISTORY_FILE).rmdir()
    os.symlink(tmp_path / "another_runs_history.json", root / HISTORY_FILE)
    with pytest.raises(ConfigError, match=r"history\.json: not a regular file"):
        check_run_files(tmp_path)
    (root / HISTORY_FILE).unlink()
    check_run_files(tmp_path)  # no history: a directory from before it

    other = tmp_path / "other"
    other.mkdir()
    (other / "checkpoints").write_text("")
    with pytest.raises(ConfigError, match=r"other/checkpoints: not a directory"):
        check_run_files(other)
    (other / "checkpoints").unlink()
    os.symlink(tmp_path / "gone", other / "checkpoints")
    with pytest.raises(ConfigError, match=r"other/checkpoints: a link to nothing"):
        check_run_files(other)


# ---- the trainer's entries of common.pt --------------------------------------------------------


def _common(tmp_path) -> dict:
    """A common state as the trainer saves it."""
    return {
        "progress": {
            "step": 2,
            "skipped_steps": 0,
            "optimizer_steps": 2,
            "sampler": {"version": 1, "num_items": 55, "seed": 0, "shuffle": True, "epoch": 2, "position": 18},
        },
        "scheduler": {
            "max_lr": 6e-4,
            "lr_warmup_steps": 0,
            "num_steps": 2,
            "lr_decay_style": "constant",
            "lr_decay_steps": 2,
            "min_lr": 0.0,
            "start_wd": 0.0,
            "end_wd": 0.0,
            "wd_incr_style": "constant",
            "wd_incr_steps": 2,
        },
        "layout": [2, 1, 1],
        "optimizer": {"param_state_sharding_type": "dp_reshardable"},
        RECORD_KEY: run_record(_config(tmp_path / "run"), _tokenizer(tmp_path / "tokenizer")),
    }


def _set(common: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    container = common
    for key in parents:
        container = container[key]
    if value is _set:
        del container[last]
    else:
        container[last] = value
    return common


COMMON_DAMAGE = [
    ("progress", [1, 2], r"field progress is a list, not a dict"),
    ("progress.step", "2", r"field progress\.step is a string, not an integer"),
    ("progress.step", -1, r"field progress\.step is -1, not an integer >= 0"),
    ("progress.step", True, r"field progress\.step is a bool, not an integer"),
    ("progress.step", _set, r"field progress\.step is missing"),
    ("progress.skipped_steps", 1.5, r"field progress\.skipped_steps is a number, not an integer"),
    ("progress.sampler", "x", r"field progress\.sampler is a string, not a dict"),
    ("progress.sampler.position", None, r"field progress\.sampler\.position is a NoneType, not an integer"),
    ("progress.sampler.num_items", 0, r"field progress\.sampler\.num_items is 0, not an integer >= 1"),
    ("progress.sampler.shuffle", 1, r"field progress\.sampler\.shuffle is an integer, not a bool"),
    ("scheduler", None, r"field scheduler is a NoneType, not a dict"),
    ("scheduler.num_steps", "2", r"field scheduler\.num_steps is a string, not an integer"),
    ("scheduler.max_lr", float("nan"), r"field scheduler\.max_lr is nan, not a finite number >= 0"),
    ("scheduler.lr_decay_style", 3, r"field scheduler\.lr_decay_style is an integer, not a string"),
    ("layout", [2, 1], r"field layout is \[2, 1\], not \[tensor, pipeline, data\] parallel sizes"),
    ("layout", "2,1,1", r"field layout is a string, not a list"),
    ("optimizer", [], r"field optimizer is a list, not a dict"),
    ("optimizer.param_state_sharding_type", "fully_reshardable", r"param_state_sharding_type is 'fully_reshardable'"),
    (RECORD_KEY, "stapo", rf"field {RECORD_KEY} is a string, not a dict"),
    (f"{RECORD_KEY}.format", 2, r"written by a newer stapo_megatron \(run record format 2"),
    (f"{RECORD_KEY}.layout.tensor_parallel", 0, rf"field {RECORD_KEY}\.layout\.tensor_parallel is 0, not an integer"),
    (f"{RECORD_KEY}.layout.pipeline_split", [2, "x"], rf"field {RECORD_KEY}\.layout\.pipeline_split is \[2, 'x'\]"),
    (f"{RECORD_KEY}.model.hidden_size", [128], rf"field {RECORD_KEY}\.model\.hidden_size is a list"),
    (
        f"{RECORD_KEY}.tokenizer.files",
        {"tokenizer.json": "0" * 63},
        r"tokenizer\.files\.tokenizer\.json is '0+\.\.\., not a sha256 digest",
    ),
    (f"{RECORD_KEY}.algo.tau_p", float("inf"), rf"field {RECORD_KEY}\.algo\.tau_p is inf, not a config value"),
    (f"{RECORD_KEY}.data", _set, rf"field {RECORD_KEY}\.data is missing"),
]


@pytest.mark.parametrize("field, value, message", COMMON_DAMAGE, ids=[f"{f}={v!r}"[:60] for f, v, _ in COMMON_DAMAGE])
def test_the_trainers_common_state_is_checked_field_by_field(tmp_path, field, value, message):
    common = _common(tmp_path)
    check_common(common, tmp_path)
    with pytest.raises(ConfigError, match=message) as error:
        check_common(_set(common, field, value), tmp_path)
    # named as every refusal names the common state: common.pt, or 0.19's object in the data files
    assert _one_line(error).startswith(f"{common_state_source(tmp_path)}: ")


# ---- the record, and what a resume may change ------------------------------------------------------


def test_the_tokenizer_digest_is_of_what_decides_tokenization(tmp_path):
    digests = tokenizer_digests(_tokenizer(tmp_path / "a"))
    assert sorted(digests) == ["tokenizer.json", "tokenizer_config.json"]
    # Re-indented and reordered (another machine's save): the same tokenizer.
    copy = tmp_path / "b"
    _tokenizer(copy)
    parsed = json.loads((copy / "tokenizer.json").read_text())
    (copy / "tokenizer.json").write_text(json.dumps(dict(reversed(list(parsed.items()))), indent=7))
    (copy / "generation_config.json").write_text('{"temperature": 0.3}')  # sampling defaults: no tokenization
    assert tokenizer_digests(str(copy)) == digests
    assert tokenizer_digests(_tokenizer(tmp_path / "c", free_words=8))["tokenizer.json"] != digests["tokenizer.json"]
    assert tokenizer_digests("") == {}


def _plan(tmp_path, saved: dict, *overrides, tokenizer=None):
    common = {**_common(tmp_path), RECORD_KEY: saved}
    now = run_record(_config(tmp_path / "run", *overrides), tokenizer or str(tmp_path / "tokenizer"))
    return plan_resume(tmp_path / "iter_0000002", common, now)


def _refused(tmp_path, saved, *overrides, tokenizer=None) -> str:
    with pytest.raises(ConfigError) as error:
        _plan(tmp_path, saved, *overrides, tokenizer=tokenizer)
    message = _one_line(error)
    assert message.startswith(f"{tmp_path / 'iter_0000002'}: cannot resume: ")
    return message


def test_another_model_or_tokenizer_is_refused_naming_what_differs(tmp_path):
    saved = _common(tmp_path)[RECORD_KEY]
    assert _plan(tmp_path, saved) == ResumePlan([], False)  # the same run: nothing to say
    said = _refused(tmp_path, saved, "model.num_hidden_layers=4", "model.hidden_size=64")
    assert said.endswith(
        ": cannot resume: model.hidden_size is 128 in the checkpoint, 64 now, model.num_hidden_layers is 2 in the "
        "checkpoint, 4 now; resume needs the same model (start a new run.output_dir)"
    )
    said = _refused(tmp_path, saved, "model.tie_word_embeddings=false", "model.rope_theta=10000.0")
    assert "model.rope_theta is 1000000.0 in the checkpoint, 10000.0 now" in said
    assert "model.tie_word_embeddings is true in the checkpoint, false now" in said
    said = _refused(tmp_path, saved, "compute.params_dtype=bfloat16")
    assert (
        'compute.params_dtype is "float32" in the checkpoint, "bfloat16" now; resume needs the same precision' in said
    )
    # A tokenizer with another vocabulary under the same model size.
    said = _refused(tmp_path, saved, "data.synthetic_distractors=8", tokenizer=_tokenizer(tmp_path / "t8", 8))
    assert "the tokenizer is not the checkpoint's (tokenizer.json differs); resume needs the same tokenizer" in said
    # The export dtype and the rotary table's length may change.
    plan = _plan(tmp_path, saved, "model.max_position_embeddings=128", "model.torch_dtype=bfloat16")
    assert plan.changes == [
        'model.torch_dtype changed on resume: "float32" -> "bfloat16" (takes effect)',
        "model.max_position_embeddings changed on resume: 64 -> 128 (takes effect)",
    ]


def test_a_layout_change_is_resharded_where_the_optimizer_state_allows(tmp_path):
    saved = _common(tmp_path)[RECORD_KEY]  # tensor_parallel=2, the distributed optimizer
    said = _refused(tmp_path, saved, "parallel.tensor_parallel=1")
    assert said.endswith(
        "cannot resume: parallel.tensor_parallel is 2 in the checkpoint, 1 now: the distributed optimizer's state "
        "(optim.distributed=true) reshards only to another data-parallel size; resume with "
        "parallel.tensor_parallel=2 parallel.pipeline_parallel=1, or start a new run.output_dir from these weights "
        f"with checkpoint.load_megatron={tmp_path / 'iter_0000002'} (any layout; the optimizer state starts afresh)"
    )
    said = _refused(tmp_path, saved, "parallel.pipeline_parallel=2")
    assert (
        "cannot resume: parallel.pipeline_parallel is 1 in the checkpoint, 2 now: the distributed optimizer's" in said
    )
    # The same stages, the layers split otherwise (as another version might): the optimizer's shards differ.
    three = ["model.num_hidden_layers=3", "parallel.pipeline_parallel=2"]
    split = run_record(_config(tmp_path / "run", *three), str(tmp_path / "tokenizer"))
    assert split["layout"]["pipeline_split"] == [2, 1]
    split["layout"]["pipeline_split"] = [1, 2]
    said = _refused(tmp_path, split, *three)
    assert "cannot resume: the layers per pipeline stage is [1, 2] in the checkpoint, [2, 1] now: the distrib" in said

    said = _refused(tmp_path, saved, "optim.distributed=false")
    assert "optim.distributed is true in the checkpoint, false now: the two optimizers keep their state" in said

    plan = _plan(tmp_path, saved, "parallel.data_parallel=2", "parallel.sequence_parallel=true")
    assert plan.changes[:2] == [
        "parallel.data_parallel changed on resume: 1 -> 2 (resharded)",
        "parallel.sequence_parallel changed on resume: false -> true (takes effect)",
    ]
    assert (
        "random-number states belong to its ranks' places in the old layout: they start from run.seed"
        in (plan.changes[2])
    )
    assert not plan.fresh_sampler
    # The replicated optimizer's state reshards like the weights, to any layout.
    replicated = run_record(_config(tmp_path / "run", "optim.distributed=false"), str(tmp_path / "tokenizer"))
    plan = _plan(
        tmp_path, replicated, "optim.distributed=false", "parallel.tensor_parallel=1", "parallel.pipeline_parallel=2"
    )
    assert plan.changes[:2] == [
        "parallel.tensor_parallel changed on resume: 2 -> 1 (resharded)",
        "parallel.pipeline_parallel changed on resume: 1 -> 2 (resharded)",
    ]


def test_another_algorithm_or_data_setting_takes_effect_with_a_line_per_change(tmp_path):
    saved = _common(tmp_path)[RECORD_KEY]
    plan = _plan(tmp_path, saved, "algo=justrl")
    assert plan.changes == [
        'algo.name changed on resume: "stapo" -> "justrl" (takes effect)',
        "algo.tau_p changed on resume: 0.006 -> 0.002 (takes effect)",
        'algo.token_rule changed on resume: "s2t" -> "all" (takes effect)',
    ]
    assert not plan.fresh_sampler
    plan = _plan(tmp_path, saved, "data.shuffle=false", "data.seed=5")
    assert plan.changes == [
        "data.seed changed on resume: 0 -> 5 (takes effect)",
        "data.shuffle changed on resume: true -> false (takes effect)",
        "the data settings changed: the prompt order starts afresh, at epoch 0 of the new data",
    ]
    assert plan.fresh_sampler
    # A field that another version did not record yet is reported, and keeps the prompt order.
    older = {**saved, "data": {k: v for k, v in saved["data"].items() if k != "deduplicate"}}
    assert _plan(tmp_path, older) == ResumePlan(
        ["data.deduplicate changed on resume: (absent) -> false (takes effect)"], fresh_sampler=False
    )


# ---- real runs ---------------------------------------------------------------------------------------


def _attempt(command, timeout: float = 300) -> subprocess.CompletedProcess:
    from tests.trainer.runs import attempt

    return attempt(command, timeout)


def _ranks(run_dir, world: int, *overrides) -> list[str]:
    """The ranks as torchrun (or SLURM) starts them, without `stapo train`'s launcher."""
    fast = ["logging.progress_bar=false", "logging.tensorboard=false"]
    return torchrun_command(default_config_path(), world, f"run.output_dir={run_dir}", *fast, *STEPS, *overrides)


def _back_to_step_1(run_dir) -> None:
    """The run as a kill after step 1 leaves it (what a resume of step 1 reads)."""
    root = run_dir / "checkpoints"
    shutil.rmtree(root / "iter_0000002")
    (root / HISTORY_FILE).write_text(json.dumps({"steps": [1]}))
    (root / LATEST_FILE).write_text("iter_0000001")


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory):
    """Two steps of the default run (tensor_parallel=2, the distributed optimizer), a checkpoint each."""
    run_dir = tmp_path_factory.mktemp("distributed") / "run"
    run(train_command(run_dir, *STEPS))
    return run_dir


@pytest.fixture(scope="module")
def replicated_run(tmp_path_factory):
    """The same with the replicated optimizer (optim.distributed=false)."""
    run_dir = tmp_path_factory.mktemp("replicated") / "run"
    run(train_command(run_dir, *STEPS, "optim.distributed=false"))
    return run_dir


def _copy(run_dir, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


def _edit_common(checkpoint, edit) -> None:
    """Change the saved common state and recompute the checksums, as a crafted file would."""
    common = crafted.read_common(checkpoint)
    edit(common)
    crafted.write_common(checkpoint, common)
    rehash(checkpoint)


def _refused_on_every_rank(result, message: str, world: int = 2) -> None:
    """Every rank refuses alike: one line each, and no rank's traceback (torchrun's own report of the
    exit follows). Torchrun stops the other ranks once the first exits, so some may not print theirs."""
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("stapo: error: ")]
    assert 1 <= len(lines) <= world and all(message in line for line in lines), result.stderr[-3000:]
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr


@pytest.mark.slow
def test_checkpoints_record_the_run_and_a_changed_run_is_refused_before_any_tensor(distributed_run, tmp_path):
    checkpoint = distributed_run / "checkpoints" / "iter_0000002"
    common = read_common(checkpoint)
    record = common[RECORD_KEY]
    assert record["layout"] == {
        "tensor_parallel": 2,
        "pipeline_parallel": 1,
        "data_parallel": 1,
        "sequence_parallel": False,
        "pipeline_split": [2],
        "distributed_optimizer": True,
    }
    assert record["model"]["num_hidden_layers"] == 2 and record["model"]["params_dtype"] == "float32"
    assert record["tokenizer"]["files"] == tokenizer_digests(str(distributed_run / "tokenizer"))
    assert record["tokenizer"]["files"] == tokenizer_digests(str(checkpoint / "hf_assets"))
    assert record["algo"]["name"] == "stapo" and record["data"]["source"] == "synthetic"

    run_dir = _copy(distributed_run, tmp_path)
    changed = ["parallel.tensor_parallel=1", "parallel.pipeline_parallel=2", "model.num_hidden_layers=4"]
    changed.append("data.synthetic_distractors=8")
    # stapo train's launcher can refuse it before torchrun starts, from the checkpoint's common.pt alone.
    with pytest.raises(ConfigError, match=r"cannot resume: model\.num_hidden_layers is 2") as early:
        check_resume_early(_config(run_dir, *changed))
    result = _attempt(_ranks(run_dir, 2, *changed, "run.steps=3"))
    expected = str(early.value)
    assert "resume needs the same model" in expected and "(tokenizer.json differs)" in expected
    assert "the distributed optimizer's state (optim.distributed=true) reshards only" in expected
    _refused_on_every_rank(result, expected)  # the ranks' own check says the same
    assert "CheckpointingException" not in result.stderr
    assert [row["step"] for row in metrics(run_dir)] == [1, 2]

    # A checkpoint from before the record: what it holds (its model and layout) is compared.
    _edit_common(run_dir / "checkpoints" / "iter_0000002", lambda common: common.pop(RECORD_KEY))
    with pytest.raises(ConfigError, match=r"cannot resume: parallel\.tensor_parallel is 2 in the checkpoint, 1 now"):
        check_resume_early(_config(run_dir, "parallel.tensor_parallel=1"))
    plan = plan_resume(
        run_dir / "checkpoints" / "iter_0000002",
        read_common(run_dir / "checkpoints" / "iter_0000002"),
        run_record(_config(run_dir, "algo=grpo"), str(run_dir / "tokenizer")),
    )
    assert plan.changes == [
        f"{run_dir / 'checkpoints' / 'iter_0000002'}: written before checkpoints recorded the whole run; its "
        "tokenizer, data settings and algorithm cannot be compared, only its model and layout"
    ]


@pytest.mark.slow
def test_a_changed_algorithm_data_setting_and_sequence_parallelism_take_effect_with_a_warning_each(
    distributed_run, tmp_path
):
    run_dir = _copy(distributed_run, tmp_path)
    result = run(
        train_command(
            run_dir, *STEPS, "run.steps=3", "algo=justrl", "data.shuffle=false", "parallel.sequence_parallel=true"
        )
    )
    warnings = [line.split("warning: ", 1)[1] for line in result.stderr.splitlines() if "warning: " in line]
    expected = [
        "parallel.sequence_parallel changed on resume: false -> true (takes effect)",
        'algo.name changed on resume: "stapo" -> "justrl" (takes effect)',
        "algo.tau_p changed on resume: 0.006 -> 0.002 (takes effect)",
        'algo.token_rule changed on resume: "s2t" -> "all" (takes effect)',
        "data.shuffle changed on resume: true -> false (takes effect)",
        "the data settings changed: the prompt order starts afresh, at epoch 0 of the new data",
    ]
    assert [w for w in warnings if w in expected] == expected, result.stderr[-3000:]
    assert result.stderr.index(expected[0]) < result.stderr.index("resumed from")  # before the first step
    assert [row["step"] for row in metrics(run_dir)] == [1, 2, 3]
    common = read_common(run_dir / "checkpoints" / "iter_0000003")
    assert common[RECORD_KEY]["algo"]["token_rule"] == "all" and common[RECORD_KEY]["data"]["shuffle"] is False
    # The new prompt order from its start: the unshuffled epoch 0, after the step's prompts.
    assert common["progress"]["sampler"]["epoch"] == 1 and common["progress"]["sampler"]["shuffle"] is False


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["parallel.tensor_parallel=1"], ["parallel.tensor_parallel=1", "parallel.pipeline_parallel=2"]],
    ids=["tp2-to-tp1", "tp2-to-pp2"],
)
def test_the_replicated_optimizer_reshards_to_another_layout_with_the_same_weights(replicated_run, tmp_path, layout):
    run_dir = _copy(replicated_run, tmp_path)
    _back_to_step_1(run_dir)
    # stare_weight_w decides nothing under the s2t rule: the step stays comparable, and is reported.
    result = run(train_command(run_dir, *STEPS, "optim.distributed=false", "algo.stare_weight_w=1.2", *layout))
    for line in (
        "warning: parallel.tensor_parallel changed on resume: 2 -> 1 (resharded)",
        "warning: the checkpoint's random-number states belong to its ranks' places in the old layout",
        "warning: algo.stare_weight_w changed on resume: 1.1 -> 1.2 (takes effect)",
    ):
        assert line in result.stderr, result.stderr[-3000:]
    assert ("parallel.pipeline_parallel changed on resume: 1 -> 2 (resharded)" in result.stderr) == (len(layout) == 2)

    # Step 2 from the resharded step-1 checkpoint, against the run that never changed layout.
    reference, resumed = checkpoint_tensors(
        replicated_run / "checkpoints" / "iter_0000002", run_dir / "checkpoints" / "iter_0000002"
    )
    assert sorted(reference) == sorted(resumed) and len(reference) == 30  # 10 weights, their Adam moments
    vocab = 24  # the embedding's rows beyond it are the tensor-parallel padding, whose size differs
    for key, value in reference.items():
        if "word_embeddings" in key:
            value, other = value[:vocab], resumed[key][:vocab]
        else:
            other = resumed[key]
        # within the reordering of float sums (measured: 2e-7 of the largest value); a misplaced shard is off by O(1)
        assert torch.allclose(value, other, rtol=1e-4, atol=1e-5 * value.abs().max().item()), key
    ref_row, row = metrics(replicated_run)[1], metrics(run_dir)[1]
    for key in ("policy/pg_loss", "policy/entropy", "optim/grad_norm", "reward/accuracy"):
        assert row[key] == pytest.approx(ref_row[key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_a_cut_off_history_is_refused_before_any_step(distributed_run, tmp_path):
    run_dir = _copy(distributed_run, tmp_path)
    history = run_dir / "checkpoints" / HISTORY_FILE
    history.write_text('{"steps": [1,')
    result = _attempt(_ranks(run_dir, 2, "run.steps=3"))
    _refused_on_every_rank(result, f"{history}: damaged (not JSON: cut off?); it lists the checkpoints this run wrote")
    assert [row["step"] for row in metrics(run_dir)] == [1, 2]  # step 3 was never trained, so none was lost
    assert history.read_text() == '{"steps": [1,'


@pytest.mark.slow
def test_a_malformed_common_state_is_one_line_on_every_rank(distributed_run, tmp_path):
    run_dir = _copy(distributed_run, tmp_path)
    checkpoint = run_dir / "checkpoints" / "iter_0000002"
    _edit_common(checkpoint, lambda common: common["progress"].update(step="2"))
    result = _attempt(_ranks(run_dir, 2, "run.steps=3"))
    _refused_on_every_rank(
        result, f"{common_state_source(checkpoint)}: field progress.step is a string, not an integer"
    )
    assert [row["step"] for row in metrics(run_dir)] == [1, 2]
