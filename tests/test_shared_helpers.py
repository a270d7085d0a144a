"""Helpers that several places used to compute each in their own way, now defined once: the padded
vocabulary, a command's configuration error as ``stapo: error: ...`` with exit status 2, the
argparse type of a positive count, and the tokenizer directory of a training config."""

from __future__ import annotations

import argparse

import pytest

from stapo_megatron.config import ConfigError
from stapo_megatron.config.command import positive_int, run_command
from stapo_megatron.launch import plan
from stapo_megatron.models.qwen3.config import Qwen3Config, padded_vocab_size
from stapo_megatron.trainer.config import TrainConfig


def test_padded_vocab_size():
    assert padded_vocab_size(151_936, 1) == 151_936  # Qwen3's vocabulary: already a multiple of 128
    assert padded_vocab_size(151_901, 1) == 151_936
    assert padded_vocab_size(151_936, 8) == 152_576  # a multiple of 128 x 8 = 1,024
    assert padded_vocab_size(1_000, 2) == 1_024
    assert padded_vocab_size(1, 4) == 512


def test_the_planner_counts_the_padded_vocabulary():
    arch = Qwen3Config(vocab_size=1_000, hidden_size=64, tie_word_embeddings=False)
    for tp in (1, 4):
        first = {p.name: p.numel for p in plan.stage_parameters(arch, tp, 2, 0)}
        last = {p.name: p.numel for p in plan.stage_parameters(arch, tp, 2, 1)}
        # 1,000 rows padded to 1,024 (a multiple of 128 x TP), split over the TP ranks
        assert first["embedding.word_embeddings.weight"] == last["output_layer.weight"] == 1_024 // tp * 64


def test_run_command_turns_a_config_error_into_one_line_and_status_2(capsys):
    def fails(args):
        raise ConfigError(f"optim.lr: must be > 0, got {args.lr}")

    assert run_command(fails, argparse.Namespace(lr=-1)) == 2
    assert capsys.readouterr().err == "stapo: error: optim.lr: must be > 0, got -1\n"
    assert run_command(lambda args: None, argparse.Namespace()) == 0


def test_a_training_rank_reports_a_config_error_like_stapo(tmp_path, capsys):
    from stapo_megatron.trainer.main import main

    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err == f"stapo: error: config file {tmp_path / 'missing.yaml'} does not exist\n"


def test_positive_int():
    assert positive_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="must be at least 1, got 0"):
        positive_int("0")


def test_hf_tokenizer_dir():
    cfg = TrainConfig()
    assert cfg.hf_tokenizer_dir == ""
    cfg.checkpoint.load_hf = "/models/qwen3-8b"
    assert cfg.hf_tokenizer_dir == "/models/qwen3-8b"
    cfg.tokenizer = "/tokenizers/qwen3"
    assert cfg.hf_tokenizer_dir == "/tokenizers/qwen3"
