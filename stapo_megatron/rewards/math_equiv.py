"""Mathematical equivalence of an answer and a ground truth, without evaluating any code.

The answer text is parsed only by latex2sympy2_extended's ANTLR LaTeX grammar. That converter
builds numbers with ``sympy.Number(token_text)``, which goes through ``sympify`` and so through
``parse_expr`` and ``eval``; :class:`_SafeConverter` replaces exactly those two spots with
constructors that read digits (``Integer(int(s))``, ``Float(s)``, mpmath's string reader).
math_verify's own ``parse`` is not used: its plain-expression extractor feeds matched text to
``parse_expr``. Comparison is math_verify's ``verify`` on the parsed sympy objects.

Numbers are written in ASCII digits only. Python's ``int()`` and the regular expression ``\\d``
accept the decimal digits of every script (Arabic-Indic ``٤٢``, fullwidth ``４２``, Devanagari
``४२``), which would make ``٤٢`` correct against 42; here every number pattern is ``[0-9]`` and
a string reaches ``int()`` only when it is ASCII, so such an answer is a parse error. That is the
grading the benchmarks are reported with: their reference answers are ASCII; Math-Verify, whose
``verify`` this module uses, extracts nothing from ``٤٢`` and finds ``\\boxed{４２}`` unequal to
42; DAPO's rule-based verifier (verl's ``math_dapo``) compares normalized strings, where ``٤٢`` is
not ``42`` either. A model that writes ``٤٢`` has not written the answer the benchmark asks for.
Superscript digits (``²``) are no numbers either.

Heavy imports (sympy, antlr, math_verify): import this module only where verification runs,
normally inside the reward workers. It has no time limit of its own; the pool provides it.
"""

from __future__ import annotations

import functools
import re

import sympy
from latex2sympy2_extended.latex2sympy2 import _Latex2Sympy, comma_number_regex
from latex2sympy2_extended.math_normalization import NormalizationConfig, normalize_latex
from math_verify.grader import should_treat_as_complex, verify

if not callable(getattr(_Latex2Sympy, "parse_number", None)):  # pragma: no cover - version guard
    raise ImportError(
        "latex2sympy2_extended changed: _Latex2Sympy.parse_number is gone, so the code-free number "
        "parsing of stapo_megatron.rewards.math_equiv no longer applies; pin latex2sympy2_extended 1.11"
    )

# math_verify's normalization for LaTeX answers, minus box extraction (the box is already taken).
_NORMALIZATION = NormalizationConfig(
    basic_latex=True, units=True, malformed_operators=True, nits=True, boxed="none", equations=False
)

# ASCII digits only (see the module's docstring); re.ASCII keeps \s to ASCII as well.
_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
# "4.5e33" as a whole answer: the grammar would read the lower-case e as Euler's number.
_SCIENTIFIC = re.compile(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))\s*[eE]\s*([+-]?[0-9]+)\s*", re.ASCII)
# math_verify's fallback for "a = b = c": parse only the last side.
_EQUATION_SPLIT = re.compile(r"(?<!\\|<|!|>)=")
_SPACES = re.compile(r"\s+")
_PERCENT_SUFFIX = re.compile(r"\s*\\?%\s*$")


def safe_number(text: str) -> sympy.Number:
    """A sympy number from a numeric literal, read without sympify (no eval)."""
    s = text.strip()
    if _INTEGER.fullmatch(s):
        return sympy.Integer(int(s))
    if _DECIMAL.fullmatch(s):
        return sympy.Float(s)
    raise ValueError(f"not a numeric literal: {s[:50]!r}")


def _comma_number(text: str) -> sympy.Number:
    """``1,234`` (thousands separators) or ``0,111`` (a decimal comma), as the converter reads them."""
    s = text.strip()
    sign = ""
    if s.startswith(("+", "-")):
        sign, s = s[0], s[1:]
    if "," in s and s.startswith("0"):
        s = s.replace(",", ".")
    return safe_number(sign + s.replace(",", "").replace(" ", ""))


class _SafeConverter(_Latex2Sympy):
    """The ANTLR LaTeX converter with its two string-to-number spots made code-free."""

    def parse_number(self, text):
        digits = text.replace(",", "")
        if digits.isascii() and digits.isdigit():  # the upstream strips leading zeros; int() does the same
            return sympy.Integer(int(digits))
        return safe_number(digits)

    def parse(self, latex_str):
        # Upstream sends a string like "1,234" to its module-level convert_number (sympify).
        if comma_number_regex.match(latex_str):
            return _comma_number(latex_str)
        return super().parse(latex_str)


def normalize_answer(text: str) -> str:
    """math_verify's LaTeX normalization (units, \\text, \\left/\\right, malformed fractions ...)."""
    text = normalize_latex(text, _NORMALIZATION).strip()
    scientific = _SCIENTIFIC.fullmatch(text)
    if scientific:
        text = f"{scientific.group(1)}\\times 10^{{{scientific.group(2)}}}"
    return text


def parse_latex(latex: str):
    """A normalized LaTeX answer as a sympy object; raises on anything the grammar rejects."""
    if _INTEGER.fullmatch(latex):
        # Most answers are integers: same result as the grammar, a hundred times faster.
        return sympy.Integer(int(latex))
    try:
        return _SafeConverter(is_real=not should_treat_as_complex(latex), convert_degrees=False).parse(latex)
    except Exception:
        parts = _EQUATION_SPLIT.split(latex) if "," not in latex and ";" not in latex else []
        if len(parts) > 2:
            last = parts[-1]
            return _SafeConverter(is_real=not should_treat_as_complex(last), convert_degrees=False).parse(last)
        raise


def _small_numbers_differ(a, b) -> bool:
    """Whether two numbers below 1e-3 differ by more than one part in a million.

    math_verify rounds floats to 6 decimal places and chops tiny differences, so it finds
    1.323e-27 equal to 1.325e-27 (minerva's answers are full of such numbers). Below 1e-3 the
    comparison is made relative instead, with the precision math_verify applies to numbers near 1.
    """
    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr) and a.is_number and b.is_number):
        return False
    try:
        x, y = sympy.N(a.doit(), 30), sympy.N(b.doit(), 30)  # doit: percentages are unevaluated products
        if not (x.is_real and y.is_real):
            return False
        scale = max(abs(x), abs(y))
        return bool(0 < scale < 1e-3 and abs(x - y) > 1e-6 * scale)
    except (TypeError, ValueError, ArithmeticError):
        return False


_FAILED = object()


class MathVerifier:
    """Checks answers against ground truths, caching parses and verdicts (answers repeat a lot)."""

    def __init__(self, cache_size: int = 8192):
        cached = functools.lru_cache(maxsize=cache_size) if cache_size else (lambda f: f)
        self._parse = cached(self._parse_uncached)
        self._verdict = cached(self._verdict_uncached)

    @staticmethod
    def _parse_uncached(normalized: str):
        try:
            return parse_latex(normalized)
        except Exception:  # any grammar or conversion failure means "not parseable"
            return _FAILED

    def _verdict_uncached(self, answer: str, gold: str) -> str:
        gold_norm, answer_norm = normalize_answer(gold), normalize_answer(answer)
        if not answer_norm:
            return "empty_answer"
        if _SPACES.sub("", gold_norm) == _SPACES.sub("", answer_norm):
            return "correct"
        gold_expr = self._parse(gold_norm)
        if gold_expr is _FAILED:
            return "gold_parse_error"
        answer_expr = self._parse(answer_norm)
        if answer_expr is _FAILED:
            return "parse_error"
        if self._equivalent(gold_expr, answer_expr):
            return "correct"
        # "12.5\%" against a ground truth of 12.5 ("what percent ...?"), or the other way round: math_verify
        # only forgives the percent sign on integers.
        gold_bare, answer_bare = _PERCENT_SUFFIX.sub("", gold_norm), _PERCENT_SUFFIX.sub("", answer_norm)
        if (gold_bare != gold_norm) != (answer_bare != answer_norm):
            gold_expr, answer_expr = self._parse(gold_bare), self._parse(answer_bare)
            if gold_expr is not _FAILED and answer_expr is not _FAILED and self._equivalent(gold_expr, answer_expr):
                return "correct"
        return "wrong"

    @staticmethod
    def _equivalent(gold_expr, answer_expr) -> bool:
        if isinstance(gold_expr, sympy.Integer) and isinstance(answer_expr, sympy.Integer):
            return gold_expr == answer_expr
        return verify(gold_expr, answer_expr, timeout_seconds=None) and not _small_numbers_differ(
            gold_expr, answer_expr
        )

    def check(self, answer: str, gold: str) -> str:
        """The reason for ``answer`` against ``gold``: correct, wrong, parse_error, gold_parse_error, empty_answer."""
        return self._verdict(answer, gold)
