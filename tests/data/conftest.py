"""Fixtures of the data tests: the repository's fixture files and tokenizer; the full shared files
for the heavier cases only."""

from pathlib import Path

import pytest

from tests.fixtures import DATA_DIR, write_qwen3_tokenizer
from tests.helpers import SHARED

SHARED_DATA_DIR = SHARED / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """A few rows of every shared file, in the same layout (``eval/``, ``train/``)."""
    return DATA_DIR


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    if not (SHARED_DATA_DIR / "eval").is_dir():
        pytest.skip(f"the full data files are not at {SHARED_DATA_DIR} (../shared/data next to the repository)")
    return SHARED_DATA_DIR


@pytest.fixture(scope="session")
def qwen3_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(write_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3-tokenizer"))))
