"""The tests' call of the policy loss in one line: :class:`PolicyLoss` of an algorithm config
(``cfg``, default :class:`AlgoConfig`'s defaults, with the config fields given) on the
:class:`LossInputs` of the other arguments."""

from __future__ import annotations

import dataclasses

from stapo_megatron.loss import AlgoConfig, LossInputs, PolicyLoss

_INPUT_FIELDS = {f.name for f in dataclasses.fields(LossInputs)}


def loss_of(logprob, old_logprob, advantages, keep, cfg: AlgoConfig | None = None, **fields):
    """(loss_sum, num_tokens, metrics) of one call; ``fields``: LossInputs and AlgoConfig fields."""
    inputs = {k: v for k, v in fields.items() if k in _INPUT_FIELDS}
    config = {k: v for k, v in fields.items() if k not in _INPUT_FIELDS}
    algo = dataclasses.replace(cfg or AlgoConfig(), **config)
    return PolicyLoss(algo)(LossInputs(logprob, old_logprob, advantages, keep, **inputs))
