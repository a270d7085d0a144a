"""The synthetic task for CPU runs, and its tiny tokenizer.

Prompts are ``BOS a + b =`` for single digits a and b; the answer is ``(a + b) mod 10`` as one
digit, then EOS. A small randomly initialised Qwen3 learns it from scratch with GRPO in a few
hundred steps on two CPU cores (the plain sum, with two-digit answers, collapses instead).

The tokenizer has one token per digit, ``+``, ``=``, three special tokens, and ``distractors``
extra tokens that never appear in a correct answer. With the default 241 the vocabulary has 256
entries: enough rare tokens that sampling at temperature 1 produces low-probability tokens and
the S2T mask has candidates (with 16 tokens it almost never fires).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

from stapo_megatron.data.records import PromptRecord

SYNTHETIC_SOURCE = "synthetic"
TOKENIZER_FILE = "tiny_tokenizer.json"
_FORMAT = "stapo_megatron.tiny_tokenizer"
_PIECE = re.compile(r"<[^<>\s]+>|\S")


class TinyTokenizer:
    """A character-level tokenizer with the parts of the Hugging Face interface the project uses."""

    pad_token, bos_token, eos_token = "<pad>", "<bos>", "<eos>"
    chat_template = None

    def __init__(self, distractors: int = 241):
        if distractors < 0:
            raise ValueError(f"distractors must be >= 0, got {distractors}")
        self.distractors = distractors
        self.vocab: list[str] = [
            self.pad_token,
            self.bos_token,
            self.eos_token,
            *"0123456789",
            "+",
            "=",
            *(f"<d{i}>" for i in range(distractors)),
        ]
        self._ids = {token: i for i, token in enumerate(self.vocab)}
        self.pad_token_id = self._ids[self.pad_token]
        self.bos_token_id = self._ids[self.bos_token]
        self.eos_token_id = self._ids[self.eos_token]
        self.all_special_ids = [self.pad_token_id, self.bos_token_id, self.eos_token_id]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text`` (whitespace separates nothing and is dropped); BOS first by default."""
        ids = [self.bos_token_id] if add_special_tokens else []
        for piece in _PIECE.findall(text):
            if piece not in self._ids:
                raise ValueError(f"TinyTokenizer: {piece!r} is not in the vocabulary (digits, '+', '=', <dN>)")
            ids.append(self._ids[piece])
        return ids

    def __call__(self, texts: str | list[str], add_special_tokens: bool = True) -> dict:
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in texts]}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Tokens joined by single spaces: ``decode(encode("3+4="))`` is ``"3 + 4 ="``."""
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return " ".join(self.convert_ids_to_tokens([int(i) for i in ids if int(i) not in special]))

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._token(ids)
        return [self._token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | list[int]:
        if isinstance(tokens, str):
            return self._ids[tokens]
        return [self._ids[t] for t in tokens]

    def _token(self, token_id: int) -> str:
        if not 0 <= token_id < len(self.vocab):
            raise ValueError(f"TinyTokenizer: id {token_id} is outside the vocabulary of {len(self.vocab)}")
        return self.vocab[token_id]

    def save_pretrained(self, directory: str | os.PathLike) -> list[str]:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        target = path / TOKENIZER_FILE
        target.write_text(json.dumps({"format": _FORMAT, "version": 1, "vocab": self.vocab}, indent=1))
        return [str(target)]

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "TinyTokenizer":
        target = Path(directory) / TOKENIZER_FILE
        try:
            data = json.loads(target.read_text())
        except FileNotFoundError:
            raise ValueError(f"{target}: no tiny tokenizer saved there") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{target}: not valid JSON ({err.msg})") from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("vocab"), list):
            raise ValueError(f"{target}: not a tiny tokenizer file")
        tokenizer = cls(distractors=max(0, len(data["vocab"]) - len(cls(0).vocab)))
        if tokenizer.vocab != data["vocab"]:
            raise ValueError(f"{target}: vocabulary differs from the one this version builds")
        return tokenizer


def load_tokenizer(path: str | os.PathLike):
    """The tiny tokenizer if ``path`` holds one, else a Hugging Face tokenizer from ``path``."""
    if (Path(path) / TOKENIZER_FILE).is_file():
        return TinyTokenizer.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def synthetic_records() -> list[PromptRecord]:
    """All 100 problems ``a + b =`` (a, b single digits), answer ``(a + b) mod 10``."""
    return [
        PromptRecord(
            uid=f"{SYNTHETIC_SOURCE}:{a}+{b}",
            problem=f"{a} + {b} =",
            answer=str((a + b) % 10),
            source=SYNTHETIC_SOURCE,
            row=10 * a + b + 1,
        )
        for a in range(10)
        for b in range(10)
    ]
