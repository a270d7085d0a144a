"""A stricter boxed-answer reward, as a ``reward.kind: custom`` function.

The response must hold exactly one ``\\boxed{...}``, and its content must equal the ground truth
after light normalisation: surrounding ``$``, spacing (``\\,``, ``\\!``, ``\\left``/``\\right``,
whitespace), ``\\dfrac``/``\\tfrac`` as ``\\frac`` and a final full stop do not count. Nothing is
parsed as mathematics: ``0.5`` and ``\\frac{1}{2}`` differ. Where the math reward accepts any
equivalent last box, this one also rewards the form: one final answer, written as the data writes it.
A row field ``answer_aliases`` (a list of strings), where the data has one, lists other accepted answers.

Every result comes with its reason, which ``stapo eval`` writes next to each response
(``detail`` in responses.jsonl). Run it with (the module must be importable in the reward workers,
which receive the trainer's ``sys.path``)::

    PYTHONPATH=examples/custom_reward stapo train --config C reward.kind=custom reward.function=strict_boxed:score
    PYTHONPATH=examples/custom_reward stapo eval --model M --data-dir D reward.kind=custom \\
        reward.function=strict_boxed:score
"""

from __future__ import annotations

import re

# The box finder of the math reward: balanced braces, escaped braces, the brace-less \boxed 5.
from stapo_megatron.rewards.extract import find_last_box

# \boxed and \fbox, but not \boxedfoo or \fboxsep.
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# Spacing that does not change an answer; \left and \right but not \leftarrow or \rightarrow.
_SPACING = re.compile(r"\\[,;:! ]|\\(?:left|right)(?![A-Za-z])|\s+")
_FRACTION = re.compile(r"\\[dt]frac(?![A-Za-z])")


def normalize(answer: str) -> str:
    """The form two answers are compared in."""
    text = answer.strip().strip("$")
    text = _FRACTION.sub(r"\\frac", text)
    return _SPACING.sub("", text).removesuffix(".")


def score(response: str, ground_truth: str, extra: dict) -> tuple[float, str]:
    """1 when the response's one box holds the ground truth (or an alias of it), else 0; and why."""
    boxes = len(_BOX.findall(response))
    if boxes == 0:
        return 0.0, "no \\boxed{}"
    if boxes > 1:
        return 0.0, f"{boxes} boxes, expected exactly one"
    span = find_last_box(response)
    if span.answer is None:
        return 0.0, f"the box holds no answer ({span.reason})"
    aliases = extra.get("answer_aliases")
    accepted = {normalize(ground_truth)}
    if isinstance(aliases, list):
        accepted |= {normalize(alias) for alias in aliases if isinstance(alias, str)}
    if normalize(span.answer) in accepted:
        return 1.0, "one box, equal to the ground truth"
    return 0.0, f"boxed {span.answer!r}, expected {ground_truth!r}"
