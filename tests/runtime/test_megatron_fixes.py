"""The corrections of Megatron's distributed optimizer (stapo_megatron.runtime.megatron_fixes):
applied by init_distributed, only where the buggy code is present on a tested release, once.
Whether they make resuming exact is tests/trainer/test_resume.py's to say."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from stapo_megatron.runtime import megatron_fixes
from stapo_megatron.runtime.launch import spawn_ranks
from tests.runtime import _fixes_workers

STEP_READ = "step read from an empty Adam state"
STEP_COPIED = "step copied, outside no_grad"
STEP_SHARED = "one step tensor shared by every parameter"


@pytest.fixture
def optimizer_class(monkeypatch):
    """Megatron's DistributedOptimizer with its methods and the fixes' record restored afterwards."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for fix in megatron_fixes.FIXES:
        monkeypatch.setattr(DistributedOptimizer, fix.method, getattr(DistributedOptimizer, fix.method))
    monkeypatch.setattr(megatron_fixes, "_applied", {})
    return DistributedOptimizer


def _methods(cls) -> dict:
    return {fix.method: getattr(cls, fix.method) for fix in megatron_fixes.FIXES}


def test_init_distributed_applies_the_fixes(tmp_path):
    spawn_ranks(_fixes_workers.fixes_after_init, 1, str(tmp_path))
    got = json.loads((tmp_path / "fixes.json").read_text())
    assert got["applied_before"] == {}
    # every tested release (0.16.1, 0.17.1, 0.18.2, 0.19.2) has all three
    assert got["before"] == {STEP_READ: True, STEP_COPIED: True, STEP_SHARED: True}
    # The patched methods no longer hold the bugs; fix 1 wraps sharded_state_dict around the
    # state_dict that still asserts, so its bug stays visible there.
    assert got["after"] == {STEP_READ: True, STEP_COPIED: False, STEP_SHARED: False}
    assert set(got["methods"].values()) == {"stapo_megatron.runtime.megatron_fixes"}


def test_buggy_code_is_recognised_whatever_its_formatting():
    fix = next(f for f in megatron_fixes.FIXES if f.name == STEP_SHARED)

    class Optimizer:
        def load_state_dict(self, state_dict):
            for s in state_dict_state.values():  # a comment  # noqa: F821
                s[ 'step' ]=step  # fmt: skip  # noqa: F821

    assert fix.bug_present(Optimizer)

    class Corrected:
        def load_state_dict(self, state_dict):
            for s in state_dict_state.values():  # noqa: F821
                s["step"] = step.detach().clone()  # noqa: F821

    assert not fix.bug_present(Corrected)


def test_each_release_lines_form_of_the_copy_is_recognised():
    fix = next(f for f in megatron_fixes.FIXES if f.name == STEP_COPIED)

    class Release016:
        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            dst_tensors = {}
            for key in dst_tensors:
                dst_tensors[key].copy_(tensors[key])

    class Release017:  # 0.17 to 0.19: the copy skips non-tensor entries
        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            dst_tensors = {}
            for key in dst_tensors:
                if not isinstance(tensors[key], torch.Tensor):
                    continue
                dst_tensors[key].copy_(tensors[key])

    class Corrected:
        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            dst_tensors = {}
            with torch.no_grad():
                for key in dst_tensors:
                    if key != "step":
                        dst_tensors[key].copy_(tensors[key])

    assert fix.bug_present(Release016) and fix.bug_present(Release017)
    assert not fix.bug_present(Corrected)


def test_untested_release_is_reported_once_and_not_patched(optimizer_class, monkeypatch, caplog):
    monkeypatch.setattr(megatron_fixes, "megatron_version", lambda: "0.20.0")
    monkeypatch.delenv("RANK", raising=False)  # rank 0 warns; the other ranks say it at info level
    before = _methods(optimizer_class)
    with caplog.at_level(logging.WARNING, logger=megatron_fixes.__name__):
        first = megatron_fixes.apply()
        second = megatron_fixes.apply()
    assert first == second == {STEP_READ: False, STEP_COPIED: False, STEP_SHARED: False}
    assert _methods(optimizer_class) == before
    warnings = [r.getMessage() for r in caplog.records if r.name == megatron_fixes.__name__]
    assert len(warnings) == 1
    assert (
        "megatron-core 0.20.0" in warnings[0]
        and "0.16, 0.17, 0.18, 0.19" in warnings[0]
        and "test_resume" in warnings[0]
    )


def test_release_without_the_bug_is_not_patched(optimizer_class, monkeypatch):
    """A tested release whose load_state_dict already gives each parameter its own step."""
    fixed = next(f for f in megatron_fixes.FIXES if f.name == STEP_SHARED)

    def load_state_dict(self, state_dict):
        for s in state_dict.values():
            s["step"] = s["step"].detach().clone()

    monkeypatch.setattr(optimizer_class, fixed.method, load_state_dict)
    applied = megatron_fixes.apply()
    assert applied == {STEP_READ: True, STEP_COPIED: True, STEP_SHARED: False}
    assert optimizer_class.load_state_dict is load_state_dict


def test_applying_twice_patches_once(optimizer_class):
    first = megatron_fixes.apply()
    patched = _methods(optimizer_class)
    second = megatron_fixes.apply()
    assert first == second == {STEP_READ: True, STEP_COPIED: True, STEP_SHARED: True}
    assert _methods(optimizer_class) == patched

    # The patched restore, on a stand-in holding what it reads: the parameter and the Adam moments
    # are copied from the loaded tensors, the step is left alone, and autograd records nothing.
    main_param = torch.nn.Parameter(torch.zeros(3))
    adam = torch.optim.AdamW([main_param])
    adam.state[main_param] = {"step": torch.tensor(7.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    stand_in = SimpleNamespace(
        config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        model_param_group_index_map={"w": (0, 0)},
        optimizer=adam,
    )
    loaded = {"param": torch.tensor([1.0, 2.0, 3.0]), "exp_avg": torch.full((3,), 0.5), "exp_avg_sq": torch.ones(3)}
    optimizer_class._set_main_param_and_optimizer_states(stand_in, "w", loaded)
    assert main_param.tolist() == [1.0, 2.0, 3.0] and main_param.requires_grad
    assert adam.state[main_param]["exp_avg"].tolist() == [0.5, 0.5, 0.5]
    assert adam.state[main_param]["exp_avg_sq"].tolist() == [1.0, 1.0, 1.0]
    assert adam.state[main_param]["step"].item() == 7.0
