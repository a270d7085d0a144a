"""What a run is, recorded in every checkpoint, and what a resume may change of it.

Every checkpoint's common state (``common.pt``) holds the run's record under :data:`RECORD_KEY`:
the model architecture, the parallel layout, the tokenizer (a sha256 of each file that decides
tokenization), the data settings and the algorithm, all plain JSON types (read back with
``weights_only=True``). A resume compares the checkpoint's record with the run's before any tensor
is read (:func:`plan_resume`):

* another model or tokenizer is refused: the weights belong to that model and its token ids;
* another parallel layout is resharded where Megatron's distributed checkpointing can do it: the
  model's weights and a replicated optimizer's state (``optim.distributed=false``) into any
  tensor-, pipeline- and data-parallel layout; the distributed optimizer's state, saved
  ``dp_reshardable`` (its only format that writes without gathering the state: see
  :mod:`stapo_megatron.trainer.checkpointing`), into another data-parallel size only. A change it
  cannot reshard is refused, naming the way out;
* other algorithm or data settings take effect, each change logged as a warning; changed data
  settings start the prompt order afresh, since the saved position belongs to the old order.

A checkpoint from before the record is compared on what it holds: the architecture of its
``stapo`` metadata and its ``layout`` entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stapo_megatron.checkpoint.convert import TOKENIZER_FILES, hf_assets, read_meta
from stapo_megatron.checkpoint.dist import common_field
from stapo_megatron.config import ConfigError, to_dict

if TYPE_CHECKING:
    from stapo_megatron.trainer.config import TrainConfig

RECORD_KEY = "run_record"
RECORD_FORMAT = 1
SECTIONS = ("model", "layout", "tokenizer", "data", "algo")
# generation_config.json holds sampling defaults, which decide no token ids.
TOKENIZATION_FILES = tuple(name for name in TOKENIZER_FILES if name != "generation_config.json")
# Model fields a resume may change: the dtype an export writes, and the length the rotary table is
# built for (the weights, and what they compute on shorter sequences, stay the same).
ADJUSTABLE_MODEL_FIELDS = ("torch_dtype", "max_position_embeddings")
_LAYOUT_FIELDS = {
    "tensor_parallel": "parallel.tensor_parallel",
    "pipeline_parallel": "parallel.pipeline_parallel",
    "data_parallel": "parallel.data_parallel",
    "sequence_parallel": "parallel.sequence_parallel",
    "pipeline_split": "the layers per pipeline stage",
    "distributed_optimizer": "optim.distributed",
}
# Context parallelism is not in it: the trainer builds context_parallel=1 only (trainer.validation).
_SIZES = ("tensor_parallel", "pipeline_parallel", "data_parallel")
_MAX_DEPTH = 16  # of a record's data and algo values: a config nests two or three levels


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a resume from a checkpoint changes: ``changes``, one warning line each (rank 0 logs
    them before the first step), and whether the prompt order starts afresh."""

    changes: list[str]
    fresh_sampler: bool


def tokenizer_digests(directory: str) -> dict[str, str]:
    """The sha256 of each file of ``directory`` that decides tokenization. A JSON file is hashed in
    a canonical form (sorted keys, no spacing): a re-save that only reorders or re-indents it is
    the same tokenizer on any machine."""
    if not directory:
        return {}
    digests = {}
    for name, path in sorted(hf_assets(directory).items()):
        if name not in TOKENIZATION_FILES:
            continue
        content = path.read_bytes()
        if name.endswith(".json"):
            try:
                parsed = json.loads(content)
            except (ValueError, RecursionError):
                pass  # hashed as it is: the tokenizer that loaded it decides what it means
            else:
                content = json.dumps(parsed, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
        digests[name] = hashlib.sha256(content).hexdigest()
    return digests


def run_record(cfg: TrainConfig, tokenizer_dir: str) -> dict:
    """This run's record (plain JSON types); ``tokenizer_dir``: the directory of the tokenizer files
    the checkpoints carry ('': none)."""
    parallel = cfg.parallel
    return {
        "format": RECORD_FORMAT,
        "model": {**to_dict(cfg.model), "params_dtype": cfg.compute.params_dtype},
        "layout": {
            **{name: getattr(parallel, name) for name in _SIZES},
            "sequence_parallel": parallel.sequence_parallel,
            "pipeline_split": list(cfg.model.layers_per_stage(parallel.pipeline_parallel)),
            "distributed_optimizer": cfg.optim.distributed,
        },
        "tokenizer": {"directory": tokenizer_dir, "files": tokenizer_digests(tokenizer_dir)},
        "data": to_dict(cfg.data, redact=True),
        "algo": to_dict(cfg.algo, redact=True),
    }


# ---- the record as read back ---------------------------------------------------------------------


def _is_plain(value: Any, depth: int = 0) -> bool:
    """JSON's types only (what a record is written with), nested at most ``_MAX_DEPTH`` deep."""
    if depth > _MAX_DEPTH:
        return False
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v, depth + 1) for k, v in value.items())
    return False


def shown_value(value: Any) -> str:
    """A value read from a file, for a one-line message: its repr, cut short (repr escapes newlines
    and terminal control characters)."""
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 60 else text


def checked_field(container: dict, key: str, kind, source: str, name: str, valid=None, expected: str = "") -> Any:
    """:func:`~stapo_megatron.checkpoint.dist.common_field` (present, of ``kind``), and ``valid(value)``
    when given: else a one-line ConfigError naming ``source`` and the field, ``expected`` saying what it must be."""
    value = common_field(container, key, kind, source, name)
    if valid is not None and not valid(value):
        raise ConfigError(f"{source}: field {name} is {shown_value(value)}, not {expected} (damaged)")
    return value


def _is_size(value: Any) -> bool:
    return value >= 1


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef")


def check_record(common: dict, source: str) -> None:
    """The run record of a checkpoint's common state, field by field (``source``: its common.pt):
    one ConfigError naming the first wrong field."""
    record = checked_field(common, RECORD_KEY, dict, source, RECORD_KEY)
    version = checked_field(record, "format", int, source, f"{RECORD_KEY}.format", _is_size, "an integer >= 1")
    if version > RECORD_FORMAT:
        raise ConfigError(
            f"{source}: written by a newer stapo_megatron (run record format {version}; this one reads "
            f"{RECORD_FORMAT}): resume it with that version"
        )
    sections = {name: checked_field(record, name, dict, source, f"{RECORD_KEY}.{name}") for name in SECTIONS}
    for name in sections["model"]:
        checked_field(
            sections["model"],
            name,
            (str, bool, float, type(None)),
            source,
            f"{RECORD_KEY}.model.{name}",
            lambda v: not isinstance(v, float) or math.isfinite(v),
            "a finite number",
        )
    layout = sections["layout"]
    for name in _SIZES:
        checked_field(layout, name, int, source, f"{RECORD_KEY}.layout.{name}", _is_size, "an integer >= 1")
    for name in ("sequence_parallel", "distributed_optimizer"):
        checked_field(layout, name, bool, source, f"{RECORD_KEY}.layout.{name}")
    checked_field(
        layout,
        "pipeline_split",
        list,
        source,
        f"{RECORD_KEY}.layout.pipeline_split",
        lambda split: bool(split) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in split),
        "a list of layer counts >= 1",
    )
    files = checked_field(sections["tokenizer"], "files", dict, source, f"{RECORD_KEY}.tokenizer.files")
    for name in files:
        checked_field(files, name, str, source, f"{RECORD_KEY}.tokenizer.files.{name}", _is_digest, "a sha256 digest")
    for section in ("data", "algo"):
        for name, value in sections[section].items():
            if not _is_plain(value):
                raise ConfigError(
                    f"{source}: field {RECORD_KEY}.{section}.{name} is {shown_value(value)}, "
                    "not a config value (damaged)"
                )


def legacy_record(checkpoint: Path, common: dict) -> dict:
    """What a checkpoint from before the record says of its run: the model (its ``stapo`` metadata,
    read by :func:`~stapo_megatron.checkpoint.convert.read_meta`) and the layout (its ``layout``
    entry, and the optimizer's kind from the optimizer's common state)."""
    arch, params_dtype = read_meta(checkpoint)
    layout: dict[str, Any] = {}
    if "layout" in common:
        layout.update(zip(("tensor_parallel", "pipeline_parallel", "data_parallel"), common["layout"], strict=True))
    # The distributed optimizer's common state names its sharding; Megatron's replicated one keeps
    # its parameter groups there.
    optimizer = common["optimizer"]
    if "param_state_sharding_type" in optimizer:
        layout["distributed_optimizer"] = True
    elif "param_groups" in optimizer:
        layout["distributed_optimizer"] = False
    return {"model": {**to_dict(arch), "params_dtype": str(params_dtype).replace("torch.", "")}, "layout": layout}


# ---- the comparison ---------------------------------------------------------------------------


def _value(value: Any) -> str:
    return json.dumps(value)


def _differences(saved: dict, now: dict, names) -> list[tuple[str, Any, Any]]:
    """(field, saved value, value now) of every field of ``names`` that both hold and that differs."""
    return [
        (name, saved[name], now[name]) for name in names if name in saved and name in now and saved[name] != now[name]
    ]


def _model_refusal(saved: dict, now: dict) -> str | None:
    fields = [name for name in now if name not in ADJUSTABLE_MODEL_FIELDS]
    differ = _differences(saved, now, fields)
    if not differ:
        return None
    said = ", ".join(
        f"{'compute' if name == 'params_dtype' else 'model'}.{name} is {_value(old)} in the checkpoint, "
        f"{_value(new)} now"
        for name, old, new in differ
    )
    if [name for name, _, _ in differ] == ["params_dtype"]:
        # The weights fit; the optimizer keeps its state in another form.
        return (
            f"{said}; resume needs the same precision (start a new run.output_dir; checkpoint.load_megatron "
            "starts one from these weights)"
        )
    return f"{said}; resume needs the same model (start a new run.output_dir)"


def _tokenizer_refusal(saved: dict, now: dict) -> str | None:
    old, new = saved["files"], now["files"]
    if old == new:
        return None
    said = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            said.append(f"{name} only in the checkpoint")
        elif name not in old:
            said.append(f"{name} only now")
        elif old[name] != new[name]:
            said.append(f"{name} differs")
    return (
        f"the tokenizer is not the checkpoint's ({', '.join(said)}); resume needs the same tokenizer, whose token "
        "ids the weights were trained on (start a new run.output_dir)"
    )


def _layout_refusal(saved: dict, now: dict, checkpoint: Path) -> str | None:
    def said(differ) -> str:
        return ", ".join(
            f"{_LAYOUT_FIELDS[name]} is {_value(old)} in the checkpoint, {_value(new)} now" for name, old, new in differ
        )

    kind = _differences(saved, now, ["distributed_optimizer"])
    if kind:
        old = _value(kind[0][1])
        return (
            f"{said(kind)}: the two optimizers keep their state in different forms; resume with optim.distributed={old}"
        )
    if now["distributed_optimizer"]:
        names = ["tensor_parallel", "pipeline_parallel"]
        split = saved.get("pipeline_split")
        if (
            split
            and sum(split) == sum(now["pipeline_split"])
            and saved["pipeline_parallel"] == now["pipeline_parallel"]
        ):
            names.append("pipeline_split")  # the same stages and layers split otherwise (by another version)
        differ = _differences(saved, now, names)
        if differ:
            keep = " ".join(
                f"{_LAYOUT_FIELDS[name]}={saved[name]}"
                for name in ("tensor_parallel", "pipeline_parallel")
                if name in saved
            )
            return (
                f"{said(differ)}: the distributed optimizer's state (optim.distributed=true) reshards only to another "
                f"data-parallel size; resume with {keep}, or start a new run.output_dir from these weights with "
                f"checkpoint.load_megatron={checkpoint} (any layout; the optimizer state starts afresh)"
            )
    return None


def _changes(section: str, saved: dict, now: dict, names) -> list[str]:
    """A line per field of ``names`` that differs; one that only one side has (a field of another
    version) is shown as absent on the other."""
    absent = "(absent)"
    return [
        f"{section}.{name} changed on resume: {_value(saved[name]) if name in saved else absent} -> "
        f"{_value(now[name]) if name in now else absent} (takes effect)"
        for name in names
        if saved.get(name, absent) != now.get(name, absent)
    ]


def plan_resume(checkpoint: Path, common: dict, now: dict) -> ResumePlan:
    """Compare the record in ``common`` (a checkpoint's validated common state) with this run's
    ``now``: a one-line ConfigError naming every refused difference, else the plan."""
    saved = common.get(RECORD_KEY)
    changes = []
    if saved is None:
        saved = legacy_record(checkpoint, common)
        changes.append(
            f"{checkpoint}: written before checkpoints recorded the whole run; its tokenizer, data settings and "
            "algorithm cannot be compared, only its model and layout"
        )
    refusals = [
        _model_refusal(saved["model"], now["model"]),
        _tokenizer_refusal(saved["tokenizer"], now["tokenizer"]) if "tokenizer" in saved else None,
        _layout_refusal(saved["layout"], now["layout"], checkpoint),
    ]
    said = [refusal for refusal in refusals if refusal]
    if said:
        raise ConfigError(f"{checkpoint}: cannot resume: {'; '.join(said)}")

    changes += _changes("model", saved["model"], now["model"], ADJUSTABLE_MODEL_FIELDS)
    layout_saved, layout_now = saved["layout"], now["layout"]
    for name, old, new in _differences(
        layout_saved, layout_now, ["tensor_parallel", "pipeline_parallel", "data_parallel", "sequence_parallel"]
    ):
        how = "takes effect" if name == "sequence_parallel" else "resharded"
        changes.append(f"{_LAYOUT_FIELDS[name]} changed on resume: {_value(old)} -> {_value(new)} ({how})")
    positions = ("tensor_parallel", "pipeline_parallel", "data_parallel")
    if any(layout_saved.get(name) != layout_now[name] for name in positions):
        changes.append(
            "the checkpoint's random-number states belong to its ranks' places in the old layout: they start from "
            "run.seed, as in a fresh run (the rollouts do not depend on them: each step samples with its own seed)"
        )
    for section in ("algo", "data"):
        if section in saved:
            changes += _changes(section, saved[section], now[section], sorted(set(saved[section]) | set(now[section])))
    # A data setting both sides hold, changed: the saved position belongs to the old prompt order.
    fresh_sampler = "data" in saved and bool(_differences(saved["data"], now["data"], now["data"]))
    if fresh_sampler:
        changes.append("the data settings changed: the prompt order starts afresh, at epoch 0 of the new data")
    return ResumePlan(changes, fresh_sampler)
