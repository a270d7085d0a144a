"""The tests' call of the policy loss in one line: :class:`PolicyLoss` of an algorithm config
(``cfg``, default :class:`AlgoConfig`'s defaults, with the config fields given) on the
:class:`LossInputs` of the other arguments. ``rollout_correction: auto`` is resolved as the
synchronous loop's (``max_staleness`` 0: none), unless ``max_staleness`` is given."""

from __future__ import annotations

import dataclasses

from stapo_megatron.loss import AlgoConfig, LossInputs, PolicyLoss, resolve_rollout_correction

_INPUT_FIELDS = {f.name for f in dataclasses.fields(LossInputs)}


def loss_of(logprob, old_logprob, advantages, keep, cfg: AlgoConfig | None = None, max_staleness: int = 0, **fields):
    """(loss_sum, num_tokens, metrics) of one call; ``fields``: LossInputs and AlgoConfig fields."""
    inputs = {k: v for k, v in fields.items() if k in _INPUT_FIELDS}
    config = {k: v for k, v in fields.items() if k not in _INPUT_FIELDS}
    algo = resolve_rollout_correction(dataclasses.replace(cfg or AlgoConfig(), **config), max_staleness)
    return PolicyLoss(algo)(LossInputs(logprob, old_logprob, advantages, keep, **inputs))
