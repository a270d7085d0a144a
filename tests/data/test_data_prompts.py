"""Prompt templates and encoding (the real Qwen3 tokenizer, the tiny one), the synthetic task, the config."""

import pytest

from stapo_megatron.config import ConfigError, build
from stapo_megatron.data import (
    DataConfig,
    DataError,
    PromptEncoder,
    PromptRecord,
    TinyTokenizer,
    build_prompt_dataset,
    load_tokenizer,
    render_prompt,
    synthetic_records,
)

STAPO_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
RECORD = PromptRecord("t:1", "Find $x$ if $\\{x\\} = \\frac{1}{2}$.", "0.5", "t", 1)


def test_render_prompt():
    assert render_prompt(RECORD.problem) == RECORD.problem + STAPO_SUFFIX
    assert render_prompt(RECORD.problem, "raw") == RECORD.problem
    assert render_prompt("2+2", "Q: {problem}\nA:") == "Q: 2+2\nA:"
    with pytest.raises(ValueError, match="does not contain"):
        render_prompt("2+2", "plain text")


def test_qwen3_prompts_with_and_without_the_chat_template(qwen3_tokenizer):
    tok = qwen3_tokenizer
    plain = PromptEncoder(tok, "stapo")
    assert tok.decode(plain.encode(RECORD)) == RECORD.problem + STAPO_SUFFIX
    chat = PromptEncoder(tok, "stapo", chat_template=True)
    text = chat.text(RECORD)
    assert text == f"<|im_start|>user\n{RECORD.problem}{STAPO_SUFFIX}<|im_end|>\n<|im_start|>assistant\n"
    ids = chat.encode(RECORD)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2  # the template's, not doubled
    no_think = PromptEncoder(tok, "stapo", chat_template=True, chat_template_kwargs={"enable_thinking": False})
    assert no_think.text(RECORD).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert chat.encode_many([RECORD, RECORD]) == [ids, ids]


def test_qwen3_prompt_dataset_from_a_benchmark_file(qwen3_tokenizer, data_dir):
    cfg = build(DataConfig, {"source": str(data_dir / "eval" / "aime24.jsonl"), "chat_template": True}, "data")
    dataset = build_prompt_dataset(cfg, qwen3_tokenizer)
    assert len(dataset) == 30 and dataset.report.kept == 30
    item = dataset[0]
    assert item.record.answer == "204" and item.record.row == 1
    assert qwen3_tokenizer.decode(item.prompt_ids).startswith("<|im_start|>user\nEvery morning Aya")
    short = build(DataConfig, {"source": str(data_dir / "eval" / "aime24.jsonl"), "max_prompt_tokens": 120}, "data")
    dataset = build_prompt_dataset(short, qwen3_tokenizer)
    assert 0 < len(dataset) < 30
    assert dataset.report.dropped == {"prompt_too_long": 30 - len(dataset)}
    assert "more than max_prompt_tokens=120" in dataset.report.messages[0]
    strict = build(DataConfig, {"source": short.source, "max_prompt_tokens": 120, "bad_rows": "error"}, "data")
    with pytest.raises(DataError, match=r"aime24.jsonl: row \d+: prompt has \d+ tokens"):
        build_prompt_dataset(strict, qwen3_tokenizer)


def test_tiny_tokenizer_round_trip_and_files(tmp_path):
    tok = TinyTokenizer()
    assert tok.vocab_size == 256 and len(tok) == 256
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok.encode("3 + 4 =")
    assert ids == [tok.bos_token_id, 6, 13, 7, 14] == tok.encode("3+4=")
    assert tok.decode(ids) == "3 + 4 ="
    assert tok.decode(ids, skip_special_tokens=False) == "<bos> 3 + 4 ="
    assert tok.decode([10, tok.eos_token_id, tok.pad_token_id]) == "7"
    assert tok.convert_ids_to_tokens([10, 255]) == ["7", "<d240>"] and tok.convert_ids_to_tokens(13) == "+"
    every = list(range(3, tok.vocab_size))
    assert tok.encode(tok.decode(every), add_special_tokens=False) == every
    with pytest.raises(ValueError, match="'x' is not in the vocabulary"):
        tok.encode("3 x 4")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([256])
    tok.save_pretrained(tmp_path / "tok")
    again = load_tokenizer(tmp_path / "tok")
    assert isinstance(again, TinyTokenizer) and again.vocab == tok.vocab
    assert TinyTokenizer(distractors=5).vocab_size == 20
    assert load_tokenizer(_save(TinyTokenizer(distractors=5), tmp_path / "small")).vocab_size == 20
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tiny_tokenizer.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a tiny tokenizer file"):
        TinyTokenizer.from_pretrained(tmp_path / "bad")


def _save(tokenizer, path):
    tokenizer.save_pretrained(path)
    return path


def test_synthetic_task_through_the_same_record_type():
    records = synthetic_records()
    assert len(records) == 100 and len({r.problem for r in records}) == 100
    assert all(r.answer == str(sum(map(int, r.problem[:-2].split(" + "))) % 10) for r in records)
    tok = TinyTokenizer()
    dataset = build_prompt_dataset(DataConfig(), tok)
    assert len(dataset) == 100 and dataset.report.dropped == {}
    item = dataset[10 * 8 + 7]  # 8 + 7 =
    assert item.record == PromptRecord("synthetic:8+7", "8 + 7 =", "5", "synthetic", 88)
    assert item.prompt_ids == (tok.bos_token_id, 11, 13, 10, 14)
    assert tok.decode(item.prompt_ids) == "8 + 7 ="
    # A sampled response "5 EOS" decodes to exactly the answer the exact reward compares.
    assert tok.decode([tok.convert_tokens_to_ids("5"), tok.eos_token_id]) == item.record.answer


def test_tiny_tokenizer_has_no_chat_template():
    with pytest.raises(ValueError, match="TinyTokenizer has no chat template"):
        PromptEncoder(TinyTokenizer(), "raw", chat_template=True)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"source": ""}, "data.source: must not be empty"),
        ({"prompt_template": "plain text"}, "data.prompt_template: 'plain text' is neither"),
        ({"chat_template": True}, "data.chat_template: the synthetic task's tokenizer has no chat template"),
        ({"max_prompt_tokens": 0}, "data.max_prompt_tokens: must be >= 1"),
        ({"synthetic_distractors": -1}, "data.synthetic_distractors: must be >= 0"),
        ({"bad_rows": "ignore"}, "data.bad_rows: 'ignore' is not one of"),
        ({"answer_format": "latex"}, "data.answer_format: 'latex' is not one of"),
        ({"sauce": 1}, "data.sauce: unknown field"),
    ],
)
def test_data_config_rejects_bad_values(fields, message):
    with pytest.raises(ConfigError, match=message):
        build(DataConfig, fields, "data")


def test_data_config_templates():
    assert DataConfig().template_text == "{problem}"
    assert DataConfig(source="x.parquet").template_text.endswith("within \\boxed{}.")
    custom = build(
        DataConfig,
        {
            "source": "x.jsonl",
            "prompt_template": "Solve: {problem}",
            "chat_template_kwargs": {"enable_thinking": False},
        },
        "data",
    )
    assert custom.template_text == "Solve: {problem}" and custom.chat_template_kwargs == {"enable_thinking": False}
