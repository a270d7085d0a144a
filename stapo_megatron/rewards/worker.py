"""The reward worker process, started by :class:`~stapo_megatron.rewards.pool.RewardPool` with
``python -c "...worker import main; main([FD])"``.

A plain subprocess rather than a multiprocessing child, so that it never imports the trainer's
``__main__`` (and torch with it). It talks over the socket FD with
``multiprocessing.connection`` messages:

parent -> worker: ``sys.path`` (list), then :class:`WorkerSettings`, then tasks
``(task_id, answer, gold)`` (kind custom: ``(task_id, response, gold, extra)``); ``None`` asks it
to exit.
worker -> parent: ``("ready", pid)``, ``("failed", message)`` or, when the custom reward function
cannot be used, ``("bad_function", message)`` once, then one ``(task_id, reason, seconds, score,
detail)`` per task, in order.

Each task runs under a SIGALRM time limit (an exception between bytecodes). Work that never
returns to the interpreter, such as a huge integer power inside C, is the parent's to kill.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from stapo_megatron.rewards.custom import MAX_DETAIL_CHARS, CustomVerifier, RewardFunctionError, load_reward_function
from stapo_megatron.rewards.guard import CodeEvaluationBlocked, install_code_eval_guard

# (answer, gold, expected reason): run at start-up of a math worker so that the lazy imports and caches of every
# comparison path (sets, intervals, matrices, relations, simplify, solve) are warm before the time
# limits and the code-evaluation guard apply, and as a self-check of the installed libraries.
WARMUP_PAIRS: tuple[tuple[str, str, str], ...] = (
    ("42", "42", "correct"),
    ("\\frac{1}{2}", "0.5", "correct"),
    ("1.5", "\\frac32", "correct"),
    ("\\sqrt{8}", "2\\sqrt{2}", "correct"),
    ("2\\pi", "\\pi + \\pi", "correct"),
    ("50\\%", "50", "correct"),
    ("(1, 2]", "(\\frac{2}{2}, 2]", "correct"),
    ("\\{1, 2\\}", "\\{2, 1\\}", "correct"),
    ("(1, 2)", "(2, 1)", "wrong"),
    ("x = 3", "3", "correct"),
    ("x^2 + 2x + 1", "(x+1)^2", "correct"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} \\frac{2}{2} \\\\ 2 \\end{pmatrix}", "correct"),
    ("x \\geq 2", "2 \\leq x", "correct"),
    ("y = 2x + 1", "y = 1 + 2x", "correct"),
    ("1,234", "1234", "correct"),
    ("4.5e3", "4500", "correct"),
    ("7", "8", "wrong"),
    ("\\text{Yes}", "\\text{yes}", "correct"),
)


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    kind: str  # the reward kind whose verifier runs here: math, dapo or custom
    dapo_answer: str  # kind dapo: RewardConfig.dapo_answer (strict_box compares without normalizing)
    function: str  # kind custom: RewardConfig.function, 'package.module:function'
    timeout_s: float
    memory_limit_mb: int
    forbid_code_eval: bool
    cache_size: int
    # Runs after warm-up and before the guard and the first task (picklable: a module-level function).
    worker_init: Callable[[], None] | None = None


class SampleTimeout(BaseException):
    """Raised by SIGALRM. Not an Exception, so math_verify's and sympy's handlers let it through."""


def _on_alarm(signum, frame):
    raise SampleTimeout()


def _limit_memory(megabytes: int) -> None:
    if megabytes <= 0:
        return
    import resource

    limit = megabytes * 1024 * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _math_verifier(cache_size: int):
    # math_verify warns once that its own timeout is off: the limit here replaces it.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from stapo_megatron.rewards.math_equiv import MathVerifier

    verifier = MathVerifier(cache_size)
    for answer, gold, expected in WARMUP_PAIRS:
        got = verifier.check(answer, gold)
        if got != expected:
            raise RuntimeError(
                f"reward worker self-check failed: {answer!r} against {gold!r} gave {got!r}, expected "
                f"{expected!r}; the installed math-verify/latex2sympy2_extended/sympy behave differently"
            )
    return verifier


def _start(conn: Connection) -> tuple[WorkerSettings, object]:
    sys.path[:] = conn.recv()
    settings: WorkerSettings = conn.recv()
    verifier: object  # check(answer, gold) -> reason; custom: check(response, gold, extra) -> (reason, score, detail)
    if settings.kind == "math":
        verifier = _math_verifier(settings.cache_size)
    elif settings.kind == "dapo":
        # Plain string operations on module-level compiled patterns: nothing to warm up, no library to check.
        from stapo_megatron.rewards.dapo_math import DapoVerifier

        verifier = DapoVerifier(normalize=settings.dapo_answer != "strict_box", cache_size=settings.cache_size)
    elif settings.kind == "custom":
        # Imported here, before the limits and the guard, as the math verifier's libraries are: a module body
        # never sees a response.
        verifier = CustomVerifier(load_reward_function(settings.function))
    else:
        raise ValueError(f"reward workers verify kinds math, dapo and custom, not {settings.kind!r}")
    _limit_memory(settings.memory_limit_mb)
    if settings.worker_init is not None:
        settings.worker_init()
    if settings.forbid_code_eval:
        install_code_eval_guard()
    signal.signal(signal.SIGALRM, _on_alarm)
    return settings, verifier


def _verify(verifier, payload: tuple, timeout_s: float) -> tuple[str, float, str | None]:
    """(reason, score, detail) of one task; the score is 1 for "correct" and 0 for every other reason
    but a custom reward's "partial"."""
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            outcome = verifier.check(*payload)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except SampleTimeout:
        return "timeout", 0.0, f"ran past timeout_s={timeout_s:g} s"
    except CodeEvaluationBlocked as err:
        print(f"reward worker: blocked a code evaluation: {err}", file=sys.stderr, flush=True)
        return "error", 0.0, f"blocked a code evaluation: {err}"[:MAX_DETAIL_CHARS]
    except Exception as err:  # MemoryError under the address-space limit, RecursionError on deep nesting, ...
        return "error", 0.0, f"{type(err).__name__}: {err}"[:MAX_DETAIL_CHARS]
    if isinstance(outcome, str):  # math and dapo give the reason alone
        return outcome, 1.0 if outcome == "correct" else 0.0, None
    return outcome


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[0]))
    # The parent stops the pool with SIGTERM/SIGKILL or by closing the socket; ^C is the parent's business.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        settings, verifier = _start(conn)
    except BaseException as err:  # report any start-up failure, then exit
        try:
            if isinstance(err, RewardFunctionError):
                conn.send(("bad_function", str(err)))
            else:
                conn.send(("failed", f"{type(err).__name__}: {err}"))
        except OSError:
            pass
        return 1
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return 0
        if task is None:
            return 0
        task_id, *payload = task
        started = time.perf_counter()
        reason, score, detail = _verify(verifier, tuple(payload), settings.timeout_s)
        conn.send((task_id, reason, time.perf_counter() - started, score, detail))
