"""Prompt templates and encoding (the real Qwen3 tokenizer, the synthetic task's), the synthetic task, the config."""

import pytest

from stapo_megatron.config import ConfigError, build
from stapo_megatron.config.core import field_default
from stapo_megatron.data import (
    DataConfig,
    DataError,
    PromptEncoder,
    PromptRecord,
    build_prompt_dataset,
    render_prompt,
    synthetic_records,
    synthetic_tokenizer,
)
from stapo_megatron.data.prompts import response_text
from stapo_megatron.data.synthetic import synthetic_vocab, synthetic_vocab_size
from stapo_megatron.rewards import RewardPool
from stapo_megatron.rewards.extract import FREE_WORD
from tests.fixtures import ROWS

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
    # JustRL's evaluation prompt (stapo eval's default, through the chat template): a space, not a newline
    justrl = PromptEncoder(tok, "justrl", chat_template=True)
    assert justrl.text(RECORD) == (
        f"<|im_start|>user\n{RECORD.problem} {STAPO_SUFFIX.lstrip()}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_stapo_eval_prompts_as_justrl_evaluates_by_default_and_the_training_form_on_request():
    from stapo_megatron.eval.config import EvalCommandConfig

    template, chat = (field_default(EvalCommandConfig, name) for name in ("template", "chat_template"))
    assert (template, chat) == ("justrl", None)  # None: the chat template when the tokenizer has one
    instruction = "Please reason step by step, and put your final answer within \\boxed{}."
    assert render_prompt("Q?", template) == f"Q? {instruction}"
    assert render_prompt("Q?", "stapo") == f"Q?\n{instruction}"  # --template stapo: the training prompt


def test_qwen3_prompt_dataset_from_a_benchmark_file(qwen3_tokenizer, data_dir):
    cfg = build(DataConfig, {"source": str(data_dir / "eval" / "aime24.jsonl"), "chat_template": True}, "data")
    dataset = build_prompt_dataset(cfg, qwen3_tokenizer)
    rows = ROWS["aime24"]
    assert len(dataset) == rows and dataset.report.kept == rows
    item = dataset[0]
    assert item.record.answer == "204" and item.record.row == 1
    assert qwen3_tokenizer.decode(item.prompt_ids).startswith("<|im_start|>user\nEvery morning Aya")
    short = build(DataConfig, {"source": str(data_dir / "eval" / "aime24.jsonl"), "max_prompt_tokens": 120}, "data")
    dataset = build_prompt_dataset(short, qwen3_tokenizer)
    assert 0 < len(dataset) < rows
    assert dataset.report.dropped == {"prompt_too_long": rows - len(dataset)}
    assert "more than max_prompt_tokens=120" in dataset.report.messages[0]
    strict = build(DataConfig, {"source": short.source, "max_prompt_tokens": 120, "bad_rows": "error"}, "data")
    with pytest.raises(DataError, match=r"aime24.jsonl: row \d+: prompt has \d+ tokens"):
        build_prompt_dataset(strict, qwen3_tokenizer)


def test_synthetic_tokenizer_is_a_hugging_face_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = synthetic_tokenizer(241)
    assert len(tok) == 256 and synthetic_vocab_size(241) == 256
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok("3 + 4 =")["input_ids"]
    assert ids == [tok.bos_token_id, 6, 13, 7, 14]
    assert tok("3 + 4 =", add_special_tokens=False)["input_ids"] == ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == "3 + 4 ="
    assert (
        tok.decode([tok.convert_tokens_to_ids("w17"), 10, tok.eos_token_id], skip_special_tokens=False) == "w17 7 <eos>"
    )
    assert tok.convert_ids_to_tokens([10, 255]) == ["7", "w240"]
    every = list(range(3, len(tok)))
    assert tok(tok.decode(every), add_special_tokens=False)["input_ids"] == every
    with pytest.raises(Exception, match="Missing \\[UNK\\] token"):  # a word outside the vocabulary
        tok("3 x 4")
    # Real Hugging Face files, loaded back by the one path every tokenizer takes.
    tok.save_pretrained(tmp_path / "tok")
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (tmp_path / "tok").iterdir()}
    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert again.convert_ids_to_tokens(list(range(len(tok)))) == synthetic_vocab(241)
    assert again("8 + 7 =")["input_ids"] == [1, 11, 13, 10, 14]
    assert (again.bos_token, again.eos_token, again.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert len(synthetic_tokenizer(5)) == 20
    # Exactly the free words are what the free_words reward lets follow the answer.
    assert [t for t in synthetic_vocab(241) if FREE_WORD.fullmatch(t)] == [f"w{i}" for i in range(241)]
    with pytest.raises(ValueError, match="free_tokens must be >= 0"):
        synthetic_vocab(-1)


def test_synthetic_task_through_the_same_record_type():
    records = synthetic_records()
    sums = [[int(x) for x in r.problem.removesuffix(" =").split(" + ")] for r in records]
    assert sorted(map(tuple, sums)) == [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    assert [r.answer for r in records] == [str(a + b) for a, b in sums]
    assert [r.row for r in records] == list(range(1, 56))
    tok = synthetic_tokenizer(241)
    dataset = build_prompt_dataset(DataConfig(), tok)
    assert len(dataset) == 55 and dataset.report.dropped == {}
    item = next(dataset[i] for i in range(len(dataset)) if dataset[i].record.problem == "3 + 2 =")
    assert item.record == PromptRecord("synthetic:3+2", "3 + 2 =", "5", "synthetic", 30)
    assert item.prompt_ids == (tok.bos_token_id, 6, 13, 5, 14)
    assert tok.decode(item.prompt_ids, skip_special_tokens=True) == "3 + 2 ="
    # A sampled response "5 w17 w203 EOS" is scored on "5 w17 w203": its first word is the answer,
    # the free words after it decide nothing; anything else after it makes it wrong.
    five, eos = tok.convert_tokens_to_ids("5"), tok.eos_token_id
    free = tok.convert_tokens_to_ids(["w17", "w203"])
    text = response_text(tok, [five, *free, eos])
    assert text == "5 w17 w203"
    pool = RewardPool(kind="free_words")
    responses = [
        text,
        response_text(tok, [*free, five]),
        response_text(tok, [five - 1, *free]),
        response_text(tok, [five, five]),
    ]
    results = pool.score(responses, [item.record.answer] * 4)
    assert [(r.reward, r.extracted) for r in results] == [(1.0, "5"), (0.0, None), (0.0, "4"), (0.0, None)]
    pool.close()


def test_synthetic_tokenizer_has_no_chat_template():
    with pytest.raises(ValueError, match="TokenizersBackend has no chat template"):
        PromptEncoder(synthetic_tokenizer(5), "raw", chat_template=True)


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
