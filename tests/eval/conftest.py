"""Fixtures of the evaluation tests: the shared benchmark files, the Qwen3 tokenizer, a tiny model."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import SHARED, save_tiny_qwen3

EVAL_DATA = SHARED / "data" / "eval"
TOKENIZER_DIR = SHARED / "assets" / "qwen3-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def eval_data_dir():
    if not (EVAL_DATA / "aime24.jsonl").is_file():
        pytest.skip(f"the shared benchmark files are not at {EVAL_DATA} (../shared/data/eval next to the repository)")
    return EVAL_DATA


@pytest.fixture(scope="session")
def tokenizer_dir():
    if not all((TOKENIZER_DIR / name).is_file() for name in TOKENIZER_FILES):
        pytest.skip(f"the Qwen3 tokenizer is not at {TOKENIZER_DIR} (../shared/assets next to the repository)")
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def qwen3_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer_dir):
    """A random Qwen3 with the real vocabulary (151,936 rows) and tiny hidden sizes, with the Qwen3 tokenizer."""
    directory = save_tiny_qwen3(
        tmp_path_factory.mktemp("model") / "tiny-qwen3", tie=True, seed=3, vocab_size=151936, max_position_embeddings=4096
    )
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory
