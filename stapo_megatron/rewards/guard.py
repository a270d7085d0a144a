"""Block code evaluation in a reward worker process.

Installed after the worker's warm-up. From then on ``eval``, sympy's ``parse_expr`` and
``sympify`` of a string (where sympy is loaded) raise :class:`CodeEvaluationBlocked`, and so
does ``exec`` unless it is called by ``sympy.polys.monomials``, which compiles arithmetic helpers
from a count of variables whenever a polynomial ring with a new number of generators appears. All of them stay allowed
while a module is being imported: module bodies run through exec, and some (sympy.physics.units,
imported lazily by ``simplify``) sympify constant strings; a module body never sees answer text.

The exception derives from BaseException so that the ``except Exception`` blocks of math_verify
and sympy cannot swallow it: the worker reports the sample as an error.

Only for dedicated worker processes: it changes builtins and library modules for good.
"""

from __future__ import annotations

import builtins
import sys

EXEC_CALLERS = frozenset({"sympy.polys.monomials"})


class CodeEvaluationBlocked(BaseException):
    """Something tried to evaluate code in a guarded reward worker."""


def _importing(frame) -> bool:
    """Whether the import system is on the stack: then the caller is some module's body."""
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _rebind(original, replacement) -> None:
    # `from sympy import sympify` copies the function into many module namespaces: replace every copy.
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        names = [name for name, value in list(namespace.items()) if value is original]
        for name in names:
            namespace[name] = replacement


def _guarded(name: str, original, allowed_callers=frozenset()):
    def guarded(*args, **kwargs):
        caller = sys._getframe(1)
        if caller.f_globals.get("__name__") in allowed_callers or _importing(caller):
            return original(*args, **kwargs)
        raise CodeEvaluationBlocked(
            f"{name} called from {caller.f_globals.get('__name__', '?')} is blocked in reward workers"
        )

    return guarded


def install_code_eval_guard() -> None:
    """Block eval and exec (but for EXEC_CALLERS) in this process from now on, and sympy's parse_expr
    and sympify(str) if sympy is loaded. A worker that never imports sympy (the dapo verifier's) is
    not made to: were sympy imported later, its parsing would still end in the guarded eval."""
    if getattr(builtins.eval, "_stapo_guard", False):
        return
    if "sympy" in sys.modules:
        _guard_sympy()
    builtins.eval = _guarded("eval", builtins.eval)
    builtins.eval._stapo_guard = True  # type: ignore[attr-defined]  # mypy does not model function attributes
    builtins.exec = _guarded("exec", builtins.exec, EXEC_CALLERS)


def _guard_sympy() -> None:
    from sympy.parsing import sympy_parser

    sympify_module = sys.modules["sympy.core.sympify"]
    original_sympify = sympify_module.sympify

    def guarded_sympify(a, *args, **kwargs):
        # sympy passes its own objects through sympify constantly; only a string becomes code.
        if isinstance(a, (str, bytes)) and not _importing(sys._getframe(1)):
            caller = sys._getframe(1).f_globals.get("__name__", "?")
            raise CodeEvaluationBlocked(f"sympify of a string called from {caller} is blocked in reward workers")
        return original_sympify(a, *args, **kwargs)

    _rebind(original_sympify, guarded_sympify)
    _rebind(sympy_parser.parse_expr, _guarded("parse_expr", sympy_parser.parse_expr))
