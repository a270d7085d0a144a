"""Test-only hooks run inside reward workers (passed as ``RewardPool(worker_init=...)``).

Module-level functions so that the worker can unpickle them by reference.
"""

from __future__ import annotations

import builtins
import os
import signal
import sys
import time


def _record(log_path: str, line: str) -> None:
    with open(log_path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


# exec cannot be refused outright: the import system runs module code with it, and sympy's
# polynomial module compiles monomial helpers from a count of variables (see the trap log).
# Those two callers are let through and logged; every other exec raises.
EXEC_ALLOWED_CALLERS = ("importlib._bootstrap", "importlib._bootstrap_external", "sympy.polys.monomials")


def read_log(log_path: str) -> list[str]:
    if not os.path.exists(log_path):
        return []
    with open(log_path, encoding="utf-8") as f:
        return f.read().split("\x00\n")[:-1]


def install_trap(log_path: str) -> None:
    """Make eval, exec, parse_expr and sympify of a string raise, and log every attempt.

    sympify is trapped for string arguments only: sympy passes its own objects through it on
    every arithmetic operation; a string is the only input it turns into code. Log entries are
    "refused <name> <argument>" or "allowed exec <caller> <source>", separated by NUL + newline.
    """
    import sympy  # noqa: F401
    from sympy.parsing import sympy_parser

    sympify_module = sys.modules["sympy.core.sympify"]
    original_sympify = sympify_module.sympify
    original_parse_expr = sympy_parser.parse_expr

    original_exec = builtins.exec

    def tripped(name):
        def refuse(*args, **kwargs):
            _record(log_path, f"refused {name} {str(args[0]) if args else ''}\x00")
            raise RuntimeError(f"{name} called while verifying")

        return refuse

    refuse_exec = tripped("exec")

    def trapped_exec(source, *args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "?")
        if caller not in EXEC_ALLOWED_CALLERS:
            return refuse_exec(source)
        _record(log_path, f"allowed exec {caller} {source if isinstance(source, str) else '<code object>'}\x00")
        return original_exec(source, *args, **kwargs)

    trapped_parse_expr = tripped("parse_expr")
    refuse_sympify = tripped("sympify")

    def trapped_sympify(a, *args, **kwargs):
        if isinstance(a, (str, bytes)):
            return refuse_sympify(a)
        return original_sympify(a, *args, **kwargs)

    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is original_sympify:
                namespace[name] = trapped_sympify
            elif value is original_parse_expr:
                namespace[name] = trapped_parse_expr
    builtins.eval = tripped("eval")
    builtins.exec = trapped_exec
    _record(log_path + ".installed", str(os.getpid()))


def install_hang_and_crash(marker_dir: str) -> None:
    """Answers "HANG" block SIGALRM and sleep (like a long C call); "CRASH" kills the worker."""
    from stapo_megatron.rewards.math_equiv import MathVerifier

    original = MathVerifier.check

    def check(self, answer, gold):
        if answer == "HANG":
            _record(os.path.join(marker_dir, "hang"), str(os.getpid()))
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(600)
        if answer == "CRASH":
            os._exit(3)
        return original(self, answer, gold)

    MathVerifier.check = check


def fail_to_start() -> None:
    raise OSError("this worker cannot start (test)")
