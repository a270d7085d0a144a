"""One evaluation: sample k responses per problem, score them, write every response and the scores.

Problems are sampled in fixed groups of ``problems_per_call`` (in file order); a group's samples
come from one engine call whose seed derives from (eval seed, benchmark, the group's first
problem). An interrupted evaluation resumes from its responses file: a group with any sample
missing is sampled again with the same seed, and only the missing samples are written, so with
a deterministic engine (the local one) the result equals that of an uninterrupted run.

With a verifier (:mod:`stapo_megatron.eval.verifier`), every response the rules grade wrong is
judged again once all responses are in; its verdicts go to their own file, keyed by the response
they judge, so a verifier can be added to a finished evaluation, an interrupted verification
resumes, and another verifier's verdicts are replaced without sampling anything again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stapo_megatron.config import ConfigError
from stapo_megatron.data.benchmarks import load_benchmark
from stapo_megatron.data.prompts import PromptEncoder, response_text
from stapo_megatron.data.records import DataError, PromptRecord
from stapo_megatron.eval.config import EvalConfig
from stapo_megatron.eval.metrics import avg_at_k, mean_pass_at, pass_levels
from stapo_megatron.eval.report import flat_metrics, markdown_table
from stapo_megatron.eval.store import (
    RESPONSES_FILE,
    RESULTS_FILE,
    SETTINGS_FILE,
    TABLE_FILE,
    VERDICTS_FILE,
    VERIFIER_FILE,
    DirectoryLock,
    Key,
    RecordStore,
    write_atomic,
    write_json_atomic,
)
from stapo_megatron.eval.verifier import (
    VERDICT_MAX_TOKENS,
    Verifier,
    parse_verdict,
    rectified_reward,
    response_digest,
    verdict_counts,
    verdict_key,
    verdict_problem,
)
from stapo_megatron.rewards import (
    RewardConfig,
    RewardPool,
    RewardResult,
    summarize_reasons,
)
from stapo_megatron.rollout.engine import RolloutEngine, SamplingParams
from stapo_megatron.runtime.jsonl import read_json

logger = logging.getLogger(__name__)

RESULTS_FORMAT = 1
# problems_per_call = 0: one problem per call for the local engine (its samples then depend on
# that problem's seed alone); SGLang needs many prompts in flight to keep its batches full.
LOCAL_PROBLEMS_PER_CALL = 1
SERVER_PROBLEMS_PER_CALL = 64
# Scores need no texts; keeping them out of memory bounds it however long the responses are.
_TEXT_FIELDS = ("response", "answer", "detail")
# What every evaluation's settings.json holds: how a directory stapo eval made is recognised.
_SETTINGS_KEYS = frozenset({"model", "engine", "temperature", "top_p", "max_new_tokens", "seed"})


@dataclasses.dataclass(frozen=True)
class BenchmarkTask:
    """The problems of one benchmark that an evaluation samples, with their prompt token ids."""

    name: str
    k: int
    records: list[PromptRecord]
    prompt_ids: list[tuple[int, ...]]
    total_problems: int  # usable problems in the file, before --limit


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    seed: int
    problems_per_call: int


def load_tasks(cfg: EvalConfig, encoder: PromptEncoder) -> list[BenchmarkTask]:
    """Load, cut to ``cfg.limit`` and encode each benchmark of ``cfg``."""
    if not cfg.data_dir:
        raise ConfigError("data_dir: the directory holding the benchmark files is required")
    tasks = []
    for name in cfg.benchmarks:
        try:
            records, report = load_benchmark(name, cfg.data_dir)
        except DataError as err:
            raise ConfigError(f"data_dir: {err}") from None
        if report.num_dropped:
            logger.warning("benchmark %s: %s", name, report.summary())
        if not records:
            raise ConfigError(f"data_dir: benchmark {name} has no usable problem ({report.summary()})")
        chosen = records[: cfg.limit] if cfg.limit else records
        try:
            ids = [tuple(p) for p in encoder.encode_many(chosen)]
        # e.g. the synthetic task's word-level tokenizer, which knows digits, "+", "=" and its free
        # words only (``tokenizers`` raises a plain Exception for a word outside its vocabulary).
        except Exception as err:
            raise ConfigError(f"benchmarks: {name}: the tokenizer cannot encode its prompts ({err})") from None
        tasks.append(BenchmarkTask(name, cfg.k_for(name), chosen, ids, len(records)))
    return tasks


def default_problems_per_call(engine_kind: str) -> int:
    return LOCAL_PROBLEMS_PER_CALL if engine_kind == "local" else SERVER_PROBLEMS_PER_CALL


def engine_kind(engine: RolloutEngine) -> str:
    from stapo_megatron.rollout.local_engine import LocalEngine

    return "local" if isinstance(engine, LocalEngine) else "sglang"


def prompt_settings(encoder: PromptEncoder, reward_cfg: RewardConfig) -> dict:
    """What decides the responses and their scores besides the model, the engine and the sampling."""
    settings = {
        "prompt_template": encoder.template,
        "chat_template": encoder.chat_template,
        "chat_template_kwargs": encoder.chat_template_kwargs,
        "reward_kind": reward_cfg.kind,
        "reward_max_answer_chars": reward_cfg.max_answer_chars,
    }
    if reward_cfg.kind == "custom":  # only then: the settings of evaluations made before it existed still match
        settings["reward_function"] = reward_cfg.function
    return settings


def group_seed(seed: int, benchmark: str, first_uid: str) -> int:
    """The sampling seed of the group of problems starting at ``first_uid``: independent of what
    else is evaluated, of --limit and of interruptions."""
    digest = hashlib.sha256(f"stapo-eval:{seed}:{benchmark}:{first_uid}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def _normalized(data: Any) -> Any:
    return json.loads(json.dumps(data))


def _in_memory(record: dict) -> dict:
    """What scoring keeps of a response record: no texts, and the digest of the response (what a verdict judges)."""
    kept = {name: value for name, value in record.items() if name not in _TEXT_FIELDS}
    kept["response_sha256"] = response_digest(record["response"])
    return kept


def _scores(correct_counts: list[int], k: int) -> dict:
    return {
        "avg@k": avg_at_k(correct_counts, k),
        "pass@k": {str(j): mean_pass_at(correct_counts, k, j) for j in pass_levels(k)},
    }


class EvalRun:
    """An evaluation directory: ``settings.json``, ``responses.jsonl``, ``results.json``, ``table.md``.

    Opening it refuses a directory that is neither new, empty nor an evaluation's (one holding the
    settings.json of stapo eval), so that nothing else is ever written over or removed; then locks
    the directory, checks that responses already there were sampled with the same settings
    (``settings`` plus ``sampling``) or removes them when ``fresh`` (responses.jsonl, results.json,
    table.md and the verdict files, nothing else), and reads them. With ``verifier`` (its
    settings), reads the verdicts of that verifier, after removing those of any other. Use as a
    context manager.
    """

    def __init__(
        self,
        directory: str | Path,
        tasks: Sequence[BenchmarkTask],
        sampling: Sampling,
        settings: dict,
        *,
        fresh: bool = False,
        verifier: dict | None = None,
    ):
        self.directory = Path(directory)
        self.tasks = list(tasks)
        self.sampling = sampling
        # The sampling always belongs to the settings a resumed evaluation must match.
        self.settings = _normalized({**settings, **dataclasses.asdict(sampling)})
        # Not part of the settings: verdicts can be added to, or replaced in, an evaluation.
        self.verifier = _normalized(verifier) if verifier is not None else None
        self._check_is_evaluation_directory()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = DirectoryLock(self.directory)
        self._lock.acquire()
        try:
            self.store = RecordStore(self.directory / RESPONSES_FILE)
            self.verdict_store = RecordStore(self.directory / VERDICTS_FILE, verdict_problem, verdict_key)
            settings_path = self.directory / SETTINGS_FILE
            if fresh:
                for name in (RESULTS_FILE, TABLE_FILE, VERIFIER_FILE):
                    (self.directory / name).unlink(missing_ok=True)
                self.store.clear()
                self.verdict_store.clear()
            elif settings_path.is_file():
                self._check_same_settings(read_json(settings_path, "settings"))
            write_json_atomic(settings_path, self.settings)
            self.records = self.store.load(keep=_in_memory)
            self.verdicts = self._open_verdicts() if self.verifier is not None else {}
        except BaseException:
            self._lock.release()
            raise

    def _check_is_evaluation_directory(self) -> None:
        """Refuse a directory that stapo eval did not make, unless it is empty (or holds only the
        lock, left by a start killed before its settings were written)."""
        if not self.directory.exists():
            return
        if not self.directory.is_dir():
            raise ConfigError(f"{self.directory}: exists and is not a directory")
        entries = sorted(p.name for p in self.directory.iterdir() if p.name != DirectoryLock.FILE)
        if not entries:
            return
        settings_path = self.directory / SETTINGS_FILE
        if settings_path.is_file():
            settings = read_json(settings_path, "settings")
            if isinstance(settings, dict) and _SETTINGS_KEYS <= set(settings):
                return
        raise ConfigError(
            f"{self.directory}: not an evaluation directory (it holds {entries[0]!r} but no {SETTINGS_FILE} "
            "written by stapo eval); give a new or empty directory"
        )

    def _check_same_settings(self, old: Any) -> None:
        if not isinstance(old, dict):
            raise ConfigError(f"{self.directory / SETTINGS_FILE}: expected a JSON object")
        for key in sorted(set(old) | set(self.settings)):
            if old.get(key) != self.settings.get(key):
                raise ConfigError(
                    f"{self.directory}: holds responses sampled with {key}={old.get(key)!r}, this evaluation has "
                    f"{key}={self.settings.get(key)!r} (use another output directory, or --overwrite to start over)"
                )

    def _open_verdicts(self) -> dict:
        """The verdicts of this verifier; any others (verifier.json says another, or none) are removed first."""
        path = self.directory / VERIFIER_FILE
        try:
            old = read_json(path, "verifier") if path.is_file() else None
        except ConfigError:  # damaged: whose verdicts they are is unknown
            old = None
        if old != self.verifier:
            if self.verdict_store.path.is_file():
                logger.warning(
                    "%s: holds verdicts of another verifier (%s); they are removed and asked again of %s",
                    self.directory,
                    old.get("model") if isinstance(old, dict) else "unknown",
                    self.verifier.get("model") if self.verifier else None,
                )
            # Removed before verifier.json names the new verifier: a kill in between leaves no verdicts misnamed.
            self.verdict_store.clear()
        write_json_atomic(path, self.verifier)
        return self.verdict_store.load()

    def close(self) -> None:
        self._lock.release()

    def __enter__(self) -> EvalRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- sampling ----------------------------------------------------------------------------

    def _groups(self, task: BenchmarkTask) -> list[range]:
        size = self.sampling.problems_per_call
        return [range(start, min(start + size, len(task.records))) for start in range(0, len(task.records), size)]

    def _missing(self, task: BenchmarkTask, group: range) -> list[tuple[int, int]]:
        return [(i, s) for i in group for s in range(task.k) if (task.name, task.records[i].uid, s) not in self.records]

    def pending(self) -> int:
        """Responses still to be sampled."""
        return sum(len(self._missing(t, g)) for t in self.tasks for g in self._groups(t))

    def generate(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        reward_cfg: RewardConfig,
        progress_every_s: float = 60.0,
    ) -> None:
        """Sample, score and append every missing response."""
        s = self.sampling
        pool: RewardPool | None = None
        try:
            for task in self.tasks:
                todo = sum(len(self._missing(task, g)) for g in self._groups(task))
                if not todo:
                    continue
                already_written = len(task.records) * task.k - todo
                logger.info(
                    "%s: %d problems x %d samples%s",
                    task.name,
                    len(task.records),
                    task.k,
                    f" ({already_written} already written)" if already_written else "",
                )
                started = last_report = time.monotonic()
                written = 0
                for group in self._groups(task):
                    missing = self._missing(task, group)
                    if not missing:
                        continue
                    seed = group_seed(s.seed, task.name, task.records[group.start].uid)
                    params = SamplingParams(
                        n=task.k,
                        temperature=s.temperature,
                        top_p=s.top_p,
                        max_new_tokens=s.max_new_tokens,
                        stop_token_ids=s.stop_token_ids,
                        seed=seed,
                    )
                    completions = engine.generate([list(task.prompt_ids[i]) for i in group], params)
                    if len(completions) != len(group) or any(len(c) != task.k for c in completions):
                        raise RuntimeError(f"{task.name}: the engine returned the wrong number of completions")
                    chosen = [(i, sample, completions[i - group.start][sample]) for i, sample in missing]
                    texts = [response_text(tokenizer, c.token_ids) for _, _, c in chosen]
                    if pool is None:
                        pool = RewardPool.from_config(reward_cfg)
                    scores = pool.score(
                        texts,
                        [task.records[i].answer for i, _, _ in chosen],
                        [task.records[i].extra for i, _, _ in chosen],
                    )
                    new: list[dict[str, Any]] = []
                    for (i, sample, completion), text, score in zip(chosen, texts, scores):
                        record = task.records[i]
                        row = {
                            "benchmark": task.name,
                            "uid": record.uid,
                            "row": record.row,
                            "sample": sample,
                            "seed": seed,
                            "answer": record.answer,
                            "response": text,
                            "extracted": score.extracted,
                            "reward": score.reward,
                            "reason": score.reason,
                            "finish_reason": completion.finish_reason,
                            "tokens": len(completion.token_ids),
                        }
                        if score.detail is not None:  # a custom reward's reason, or why scoring failed
                            row["detail"] = score.detail
                        new.append(row)
                    self.store.append(new)
                    for row in new:
                        self.records[(task.name, row["uid"], row["sample"])] = _in_memory(row)
                    written += len(new)
                    now = time.monotonic()
                    if written < todo and now - last_report >= progress_every_s:
                        last_report = now
                        logger.info("%s: %d/%d responses, %.0f s", task.name, written, todo, now - started)
                logger.info("%s: %d responses in %.1f s", task.name, written, time.monotonic() - started)
        finally:
            if pool is not None:
                pool.close()

    # ---- verification ------------------------------------------------------------------------

    def _verdict(self, key: Key) -> dict | None:
        """The verdict on the response of ``key`` as it is in the file (a verdict on another text does not count)."""
        row = self.records[key]
        verdict = self.verdicts.get((*key, row["response_sha256"]))
        return verdict if verdict is not None and verdict["rule_reward"] == row["reward"] else None

    def _unjudged(self, task: BenchmarkTask) -> list[tuple[int, int]]:
        """(problem index, sample) of the responses the rules grade wrong that have no verdict yet."""
        out = []
        for i, record in enumerate(task.records):
            for sample in range(task.k):
                key = (task.name, record.uid, sample)
                row = self.records.get(key)
                if row is not None and row["reward"] != 1.0 and self._verdict(key) is None:
                    out.append((i, sample))
        return out

    def pending_verdicts(self) -> int:
        """Responses the rules grade wrong that the verifier has still to judge."""
        return sum(len(self._unjudged(task)) for task in self.tasks)

    def verify(self, engine: RolloutEngine, verifier: Verifier) -> None:
        """Ask ``verifier`` (served by ``engine``) about each rule-wrong response without a verdict; write them."""
        if self.verifier is None:
            raise RuntimeError("EvalRun.verify: the run was opened without a verifier")
        for task in self.tasks:
            todo = self._unjudged(task)
            if not todo:
                continue
            logger.info("%s: %d rule-wrong responses to the verifier %s", task.name, len(todo), verifier.name)
            started = time.monotonic()
            keys = {(task.name, task.records[i].uid, sample) for i, sample in todo}
            # Only this benchmark's texts in memory, and only those the verifier reads.
            texts = self.store.load(keep=lambda record: record["response"], only=keys)
            # As many prompts per call as problems by default, for the same reasons (the local engine:
            # bounded memory, each verdict from its own prompt; servers: full batches).
            per_call = default_problems_per_call(engine_kind(engine))
            for start in range(0, len(todo), per_call):
                chunk = todo[start : start + per_call]
                prompts = [
                    verifier.prompt_ids(
                        task.records[i].problem, task.records[i].answer, texts[(task.name, task.records[i].uid, s)]
                    )
                    for i, s in chunk
                ]
                fits = [len(p) + VERDICT_MAX_TOKENS <= verifier.context_length for p in prompts]
                asked = [p for p, fit in zip(prompts, fits) if fit]
                completions = engine.generate(asked, verifier.sampling) if asked else []
                if len(completions) != len(asked) or any(len(c) != 1 for c in completions):
                    raise RuntimeError(f"{task.name}: the verifier's engine returned the wrong number of completions")
                answers = iter(completions)
                new = []
                for (i, sample), fit in zip(chunk, fits):
                    key = (task.name, task.records[i].uid, sample)
                    row = self.records[key]
                    if fit:
                        completion = next(answers)[0]
                        output = response_text(verifier.tokenizer, completion.token_ids)
                        status = parse_verdict(output)
                    else:
                        output, status = "", "too_long"
                    new.append(
                        {
                            "benchmark": task.name,
                            "uid": key[1],
                            "sample": sample,
                            "response_sha256": row["response_sha256"],
                            "rule_reward": row["reward"],
                            "status": status,
                            "rectified_reward": rectified_reward(float(row["reward"]), status),
                            "output": output,
                        }
                    )
                self.verdict_store.append(new)
                for verdict in new:
                    self.verdicts[verdict_key(verdict)] = verdict
            logger.info("%s: %d verdicts in %.1f s", task.name, len(todo), time.monotonic() - started)

    # ---- scores ------------------------------------------------------------------------------

    def _benchmark_scores(self, task: BenchmarkTask) -> dict:
        correct_counts, rectified_counts, rewards, verdicts, truncated, tokens = [], [], [], [], 0, 0
        for record in task.records:
            correct = rectified = 0
            for sample in range(task.k):
                key = (task.name, record.uid, sample)
                row = self.records.get(key)
                if row is None:
                    raise RuntimeError(f"{task.name}: response {sample} of {record.uid} is missing; sample it first")
                # Checked when read (RecordStore.load) or made by the reward pool.
                result = RewardResult(float(row["reward"]), row["reason"], row["extracted"])
                rewards.append(result)
                correct += result.reward == 1.0
                rectified += result.reward == 1.0
                if self.verifier is not None and result.reward != 1.0:
                    verdict = self._verdict(key)
                    if verdict is None:
                        raise RuntimeError(f"{task.name}: response {sample} of {record.uid} has no verdict; verify it")
                    verdicts.append(verdict)
                    rectified += verdict["rectified_reward"] == 1.0
                truncated += row["finish_reason"] == "length"
                tokens += row["tokens"]
            correct_counts.append(correct)
            rectified_counts.append(rectified)
        samples = len(task.records) * task.k
        scores = {
            "k": task.k,
            "problems": len(task.records),
            "problems_total": task.total_problems,
            "samples": samples,
            **_scores(correct_counts, task.k),
            "truncated": truncated / samples,
            "response_tokens_mean": tokens / samples,
            "reasons": summarize_reasons(rewards),
        }
        if self.verifier is not None:
            counts = verdict_counts(verdicts)
            scores["verifier"] = {
                **_scores(rectified_counts, task.k),
                "rule_wrong": len(verdicts),
                # Only rule-wrong responses are judged: every flip is wrong -> correct.
                "flips": counts["correct"],
                "verdicts": counts,
            }
        return scores

    def results(self, model: str, decoding: dict) -> dict:
        """The scores of every benchmark and their average; written to results.json and table.md."""
        benchmarks = {task.name: self._benchmark_scores(task) for task in self.tasks}
        scores = list(benchmarks.values())
        average = {
            "benchmarks": list(benchmarks),
            "avg@k": sum(b["avg@k"] for b in scores) / len(scores),
            "pass@k": sum(b["pass@k"][str(b["k"])] for b in scores) / len(scores),
            "truncated": sum(b["truncated"] for b in scores) / len(scores),
        }
        if self.verifier is not None:
            average["verifier"] = {
                "avg@k": sum(b["verifier"]["avg@k"] for b in scores) / len(scores),
                "pass@k": sum(b["verifier"]["pass@k"][str(b["k"])] for b in scores) / len(scores),
                "flips": sum(b["verifier"]["flips"] for b in scores),
            }
        results = {
            "format": RESULTS_FORMAT,
            "model": model,
            "decoding": decoding,
            "settings": self.settings,
            "benchmarks": benchmarks,
            "average": average,
        }
        if self.verifier is not None:
            results["verifier"] = {"name": Path(self.verifier["model"]).name, **self.verifier}
        results["metrics"] = flat_metrics(results)
        write_json_atomic(self.directory / RESULTS_FILE, results)
        write_atomic(self.directory / TABLE_FILE, markdown_table([results]))
        return results
