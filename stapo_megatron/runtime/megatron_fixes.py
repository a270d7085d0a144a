"""Corrections to Megatron-Core 0.16.1's distributed optimizer on the plain torch Adam path.

Without Transformer Engine or apex, Megatron wraps ``torch.optim.AdamW``, and saving/loading its
state has three bugs (in Megatron itself, on any device):

1. ``sharded_state_dict`` on an optimizer that has not stepped yet (a fresh one being loaded
   into, or one saved before its first update) asserts, because the Adam state is still empty
   and no ``step`` can be read from it;
2. restoring states copies the ``step`` key too (``KeyError: 'step'``) and copies into the main
   parameters, leaves that require grad, outside ``no_grad``;
3. loading hands every parameter the same ``step`` tensor; AdamW increments it once per
   parameter, so after one step it reads N+1 instead of 2 and training silently diverges from
   the uninterrupted run.

:func:`apply` patches the three spots; with Transformer Engine's or apex's fused Adam (where
``step`` lives in the param groups) Megatron takes other branches and nothing changes.
"""

from __future__ import annotations

import torch

_applied = False


def _empty_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter the state AdamW creates on its first step."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        _applied = True
        return
    cls = distrib_optimizer.DistributedOptimizer
    original_sharded_state_dict = cls.sharded_state_dict
    original_set_states = cls._set_main_param_and_optimizer_states
    original_load_state_dict = cls.load_state_dict

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        _empty_adam_state(self.optimizer)  # fix 1: the state AdamW would create on its first step
        return original_sharded_state_dict(self, model_sharded_state_dict, is_loading, **kwargs)

    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original_set_states(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        targets = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():  # fix 2
            for key, target in targets.items():
                if key != "step":
                    target.copy_(tensors[key])

    def load_state_dict(self, state_dict):
        original_load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():  # fix 3
            if "step" in state:
                state["step"] = state["step"].detach().clone()

    cls.sharded_state_dict = sharded_state_dict
    cls._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    cls.load_state_dict = load_state_dict
    _applied = True
