"""The spurious-token inspector: which tokens the rule silences, with their context.

Every ``logging.inspect_every`` steps the last pipeline stage writes each silenced response token
(the rule's candidates that it silenced; for rules without candidates, every silenced token)
with its probability, entropy, advantage and a window of decoded text around it, to
``<run>/spurious/step_NNNNNNN.jsonl``. ``stapo inspect RUN`` ranks the tokens the way the STAPO
paper's tables do, then shows the quadrants of the positive-advantage tokens from the run's
``metrics.jsonl`` (:mod:`stapo_megatron.loss.diagnostics`: their shares of the tokens and of the
gradient norm, per range of steps). It reads the dumps as untrusted: a malformed entry is skipped
with one counted warning per file, and the model's text is printed with its control and bidi
characters escaped.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from stapo_megatron.config import MAX_STEPS
from stapo_megatron.loss.diagnostics import QUADRANTS
from stapo_megatron.runtime.distributed import ParallelContext
from stapo_megatron.runtime.jsonl import is_number, read_rows, shown_key
from stapo_megatron.runtime.run_files import atomic_open
from stapo_megatron.runtime.safe_text import printable
from stapo_megatron.trainer.metrics import read_metrics

DUMP_DIR = "spurious"
# The fields of a dump entry a reader uses, and what each must be; step and token are required.
_ENTRY_FIELDS: dict[str, Any] = {
    "step": int,
    "sequence": int,
    "position": int,
    "token_id": int,
    "token": str,
    "probability": float,
    "entropy": float,
    "advantage": float,
    "correct": bool,
    "before": str,
    "after": str,
}
_REQUIRED_FIELDS = ("step", "token")


class SpuriousTokenDump:
    def __init__(self, run_dir: Path, tokenizer, context_tokens: int, ctx: ParallelContext):
        self.directory = Path(run_dir) / DUMP_DIR
        self.tokenizer = tokenizer
        self.context = context_tokens
        self.ctx = ctx

    def _entries(self, step, minibatches, stats_per_minibatch, selections_per_minibatch, batch) -> list[dict]:
        entries = []
        for microbatches, stats_list, selections in zip(minibatches, stats_per_minibatch, selections_per_minibatch):
            for mb, stats, selection in zip(microbatches, stats_list, selections):
                response = mb["response_mask"] > 0
                silenced = response & (selection.keep == 0)
                if selection.candidates is not None:
                    silenced &= selection.candidates.bool()
                for row, position in silenced.nonzero().tolist():
                    labels = mb["labels"][row]
                    segment = int(mb["segment_ids"][row, position])  # packed rows hold several sequences
                    sequence = int(mb["sequence_index"][segment])
                    in_segment = mb["segment_ids"][row] == segment
                    own = response[row] & in_segment
                    start = int(own.nonzero()[0])
                    # the context before reaches back into the prompt (the question asked); a
                    # sequence's first label is its second token, so BOS never shows
                    first = int(in_segment.nonzero()[0])
                    before = labels[max(first, position - self.context) : position].tolist()
                    after = labels[position + 1 : position + 1 + self.context][
                        own[position + 1 : position + 1 + self.context]
                    ].tolist()
                    token = int(labels[position])
                    entries.append(
                        {
                            "step": step,
                            "sequence": sequence,
                            "position": position - start,
                            "token_id": token,
                            "token": self.tokenizer.decode([token], skip_special_tokens=False),
                            "probability": math.exp(float(stats.logprob[row, position])),
                            "entropy": float(stats.entropy[row, position]),
                            "advantage": float(mb["advantages"][row, position]),
                            "correct": bool(batch.correct[sequence] > 0),
                            "before": self.tokenizer.decode(before, skip_special_tokens=False),
                            "after": self.tokenizer.decode(after, skip_special_tokens=False),
                        }
                    )
        return entries

    def dump(self, step, minibatches, stats_per_minibatch, selections_per_minibatch, batch) -> None:
        """Collective over the last stage's data-parallel group (the entries are Python objects:
        its gloo group); its first rank writes the file."""
        ctx = self.ctx
        if not ctx.is_last_stage or ctx.tp_rank != 0:
            return
        entries = self._entries(step, minibatches, stats_per_minibatch, selections_per_minibatch, batch)
        group = ctx.dp_cpu_group
        gathered: list[Any] | None = [None] * ctx.dp_size if ctx.dp_rank == 0 else None  # each rank's entries
        dist.gather_object(entries, gathered, dst=dist.get_global_rank(group, 0), group=group)
        if gathered is None:  # not the writer (data-parallel rank 0)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        with atomic_open(self.directory / f"step_{step:07d}.jsonl") as f:
            for rank_entries in gathered:
                for entry in rank_entries:
                    f.write(json.dumps(entry, ensure_ascii=False) + "\n")


def dump_entry_problem(entry: dict) -> str | None:
    """Why ``entry`` is not a dump entry as :class:`SpuriousTokenDump` writes them, or None."""
    for name in _REQUIRED_FIELDS:
        if name not in entry:
            return f"has no {name}"
    for name, kind in _ENTRY_FIELDS.items():
        if name not in entry:
            continue
        value = entry[name]
        if kind is bool:
            fits = isinstance(value, bool)
        elif kind is float:
            fits = is_number(value)
        elif kind is int:
            fits = is_number(value) and not isinstance(value, float)
        else:
            fits = isinstance(value, kind)
        if not fits:
            return f"holds a {type(value).__name__} for {shown_key(name)}"
    if not 0 <= entry["step"] <= MAX_STEPS:
        return f"has a step outside 0..{MAX_STEPS:,}"
    return None


def read_dumps(run_dir: str | os.PathLike) -> list[dict]:
    """Every entry of the run's dumps; malformed entries skipped, one warning per file counting them."""
    directory = Path(run_dir) / DUMP_DIR
    entries = []
    for path in sorted(directory.glob("step_*.jsonl")):
        entries.extend(read_rows(path, dump_entry_problem))
    return entries


def _mean(rows: list[dict], name: str) -> float | None:
    values = [row[name] for row in rows if name in row]
    return sum(values) / len(values) if values else None


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# The token classes that the STAPO paper (arXiv 2602.15620) names among the most frequent spurious
# tokens of Qwen3 on real math text: digits, "$" and "x" (as issue 12 item 6 quotes the paper; the
# passage itself was not in the stored copies of the paper searched here). A token belongs to a
# class by its decoded text without surrounding whitespace (Qwen's " x" is "x").
PAPER_CLASSES = ("digit", "$", "x")


def paper_class(token: str) -> str | None:
    """The paper's class of a decoded token ("digit", "$" or "x"), or None."""
    text = token.strip()
    if text and all(c in "0123456789" for c in text):
        return "digit"
    if text and set(text) == {"$"}:
        return "$"
    if text == "x":
        return "x"
    return None


def step_groups(steps: list[int], max_rows: int) -> list[list[int]]:
    """``steps`` (sorted) cut into at most ``max_rows`` runs of consecutive dumps, as even as possible."""
    rows = min(max_rows, len(steps))
    return [steps[len(steps) * i // rows : len(steps) * (i + 1) // rows] for i in range(rows)]


def paper_comparison(entries: list[dict], top: int = 5, max_rows: int = 20) -> list[str]:
    """Per dump step (or range of dump steps when there are more than ``max_rows``): the tokens
    silenced most often, with those of the paper's classes starred, and each class's share of
    the silenced tokens; a last row over all steps."""
    by_step = defaultdict(list)
    for e in entries:
        by_step[e["step"]].append(e["token"])
    groups = step_groups(sorted(by_step), max_rows)
    header = (
        f"{'steps':<13} {'silenced':>8} "
        + " ".join(f"{name:>7}" for name in PAPER_CLASSES)
        + f" {'paper':>7}  most silenced (* = the paper's classes)"
    )
    lines = [
        'silenced tokens next to the STAPO paper\'s observation (digits, "$" and "x" among the most frequent',
        "spurious tokens on real text); shares are of the silenced tokens in the row's steps:",
        header,
    ]

    def row(label: str, tokens: list[str]) -> str:
        counts = Counter(tokens)
        classes = Counter(paper_class(token) for token in tokens)
        shares = " ".join(f"{classes[name] / len(tokens):>7.1%}" for name in PAPER_CLASSES)
        in_paper = sum(classes[name] for name in PAPER_CLASSES) / len(tokens)
        listed = ", ".join(
            f"{token!r}{'*' if paper_class(token) else ''} {count}" for token, count in counts.most_common(top)
        )
        return f"{label:<13} {len(tokens):>8} {shares} {in_paper:>7.1%}  {listed}"

    for group in groups:
        label = str(group[0]) if len(group) == 1 else f"{group[0]}..{group[-1]}"
        lines.append(row(label, [token for step in group for token in by_step[step]]))
    lines.append(row("all", [e["token"] for e in entries]))
    return lines


def quadrant_table(rows: list[dict], max_rows: int = 20) -> list[str]:
    """Per range of logged steps (at most ``max_rows`` ranges of consecutive steps) and over all
    steps: each quadrant's share of the positive-advantage tokens and of their summed gradient
    norm, exact over the range (summed counts and norms, not a mean of the steps' shares). []
    when ``rows`` (metrics.jsonl rows) hold no quadrant metrics (a run of an earlier release)."""
    by_step = {r["step"]: r for r in rows if r.get("quadrant/positive_tokens") is not None}
    if not by_step:
        return []
    lines = [
        "positive-advantage tokens by quadrant (lowp: p < tau_p; lowh: entropy below the split, the median of",
        "these tokens' entropy or algo.tau_h), each quadrant's share of the tokens / of the summed gradient",
        "norm ||d loss / dz|| (the STAPO paper's Theorem 3.3):",
        f"{'steps':<13} {'A>0 tokens':>10} " + " ".join(f"{name:>17}" for name in QUADRANTS),
    ]

    def row(label: str, chosen: list[dict]) -> str:
        tokens = sum(r["quadrant/positive_tokens"] for r in chosen)
        cells = []
        for name in QUADRANTS:
            count = sum(r.get(f"quadrant/{name}_tokens") or 0.0 for r in chosen)
            weighted = [r for r in chosen if r.get(f"quadrant/{name}_grad_share") is not None]
            norm = sum(r["quadrant/grad_norm_sum"] for r in weighted)
            grad = sum(r[f"quadrant/{name}_grad_share"] * r["quadrant/grad_norm_sum"] for r in weighted)
            token_share = f"{count / tokens:.1%}" if tokens else "-"
            grad_share = f"{grad / norm:.1%}" if norm else "-"
            cells.append(f"{token_share:>7} / {grad_share:>7}")
        return f"{label:<13} {tokens:>10,.0f} " + " ".join(cells)

    for group in step_groups(sorted(by_step), max_rows):
        label = str(group[0]) if len(group) == 1 else f"{group[0]}..{group[-1]}"
        lines.append(row(label, [by_step[step] for step in group]))
    lines.append(row("all", list(by_step.values())))
    return lines


def summarize(
    run_dir: str | os.PathLike, top: int = 20, examples: int = 3, per_step_top: int = 5, max_step_rows: int = 20
) -> str:
    """The most frequently silenced tokens, with mean probability and entropy and example
    contexts, then the per-step comparison with the paper's token classes (:func:`paper_comparison`),
    then the quadrants of the positive-advantage tokens (:func:`quadrant_table`)."""
    quadrants = quadrant_table(read_metrics(run_dir), max_step_rows)
    after = ["", *quadrants] if quadrants else []
    entries = read_dumps(run_dir)
    if not entries:
        return "\n".join([f"{run_dir}: no silenced tokens recorded (see logging.inspect_every)", *after])
    counts = Counter(e["token"] for e in entries)
    by_token = defaultdict(list)
    for e in entries:
        by_token[e["token"]].append(e)
    steps = sorted({e["step"] for e in entries})
    lines = [
        f"{len(entries)} silenced tokens in {len(steps)} dumps (steps {steps[0]}..{steps[-1]}), {len(counts)} distinct",
        "",
        f"{'rank':>4}  {'token':<20} {'count':>7} {'share':>7} {'mean p':>9} {'mean H':>8}  paper class",
    ]
    for rank, (token, count) in enumerate(counts.most_common(top), start=1):
        rows = by_token[token]
        mean_p, mean_h = _number(_mean(rows, "probability"), ".2e"), _number(_mean(rows, "entropy"), ".3f")
        lines.append(
            f"{rank:>4}  {token!r:<20} {count:>7} {count / len(entries):>7.2%} {mean_p:>9} {mean_h:>8}  "
            f"{paper_class(token) or '-'}"
        )
    lines.append("")
    lines.append("example contexts ([[token]] is silenced):")
    for token, _ in counts.most_common(min(top, 5)):
        for row in by_token[token][:examples]:
            context = printable(f"{row.get('before', '')}[[{row['token']}]]{row.get('after', '')}")
            lines.append(
                f"  step {row['step']:>5} p={_number(row.get('probability'), '.1e')} "
                f"H={_number(row.get('entropy'), '.2f')}: ...{context}..."
            )
    lines.append("")
    lines.extend(paper_comparison(entries, per_step_top, max_step_rows))
    return "\n".join(lines + after)
