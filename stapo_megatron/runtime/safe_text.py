"""Untrusted text (a model's output, a string read from a file) made safe to print on a terminal.

A terminal acts on what it is sent: ESC and the other C0 and C1 control characters move the
cursor, clear the screen, set the window title or (in some terminals) write files; the bidi
overrides (U+202A-202E, U+2066-2069) reorder what is shown, so printed text can read as something
else than it is. :func:`printable` shows each character that Python does not count as printable
(the control characters, format characters such as the bidi overrides, line and paragraph
separators, lone surrogates) as its escape, ``\\x1b``, ``\\u202e``; newlines and tabs too, so
that a context stays on its own line.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every character that is not printable shown as its Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
