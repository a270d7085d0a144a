"""Measure what ``stapo plan`` estimates, on this machine: activation peaks, optimizer bytes, and
the bytes the trainer's offload moves out of the rollout phase.

Both run inside an initialised world (``init_distributed``) whose parallel state is the layout
to measure; tests/launch and benchmarks/plan.py spawn those worlds with gloo on CPU.

Peak memory: torch's profiler with ``profile_memory=True`` receives every allocation and free of
the CPU allocator (c10's profiled memory reporter), in order. The running sum of those events
over one forward + backward is the memory that step allocated on top of what existed before,
and its maximum is the step's peak: exact to the byte, unlike the resident set, which the C
library's allocator caches. Weights and gradient tensors exist before the measured step (as
Megatron's gradient buffer does), so the peak is activations, logits and the backward working
set: the planner's activations, kept + max(work, logits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stapo_megatron.models.qwen3.config import Qwen3Config

if TYPE_CHECKING:
    from stapo_megatron.runtime.distributed import ParallelContext


def allocation_peak(fn) -> tuple[int, int]:
    """(peak, final) bytes allocated on the CPU while ``fn()`` runs, relative to its start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())  # stable: same-time events keep their recorded order
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak, live


def activation_peak(
    ctx: ParallelContext,
    arch: Qwen3Config,
    *,
    seq_len: int,
    micro_batch: int,
    recompute: str = "none",
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    logits_chunk: int = 1024,
    seed: int = 0,
) -> int:
    """Peak bytes of one forward + backward of this rank's stage (PP = 1) of the layout ``ctx`` with the
    trainer's log-prob kernel as the loss, gradients allocated beforehand."""
    from stapo_megatron.loss import vocab_parallel_logprob_entropy
    from stapo_megatron.models.qwen3.parallelize import build_stage

    if ctx.pp_size != 1:
        raise ValueError("activation_peak measures a whole model (pipeline_parallel = 1)")
    torch.manual_seed(seed)
    model = build_stage(arch, ctx, params_dtype=params_dtype, recompute=recompute, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, arch.vocab_size, (micro_batch, seq_len))
    positions = torch.arange(seq_len).expand(micro_batch, seq_len)

    def step():
        logits = model(ids, positions, None)
        logprob, _ = vocab_parallel_logprob_entropy(
            logits, ids, tp_group=ctx.tp_group, chunk_size=logits_chunk, vocab_size=arch.vocab_size
        )
        loss = -logprob.float().sum()
        # as in the trainer's schedule, only the loss kernel holds the logits during backward
        del logits, logprob
        loss.backward()

    for param in model.parameters():  # gradients exist before the step, as Megatron's buffer does
        param.grad = torch.zeros_like(param)
    peak, _ = allocation_peak(step)
    return peak


def optimizer_footprint(ctx: ParallelContext, arch: Qwen3Config, *, params_dtype: torch.dtype = torch.bfloat16) -> dict:
    """This rank's stage of the layout ``ctx`` under Megatron's DDP (fp32 gradient buffer) and distributed Adam, as the
    trainer builds them: parameter count, buffer elements and optimizer bytes after one step."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from stapo_megatron.models.qwen3.parallelize import build_stage

    model = build_stage(arch, ctx, params_dtype=params_dtype)
    params = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        ),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            bf16=params_dtype == torch.bfloat16,
            params_dtype=params_dtype,
            use_distributed_optimizer=True,
        ),
        [ddp],
    )
    for buffer in ddp.buffers:
        buffer.grad_data.fill_(1e-3)
    optimizer.step()
    # fp32 weights are their own master copy: their main shards are views into the param buffer
    buffer_storages = {b.param_data.untyped_storage().data_ptr() for b in ddp.buffers if b.param_data is not None}
    state_bytes = main_bytes = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = opt.optimizer
        for group in torch_opt.param_groups:
            for main in group["params"]:
                if main.untyped_storage().data_ptr() not in buffer_storages:
                    main_bytes += main.numel() * main.element_size()
                state = torch_opt.state.get(main, {})
                state_bytes += sum(
                    t.numel() * t.element_size() for k, t in state.items() if k in ("exp_avg", "exp_avg_sq")
                )
    # what the rollout phase leaves on the GPU: the trainer's offload moves each part out and back
    from stapo_megatron.trainer.offload import OPTIMIZER, PARAMS, TrainerOffload

    offload = TrainerOffload(ddp, optimizer, torch.device("cpu"))
    offloaded = {OPTIMIZER: offload.offload(OPTIMIZER), PARAMS: offload.offload(PARAMS)}
    offload.reload()
    return {
        "params": params,
        "buffer_numel": sum(b.grad_data.numel() for b in ddp.buffers),
        "optimizer_bytes": main_bytes + state_bytes,
        "offloaded_bytes": offloaded,
        # Adam's step counters (one fp32 scalar per main parameter), which the planner leaves out
        "adam_step_bytes": sum(
            4
            for o in getattr(optimizer, "chained_optimizers", [optimizer])
            for g in o.optimizer.param_groups
            for _ in g["params"]
        ),
    }
