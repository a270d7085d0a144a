"""LLM-verifier rectification: the responses the rules grade wrong, judged again by a verifier model.

The STAPO paper grades with rule-based verification and then rectifies its misclassifications with
CompassVerifier-3B (Liu et al. 2025, arXiv 2508.03686; github.com/open-compass/CompassVerifier). The
verifier reads the problem, the reference answer and the whole response in its published prompt and
answers with one letter: A (correct), B (incorrect) or C (invalid: cut off, repetitive, a refusal).
Only responses the rules grade wrong are asked, so a verdict can turn wrong into correct and never
the reverse: A is the one verdict that changes a grade. The verifier's output is untrusted text: it
counts only when it is exactly one of the three letters (whitespace around it aside); anything else
is "unparsed", counted, and keeps the rule's grade. A prompt longer than the verifier's context is
not sent ("too_long") and keeps the rule's grade too.

The verifier is served like the evaluated model, after it: the local engine (Qwen3 architectures,
as the local engine runs only those) or SGLang servers launched on its directory (any architecture
SGLang serves, e.g. CompassVerifier's Qwen2.5). Its weights load from a path only.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from stapo_megatron.config import ConfigError
from stapo_megatron.eval.store import fields_problem
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.rollout.config import RolloutConfig
from stapo_megatron.rollout.engine import RolloutEngine, SamplingParams
from stapo_megatron.runtime.jsonl import is_finite_number, read_json

# CompassVerifier's prompt CV_PROMPT, verbatim (open-compass/CompassVerifier, src/prompts.py at
# c5d6700ae5a820ed1232c847a57e7060d130b7df; Apache-2.0): the verifier was trained on it, and its
# README and src/cv_eval.ipynb send it as the one user message of the chat template and decode greedily.
# Filled with str.format, which inserts the texts as they are (their braces stay).
PROMPT = (
    "\n"
    "Please as a grading expert, judge whether the final answers given by the candidates below are consistent "
    "with the standard answers, that is, whether the candidates answered correctly. \n"
    "Here are some evaluation criteria:\n"
    "1. Please refer to the given standard answer. You don't need to re-generate the answer to the question "
    "because the standard answer has been given. You only need to judge whether the candidate's answer is "
    "consistent with the standard answer according to the form of the question. THE STANDARD ANSWER IS ALWAYS "
    "CORRECT AND THE QUESTION IS PERFECTLY VALID. NEVER QUESTION THEM.\n"
    "2. ONLY compare the FINAL ANSWER - COMPLETELY IGNORE any potential errors in the REASONING PROCESSES.\n"
    "3. Some answers may be expressed in different ways, such as some answers may be a mathematical expression, "
    "some answers may be a textual description, as long as the meaning expressed is the same. Before making a "
    "judgment, please understand the question and the standard answer first, and then judge whether the "
    "candidate's answer is correct.\n"
    "4. Some answers may consist of multiple items, such as multiple-choice questions, multiple-select "
    "questions, fill-in-the-blank questions, etc. Regardless of the question type, the final answer will be "
    "considered correct as long as it matches the standard answer, regardless of whether the reasoning process "
    "is correct. For multiple-select questions and multi-blank fill-in-the-blank questions, all corresponding "
    "options or blanks must be answered correctly and match the standard answer exactly to be deemed correct.\n"
    "5. If the prediction is given with \\boxed{{}}, please ignore the \\boxed{{}} and only judge whether the "
    "candidate's answer is consistent with the standard answer.\n"
    "6. If the candidate's answer is invalid (e.g., incomplete (cut off mid-response), lots of unnormal "
    "repetitive content, or irrelevant to the question, saying it can't answer the question because some "
    "irresistible factors, like ethical issues, no enough information, etc.), select option C (INVALID).Please "
    "judge whether the following answers are consistent with the standard answer based on the above criteria. "
    "Grade the predicted answer of this new question as one of:\n"
    "A: CORRECT \n"
    "B: INCORRECT\n"
    "C: INVALID\n"
    'Just return the letters "A", "B", or "C", with no text around it.\n'
    "Here is your task. Simply reply with either CORRECT, INCORRECT, or INVALID. Don't apologize or correct "
    "yourself if there was a mistake; we are just trying to grade the answer.\n"
    "<Original Question Begin>:\n"
    "{question}\n"
    "<Original Question End>\n"
    "<Standard Answer Begin>:\n"
    "{gold_answer}\n"
    "<Standard Answer End>\n"
    "<Candidate's Answer Begin>: \n"
    "{llm_response}\n"
    "<Candidate's Answer End>\n"
    "Judging the correctness of the candidate's answer:\n"
)
PROMPT_NAME = "CompassVerifier CV_PROMPT"
# The verdict letters as CompassVerifier's README defines them ("The output will only be A/B/C").
STATUS_OF_VERDICT = {"A": "correct", "B": "incorrect", "C": "invalid"}
# What a verdict line records: a verdict, or why there is none.
STATUSES = ("correct", "incorrect", "invalid", "unparsed", "too_long")
# The letter, whitespace and the stop token fit; an answer that needs more is not the format anyway.
VERDICT_MAX_TOKENS = 8

# Field -> accepted types of one verdict line (verdicts.jsonl).
VERDICT_FIELDS: dict[str, tuple[type, ...]] = {
    "benchmark": (str,),
    "uid": (str,),
    "sample": (int,),
    "response_sha256": (str,),  # the response judged: a verdict holds for that text only
    "rule_reward": (int, float),
    "status": (str,),
    "rectified_reward": (int, float),
    "output": (str,),  # the verifier's answer as it came ('' when too_long)
}


def parse_verdict(output: str) -> str:
    """The status of the verifier's answer: its verdict when the answer is exactly one of the letters
    (whitespace around it aside), else "unparsed"."""
    return STATUS_OF_VERDICT.get(output.strip(), "unparsed")


def rectified_reward(rule_reward: float, status: str) -> float:
    """A response the verifier calls correct scores 1.0; every other keeps the rule's reward."""
    return 1.0 if status == "correct" else rule_reward


def response_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def verdict_key(record: dict) -> tuple[str, str, int, str]:
    """(benchmark, uid, sample, response digest): a verdict is about one response text."""
    return record["benchmark"], record["uid"], record["sample"], record["response_sha256"]


def verdict_problem(record: dict) -> str | None:
    """Why ``record`` is not a verdict record, or None."""
    problem = fields_problem(record, VERDICT_FIELDS)
    if problem is not None:
        return problem
    if record["status"] not in STATUSES:
        return f"has an unknown status {record['status']!r}"
    rule, rectified = record["rule_reward"], record["rectified_reward"]
    if not (is_finite_number(rule) and is_finite_number(rectified)):
        return "has a reward that is not finite"
    if rule == 1.0:
        return "judges a response the rules grade correct (only wrong ones are asked)"
    if rectified != rectified_reward(float(rule), record["status"]):
        return "has a rectified reward that does not follow from its status"
    return None


@dataclasses.dataclass(frozen=True)
class Verifier:
    """A verifier model, checked: its directory, tokenizer, stop tokens, context, and (local engine) architecture."""

    path: Path
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    context_length: int  # prompt + verdict tokens it can hold (its max_position_embeddings)
    arch: Qwen3Config | None  # what the local engine builds; None when SGLang serves it

    @property
    def name(self) -> str:
        return self.path.resolve().name

    def settings(self, engine: str) -> dict:
        """What decides its verdicts besides the responses: a different one makes verdicts afresh."""
        return {
            "model": str(self.path.resolve()),
            "engine": engine,
            "prompt": PROMPT_NAME,
            "max_new_tokens": VERDICT_MAX_TOKENS,
            "decoding": "greedy",
        }

    @property
    def sampling(self) -> SamplingParams:
        # Greedy, as CompassVerifier's examples decode (do_sample=False; vLLM temperature 0): top-k 1.
        return SamplingParams(
            n=1, temperature=1.0, top_k=1, max_new_tokens=VERDICT_MAX_TOKENS, stop_token_ids=self.stop_token_ids, seed=0
        )

    def prompt_ids(self, problem: str, answer: str, response: str) -> list[int]:
        text = PROMPT.format(question=problem, gold_answer=answer, llm_response=response)
        chat = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        # The chat template spells out its special tokens itself.
        return list(self.tokenizer(chat, add_special_tokens=False)["input_ids"])


def inspect_verifier(path: str, engine: str, field: str) -> Verifier:
    """The verifier at ``path`` for ``engine``, checked without reading weights; an error names ``field``."""
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.data.prompts import default_stop_token_ids
    from stapo_megatron.eval.model import TOKENIZER_VOCAB_FILES, hf_check, load_tokenizer

    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(f"{field}: {path} {'is not a directory' if directory.exists() else 'does not exist'}")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{field}: {path} holds no config.json (not a Hugging Face model directory)")
    config = read_json(config_file, field)
    if not isinstance(config, dict):
        raise ConfigError(f"{field}: {config_file} is not a JSON object")
    context = config.get("max_position_embeddings")
    if isinstance(context, bool) or not isinstance(context, int) or context <= VERDICT_MAX_TOKENS:
        raise ConfigError(f"{field}: {config_file} has no usable max_position_embeddings (got {context!r})")
    if not any((directory / name).is_file() for name in TOKENIZER_VOCAB_FILES):
        raise ConfigError(f"{field}: {path} holds no tokenizer files ({' or '.join(TOKENIZER_VOCAB_FILES)})")
    arch = None
    try:
        if engine == "local":
            try:
                arch = Qwen3Config.from_hf_dict(config, str(config_file))
            except ConfigError as err:
                raise ConfigError(
                    f"the local engine runs Qwen3 models only ({err}); serve this verifier with rollout.engine=sglang"
                ) from None
            hf_check(directory, arch)
        else:
            HFCheckpoint(directory)  # safetensors present and readable; SGLang knows the architecture
    except ConfigError as err:
        raise ConfigError(f"{field}: {err}") from None
    tokenizer = load_tokenizer(directory, field)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{field}: the tokenizer in {path} has no chat template (the verifier is asked in one)")
    if arch is not None and len(tokenizer) > arch.vocab_size:
        raise ConfigError(
            f"{field}: its tokenizer has {len(tokenizer):,} tokens, more than its {arch.vocab_size:,} embedding rows"
        )
    stops = tuple(default_stop_token_ids(tokenizer, chat_template=True))
    return Verifier(directory, tokenizer, stops, context, arch)


def start_verifier_engine(verifier: Verifier, rollout_cfg: RolloutConfig, device: str, log_dir: Path) -> RolloutEngine:
    """The evaluation's engine kind, serving the verifier: the local engine holding its weights, or
    SGLang servers launched on its directory with the evaluation's server settings."""
    if rollout_cfg.engine == "local":
        from stapo_megatron.eval.model import ModelSource, start_engine

        assert verifier.arch is not None  # inspect_verifier reads it for the local engine
        source = ModelSource(verifier.path, "hf", verifier.arch, verifier.path)
        return start_engine(rollout_cfg, source, verifier.path, device, log_dir)
    from stapo_megatron.rollout.sglang_engine import SGLangEngine

    sglang = rollout_cfg.sglang
    # Its logs beside the evaluated model's (the launch default: <out>/sglang), in a folder of their own.
    logs = Path(sglang.log_dir or log_dir / "sglang") / "verifier"
    sglang = dataclasses.replace(sglang, model_path=str(verifier.path), tokenizer_path=None, log_dir=str(logs))
    return SGLangEngine(sglang)


def verdict_counts(rows: list[dict]) -> dict[str, int]:
    """How many verdict rows have each status (every status listed)."""
    counts = dict.fromkeys(STATUSES, 0)
    for row in rows:
        counts[row["status"]] += 1
    return counts
