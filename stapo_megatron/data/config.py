"""The ``data`` config section: where training prompts come from and how they become tokens."""

from __future__ import annotations

import dataclasses
from typing import Literal

from stapo_megatron.config import MAX_SEED, MAX_TOKENS, ConfigError, option

# The synthetic task runs on CPU: its vocabulary stays far below a real tokenizer's.
MAX_DISTRACTORS = 1 << 16

PROMPT_TEMPLATES: dict[str, str] = {
    # The STAPO paper's instruction: step-by-step reasoning, final answer in \boxed{}.
    "stapo": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "raw": "{problem}",
    # JustRL's evaluation prompt (thunlp/JustRL evals: the problem, a space, the same instruction),
    # which it sends through the chat template
    "justrl": "{problem} Please reason step by step, and put your final answer within \\boxed{}.",
}


@dataclasses.dataclass
class DataConfig:
    source: str = option(
        "synthetic",
        "training prompts: 'synthetic' (the single-digit sums a + b <= 9, with their tiny tokenizer), a .parquet "
        "or .jsonl file, a directory written by datasets' save_to_disk, or a Hugging Face dataset name",
    )
    format: Literal["auto", "parquet", "jsonl", "hf"] = option(
        "auto", "how to read source; auto: by file suffix, a directory or anything else is a Hugging Face dataset"
    )
    split: str = option("train", "split of a Hugging Face dataset")
    problem_field: str = option(
        "auto", "dotted field holding the problem (a list of chat messages gives its last user turn); auto: detected"
    )
    answer_field: str = option(
        "auto", "dotted field holding the answer, e.g. reward_model.ground_truth; auto: detected"
    )
    answer_format: Literal["auto", "plain", "boxed", "gsm8k", "list"] = option(
        "auto",
        "how the answer field is written: plain, boxed (last \\boxed{} of it), gsm8k (after '####'), list "
        "(joined with ', '); auto: detected from the first row",
    )
    prompt_template: str = option(
        "auto",
        "stapo (the paper's step-by-step instruction), justrl (JustRL's evaluation prompt), raw (the problem "
        "alone), or a custom text containing {problem}; auto: stapo, raw for the synthetic task",
    )
    chat_template: bool = option(
        False,
        "wrap the prompt in the tokenizer's chat template as one user turn, with the generation prompt, as verl "
        "builds prompts of chat-form rows (the paper configs: true for DAPO-Math-17k); false for plain-text data",
    )
    chat_template_kwargs: dict = option({}, "extra arguments of apply_chat_template, e.g. {enable_thinking: false}")
    max_prompt_tokens: int = option(
        2048,
        "prompts longer than this many tokens are dropped (and counted); DAPO-Math-17k's longest has 1503 (Qwen3)",
        ge=1,
        le=MAX_TOKENS,
    )
    bad_rows: Literal["drop", "error"] = option(
        "drop", "a row without a usable problem or answer: drop it (counted and logged) or stop with an error"
    )
    deduplicate: bool = option(False, "drop rows whose problem text already appeared (DAPO-Math-17k has 627)")
    shuffle: bool = option(True, "sample prompts in a new permutation every epoch (else in file order)")
    seed: int = option(
        0, "seed of the prompt order; epoch e uses a permutation derived from (seed, e)", ge=0, le=MAX_SEED
    )
    synthetic_distractors: int = option(
        241,
        "free words w0, w1, ... of the synthetic task's tokenizer, which a response may carry after its "
        "answer (241 makes a vocabulary of 256)",
        ge=0,
        le=MAX_DISTRACTORS,
    )

    def __post_init__(self):
        if not self.source.strip():
            raise ConfigError("source: must not be empty")
        template = self.prompt_template
        if template not in ("auto", *PROMPT_TEMPLATES) and "{problem}" not in template:
            raise ConfigError(
                f"prompt_template: {template!r} is neither a known template ({', '.join(PROMPT_TEMPLATES)}) "
                "nor a text containing {problem}"
            )
        if self.is_synthetic and self.chat_template:
            raise ConfigError("chat_template: the synthetic task's tokenizer has no chat template")

    @property
    def is_synthetic(self) -> bool:
        return self.source == "synthetic"

    @property
    def template_text(self) -> str:
        """The template with "auto" resolved."""
        if self.prompt_template == "auto":
            return PROMPT_TEMPLATES["raw" if self.is_synthetic else "stapo"]
        return PROMPT_TEMPLATES.get(self.prompt_template, self.prompt_template)
