"""Generation beside training (``rollout.async.max_staleness > 0``): rank 0 generates the next steps'
batches in a thread of its own while the trainer updates, on a schedule of weight versions.

The batch of step ``s`` is generated with the weights of version ``v(s) = max(0, s - 1 - L)``
(version ``t``: the weights after ``t`` training steps; ``L`` the generation lag,
``rollout.generation_lag``). The trainer at step ``s`` trains from version ``s - 1``, so every
token it trains on is at most ``L`` versions old, or ``L + 1 = max_staleness`` for a partial sample
that continued from the step before (:mod:`~stapo_megatron.trainer.sample_pool`).

The engine holds one version at a time, so the hand-over is the schedule's boundary: the weights of
version ``t`` go to the engine once every batch of an older version is generated (steps up to
``t + L``, :meth:`RolloutPipeline.wait_for_boundary`), and the thread starts the batches of version
``t`` once the trainer has taken step ``t + 1``'s (:meth:`RolloutPipeline.take`), i.e. after any
evaluation and checkpoint of step ``t``. At that boundary the state of the rollout side (the
batches generated ahead, the sample pool, the prompt sampler) depends only on the step: it is what
a checkpoint holds (:meth:`RolloutPipeline.state_dict`), so a resumed run goes on exactly as an
uninterrupted one, given an engine whose sampling is seeded.

So the servers generate the batch of step ``s + L`` while the trainer trains step ``s``, and each
waits for the other only when it is the slower one: ``async/trainer_wait_s`` is the trainer's wait
for a batch, ``async/generator_wait_s`` the thread's wait for weights.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from stapo_megatron.loss.metrics import Reduction, declare
from stapo_megatron.trainer.batch import RolloutBatch, pack_rollouts, unpack_rollouts
from stapo_megatron.trainer.sample_pool import SamplePool

logger = logging.getLogger(__name__)

_STATE_VERSION = 1

declare(
    Reduction.SUM,
    {
        "async/trainer_wait_s": "seconds the trainer waited for the step's batch",
        "async/generator_wait_s": "seconds the generation thread waited for weights since the previous step's batch",
        "async/generate_s": "seconds the generation thread spent on the step's batch",
    },
)


class RolloutGenerationError(RuntimeError):
    """The generation thread failed; the trainer raises it where it next waits for the thread."""


@dataclasses.dataclass
class GeneratedStep:
    batch: RolloutBatch
    metrics: dict[str, float]


class RolloutPipeline:
    """Rank 0's generation thread and its schedule (see the module docstring). ``next_step``: the
    first step it has not generated; ``ready``: batches generated ahead (a resume's)."""

    def __init__(
        self,
        pool: SamplePool,
        lag: int,
        last_step: int,
        next_step: int,
        ready: dict[int, GeneratedStep] | None = None,
    ):
        self.pool, self.lag, self.last_step = pool, lag, last_step
        self._cond = threading.Condition()
        self._next_step = next_step
        self._ready: dict[int, GeneratedStep] = dict(ready or {})
        self._allowed_version = -1  # the newest version the thread may generate with (take() raises it)
        self._generating = False
        self._closed = False
        self._error: BaseException | None = None
        self._waited_for_weights = 0.0
        # CUDA's current device is per thread: the thread's work (the local engine) runs on this rank's device
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._thread = threading.Thread(target=self._run, name="stapo-rollout-pipeline", daemon=True)
        self._thread.start()

    def version_for(self, step: int) -> int:
        """The weight version that generates the batch of ``step``."""
        return max(0, step - 1 - self.lag)

    # ---- the trainer's side ----------------------------------------------------------------

    def take(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The batch of ``step`` and its metrics, once generated. The engine holds version
        ``step - 1`` now (the trainer synced it), so the thread may go on with that version's steps."""
        began = time.perf_counter()
        with self._cond:
            self._allowed_version = step - 1
            self._cond.notify_all()
            self._wait(lambda: step in self._ready)
            generated = self._ready.pop(step)
            waited_for_weights, self._waited_for_weights = self._waited_for_weights, 0.0
        generated.metrics["async/trainer_wait_s"] = time.perf_counter() - began
        generated.metrics["async/generator_wait_s"] = waited_for_weights
        return generated.batch, generated.metrics

    def wait_for_boundary(self, version: int) -> None:
        """Return once every batch generated with a version older than ``version`` exists (and no
        generation runs): the engine may then take the weights of ``version``."""
        # the last step generated with an older version (none is older than version 0)
        last_older = min(version + self.lag, self.last_step) if version > 0 else 0
        with self._cond:
            self._wait(lambda: self._next_step > last_older and not self._generating)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _wait(self, ready) -> None:
        while not ready():
            if self._error is not None:
                raise RolloutGenerationError(f"rollout generation failed: {self._error}") from self._error
            if self._closed:
                raise RolloutGenerationError("the rollout pipeline was closed")
            self._cond.wait()

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._cuda_device is not None:
                torch.cuda.set_device(self._cuda_device)
            while True:
                with self._cond:
                    idle_since = time.perf_counter()
                    while not self._closed and not self._may_generate():
                        self._cond.wait()
                    if self._closed:
                        return
                    self._waited_for_weights += time.perf_counter() - idle_since
                    step, self._generating = self._next_step, True
                began = time.perf_counter()
                batch, metrics = self.pool.take(step)
                metrics["async/generate_s"] = time.perf_counter() - began
                with self._cond:
                    self._ready[step] = GeneratedStep(batch, metrics)
                    self._next_step, self._generating = step + 1, False
                    self._cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - handed to the trainer, which raises it
            logger.exception("rollout generation failed")
            with self._cond:
                self._error, self._generating = error, False
                self._cond.notify_all()

    def _may_generate(self) -> bool:
        return self._next_step <= self.last_step and self.version_for(self._next_step) <= self._allowed_version

    # ---- checkpoint ------------------------------------------------------------------------

    def state_dict(self, version: int) -> dict:
        """The rollout side at the boundary of ``version`` (the trainer's, after its step): the
        batches generated ahead, the pool and the sampler, as plain lists and numbers."""
        self.wait_for_boundary(version)
        with self._cond:
            return {
                "version": _STATE_VERSION,
                "lag": self.lag,
                "next_step": self._next_step,
                "ready": {
                    str(step): {"batch": _batch_state(g.batch), "metrics": dict(g.metrics)}
                    for step, g in sorted(self._ready.items())
                },
                "pool": self.pool.state_dict(),
            }

    @classmethod
    def resumed(cls, pool: SamplePool, lag: int, last_step: int, step: int, state: dict | None) -> RolloutPipeline:
        """The pipeline of a run at ``step``: from its checkpoint's ``state``. The batches a checkpoint
        generated ahead with another lag are discarded, with a warning (their prompts are not trained
        on); its pool's samples in flight continue either way (their versions are all at most the
        trainer's, and the staleness bound still applies to them)."""
        if state is None:
            return cls(pool, lag, last_step, next_step=step + 1)
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"rollout pipeline state: version {state.get('version')!r}, expected {_STATE_VERSION}")
        pool.load_state_dict(state["pool"])
        if state["lag"] != lag:
            logger.warning(
                "the checkpoint's rollouts ran %d steps ahead, this run %d: the %d batches it generated ahead are "
                "discarded (their prompts are not trained on)",
                state["lag"],
                lag,
                len(state["ready"]),
            )
            return cls(pool, lag, last_step, next_step=step + 1)
        ready = {
            int(s): GeneratedStep(_batch_from_state(r["batch"]), dict(r["metrics"])) for s, r in state["ready"].items()
        }
        if sorted(ready) != list(range(step + 1, state["next_step"])):
            raise ValueError(
                f"rollout pipeline state: batches for steps {sorted(ready)}, expected "
                f"{step + 1}..{state['next_step'] - 1}"
            )
        return cls(pool, lag, last_step, next_step=state["next_step"], ready=ready)


def _batch_state(batch: RolloutBatch) -> dict:
    sizes, integers, floats = pack_rollouts(batch)
    return {"sizes": sizes.tolist(), "integers": integers.tolist(), "floats": floats.tolist()}


def _batch_from_state(state: dict) -> RolloutBatch:
    return unpack_rollouts(
        torch.tensor(state["sizes"], dtype=torch.long),
        torch.tensor(state["integers"], dtype=torch.long),
        torch.tensor(state["floats"], dtype=torch.float32),
    )
