"""From records to prompt token ids: the template, optionally the chat template, the tokenizer."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from stapo_megatron.data.config import PROMPT_TEMPLATES, DataConfig
from stapo_megatron.data.loaders import load_records
from stapo_megatron.data.records import DataError, EncodedPrompt, LoadReport, PromptRecord
from stapo_megatron.data.synthetic import synthetic_records

logger = logging.getLogger(__name__)


def load_tokenizer(data: DataConfig, tokenizer_dir: str):
    """The run's tokenizer: the synthetic task's own, or the Hugging Face one in ``tokenizer_dir``."""
    if data.is_synthetic:
        from stapo_megatron.data.synthetic import synthetic_tokenizer

        return synthetic_tokenizer(data.synthetic_distractors)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def render_prompt(problem: str, template: str = "stapo") -> str:
    """The prompt text: ``template`` is a name in PROMPT_TEMPLATES or a text containing ``{problem}``."""
    text = PROMPT_TEMPLATES.get(template, template)
    if "{problem}" not in text:
        raise ValueError(f"prompt template {template!r} is not known and does not contain {{problem}}")
    # replace, not format: problems and the template itself are full of LaTeX braces.
    return text.replace("{problem}", problem)


class PromptEncoder:
    """Turns records into prompt token ids with a Hugging Face tokenizer or the tiny tokenizer."""

    def __init__(
        self,
        tokenizer: Any,
        template: str = "stapo",
        chat_template: bool = False,
        chat_template_kwargs: dict | None = None,
    ):
        render_prompt("", template)  # fail now on a bad template
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{type(tokenizer).__name__} has no chat template; set chat_template to false")
        self.tokenizer = tokenizer
        self.template = template
        self.chat_template = chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @classmethod
    def from_config(cls, cfg: DataConfig, tokenizer: Any) -> PromptEncoder:
        return cls(tokenizer, cfg.template_text, cfg.chat_template, cfg.chat_template_kwargs)

    def text(self, record: PromptRecord) -> str:
        """The full prompt text, chat template included when enabled."""
        text = render_prompt(record.problem, self.template)
        if self.chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                tokenize=False,
                add_generation_prompt=True,
                **self.chat_template_kwargs,
            )
        return text

    def encode(self, record: PromptRecord) -> list[int]:
        return self.encode_many([record])[0]

    def encode_many(self, records: Sequence[PromptRecord]) -> list[list[int]]:
        """Token ids of each record's prompt, tokenized as one batch."""
        if not records:
            return []
        texts = [self.text(record) for record in records]
        # The chat template already spells out its special tokens (and a BOS when the model has one).
        encoded = self.tokenizer(texts, add_special_tokens=not self.chat_template)["input_ids"]
        return [list(ids) for ids in encoded]


@dataclasses.dataclass
class PromptDataset:
    """The training prompts: records and their token ids, plus the report of what was dropped."""

    records: list[PromptRecord]
    prompt_ids: list[tuple[int, ...]]
    report: LoadReport

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> EncodedPrompt:
        return EncodedPrompt(self.records[index], self.prompt_ids[index])

    def batch(self, indices: Sequence[int]) -> list[EncodedPrompt]:
        return [self[i] for i in indices]


def load_prompt_records(cfg: DataConfig) -> tuple[list[PromptRecord], LoadReport]:
    """The records of ``cfg.source`` (the synthetic problems, or a loaded file or dataset)."""
    if cfg.is_synthetic:
        records = synthetic_records()
        return records, LoadReport(source="synthetic", rows=len(records), kept=len(records))
    return load_records(
        cfg.source,
        fmt=cfg.format,
        split=cfg.split,
        problem_field=cfg.problem_field,
        answer_field=cfg.answer_field,
        answer_format=cfg.answer_format,
        bad_rows=cfg.bad_rows,
        deduplicate=cfg.deduplicate,
    )


def build_prompt_dataset(cfg: DataConfig, tokenizer: Any, encode_batch_size: int = 1024) -> PromptDataset:
    """Load, encode and length-filter the training prompts; the report counts every drop."""
    records, report = load_prompt_records(cfg)
    encoder = PromptEncoder.from_config(cfg, tokenizer)
    kept_records: list[PromptRecord] = []
    kept_ids: list[tuple[int, ...]] = []
    too_long = 0
    for start in range(0, len(records), encode_batch_size):
        chunk = records[start : start + encode_batch_size]
        for record, ids in zip(chunk, encoder.encode_many(chunk)):
            if len(ids) > cfg.max_prompt_tokens:
                message = (
                    f"{cfg.source}: row {record.row}: prompt has {len(ids)} tokens, more than "
                    f"max_prompt_tokens={cfg.max_prompt_tokens}"
                )
                if cfg.bad_rows == "error":
                    raise DataError(message)
                report.drop("prompt_too_long", message)
                too_long += 1
                continue
            kept_records.append(record)
            kept_ids.append(tuple(ids))
    report.kept = len(kept_records)
    if too_long:
        logger.warning("%s", report.summary())
    if not kept_records:
        raise DataError(f"{cfg.source}: no usable prompts ({report.summary()})")
    return PromptDataset(kept_records, kept_ids, report)


def default_stop_token_ids(tokenizer: Any, chat_template: bool) -> list[int]:
    """The tokens that end a response: end-of-text, and end-of-turn when prompts use the chat template."""
    ids = {tokenizer.eos_token_id}
    if chat_template:
        end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(end_of_turn, int) and end_of_turn != getattr(tokenizer, "unk_token_id", None):
            ids.add(end_of_turn)
    return sorted(i for i in ids if i is not None)


def response_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The text a response is scored on (every reward kind, training and evaluation): decoded without
    special tokens, as verl decodes a response before its reward sees it (a special token kept in the
    text would, e.g., move the 100-character window of DAPO's strict-box check)."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)
