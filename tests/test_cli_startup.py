"""What the ``stapo`` command prints around its product: none of Megatron's warnings about its
fallbacks and defaults, and no traceback when the reader of its output goes away."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

MEGATRON_MODULES = "megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs, megatron.core.distributed"


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_importing_the_trainer_and_megatron_prints_no_fallback_warnings():
    # the ranks' entry point imports the package first, as every stapo process does
    code = (
        f"import stapo_megatron.trainer.main, stapo_megatron.trainer.trainer, {MEGATRON_MODULES}\n"
        "from megatron.core.transformer.transformer_config import TransformerConfig\n"
        "TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)"
    )  # as each rank builds its model
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "not installed" not in done.stderr and "Warning" not in done.stderr, done.stderr
    # other warnings from the same modules still show: the filter names these messages only
    code = (
        "import warnings, stapo_megatron\n"
        "warnings.warn_explicit('Apex is not installed.', UserWarning, 'x.py', 1, module='megatron.core.x')\n"
        "warnings.warn_explicit('other', UserWarning, 'x.py', 2, module='megatron.core.x')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert "UserWarning: other" in done.stderr and "Apex" not in done.stderr, done.stderr


def test_train_help_prints_only_the_help():
    command = [sys.executable, "-m", "stapo_megatron.cli", "train", "--help"]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage: stapo train") and done.stderr == ""


def test_a_reader_that_leaves_gets_no_traceback():
    """``stapo config --docs | head``: the pipe closes before the command has written everything."""
    process = subprocess.Popen(
        [sys.executable, "-m", "stapo_megatron.cli", "config", "--docs"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    process.stdout.close()  # the reader is gone before the first write
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=300) == 128 + signal.SIGPIPE
    assert stderr == ""
