"""Metric names and the Markdown table of results, in the STAPO paper's layout.

The table has one row per (model, decoding) and one column per benchmark, then the average; a
cell is avg@k in percent. A cell evaluated off the paper's protocol says so: another k, or only
the first problems of the benchmark (--limit). When an evaluation was rectified by a verifier, a
Grading column appears and its rule-based row is followed by its rectified row, whose cells add
the flips (rule-wrong responses the verifier judged correct) and the verdicts that did not count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from stapo_megatron.config import ConfigError
from stapo_megatron.data.benchmarks import BENCHMARKS
from stapo_megatron.eval.store import RESULTS_FILE
from stapo_megatron.runtime.jsonl import is_finite_number, is_number, read_json
from stapo_megatron.runtime.safe_text import printable

# Column titles as the paper writes them.
DISPLAY_NAMES = {
    "aime24": "AIME24",
    "aime25": "AIME25",
    "amc23": "AMC23",
    "math500": "MATH-500",
    "minerva": "Minerva",
    "olympiadbench": "OlympiadBench",
    "gsm8k": "GSM8K",
}
MISSING = "–"
# How every table of results begins: how a table stapo wrote is told from other files.
TABLE_START = "| Model | Decoding |"
RULES = "rules"
RECTIFIED_NOTE = (
    "Rectified rows: the verifier re-judges only the responses the rules grade wrong, so a flip turns wrong "
    "into correct and never the reverse; unparsed and too-long verdicts keep the rule's grade."
)


def flat_metrics(results: dict) -> dict[str, float]:
    """``eval/<benchmark>/avg@<k>``, ``eval/<benchmark>/pass@<j>``, ... and ``eval/average/*``."""
    metrics: dict[str, float] = {}
    for name, b in results["benchmarks"].items():
        prefix = f"eval/{name}/"
        metrics[f"{prefix}avg@{b['k']}"] = b["avg@k"]
        for j, value in b["pass@k"].items():
            metrics[f"{prefix}pass@{j}"] = value
        metrics[f"{prefix}truncated"] = b["truncated"]
        metrics[f"{prefix}response_tokens_mean"] = b["response_tokens_mean"]
        for reason, count in b["reasons"].items():
            metrics[f"{prefix}reason_{reason}"] = count / b["samples"]
        verifier = b.get("verifier")
        if verifier is not None:
            metrics[f"{prefix}rectified_avg@{b['k']}"] = verifier["avg@k"]
            for j, value in verifier["pass@k"].items():
                metrics[f"{prefix}rectified_pass@{j}"] = value
            # Fractions of all samples: rectified_avg@k = avg@k + verifier_correct.
            for status, count in verifier["verdicts"].items():
                metrics[f"{prefix}verifier_{status}"] = count / b["samples"]
    average = results["average"]
    for key in ("avg@k", "pass@k", "truncated"):
        metrics[f"eval/average/{key}"] = average[key]
    if "verifier" in average:
        for key in ("avg@k", "pass@k"):
            metrics[f"eval/average/rectified_{key}"] = average["verifier"][key]
    return metrics


def _number(value: float) -> str:
    return str(float(value))  # 1.0, 0.7, 0.95: as the paper writes them


def decoding_label(decoding: dict) -> str:
    return f"T={_number(decoding['temperature'])}, top-p={_number(decoding['top_p'])}"


def _text(value: str) -> str:
    """A label safe inside a table cell and on a terminal."""
    return printable(" ".join(str(value).split())).replace("|", "\\|")


def _cell(name: str, score: dict, rectified: bool = False) -> str:
    """avg@k of the rules (or the rectified one) in percent, with what sets the cell off the paper's protocol."""
    notes = []
    if rectified:
        verifier = score["verifier"]
        text = f"{100.0 * verifier['avg@k']:.1f}"
        notes.append(f"+{verifier['flips']} flips")
        counts = verifier["verdicts"]
        notes += [f"{counts[s]} {s.replace('_', ' ')}" for s in ("unparsed", "too_long") if counts.get(s)]
    else:
        text = f"{100.0 * score['avg@k']:.1f}"
    spec = BENCHMARKS.get(name)
    if spec is None or score["k"] != spec.default_k:
        notes.append(f"avg@{score['k']}")
    if score["problems"] != score["problems_total"]:
        notes.append(f"{score['problems']} of {score['problems_total']} problems")
    return f"{text} ({'; '.join(notes)})" if notes else text


def _row(run: dict, columns: list[str], rectified: bool) -> list[str]:
    scores = run["benchmarks"]
    cells = [_cell(c, scores[c], rectified) if c in scores else MISSING for c in columns]
    if all(c in scores for c in columns):
        values = [scores[c]["verifier"]["avg@k"] if rectified else scores[c]["avg@k"] for c in columns]
        average = f"{100.0 * math.fsum(values) / len(columns):.1f}"
    else:  # an average over other benchmarks than its neighbours' would mislead
        average = MISSING
    return [*cells, average]


def markdown_table(runs: Sequence[dict]) -> str:
    """One table over ``runs`` (results dicts), columns in the registry's order (the paper's six first)."""
    present: set[str] = {name for run in runs for name in run["benchmarks"]}
    columns = [name for name in BENCHMARKS if name in present] + sorted(present - set(BENCHMARKS))
    graded = any("verifier" in run for run in runs)
    grading = ["Grading"] if graded else []
    header = ["Model", "Decoding", *grading, *(_text(DISPLAY_NAMES.get(c, c)) for c in columns), "Avg."]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join([":--"] * (2 + len(grading)) + ["--:"] * (len(columns) + 1)) + "|",
    ]
    for run in runs:
        label = [_text(run["model"]), decoding_label(run["decoding"])]
        lines.append("| " + " | ".join([*label, *([RULES] if graded else []), *_row(run, columns, False)]) + " |")
        if "verifier" in run:
            grade = f"{RULES} + {_text(run['verifier']['name'])}"
            lines.append("| " + " | ".join([*label, grade, *_row(run, columns, True)]) + " |")
    if graded:
        lines += ["", RECTIFIED_NOTE]
    return "\n".join(lines) + "\n"


def is_results_table(path: str | Path) -> bool:
    """Whether ``path`` is a regular file holding a table of results that stapo eval wrote."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(TABLE_START)) == TABLE_START.encode()


def _is_count(value) -> bool:
    return is_number(value) and not isinstance(value, float) and value >= 0


def _verifier_problem(score: dict) -> str | None:
    """Why a benchmark's rectified scores are not what the table reads, or None."""
    verifier = score["verifier"]
    if not isinstance(verifier, dict) or not is_finite_number(verifier.get("avg@k")):
        return "a rectified score without a finite avg@k"
    counts = verifier.get("verdicts")
    if not _is_count(verifier.get("flips")) or not isinstance(counts, dict):
        return "a rectified score without whole counts of flips and verdicts"
    if not all(_is_count(counts.get(status)) for status in ("unparsed", "too_long")):
        return "a rectified score without whole counts of unparsed and too-long verdicts"
    return None


def _results_problem(results) -> str | None:
    """Why ``results`` is not what a finished evaluation writes to results.json (the fields the
    table reads), or None."""
    if not isinstance(results, dict) or not {"model", "decoding", "benchmarks"} <= set(results):
        return "not a stapo evaluation result"
    decoding, benchmarks = results["decoding"], results["benchmarks"]
    if not isinstance(results["model"], str):
        return "its model is not a text"
    if not isinstance(decoding, dict) or not all(is_finite_number(decoding.get(k)) for k in ("temperature", "top_p")):
        return "its decoding lacks a finite temperature and top_p"
    if not isinstance(benchmarks, dict) or not benchmarks:
        return "it holds no benchmarks"
    for name, score in benchmarks.items():
        if not (
            isinstance(score, dict)
            and is_finite_number(score.get("avg@k"))
            and _is_count(score.get("k"))
            and _is_count(score.get("problems"))
            and _is_count(score.get("problems_total"))
        ):
            return f"benchmark '{_text(name)}' lacks a finite avg@k or whole counts k, problems, problems_total"
    verifier = results.get("verifier")
    rectified = [name for name, score in benchmarks.items() if "verifier" in score]
    if verifier is not None or rectified:
        if not isinstance(verifier, dict) or not isinstance(verifier.get("name"), str):
            return "its verifier has no name"
        if len(rectified) != len(benchmarks):
            return "it has rectified scores for some benchmarks only"
        for name in rectified:
            problem = _verifier_problem(benchmarks[name])
            if problem is not None:
                return f"benchmark '{_text(name)}' has {problem}"
    return None


def load_results(path: str | Path) -> dict:
    """The results of a finished evaluation: its directory or its results.json."""
    path = Path(path)
    file = path / RESULTS_FILE if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--compare: {path} has no {RESULTS_FILE} (not a finished evaluation)")
    results = read_json(file, "--compare")
    problem = _results_problem(results)
    if problem is not None:
        raise ConfigError(f"--compare: {file}: {problem}")
    return results
