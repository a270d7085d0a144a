"""A deterministic, resumable stream of prompt indices.

Epoch e visits every index once, in a permutation that depends only on (seed, e); the position
inside the epoch and the epoch number are the whole state, so a restored sampler continues
with exactly the indices the original would have produced. The trainer samples on one rank
and broadcasts, so there is a single stream.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_STATE_VERSION = 1


class PromptSampler:
    def __init__(self, num_items: int, seed: int = 0, shuffle: bool = True):
        if num_items < 1:
            raise ValueError(f"PromptSampler: num_items must be >= 1, got {num_items}")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order: np.ndarray | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_items)
        # A seed sequence of (seed, epoch): independent, reproducible permutations per epoch.
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def next_indices(self, count: int) -> list[int]:
        """The next ``count`` indices, moving into the next epoch (and permutation) as needed."""
        if count < 0:
            raise ValueError(f"PromptSampler.next_indices: count must be >= 0, got {count}")
        out: list[int] = []
        while len(out) < count:
            if self._order is None:
                self._order = self._epoch_order(self.epoch)
            take = min(count - len(out), self.num_items - self.position)
            out.extend(int(i) for i in self._order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = None
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "num_items": self.num_items,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the dataset size, seed and shuffle must match the saved ones."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"sampler state: version {state.get('version')!r}, expected {_STATE_VERSION}")
        for key in ("num_items", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"sampler state: {key} was {state.get(key)!r} when saved but is {getattr(self, key)!r} now "
                    "(a different dataset or data config would silently change the prompt order)"
                )
        epoch, position = state.get("epoch"), state.get("position")
        if (
            not isinstance(epoch, int)
            or epoch < 0
            or not isinstance(position, int)
            or not 0 <= position < self.num_items
        ):
            raise ValueError(f"sampler state: bad epoch/position {epoch!r}/{position!r}")
        self.epoch, self.position, self._order = epoch, position, None
