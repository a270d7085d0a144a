"""Checks across config sections and against files on disk, before any process group starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from stapo_megatron.config import MAX_BATCH, ConfigError
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.parallelize import check_layout
from stapo_megatron.runtime.distributed import MAX_RANKS
from stapo_megatron.trainer.config import TrainConfig

# Fields that describe the weights; the rest (dtype written on export, rope length) may differ.
_ARCH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
)


def _check_same_arch(expected: Qwen3Config, found: Qwen3Config, where: str) -> None:
    for name in _ARCH_FIELDS:
        if getattr(expected, name) != getattr(found, name):
            raise ConfigError(f"model.{name}: is {getattr(expected, name)!r} but {where} has {getattr(found, name)!r}")


def _check_initial_weights(cfg: TrainConfig) -> None:
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.models.qwen3.state_dict_adapter import hf_tensor_shapes

    ckpt = cfg.checkpoint
    if ckpt.load_hf:
        if not Path(ckpt.load_hf).is_dir():
            raise ConfigError(f"checkpoint.load_hf: {ckpt.load_hf} is not a directory")
        _check_same_arch(cfg.model, Qwen3Config.from_hf(ckpt.load_hf), ckpt.load_hf)
        ignorable = ["lm_head.weight"] if cfg.model.tie_word_embeddings else []
        HFCheckpoint(ckpt.load_hf).check(hf_tensor_shapes(cfg.model), ignorable=ignorable)
    if ckpt.load_megatron:
        from stapo_megatron.checkpoint.convert import read_meta

        arch, _ = read_meta(ckpt.load_megatron)
        _check_same_arch(cfg.model, arch, ckpt.load_megatron)


def _check_data(cfg: TrainConfig, files: bool) -> None:
    data = cfg.data
    if data.is_synthetic:
        from stapo_megatron.data.synthetic import synthetic_vocab_size

        needed = synthetic_vocab_size(data.synthetic_distractors)
        if cfg.model.vocab_size < needed:
            raise ConfigError(
                f"model.vocab_size: {cfg.model.vocab_size} is smaller than the synthetic task's tokenizer ({needed} "
                "tokens)"
            )
        return
    source = Path(data.source)
    if files and source.suffix in (".parquet", ".jsonl", ".json") and not source.is_file():
        raise ConfigError(f"data.source: {data.source} does not exist")
    tokenizer = cfg.hf_tokenizer_dir
    if not tokenizer:
        raise ConfigError("tokenizer: needed for a real dataset (or set checkpoint.load_hf, whose tokenizer is used)")
    if files and not Path(tokenizer).is_dir():
        raise ConfigError(f"tokenizer: {tokenizer} is not a directory")


def check_train_config(cfg: TrainConfig, files: bool = True) -> None:
    """Every check across sections; with ``files=False`` nothing on disk is looked at (the paths
    may be another machine's, as when submitting through an SSH tunnel)."""
    p = cfg.parallel
    if p.world_size > MAX_RANKS:
        raise ConfigError(
            f"parallel: tensor x pipeline x context x data parallel = {p.world_size} ranks, more than {MAX_RANKS}"
        )
    responses = cfg.batch.prompts_per_step * cfg.batch.group_size
    if responses > MAX_BATCH:
        raise ConfigError(
            f"batch.group_size: prompts_per_step x group_size = {responses} responses per step, more than {MAX_BATCH}"
        )
    check_layout(cfg.model, p.tensor_parallel, p.pipeline_parallel)
    if p.context_parallel > 1:
        # Megatron splits a sequence over CP ranks only inside Transformer Engine's attention
        # (ring attention over load-balanced chunks); the local spec's attention cannot, and the
        # trainer's micro-batches and loss keep each sequence whole on a rank.
        raise ConfigError(
            "parallel.context_parallel: must be 1 (context parallelism needs Transformer Engine's attention "
            "and sequence-split micro-batches, which the trainer does not build; sequence_parallel splits "
            "activations over TP instead)"
        )
    if cfg.algo.overlong_shaping and cfg.algo.overlong_buffer > cfg.batch.max_new_tokens:
        raise ConfigError(
            f"algo.overlong_buffer: {cfg.algo.overlong_buffer} is longer than batch.max_new_tokens "
            f"{cfg.batch.max_new_tokens}"
        )
    if cfg.data.is_synthetic and cfg.reward.kind in ("math", "dapo"):
        raise ConfigError(
            "reward.kind: the synthetic task is scored with free_words or exact (its answers have no \\boxed{})"
        )
    if cfg.eval.every:
        from stapo_megatron.data.benchmarks import get_benchmark

        if cfg.data.is_synthetic:
            raise ConfigError(
                "eval.every: the math benchmarks cannot be evaluated with the synthetic task's tokenizer; set 0"
            )

        if not cfg.eval.data_dir:
            raise ConfigError("eval.data_dir: needed when eval.every > 0")
        for name in cfg.eval.benchmarks if files else ():
            path = Path(cfg.eval.data_dir) / get_benchmark(name).file_name
            if not path.is_file():
                raise ConfigError(f"eval.data_dir: {path} (benchmark {name}) does not exist")
    if cfg.eval.verifier_model:
        raise ConfigError(
            "eval.verifier_model: only for stapo eval (evaluation inside training grades with the rules alone)"
        )
    if cfg.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb_project: wandb is not installed (pip install 'stapo_megatron[wandb]')")
    _check_data(cfg, files)
    if files:
        _check_initial_weights(cfg)
        from stapo_megatron.rewards import check_reward_function

        # reward.kind custom: the function is imported and its signature checked in a short-lived
        # reward worker (never in this process), before anything starts
        check_reward_function(cfg.reward)
        if cfg.checkpoint.resume == "required":
            from stapo_megatron.trainer.checkpoint_directory import CheckpointDirectory

            checkpoints = CheckpointDirectory(cfg.run.directory, cfg.checkpoint.keep_last)
            if checkpoints.latest() is None:
                raise ConfigError(f"checkpoint.resume: required, but {checkpoints.root} holds no complete checkpoint")
