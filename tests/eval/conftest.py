"""Fixtures of the evaluation tests: the repository's benchmark excerpts, the Qwen3 tokenizer, a tiny model."""

from __future__ import annotations

import shutil

import pytest

from tests.fixtures import EVAL_DIR, TOKENIZER_FILES, write_qwen3_tokenizer
from tests.helpers import save_tiny_qwen3


@pytest.fixture(scope="session")
def eval_data_dir():
    """The first rows of every benchmark file (``tests.fixtures.ROWS`` counts them)."""
    return EVAL_DIR


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return write_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3-tokenizer"))


@pytest.fixture(scope="session")
def qwen3_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer_dir):
    """A random Qwen3 with the real vocabulary (151,936 rows) and tiny hidden sizes, with the Qwen3 tokenizer."""
    directory = save_tiny_qwen3(
        tmp_path_factory.mktemp("model") / "tiny-qwen3",
        tie=True,
        seed=3,
        vocab_size=151936,
        max_position_embeddings=4096,
    )
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory
