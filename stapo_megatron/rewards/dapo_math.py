"""DAPO's rule-based math verifier: string equality, after DAPO's normalization or without it; no sympy.

The behaviour of verl's ``verl/utils/reward_score/math_dapo.py`` (its ``compute_score``, the verifier
of DAPO's recipe and of JustRL; its normalization comes from lm-evaluation-harness's Minerva
``normalize_final_answer``), written anew. ``compute_score`` reads only the last 300 characters of a
response, and a box only in the last 100. Three ways to take the answer, ``reward.dapo_answer``:

- ``strict_box``: the last ``\\boxed{`` in the last 100 characters, up to its matching brace (every
  brace counts, escaped or not), must equal the ground truth exactly, without normalization.
  verl's ``is_correct_strict_box``; JustRL's fork sets ``strict_box_verify=True`` as its default
  (thunlp/JustRL ``train/verl/utils/reward_score/math_dapo.py``), so this is how JustRL (and the
  STAPO paper, which trains under JustRL's setting) scored.
- ``answer_line``: the last match of ``(?i)Answer\\s*:\\s*([^\\n]+)`` in the last 300 characters,
  normalized, must equal the normalized ground truth. verl's ``is_correct_minerva``, the default path
  of ``compute_score`` as DAPO released it (the DAPO-Math-17k prompt asks for a last line
  "Answer: $Answer").
- ``answer_line_or_box``: ``answer_line``, and without an Answer line the box of ``strict_box``,
  normalized, against the normalized ground truth (verl's ``verify`` since the box fallback was added).

The trainer's process only takes the answer out of the response (:func:`find_dapo_answer`: a slice, a
regular-expression search over at most 300 characters and a brace scan over at most 100). The
normalization's regular expressions, some quadratic in their input, run in the reward workers
(:class:`DapoVerifier`) under the pool's time limit.

Two deliberate differences from verl, neither of which changes a verdict on real data: a response
without an answer is wrong here whatever the ground truth, where verl compares a placeholder
``"[INVALID]"`` with it (so a ground truth that normalizes to ``[INVALID]`` would be matched, and an
Answer line reading ``[INVALID]`` falls back to the box); and an answer longer than
``max_answer_chars`` is wrong (reason ``too_long``), which only matters below 300 characters.
"""

from __future__ import annotations

import functools
import re
from typing import Literal, get_args

from stapo_megatron.rewards.extract import AnswerSpan

DapoAnswer = Literal["strict_box", "answer_line", "answer_line_or_box"]
DAPO_ANSWERS: tuple[str, ...] = get_args(DapoAnswer)

# compute_score's solution_str[-300:] ("The longest answer in MATH-500 has 159 characters") and
# is_correct_strict_box's pred[-100:].
TAIL_CHARS = 300
BOX_TAIL_CHARS = 100

# is_correct_minerva's answer_pattern. Lines are matched left to right without overlap and the last
# match wins: "Answer: 1 Answer: 2" on one line is one answer, "1 Answer: 2". \s* after the colon
# crosses line breaks, so "Answer:\n5" answers 5.
_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
_BOX_OPEN = "\\boxed{"
_BRACE = re.compile(r"[{}]")


def _last_answer_line(text: str) -> str | None:
    answers = _ANSWER_LINE.findall(text)
    return answers[-1] if answers else None


def _last_box_content(text: str) -> AnswerSpan:
    """The content of the last ``\\boxed{...}`` in ``text`` as DAPO's ``last_boxed_only_string`` and
    ``remove_boxed`` take it: only the ``\\boxed{`` spelling, braces counted without regard to
    backslashes, nothing stripped. Reasons: ``no_box``, ``unterminated_box``."""
    start = text.rfind(_BOX_OPEN)
    if start < 0:
        return AnswerSpan(None, "no_box")
    depth = 0
    for brace in _BRACE.finditer(text, start):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return AnswerSpan(text[start + len(_BOX_OPEN) : brace.start()])
    return AnswerSpan(None, "unterminated_box")


def find_dapo_answer(text: str, mode: DapoAnswer, max_chars: int | None = None) -> AnswerSpan:
    """The answer DAPO's verifier would compare for response ``text`` (not yet normalized).

    Reasons: ``no_answer_line`` (``answer_line``), ``no_box`` / ``unterminated_box`` (the box, in
    ``strict_box`` and as the fallback of ``answer_line_or_box``), ``too_long`` (more than
    ``max_chars`` characters). An empty answer is returned as such: the verifier decides on it.
    """
    if mode not in DAPO_ANSWERS:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join(DAPO_ANSWERS)}")
    answer = _last_answer_line(text[-TAIL_CHARS:]) if mode != "strict_box" else None
    if answer is None:
        if mode == "answer_line":
            return AnswerSpan(None, "no_answer_line")
        span = _last_box_content(text[-BOX_TAIL_CHARS:])
        if span.answer is None:
            return span
        answer = span.answer
    if max_chars is not None and len(answer) > max_chars:
        return AnswerSpan(None, "too_long")
    return AnswerSpan(answer)


# normalize_final_answer's SUBSTITUTIONS, then its REMOVED_EXPRESSIONS (each replaced by nothing):
# plain replacements over the whole string, in this order. Spaces go early, so the units below are
# matched with their spaces removed ("square feet" is gone as "square" and "feet"); "\text{m}"
# becomes "\text{}" and is then removed with it.
_REWRITES: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
) + tuple(
    (removed, "")
    for removed in (
        "square",
        "ways",
        "integers",
        "dollars",
        "mph",
        "inches",
        "hours",
        "km",
        "units",
        "\\ldots",
        "sue",
        "points",
        "feet",
        "minutes",
        "digits",
        "cents",
        "degrees",
        "cm",
        "gm",
        "pounds",
        "meters",
        "meals",
        "edges",
        "students",
        "childrentickets",
        "multiples",
        "\\text{s}",
        "\\text{.}",
        "\\text{\ns}",
        "\\text{}^2",
        "\\text{}^3",
        "\\text{\n}",
        "\\text{}",
        "\\mathrm{th}",
        "^\\circ",
        "^{\\circ}",
        "\\;",
        ",\\!",
        "{,}",
        '"',
        "\\dots",
    )
)
# Then, in this order, each over the whole string: a line with two dollars keeps only its first
# $...$ span; \text{...}, \textbf{...}, \overline{...} lose their wrapper up to the first closing
# brace; \boxed{...} loses its wrapper up to the last closing brace; "fracab" becomes "frac{a}{b}"
# and "sqrta" "sqrt{a}".
_FIRST_MATH_SPAN = re.compile(r".*?\$(.*?)\$.*")
_UNWRAPPED = tuple(re.compile(rf"\\{command}\{{(.*?)\}}") for command in ("text", "textbf", "overline"))
_BOXED = re.compile(r"\\boxed\{(.*)\}")
_FRAC_SHORTHAND = re.compile(r"frac([^{])(.)")
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")


def normalize_final_answer(text: str) -> str:
    """DAPO's normalization of an answer (and of the ground truth): what follows the last ``=``,
    units, spaces and ``\\text`` wrappers removed, shorthand ``\\frac12`` spelt out, dollars
    dropped, and thousands commas removed from a number."""
    text = text.split("=")[-1]
    for old, new in _REWRITES:
        text = text.replace(old, new)
    text = _FIRST_MATH_SPAN.sub(r"$\1$", text)
    for wrapper in _UNWRAPPED:
        text = wrapper.sub(r"\1", text)
    text = _BOXED.sub(r"\1", text)
    text = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", text)
    text = _SQRT_SHORTHAND.sub(r"sqrt{\1}", text)
    text = text.replace("$", "")
    # str.isdigit, as DAPO's: it also accepts other scripts' digits, which only decides the commas.
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


class DapoVerifier:
    """Compares answers taken by :func:`find_dapo_answer` with ground truths, as DAPO's verifier does.

    ``normalize`` is False for ``strict_box`` (the box content must equal the ground truth as
    written) and True for the Answer-line modes. The verdict is DAPO's: ``correct`` exactly when
    the two strings are equal; a wrong answer that is empty (after normalization) is reported as
    ``empty_answer``.
    """

    def __init__(self, normalize: bool, cache_size: int = 8192):
        self.normalize = normalize
        self._normalized = (
            functools.lru_cache(maxsize=cache_size)(normalize_final_answer) if cache_size else normalize_final_answer
        )

    def check(self, answer: str, gold: str) -> str:
        if self.normalize:
            answer, gold = self._normalized(answer), self._normalized(gold)
        if answer == gold:
            return "correct"
        return "empty_answer" if not answer else "wrong"
