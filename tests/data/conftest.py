from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
DATA_DIR = SHARED / "data"
QWEN3_TOKENIZER = SHARED / "assets" / "qwen3-tokenizer"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA_DIR / "eval").is_dir():
        pytest.skip(f"the shared data files are not at {DATA_DIR} (../shared/data next to the repository)")
    return DATA_DIR


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    if not (QWEN3_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"the Qwen3 tokenizer is not at {QWEN3_TOKENIZER} (../shared/assets next to the repository)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QWEN3_TOKENIZER))
