"""Scoring batches of responses with a persistent pool of verification workers.

The trainer's process only slices strings (finding the last box, or the answer DAPO's verifier
reads in a response's last 300 characters) and deduplicates
(answer, ground truth) pairs; every parse and comparison happens in a worker process
(:mod:`stapo_megatron.rewards.worker`) under a per-sample time limit. A custom reward function
(``kind="custom"``) gets the whole response, and is imported and called in the workers alone. A worker still busy
``timeout_s + kill_grace_s`` after it started a sample is killed and replaced; the sample gets
reason ``timeout`` and the samples queued behind it go to the other workers.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import multiprocessing
import os
import pickle
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path

from stapo_megatron.config import ConfigError
from stapo_megatron.rewards.config import RewardConfig, RewardKind
from stapo_megatron.rewards.dapo_math import DapoAnswer, find_dapo_answer
from stapo_megatron.rewards.extract import (
    AnswerSpan,
    exact_answer,
    find_last_box,
    free_words_answer,
    normalize_exact,
)
from stapo_megatron.rewards.result import RewardResult
from stapo_megatron.rewards.worker import WorkerSettings

logger = logging.getLogger(__name__)

# Start-up imports sympy, antlr and math_verify and runs the self-check: about a second on an idle
# core; the bound only catches a worker that hangs while starting.
_STARTUP_TIMEOUT_S = 120.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# -c rather than -m: runpy warns when the package (which imports the worker module) is already loaded.
_WORKER_ENTRY = "import sys; from stapo_megatron.rewards.worker import main; sys.exit(main(sys.argv[1:]))"
# Reward kinds scored by string comparison in this process, and how each takes the answer.
_LOCAL_EXTRACTORS = {"exact": exact_answer, "free_words": free_words_answer}


@dataclasses.dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    spawned_at: float
    ready: bool = False
    inflight: collections.deque = dataclasses.field(default_factory=collections.deque)
    head_started: float = 0.0


def _stop_all(workers: list[_Worker]) -> None:
    """Kill whatever is still running (the pool's finalizer; also used by close)."""
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.kill()
    for worker in workers:
        try:
            worker.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
            pass
        worker.conn.close()
    workers.clear()


# What a reward worker's environment holds: what the interpreter, the locale and the math libraries
# read, and a measured test run's coverage settings. A user's reward function is untrusted code: no
# API key, token, run-lock token, rank identity or launcher variable (torchrun's would make it a rank)
# reaches it unless reward.pass_env names it.
WORKER_ENV = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TEMP",
        "TMP",
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
        "PYTHONIOENCODING",
        "VIRTUAL_ENV",
        "LD_LIBRARY_PATH",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
    }
)
WORKER_ENV_PREFIXES = ("LC_", "COVERAGE_")


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured, closed)
        return False
    return True


def worker_environment(environ: Mapping[str, str], pass_env: Sequence[str] = ()) -> dict[str, str]:
    """The environment a reward worker starts with: ``environ``'s :data:`WORKER_ENV` and ``pass_env``."""
    named = set(pass_env)
    return {
        name: value
        for name, value in environ.items()
        if name in WORKER_ENV or name.startswith(WORKER_ENV_PREFIXES) or name in named
    }


class RewardPool:
    """Rewards for batches of responses: ``score(responses, answers, extras) -> list[RewardResult]``.

    ``kind="math"`` verifies the last box against the ground truth in ``num_workers`` worker
    processes, ``kind="dapo"`` the answer DAPO's verifier takes (``dapo_answer``) with its string
    comparison, ``kind="custom"`` calls ``function`` ('package.module:function',
    :mod:`stapo_megatron.rewards.custom`) on the whole response, its ground truth and its data
    row there; ``kind="exact"`` compares normalized strings, ``kind="free_words"`` the last word
    after free words, in this process, and start no worker.
    ``worker_init`` (a picklable, module-level function) runs in each worker after its warm-up,
    before the code-evaluation guard and the first sample. Not thread-safe; close it when done
    (or use it as a context manager).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        kind: RewardKind = "math",
        *,
        kill_grace_s: float = 1.0,
        max_answer_chars: int = 1000,
        prefetch: int = 4,
        memory_limit_mb: int = 4096,
        forbid_code_eval: bool = True,
        cache_size: int = 8192,
        worker_init: Callable[[], None] | None = None,
        dapo_answer: DapoAnswer = "strict_box",
        function: str = "",
        pass_env: Sequence[str] = (),
    ):
        # The config's checks, with the config's messages.
        RewardConfig(
            kind=kind,
            dapo_answer=dapo_answer,
            function=function,
            num_workers=num_workers,
            timeout_s=timeout_s,
            kill_grace_s=kill_grace_s,
            max_answer_chars=max_answer_chars,
            prefetch=prefetch,
            memory_limit_mb=memory_limit_mb,
            forbid_code_eval=forbid_code_eval,
            cache_size=cache_size,
            pass_env=list(pass_env),
        )
        self.kind = kind
        self.pass_env = tuple(pass_env)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.hard_limit_s = float(timeout_s) + float(kill_grace_s)
        self.max_answer_chars = max_answer_chars
        self.prefetch = prefetch
        # Where the answer is taken out of a response, in this process (bounded slicing and scanning).
        self._extract: Callable[[str], AnswerSpan] = (
            functools.partial(find_dapo_answer, mode=dapo_answer, max_chars=max_answer_chars)
            if kind == "dapo"
            else functools.partial(find_last_box, max_chars=max_answer_chars)
        )
        self._settings = WorkerSettings(
            kind=kind,
            dapo_answer=dapo_answer,
            function=function,
            timeout_s=float(timeout_s),
            memory_limit_mb=memory_limit_mb,
            forbid_code_eval=forbid_code_eval,
            cache_size=cache_size,
            worker_init=worker_init,
        )
        self.workers_replaced = 0
        self._closed = False
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)
        if kind not in _LOCAL_EXTRACTORS:
            for _ in range(num_workers):
                self._workers.append(self._spawn())

    @classmethod
    def from_config(cls, cfg: RewardConfig, worker_init: Callable[[], None] | None = None) -> RewardPool:
        return cls(
            num_workers=cfg.num_workers,
            timeout_s=cfg.timeout_s,
            kind=cfg.kind,
            kill_grace_s=cfg.kill_grace_s,
            max_answer_chars=cfg.max_answer_chars,
            prefetch=cfg.prefetch,
            memory_limit_mb=cfg.memory_limit_mb,
            forbid_code_eval=cfg.forbid_code_eval,
            cache_size=cfg.cache_size,
            worker_init=worker_init,
            dapo_answer=cfg.dapo_answer,
            function=cfg.function,
            pass_env=cfg.pass_env,
        )

    # ------------------------------------------------------------------ public

    def score(
        self, responses: Sequence[str], answers: Sequence[str], extras: Sequence[Mapping] | None = None
    ) -> list[RewardResult]:
        """One result per response, in order; ``answers[i]`` is the ground truth of ``responses[i]``
        and ``extras[i]`` (a dict) the data row it answers, which only a custom reward reads ({} when
        not given)."""
        if self._closed:
            raise RuntimeError("RewardPool.score: the pool is closed")
        if len(responses) != len(answers):
            raise ValueError(f"RewardPool.score: {len(responses)} responses but {len(answers)} answers")
        if extras is not None and len(extras) != len(responses):
            raise ValueError(f"RewardPool.score: {len(responses)} responses but {len(extras)} extras")
        for name, items, expected in (
            ("responses", responses, str),
            ("answers", answers, str),
            ("extras", extras, dict),
        ):
            for i, item in enumerate(items or ()):
                if not isinstance(item, expected):
                    raise TypeError(
                        f"RewardPool.score: {name}[{i}] is {type(item).__name__}, expected {expected.__name__}"
                    )
        if self.kind in _LOCAL_EXTRACTORS:
            return [self._score_locally(response, answer) for response, answer in zip(responses, answers)]

        results: list[RewardResult | None] = [None] * len(responses)
        # Identical tasks are verified once: groups of G samples agree often. A custom task is the whole
        # response with its ground truth and row (the G samples of a prompt share one row object).
        groups: dict[tuple, list[int]] = {}
        tasks: list[tuple] = []
        no_extra: dict = {}
        for i, (response, answer) in enumerate(zip(responses, answers)):
            if self.kind == "custom":
                extra = extras[i] if extras is not None else no_extra
                key: tuple = (response, answer, id(extra))
                task: tuple = (response, answer, extra)
            else:
                started = time.perf_counter()
                span = self._extract(response)
                if span.reason is not None:
                    results[i] = RewardResult(0.0, span.reason, None, time.perf_counter() - started)
                    continue
                assert span.answer is not None  # found whenever there is no reason
                key = task = (span.answer, answer)
            if key not in groups:
                groups[key] = []
                tasks.append(task)
            groups[key].append(i)
        outcomes = self._run(tasks) if tasks else []
        for task, indices, (reason, seconds, score, detail) in zip(tasks, groups.values(), outcomes):
            extracted = None if self.kind == "custom" else task[0]
            result = RewardResult(score, reason, extracted, seconds, detail)
            for i in indices:
                results[i] = result
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the workers (politely, then by force). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for worker in self._workers:
            try:
                worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _score_locally(self, response: str, answer: str) -> RewardResult:
        started = time.perf_counter()
        span = _LOCAL_EXTRACTORS[self.kind](response, self.max_answer_chars)
        if span.reason is not None:
            return RewardResult(0.0, span.reason, None, time.perf_counter() - started)
        correct = span.answer == normalize_exact(answer)
        return RewardResult(
            1.0 if correct else 0.0, "correct" if correct else "wrong", span.answer, time.perf_counter() - started
        )

    def _spawn(self) -> _Worker:
        parent_end, child_end = multiprocessing.Pipe(duplex=True)
        env = worker_environment(os.environ, self.pass_env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        fd = child_end.fileno()
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_ENTRY, str(fd)],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            # what a reward function prints goes to the messages' channel, never into a command's product
            # (stapo eval's table, stapo config's YAML on stdout)
            stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else subprocess.DEVNULL,
            env=env,
            # Its own session: a ^C at the terminal is the trainer's to handle, not the workers'.
            start_new_session=True,
        )
        child_end.close()
        worker = _Worker(proc=proc, conn=parent_end, spawned_at=time.monotonic())
        try:
            parent_end.send(list(sys.path))
            parent_end.send(self._settings)
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            _stop_all([worker])
            raise TypeError(
                f"RewardPool: worker_init must be picklable (a module-level function, or a functools.partial "
                f"of one): {err}"
            ) from None
        return worker

    def _replace(self, worker: _Worker, queue: collections.deque) -> None:
        """Kill ``worker`` (if still alive), put its queued tasks back in front, start a new one."""
        queue.extendleft(reversed(worker.inflight))
        worker.inflight.clear()
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.proc.wait()
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._spawn()
        self.workers_replaced += 1

    def _fail(self, message: str, error: type[Exception] = RuntimeError) -> None:
        self.close()
        raise error(message)

    def wait_ready(self) -> None:
        """Block until every worker has started (the first score does this too); raises if one cannot."""
        if self._closed:
            raise RuntimeError("RewardPool.wait_ready: the pool is closed")
        self._run([])

    def _run(self, pairs: list[tuple]) -> list[tuple[str, float, float, str | None]]:
        """(reason, seconds, score, detail) for each task ((answer, ground truth); custom: (response,
        ground truth, extra)), verified by the workers.

        With no tasks, returns once every worker is ready.
        """
        out: list[tuple[str, float, float, str | None] | None] = [None] * len(pairs)
        queue = collections.deque(range(len(pairs)))
        remaining = len(pairs)
        until_ready = not pairs
        try:
            while remaining or (until_ready and not all(w.ready for w in self._workers)):
                for worker in list(self._workers):
                    remaining -= self._dispatch(worker, queue, pairs, out)
                watched = [w for w in self._workers if w.inflight or not w.ready]
                if not watched:  # every task left was settled while dispatching
                    continue
                deadline = min(
                    w.head_started + self.hard_limit_s if w.ready else w.spawned_at + _STARTUP_TIMEOUT_S
                    for w in watched
                )
                readable = wait([w.conn for w in watched], timeout=max(0.0, deadline - time.monotonic()))
                for worker in [w for w in watched if w.conn in readable]:
                    remaining -= self._receive(worker, queue, out)
                now = time.monotonic()
                for worker in list(self._workers):
                    if not worker.ready and now - worker.spawned_at > _STARTUP_TIMEOUT_S:
                        self._fail(f"reward worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
                    if worker.ready and worker.inflight and now - worker.head_started > self.hard_limit_s:
                        stuck_s = now - worker.head_started
                        out[worker.inflight.popleft()] = (
                            "timeout",
                            stuck_s,
                            0.0,
                            f"worker killed after {stuck_s:.1f} s",
                        )
                        remaining -= 1
                        logger.warning(
                            "reward worker %d stuck for %.1f s on one answer: killed and replaced",
                            worker.proc.pid,
                            now - worker.head_started,
                        )
                        self._replace(worker, queue)
        except BaseException:
            # Results still on their way would be read as the next batch's: drop the busy workers.
            if not self._closed:
                for worker in list(self._workers):
                    if worker.inflight:
                        worker.inflight.clear()
                        self._replace(worker, queue)
            raise
        return out  # type: ignore[return-value]

    def _dispatch(self, worker: _Worker, queue: collections.deque, pairs, out) -> int:
        """Top up a ready worker's queue. Returns how many tasks got settled (a dead worker's current
        one, tasks that cannot be sent)."""
        if not worker.ready:
            return 0
        settled = 0
        while queue and len(worker.inflight) < self.prefetch:
            task = queue.popleft()
            try:
                worker.conn.send((task, *pairs[task]))
            except OSError:  # it died while idle: the task never reached it
                queue.appendleft(task)
                return settled + self._on_death(worker, queue, out)
            except (pickle.PicklingError, TypeError, AttributeError) as err:
                # A custom task's row holds an object pickle refuses; it is pickled before anything is sent.
                out[task] = ("error", 0.0, 0.0, f"its data row cannot be sent to a reward worker: {err}")
                settled += 1
                continue
            if not worker.inflight:
                worker.head_started = time.monotonic()
            worker.inflight.append(task)
        return settled

    def _receive(self, worker: _Worker, queue: collections.deque, out) -> int:
        """Read one message from a worker. Returns how many tasks it settled."""
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            return self._on_death(worker, queue, out)
        if not worker.ready:
            if message[0] == "bad_function":
                self._fail(f"reward.function: {message[1]}", ConfigError)
            if message[0] == "failed":
                self._fail(f"reward worker failed to start: {message[1]}")
            worker.ready = True
            return 0
        self._settle(worker, message, out)
        return 1

    def _settle(self, worker: _Worker, message, out) -> None:
        task, reason, seconds, score, detail = message
        if task != worker.inflight[0]:  # pragma: no cover - protocol invariant
            self._fail(f"reward worker answered task {task}, expected {worker.inflight[0]}")
        worker.inflight.popleft()
        worker.head_started = time.monotonic()
        out[task] = (reason, seconds, score, detail)

    def _drain(self, worker: _Worker, out) -> int:
        """Settle the results a dead worker sent before it died. A send that finds the worker gone
        can come before those results were read; without this the crash would be charged to a
        sample it had answered, and the sample it died on would be retried (and kill another)."""
        settled = 0
        while worker.ready and worker.inflight:
            try:
                if not worker.conn.poll(0):
                    break
                message = worker.conn.recv()
            except (EOFError, OSError):
                break
            self._settle(worker, message, out)
            settled += 1
        return settled

    def _on_death(self, worker: _Worker, queue: collections.deque, out) -> int:
        """A worker's socket closed. Returns how many tasks that settles (its current one: error)."""
        if worker.proc.poll() is None:  # a closed socket means it is exiting; do not wait on it
            worker.proc.kill()
        code = worker.proc.wait()
        if not worker.ready:
            self._fail(f"reward worker exited during start-up with code {code} (its error is on stderr above)")
        settled = self._drain(worker, out)
        if worker.inflight:
            # Its current sample crashed it (the OOM killer, a segfault): that sample is an error,
            # not retried, so one input cannot take down worker after worker.
            out[worker.inflight.popleft()] = (
                "error",
                time.monotonic() - worker.head_started,
                0.0,
                f"the worker died on it (exit code {code})",
            )
            settled += 1
        logger.warning("reward worker %d died with code %d: replaced", worker.proc.pid, code)
        self._replace(worker, queue)
        return settled


def check_reward_function(cfg: RewardConfig) -> None:
    """For kind custom: load reward.function in one short-lived reward worker (the pool's sandbox) and
    raise ConfigError in one line if it cannot be imported or called as function(response,
    ground_truth, extra). The calling process never imports the function's module. Other kinds: nothing."""
    if cfg.kind != "custom":
        return
    with RewardPool.from_config(dataclasses.replace(cfg, num_workers=1)) as pool:
        pool.wait_ready()
