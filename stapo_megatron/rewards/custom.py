"""User-defined rewards (``reward.kind: custom``): the function named by ``reward.function``, loaded
and called inside the reward workers only.

:func:`load_reward_function` runs in a worker (:mod:`stapo_megatron.rewards.worker`): it imports
the module, finds the function and checks that it can be called as
``function(response, ground_truth, extra)``; :class:`CustomVerifier` calls it on each sample and
turns what it returns into ``(reason, score, detail)``. The trainer's process never imports the
user's module: the check before a run starts asks a short-lived worker
(:func:`stapo_megatron.rewards.pool.check_reward_function`).

A function returns a score in [0, 1] (a float, an int or a bool, numpy's too), a ``(score, reason)`` pair or a
dict ``{"score": ..., "reason": ...}`` (``reason`` optional); ``reason`` is text or None. The score
sets the reason category: 1 ``correct``, 0 ``wrong``, in between ``partial``; the function's own
reason is the result's ``detail``. Anything else it returns, and any exception it raises, scores 0
with reason ``error`` and says why in ``detail``.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
import reprlib
from collections.abc import Callable
from typing import Any

# package.module:function, the part after the colon an attribute path (module:Class.method).
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
FUNCTION_SPEC = re.compile(rf"(?P<module>{_DOTTED}):(?P<attribute>{_DOTTED})")
# A detail (the function's reason, or why it failed) is cut to this length: it goes into every
# evaluation record and crosses the worker's socket once per sample.
MAX_DETAIL_CHARS = 500
_EXPECTED = "expected a score in [0, 1] (float, int or bool), a (score, reason) pair or a dict {score, reason}"
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80


class RewardFunctionError(ValueError):
    """reward.function cannot be used: not importable, not found, or not callable as documented."""


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_DETAIL_CHARS else line[: MAX_DETAIL_CHARS - 3] + "..."


def _describe(value: Any) -> str:
    try:
        return f"{_SHORT.repr(value)} ({type(value).__name__})"
    except Exception:  # a user object whose repr raises
        return f"a {type(value).__name__}"


def load_reward_function(spec: str) -> Callable[..., Any]:
    """The function ``spec`` ('package.module:function') names, checked; raises RewardFunctionError in one line."""
    match = FUNCTION_SPEC.fullmatch(spec)
    if match is None:
        raise RewardFunctionError(f"expected 'package.module:function', got {spec!r}")
    module_name, attribute = match["module"], match["attribute"]
    try:
        module = importlib.import_module(module_name)
    except BaseException as err:  # ImportError, or anything the module's body raised (SystemExit included)
        missing = getattr(err, "name", None)
        hint = (
            "; is it installed or on PYTHONPATH?"
            if isinstance(err, ModuleNotFoundError)
            and missing
            and (module_name == missing or module_name.startswith(missing + "."))
            else ""
        )
        raise RewardFunctionError(
            f"cannot import module {module_name!r} ({type(err).__name__}: {_one_line(str(err))}{hint})"
        ) from None
    function: Any = module
    for depth, part in enumerate(attribute.split(".")):
        try:
            function = getattr(function, part)
        except AttributeError:
            where = module_name if depth == 0 else f"{module_name}:{'.'.join(attribute.split('.')[:depth])}"
            raise RewardFunctionError(f"{where} has no attribute {part!r}") from None
    check_signature(function, spec)
    return function


def check_signature(function: Any, spec: str) -> None:
    """Raise RewardFunctionError unless ``function`` can be called as function(response, ground_truth, extra)."""
    if inspect.isclass(function):
        raise RewardFunctionError(f"{spec} is a class; name a function (or an object with __call__)")
    if not callable(function):
        raise RewardFunctionError(f"{spec} is not a function (its type is {type(function).__name__})")
    if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
        raise RewardFunctionError(f"{spec} is an async function; a reward function returns its score directly")
    if inspect.isgeneratorfunction(function):
        raise RewardFunctionError(f"{spec} is a generator function; a reward function returns its score directly")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to read (some builtins): a bad call scores as an error
        return
    try:
        signature.bind("response", "ground_truth", {})
    except TypeError as err:
        raise RewardFunctionError(
            f"{spec}{signature} cannot be called as function(response, ground_truth, extra): {err}"
        ) from None


def score_of(returned: Any) -> tuple[str, float, str | None]:
    """(reason, score, detail) of what a reward function returned; a return that is not a score is an error."""
    reason: Any = None
    if isinstance(returned, dict):
        unknown = sorted(map(str, set(returned) - {"score", "reason"}))
        if "score" not in returned or unknown:
            problem = f"unknown keys {unknown}" if unknown else "no 'score'"
            return "error", 0.0, f"returned a dict with {problem}; {_EXPECTED}"
        score, reason = returned["score"], returned.get("reason")
    elif isinstance(returned, tuple):
        if len(returned) != 2:
            return "error", 0.0, f"returned a tuple of {len(returned)}; {_EXPECTED}"
        score, reason = returned
    else:
        score = returned
    if reason is not None and not isinstance(reason, str):
        return "error", 0.0, f"returned the reason {_describe(reason)}; expected text or None"
    if _numpy_bool(score):
        score = bool(score)
    if not isinstance(score, (bool, numbers.Real)):
        return "error", 0.0, f"returned the score {_describe(score)}; {_EXPECTED}"
    try:
        value = float(score)
    except Exception as err:  # a Real subclass whose conversion fails
        return "error", 0.0, f"returned the score {_describe(score)}, not convertible to float ({err})"
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        return "error", 0.0, f"returned the score {value!r}, outside [0, 1]"
    category = "correct" if value == 1.0 else "wrong" if value == 0.0 else "partial"
    return category, value, _one_line(str(reason)) if reason is not None else None


def _numpy_bool(value: Any) -> bool:
    """numpy's boolean scalar (``np.bool_``; ``np.bool`` in numpy 2), which, unlike numpy's integers and
    floats, is no ``numbers.Real``; recognised without importing numpy."""
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")


class CustomVerifier:
    """Calls a loaded reward function on one sample; exceptions become scored errors (the worker
    applies the time limit and the code-evaluation guard around the call)."""

    def __init__(self, function: Callable[..., Any]):
        self.function = function

    def check(self, response: str, ground_truth: str, extra: dict) -> tuple[str, float, str | None]:
        try:
            returned = self.function(response, ground_truth, extra)
        except (Exception, SystemExit) as err:  # SystemExit: sys.exit() in the function must not end the worker
            message = str(err)
            return "error", 0.0, _one_line(f"raised {type(err).__name__}{': ' + message if message else ''}")
        return score_of(returned)
