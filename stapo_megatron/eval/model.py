"""The model under evaluation: a Hugging Face directory or a stapo Megatron checkpoint.

Everything that can be wrong with the path is found by :func:`inspect_model` from metadata alone.
A Megatron checkpoint is exported to Hugging Face safetensors (with the tokenizer files it carries
in ``hf_assets/``) before an engine starts; the local engine then reads the Hugging Face tensors
through ``load_weights``, and SGLang servers get the directory as their model path.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from stapo_megatron.checkpoint.dist import ASSETS_DIR
from stapo_megatron.checkpoint.hf_io import EVAL_EXPORT_MARKER, EXPORT_MARKER, HFCheckpoint
from stapo_megatron.checkpoint.marker import COMPLETE_MARKER, check_complete
from stapo_megatron.config import ConfigError
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.state_dict_adapter import hf_tensor_shapes
from stapo_megatron.rollout.config import RolloutConfig
from stapo_megatron.rollout.engine import RolloutEngine
from stapo_megatron.runtime.jsonl import read_json

logger = logging.getLogger(__name__)

# Either spelling of a Qwen tokenizer's vocabulary; without one, no tokenizer can be built.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "vocab.json")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    path: Path
    kind: str  # "hf" or "megatron"
    arch: Qwen3Config
    tokenizer_dir: Path


def hf_check(directory: Path, arch: Qwen3Config) -> None:
    """Every tensor of ``arch`` in the checkpoint at ``directory``, with its shape, and no other."""
    ignorable = ["lm_head.weight"] if arch.tie_word_embeddings else []
    HFCheckpoint(directory).check(hf_tensor_shapes(arch), ignorable=ignorable)


def inspect_model(path: str, tokenizer: str | None = None) -> ModelSource:
    """What ``path`` holds, checked without reading any weights."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"--model: {path} {'is not a directory' if directory.exists() else 'does not exist'}")
    try:
        if (directory / COMPLETE_MARKER).is_file():
            from stapo_megatron.checkpoint.convert import read_meta

            arch, _ = read_meta(directory)
            kind, tokenizer_dir = "megatron", directory / ASSETS_DIR
        elif (directory / "config.json").is_file():
            arch = Qwen3Config.from_hf(directory)
            hf_check(directory, arch)
            kind, tokenizer_dir = "hf", directory
        else:
            raise ConfigError(
                f"{path} is neither a Hugging Face checkpoint (config.json and safetensors) nor a complete stapo "
                f"Megatron checkpoint (with {COMPLETE_MARKER})"
            )
    except ConfigError as err:
        raise ConfigError(f"--model: {err}") from None
    if tokenizer:
        tokenizer_dir = Path(tokenizer)
        if not tokenizer_dir.is_dir():
            raise ConfigError(f"--tokenizer: {tokenizer} is not a directory")
    if not any((tokenizer_dir / name).is_file() for name in TOKENIZER_VOCAB_FILES):
        files = " or ".join(TOKENIZER_VOCAB_FILES)
        if tokenizer:
            raise ConfigError(f"--tokenizer: {tokenizer_dir} holds no tokenizer files ({files})")
        raise ConfigError(f"--model: {tokenizer_dir} holds no tokenizer files ({files}); pass --tokenizer DIR")
    return ModelSource(directory, kind, arch, tokenizer_dir)


def load_tokenizer(directory: Path, field: str = "--tokenizer") -> Any:
    """The tokenizer in ``directory`` (read from there only); an error names ``field``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises many types for a bad directory
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{field}: cannot load a tokenizer from {directory}: {first_line}") from None


def default_model_name(path: Path) -> str:
    """The directory name; ``<run>/iter_0000100`` for a training checkpoint (``<run>/checkpoints/iter_*``)."""
    path = path.resolve()
    if re.fullmatch(r"iter_\d+", path.name) and path.parent.name == "checkpoints":
        return f"{path.parent.parent.name}/{path.name}"
    return path.name


class HFExport:
    """The Hugging Face directory the engine loads: the model itself, or a Megatron checkpoint's export.

    The export goes to ``export_dir`` (kept, and reused while the checkpoint is unchanged) or to a
    temporary directory removed by :meth:`cleanup`.
    """

    def __init__(self, source: ModelSource, export_dir: str | None = None):
        self.source = source
        self._temporary = False
        if source.kind == "hf":
            self.hf_dir = source.path
            return
        if export_dir:
            self.hf_dir = Path(export_dir)
            if self.hf_dir.exists() and not self.hf_dir.is_dir():
                raise ConfigError(f"--export-dir: {export_dir} is not a directory")
            if (
                self.hf_dir.is_dir()
                and any(self.hf_dir.iterdir())
                and not any((self.hf_dir / marker).is_file() for marker in (EXPORT_MARKER, EVAL_EXPORT_MARKER))
            ):
                # The export replaces the directory: never do that to something stapo did not write.
                raise ConfigError(f"--export-dir: {export_dir} is not empty and holds no stapo export")
        else:
            self.hf_dir = Path(tempfile.mkdtemp(prefix="stapo-eval-export-")) / "hf"
            self._temporary = True

    def _identity(self) -> dict:
        return {
            "checkpoint": str(self.source.path.resolve()),
            "complete": check_complete(self.source.path),
            "tokenizer": str(self.source.tokenizer_dir.resolve()),
        }

    def materialize(self) -> Path:
        """Export the checkpoint unless an export of the same checkpoint is already there."""
        if self.source.kind == "hf":
            return self.hf_dir
        from stapo_megatron.checkpoint.convert import convert_megatron_to_hf

        identity = json.loads(json.dumps(self._identity()))
        marker = self.hf_dir / EVAL_EXPORT_MARKER
        if marker.is_file():
            try:
                if read_json(marker, "--export-dir") == identity:
                    return self.hf_dir
            except ConfigError:  # a damaged marker: the export is redone
                pass
        logger.info("exporting %s to Hugging Face format in %s", self.source.path, self.hf_dir)
        convert_megatron_to_hf(self.source.path, self.hf_dir, tokenizer_dir=self.source.tokenizer_dir, overwrite=True)
        # Written last: an export killed half-way has no marker and is redone.
        marker.write_text(json.dumps(identity, indent=2), encoding="utf-8")
        return self.hf_dir

    def cleanup(self) -> None:
        if self._temporary:
            shutil.rmtree(self.hf_dir.parent, ignore_errors=True)


def load_hf_weights(engine: RolloutEngine, hf_dir: Path, arch: Qwen3Config) -> None:
    """Stream a Hugging Face checkpoint's tensors into ``engine``, one tensor at a time."""
    hf_check(hf_dir, arch)
    checkpoint = HFCheckpoint(hf_dir)
    engine.load_weights((name, checkpoint.read(name)) for name in hf_tensor_shapes(arch))


def start_engine(
    rollout_cfg: RolloutConfig, source: ModelSource, hf_dir: Path, device: str, log_dir: Path
) -> RolloutEngine:
    """The configured engine, holding the model's weights."""
    from stapo_megatron.rollout.factory import build_engine

    engine = build_engine(rollout_cfg, source.arch, torch.device(device), hf_dir=str(hf_dir), run_dir=log_dir)
    if rollout_cfg.engine == "local":
        try:
            load_hf_weights(engine, hf_dir, source.arch)
        except BaseException:
            engine.shutdown()
            raise
    return engine
