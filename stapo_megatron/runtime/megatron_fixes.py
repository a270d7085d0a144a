"""Corrections to Megatron-Core's distributed optimizer on the plain torch Adam path, written for
megatron-core 0.16, all three bugs present in 0.16.1, 0.17.1, 0.18.2 and 0.19.2 (exact resume checked
on 0.16.1, 0.17.1 and 0.19.2; 0.18.2 lies between them and is still to be run),
applied by :func:`stapo_megatron.runtime.distributed.init_distributed`.

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

Each :class:`Fix` names the release lines (major.minor) it was checked on and recognises its bug
by the code it replaces (the buggy statement in Megatron's source, as each line writes it).
:func:`apply` patches a fix only on a tested line where that code is present; on any other release
it patches nothing and warns once, and ``tests/trainer/test_resume.py`` (an exact resume) decides
whether a fix is still needed there.
With Transformer Engine's or apex's fused Adam (``step`` in the param groups) Megatron takes other
branches and nothing is patched.

The other patch of Megatron, :mod:`stapo_megatron.runtime.cpu_compat`, is not a bug fix: it lets
Megatron run without CUDA, and only there.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import logging
import os
import textwrap
import tokenize
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def _code(source: str) -> str:
    """Python source as its tokens, one space apart: comments, blank lines and indentation dropped,
    a statement's end written ``;`` and every string quoted with ``"``, so that a statement is
    recognised whatever its formatting."""
    tokens = tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline)
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    return " ".join(
        ";" if tok.type == tokenize.NEWLINE else tok.string.replace("'", '"')
        for tok in tokens
        if tok.type not in skipped
    )


@dataclasses.dataclass(frozen=True)
class Fix:
    """One bug of ``DistributedOptimizer``: the megatron-core release lines the fix was checked on
    (exact resume), the method whose source holds the bug, the statement that is the bug (each way a
    release line writes it), and the patch of ``method`` that corrects it."""

    name: str
    releases: tuple[str, ...]
    bug_in: str
    buggy_code: tuple[str, ...]
    method: str
    patch: Callable[[Callable], Callable]

    def bug_present(self, cls: type) -> bool:
        """Whether ``cls.<bug_in>`` still contains a buggy statement; True where its source cannot
        be read (a tested release installed without sources: the version says the bug is there)."""
        try:
            source = _code(inspect.getsource(getattr(cls, self.bug_in)))
        except (OSError, TypeError):
            return True
        return any(_code(code) in source for code in self.buggy_code)


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


def _patch_sharded_state_dict(original: Callable) -> Callable:
    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        _empty_adam_state(self.optimizer)  # the state AdamW would create on its first step
        return original(self, model_sharded_state_dict, is_loading, **kwargs)

    return sharded_state_dict


def _patch_set_states(original: Callable) -> Callable:
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        targets = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():  # main_param is a leaf that requires grad
            for key, target in targets.items():
                if key == "step":  # not in the saved tensors; restored from the param groups
                    continue
                if isinstance(tensors[key], torch.Tensor):  # 0.17+ may hand non-tensor entries: skipped there too
                    target.copy_(tensors[key])

    return _set_main_param_and_optimizer_states


def _patch_load_state_dict(original: Callable) -> Callable:
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        for state in self.optimizer.state.values():  # one step tensor per parameter
            if "step" in state:
                state["step"] = state["step"].detach().clone()

    return load_state_dict


TESTED_RELEASES = ("0.16", "0.17", "0.18", "0.19")  # exact resume on 0.16.1, 0.17.1, 0.19.2 (0.18.2: to run)

FIXES = (
    Fix(
        "step read from an empty Adam state",
        releases=TESTED_RELEASES,
        bug_in="state_dict",  # called by sharded_state_dict
        buggy_code=(
            """
            steps = list(set([s["step"].item() for s in inner_state_dict["state"].values()]))
            assert len(steps) == 1
            """,
        ),
        method="sharded_state_dict",
        patch=_patch_sharded_state_dict,
    ),
    Fix(
        "step copied, outside no_grad",
        releases=TESTED_RELEASES,
        bug_in="_set_main_param_and_optimizer_states",
        buggy_code=(
            """
            for key in dst_tensors:
                dst_tensors[key].copy_(tensors[key])
            """,
            # 0.17+: the same copy, of tensor entries only (the step is a tensor entry there)
            """
            for key in dst_tensors:
                if not isinstance(tensors[key], torch.Tensor):
                    continue
                dst_tensors[key].copy_(tensors[key])
            """,
        ),
        method="_set_main_param_and_optimizer_states",
        patch=_patch_set_states,
    ),
    Fix(
        "one step tensor shared by every parameter",
        releases=TESTED_RELEASES,
        bug_in="load_state_dict",
        buggy_code=(
            """
            for s in state_dict_state.values():
                s["step"] = step
            """,
        ),
        method="load_state_dict",
        patch=_patch_load_state_dict,
    ),
)

_applied: dict[str, bool] = {}  # fix name -> patched; filled by the first apply()


def megatron_version() -> str:
    from megatron.core import __version__

    return __version__


def megatron_release() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core: the compatibility points whose behaviour
    cannot be probed (checkpoint/safe_load.py) are written against it."""
    major, minor = megatron_version().split(".")[:2]
    return int(major), int(minor)


def apply() -> dict[str, bool]:
    """Patch the fixes whose bug this megatron-core has; idempotent. Returns which were patched."""
    if _applied:
        return dict(_applied)
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    version = megatron_version()
    line = "{}.{}".format(*megatron_release())
    untested = []
    for fix in FIXES:
        if distrib_optimizer.HAVE_APEX_OR_TE:
            _applied[fix.name] = False  # fused Adam: the buggy branches are not taken
        elif line not in fix.releases:
            _applied[fix.name] = False  # not patched blind: the exact-resume test is the judge
            untested.append(f"{fix.name} ({', '.join(fix.releases)})")
        elif fix.bug_present(cls):
            setattr(cls, fix.method, fix.patch(getattr(cls, fix.method)))
            _applied[fix.name] = True
        else:
            _applied[fix.name] = False
            log.info("megatron-core %s: %s is corrected there; not patched", version, fix.name)
    if untested:
        # one warning per job: the other ranks' copy is an info line (shown with logging.all_ranks)
        log.log(
            logging.WARNING if os.environ.get("RANK", "0") == "0" else logging.INFO,
            "megatron-core %s is not a release these optimizer fixes were tested on, so they are not applied: %s; "
            "tests/trainer/test_resume.py tells whether resuming is exact with it",
            version,
            "; ".join(untested),
        )
    return dict(_applied)
