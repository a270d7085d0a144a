"""The rollout-engine interface shared by training and evaluation.

An engine turns prompt token ids into sampled responses with the per-token log-probs it
sampled with, loads new weights from a stream of (Hugging Face name, tensor) pairs (or says how
the trainer ranks send them itself), can release and resume its accelerator memory (for
colocation with the trainer), and shuts down.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from stapo_megatron.rollout.weight_sync.plan import WeightSyncPlan

FinishReason = Literal["stop", "length"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``top_k <= 0`` means no top-k cut; ``seed=None`` means unseeded."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass
class Completion:
    """One sampled response.

    ``token_ids`` include the stop token when generation stopped on one; ``logprobs[i]`` is the
    log-probability the engine sampled ``token_ids[i]`` with (at the sampling temperature).
    ``versions[i]`` is the weight version that produced ``token_ids[i]`` (the ``version`` of the
    :meth:`RolloutEngine.load_weights` or weight sync that put those weights on the engine): one
    response may span several when the weights changed while it was generated. ``None`` where
    the weights that produced it carry no version number (loaded without one, or the servers'
    launch weights).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    versions: list[int] | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Completion has {len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(f"Completion has {len(self.token_ids)} tokens but {len(self.versions)} weight versions")


class RolloutEngine(abc.ABC):
    """What the trainer and the evaluator need from an inference engine."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each prompt; result[i] holds prompt i's."""

    @abc.abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Replace the weights with a complete stream of (Hugging Face name, full tensor) pairs."""

    def weight_sync_plan(self) -> WeightSyncPlan | None:
        """How every trainer rank sends its own share of the weights to this engine (the controller asks,
        every rank follows); None: the controller streams them all into :meth:`load_weights`."""
        return None

    def weights_synced(self, version: int) -> None:
        """The trainer ranks put ``version`` on everything the last :meth:`weight_sync_plan` named."""
        raise NotImplementedError(f"{type(self).__name__} has no weight_sync_plan to sync through")

    @abc.abstractmethod
    def release_memory(self) -> None:
        """Free accelerator memory (weights and caches) while the trainer runs."""

    @abc.abstractmethod
    def resume_memory(self) -> None:
        """Take back the memory released by :meth:`release_memory`."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and every process it started."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
