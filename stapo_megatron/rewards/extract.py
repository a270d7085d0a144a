"""Finding the final answer of a response: the last ``\\boxed{...}`` (or ``\\fbox{...}``).

This runs in the trainer's process on untrusted text, so it only slices strings and its cost is
bounded: C-speed searches over the whole response, and a Python loop over at most
``max_chars`` characters of the box itself.
"""

from __future__ import annotations

import dataclasses
import re

_COMMANDS = ("\\boxed", "\\fbox")
_SPACE = re.compile(r"\s*")
# A backslash escape is consumed as a unit so that \{ and \} (literal braces in TeX) and \\
# do not count towards the grouping braces.
_BRACE_OR_ESCAPE = re.compile(r"\\[\s\S]|[{}]")
# The argument of the brace-less form (``\boxed 5``): everything up to whitespace or a dollar.
_BARE_ARGUMENT = re.compile(r"[^\s$]*")


@dataclasses.dataclass(frozen=True)
class AnswerSpan:
    """The answer found in a response, or why there is none (``reason`` is then set)."""

    answer: str | None
    reason: str | None = None


def _last_command(text: str, end: int) -> tuple[int, int]:
    """Start and length of the last box command that starts before ``end``; (-1, 0) if none.

    One backward scan per command: each command's next occurrence is searched only to the left of
    its previous one, so thousands of ``\\boxedfoo`` cost one pass over the text, not one each.
    (An occurrence of one command cannot overlap another's: both start with the only backslash.)
    """
    found = [text.rfind(command, 0, end) for command in _COMMANDS]
    while True:
        at = max(found)
        if at < 0:
            return -1, 0
        index = found.index(at)
        after = at + len(_COMMANDS[index])
        # \boxedfoo or \fboxsep is another command, not a box.
        if after < len(text) and text[after].isalpha():
            found[index] = text.rfind(_COMMANDS[index], 0, at)
            continue
        return at, len(_COMMANDS[index])


def find_last_box(text: str, max_chars: int | None = None) -> AnswerSpan:
    """The content of the last box to start in ``text``.

    Accepts ``\\boxed{...}`` and ``\\fbox{...}`` with balanced braces (escaped ``\\{``/``\\}`` do
    not count), and the brace-less form ``\\boxed 5`` (the argument runs to whitespace or ``$``).
    Reasons: ``no_box``, ``unterminated_box``, ``empty_answer``, ``too_long`` (content longer than
    ``max_chars``, found without scanning past that many characters).
    """
    start, length = _last_command(text, len(text))
    if start < 0:
        return AnswerSpan(None, "no_box")
    after = start + length
    space = _SPACE.match(text, after)
    assert space is not None  # \s* matches anywhere
    arg = space.end()
    if arg >= len(text):
        return AnswerSpan(None, "unterminated_box")
    if text[arg] != "{":
        bare = _BARE_ARGUMENT.match(text, arg)
        assert bare is not None  # [^\s$]* matches anywhere
        content = bare.group()
        # "... is \boxed 5." ends a sentence: the full stop is not part of the answer.
        content = content.rstrip(".,;")
        if max_chars is not None and len(content) > max_chars:
            return AnswerSpan(None, "too_long")
        return AnswerSpan(content, None) if content else AnswerSpan(None, "empty_answer")
    depth = 1
    limit = len(text) if max_chars is None else min(len(text), arg + 2 + max_chars)
    for match in _BRACE_OR_ESCAPE.finditer(text, arg + 1, limit):
        token = match.group()
        if token == "{":
            depth += 1
        elif token == "}":
            depth -= 1
            if depth == 0:
                content = text[arg + 1 : match.start()].strip()
                return AnswerSpan(content, None) if content else AnswerSpan(None, "empty_answer")
    if limit < len(text):
        return AnswerSpan(None, "too_long")
    return AnswerSpan(None, "unterminated_box")


def extract_boxed(text: str) -> str | None:
    """The content of the last complete box in ``text``, or None (no box, or it never closes)."""
    return find_last_box(text).answer


_WHITESPACE = re.compile(r"\s+")


def normalize_exact(text: str) -> str:
    """The form the exact-match reward compares: whitespace runs collapsed, a final full stop dropped."""
    return _WHITESPACE.sub(" ", text).strip().removesuffix(".").rstrip()


# The free words of the synthetic task's tokenizer (stapo_megatron.data.synthetic): w0, w1, ...
# (ASCII digits: \d would take "w٤" for one).
FREE_WORD = re.compile(r"w[0-9]+")


def free_words_answer(text: str, max_chars: int | None = None) -> AnswerSpan:
    """The answer for the free-words reward: the response's first whitespace-separated word, when
    every word after it is a free word (``w`` and digits); any other word after it (a second
    digit, a special token) makes the response wrong."""
    words = text.split()
    if not words:
        return AnswerSpan(None, "empty_answer")
    if not all(FREE_WORD.fullmatch(word) for word in words[1:]):
        return AnswerSpan(None, "wrong")
    if max_chars is not None and len(words[0]) > max_chars:
        return AnswerSpan(None, "too_long")
    return AnswerSpan(words[0], None)


def exact_answer(text: str, max_chars: int | None = None) -> AnswerSpan:
    """The answer for the exact-match reward: the last box if there is one, else the whole response."""
    start, _ = _last_command(text, len(text))
    if start >= 0:
        span = find_last_box(text, max_chars)
        if span.answer is None:
            return span
        text = span.answer
    answer = normalize_exact(text)
    if not answer:
        return AnswerSpan(None, "empty_answer")
    if max_chars is not None and len(answer) > max_chars:
        return AnswerSpan(None, "too_long")
    return AnswerSpan(answer, None)
