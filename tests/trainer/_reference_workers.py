"""Rank function for test_reference_kl.py: one spawn per tensor-parallel size runs every check of
the frozen reference model on the real update path and records the outcome.

Every rank runs the same collectives; failures are recorded and asserted by the test afterwards.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from stapo_megatron.loss import AlgoConfig, resolve_rollout_correction
from stapo_megatron.trainer.batch import RolloutBatch

TEMPERATURE = 0.7  # not 1: the reference pass must divide the logits by the rollout temperature
GROUP = 4


def rollout(vocab_size: int, seed: int = 0) -> RolloutBatch:
    """8 groups of 4 mixed-reward responses (every advantage non-zero), lengths 2-24."""
    generator = torch.Generator().manual_seed(seed)
    groups = 8
    correct = torch.zeros(groups, GROUP)
    correct[:, :2] = 1.0
    advantages = (correct - correct.mean(1, keepdim=True)) / (correct.std(1, keepdim=True) + 1e-6)
    n = groups * GROUP
    prompts, responses, logprobs = [], [], []
    for _ in range(n):
        p = int(torch.randint(3, 9, (), generator=generator))
        r = int(torch.randint(2, 25, (), generator=generator))
        prompts.append(torch.randint(1, vocab_size, (p,), generator=generator).tolist())
        responses.append(torch.randint(1, vocab_size, (r,), generator=generator).tolist())
        logprobs.append((-4 * torch.rand(r, generator=generator)).tolist())
    return RolloutBatch(
        prompts,
        responses,
        logprobs,
        torch.zeros(n, dtype=torch.bool),
        correct.reshape(-1),
        correct.reshape(-1),
        advantages.reshape(-1),
        torch.arange(groups).repeat_interleave(GROUP),
    )


def config(**algo) -> SimpleNamespace:
    return SimpleNamespace(
        batch=SimpleNamespace(
            minibatches_per_step=2,
            max_tokens_per_microbatch=200,
            max_tokens_per_forward=300,
            skip_zero_advantage=True,
            entropy_over_skipped=True,
            temperature=TEMPERATURE,
        ),
        compute=SimpleNamespace(logits_chunk_size=64),
        run=SimpleNamespace(seed=0),
        parallel=SimpleNamespace(sequence_parallel=False),
        algo=resolve_rollout_correction(AlgoConfig(**algo), 0),
    )


def _params(module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def reference_checks(out_dir: str, hf_dir: str, arch_fields: dict, tensor_parallel: int) -> None:
    """Policy and reference from the same Hugging Face weights at TP=``tensor_parallel``; records
    the reference's response log-probs (per-rank token vector, identical layout at any TP with
    DP=1), its equality with the policy before the update, the update's metrics, and that the
    reference stays fixed (and survives an offload round trip) while the policy moves."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from stapo_megatron.checkpoint.convert import fill_from_hf
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from stapo_megatron.trainer.offload import OPTIMIZER, PARAMS, TrainerOffload
    from stapo_megatron.trainer.reference import ReferenceModel
    from stapo_megatron.trainer.step_plan import plan_step
    from stapo_megatron.trainer.update import PolicyUpdater

    ctx = init_distributed(ParallelConfig(tensor_parallel=tensor_parallel), seed=5)
    arch = Qwen3Config(**arch_fields)
    record: dict = {"failures": []}

    def check(name, fn):
        try:
            fn()
        except Exception:  # recorded, asserted by the test
            record["failures"].append(f"{name}: {traceback.format_exc()}")

    policy = build_stage(arch, ctx, calculate_per_token_loss=True)
    fill_from_hf(policy, arch, HFCheckpoint(hf_dir), ctx)
    reference = ReferenceModel(policy, arch, ctx, params_dtype=torch.float32, sequence_parallel=False)
    initial = _params(reference.model)

    def equals_policy_at_step_0():
        policy_params = _params(policy)
        assert sorted(policy_params) == sorted(initial) and len(initial) > 5
        for name, value in policy_params.items():
            assert torch.equal(initial[name], value), f"{name}: reference differs from the policy"
        assert not any(p.requires_grad for p in reference.model.parameters()), "reference parameters require grad"
        assert not reference.model.training, "reference not in eval mode"

    check("equals_policy_at_step_0", equals_policy_at_step_0)

    ddp = DistributedDataParallel(
        config=policy.config,
        module=policy,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
    )
    policy.config.finalize_model_grads_func = finalize_model_grads
    policy.config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-2, clip_grad=0.0, params_dtype=torch.float32, use_distributed_optimizer=False
        ),
        [ddp],
    )
    cfg = config(token_rule="all", kl_coef=0.5, kl_estimator="k3")
    updater = PolicyUpdater(ddp, optimizer, cfg, arch, ctx, reference=reference)
    batch = rollout(arch.vocab_size)
    plan = plan_step(batch, cfg, ctx)
    forward_all = [mb for m in plan.minibatches for mb in m.forward]
    before = updater.reference_logprobs(plan.slots, forward_all)
    response = torch.zeros(plan.slots.size, dtype=torch.bool)
    for mb in forward_all:
        response[mb["token_index"].reshape(-1)] = mb["response_mask"].reshape(-1) > 0
    record["offsets"] = {str(i): offset for i, offset in plan.slots.offsets.items()}
    record["ref_logprob"] = before.tolist()
    record["response"] = response.tolist()

    phases: list[str] = []
    done = updater.update_step(batch, timer=lambda name: _Phase(phases, name))
    record["phases"] = phases
    record["minibatch_metrics"] = [r.metrics for r in done.results]
    record["skipped"] = [r.skipped for r in done.results]

    def reference_fixed_while_policy_moves():
        moved = max((p.detach() - initial[n]).abs().max().item() for n, p in policy.named_parameters())
        assert moved > 1e-4, f"the policy did not move ({moved})"
        for name, value in reference.model.named_parameters():
            assert torch.equal(value, initial[name]), f"{name}: reference changed by the update"
        after = updater.reference_logprobs(plan.slots, forward_all)
        assert torch.equal(after, before), "reference log-probs changed by the update"

    check("reference_fixed_while_policy_moves", reference_fixed_while_policy_moves)

    def offloaded_with_the_optimizer():
        offload = TrainerOffload(ddp, optimizer, ctx.device, reference=reference.model)
        offload.offload(OPTIMIZER)
        assert all(p.untyped_storage().nbytes() == 0 for p in reference.model.parameters()), "reference not offloaded"
        assert all(p.untyped_storage().nbytes() > 0 for p in policy.parameters()), (
            "policy weights left with the optimizer"
        )
        offload.reload()
        assert not offload.offloaded(OPTIMIZER) and not offload.offloaded(PARAMS)
        for name, value in reference.model.named_parameters():
            assert torch.equal(value, initial[name]), f"{name}: reference differs after the reload"

    check("offloaded_with_the_optimizer", offloaded_with_the_optimizer)
    if ctx.rank == 0:
        Path(out_dir, f"tp{tensor_parallel}.json").write_text(json.dumps(record))


class _Phase:
    """A timer context that records the phase names in order."""

    def __init__(self, phases: list, name: str):
        phases.append(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
