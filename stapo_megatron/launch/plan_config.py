"""``stapo plan``'s fields (:class:`PlanConfig`) and what a training config gives the ones left unset:
the workload and options of the memory model (:mod:`.plan`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from stapo_megatron.config import MAX_BATCH, MAX_TOKENS, option
from stapo_megatron.config.core import field_default
from stapo_megatron.launch.plan import USABLE_GPU_MEMORY_GB, DeviceCosts, Kernels, Recompute, Workload
from stapo_megatron.runtime.environment import shared_nccl_env


@dataclasses.dataclass
class PlanConfig:
    """``stapo plan``'s fields: the ``plan:`` section of a training config, or the command line alone.
    Unset (None) fields take the training config's value, else the default their documentation names."""

    model: str = option(
        "", "Qwen3 preset (qwen3_0.6b ... qwen3_32b) or a model YAML ('': the training config's model)."
    )
    gpus: int | None = option(
        None, "GPUs of the trainer (default: the training config's world size).", ge=1, le=MAX_BATCH
    )
    seq_len: int | None = option(
        None,
        "Tokens per micro-batch row, prompt + response (default: the training config's "
        "batch.max_tokens_per_microbatch, else its default).",
        ge=1,
        le=MAX_BATCH * MAX_TOKENS,
    )
    micro_batch: int | None = option(None, "Sequences per micro-batch (default 1).", ge=1, le=MAX_BATCH)
    sequences_per_minibatch: int | None = option(
        None,
        "Sequences per optimizer step, all DP ranks (default: the training config's, else 512 = 64 prompts x 8); "
        "bounds the micro-batches in flight under pipeline parallelism.",
        ge=1,
        le=MAX_BATCH,
    )
    recompute: Recompute | None = option(None, "Activation recomputation (default: the training config's, else none).")
    sequence_parallel: bool | None = option(
        None,
        "Megatron sequence parallelism: the norm/residual activations split over TP (default: the training "
        "config's parallel.sequence_parallel, else false).",
    )
    kernels: Kernels = option(
        "te", "te: Transformer Engine with flash attention (GPU); local: Megatron's local spec (no TE)."
    )
    dtype: Literal["bfloat16", "float32"] | None = option(
        None, "Parameter dtype (default: the training config's, else bfloat16)."
    )
    gpu_memory_gb: float = option(
        USABLE_GPU_MEMORY_GB,
        "Usable memory per GPU in GiB: the total torch.cuda.mem_get_info reports (79.6 on an 80 GB H100).",
        gt=0,
        le=1 << 20,
    )
    gpus_per_node: int = option(
        8,
        "GPUs per node: the largest TP considered (TP stays within a node), and the nodes of --check.",
        ge=1,
        le=MAX_BATCH,
    )
    colocate_fraction: float | None = option(
        None,
        "Fraction of each GPU held by colocated SGLang servers (their mem_fraction_static); 0: separate GPUs "
        "(default: the training config's, else 0).",
        ge=0,
        lt=1,
    )
    sglang_released: bool | None = option(
        None,
        "Colocated servers free their share while the trainer runs (default: the training config's "
        "rollout.release_memory_between_steps or offload, else false).",
    )
    offload: bool | None = option(
        None,
        "The trainer's state waits in host memory while colocated servers generate; implies sglang_released "
        "(default: the training config's compute.offload_while_generating, else false).",
    )
    server_tp: int | None = option(
        None,
        "Tensor-parallel size of each SGLang server, for the rollout capacity (default: the training config's, "
        "else 1).",
        ge=1,
        le=MAX_BATCH,
    )
    reserve_gb: float = option(
        DeviceCosts.fragmentation_gb,
        "The caching allocator's fragmentation and anything no other term counts, GiB per GPU.",
        ge=0,
        le=1 << 20,
    )
    cuda_context_gb: float = option(
        DeviceCosts.cuda_context_gb, "One process's CUDA context (trainer rank, colocated server), GiB.", ge=0, le=1024
    )
    nccl_communicator_gb: float = option(
        DeviceCosts.nccl_communicator_gb, "One NCCL communicator's buffers without NVLS, GiB.", ge=0, le=1024
    )
    nvls_gb: float = option(
        DeviceCosts.nvls_gb,
        "Added per NCCL communicator of 4+ ranks when NCCL_NVLS_ENABLE is on in this environment, GiB.",
        ge=0,
        le=1024,
    )
    headroom_gb: float = option(
        2.0, "--check refuses a phase that leaves less than this free on a GPU, GiB.", ge=0, le=1 << 20
    )
    logits_chunk: int | None = option(
        None, "Tokens per log-prob/entropy chunk (default: the training config's, else 1024).", ge=1, le=MAX_TOKENS
    )
    distributed_optimizer: bool | None = option(
        None, "Optimizer state sharded over DP (default: the training config's optim.distributed, else true)."
    )
    tp: int | None = option(
        None,
        "Show this layout's stages in detail (with pp; default with a training config: its layout).",
        ge=1,
        le=MAX_BATCH,
    )
    pp: int | None = option(None, "Pipeline stages of the detailed layout.", ge=1, le=MAX_BATCH)
    search: bool = option(False, "With a training config: list layouts instead of the config's own.")
    all: bool = option(False, "List layouts that do not fit too.")
    check: bool = option(
        False,
        "With a training config: check its whole layout on nodes x gpus_per_node GPUs (ranks, groups, servers, "
        "weight-sync routes, memory of each phase) and refuse one that cannot work (stapo_megatron/launch/layout.py).",
    )
    nodes: int | None = option(
        None, "Nodes of the checked layout (default: the config's world size / gpus_per_node).", ge=1, le=MAX_BATCH
    )
    verbose: bool = option(False, "With check: list every weight-sync route.")
    async_: bool = option(
        False,
        "With a training config: the splits of the job's nodes x gpus_per_node GPUs between trainer and "
        "disaggregated SGLang servers (rollout.async.max_staleness >= 1), each with its modelled step time, next "
        "to the synchronous colocated layout's (stapo_megatron/launch/step_time.py).",
        key="async",
    )
    trainer_gpus_per_node: int | None = option(
        None,
        "With async: model only the split with this many trainer GPUs per node (the rest serve), and refuse it if "
        "it cannot work.",
        ge=1,
        le=MAX_BATCH,
    )
    response_tokens: float | None = option(
        None,
        "With async: expected mean response length in tokens (default: a third of the training config's "
        "batch.max_new_tokens; the STAPO paper states no mean; set it from a run's response-length metric).",
        gt=0,
        le=MAX_TOKENS,
    )
    prompt_tokens: float = option(
        108.0,
        "With async: mean prompt length in tokens (default: DAPO-Math-17k's mean under the stapo template with the "
        "Qwen3 tokenizer, measured).",
        ge=0,
        le=MAX_TOKENS,
    )
    decode_tokens_per_gpu_s: float | None = option(
        None,
        "With async: response tokens one server GPU decodes per second (default: derived from NeMo-RL v0.5's "
        "Qwen3-32B runs on H100, scaled by parameters; step_time.py says how).",
        gt=0,
        le=1e9,
    )
    train_tokens_per_gpu_s: float | None = option(
        None,
        "With async: sequence tokens one trainer GPU trains on per second (default: derived like "
        "decode_tokens_per_gpu_s).",
        gt=0,
        le=1e9,
    )
    sync_pause_s: float | None = option(
        None,
        "With async: seconds one weight sync pauses a step (default: 16 for Qwen3-32B, scaled by parameters).",
        ge=0,
        le=1e6,
    )


def training_config_defaults(cfg) -> dict:
    """Defaults taken from a training config (its model, lengths, batch and layout)."""
    sglang = cfg.rollout.sglang
    colocated = cfg.rollout.engine == "sglang" and sglang.colocated
    return {
        "model": cfg.model,
        "gpus": cfg.parallel.world_size,
        # a micro-batch is one packed row of up to max_tokens_per_microbatch tokens
        "seq_len": cfg.batch.max_tokens_per_microbatch,
        "micro_batch": 1,
        "recompute": cfg.compute.recompute,
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "dtype": cfg.compute.params_dtype,
        "sequences_per_minibatch": cfg.batch.prompts_per_minibatch * cfg.batch.group_size,
        "logits_chunk": cfg.compute.logits_chunk_size,
        "distributed_optimizer": cfg.optim.distributed,
        "colocate_fraction": sglang.mem_fraction_static if colocated else 0.0,
        # the trainer has colocated servers free their memory while it trains (always with offload)
        "sglang_released": colocated
        and (cfg.rollout.release_memory_between_steps or cfg.compute.offload_while_generating),
        "offload": colocated and cfg.compute.offload_while_generating,
        "server_tp": sglang.tp_size,
        "mem_fraction": sglang.mem_fraction_static,
        "dedicated_servers": len(sglang.urls) or sglang.num_servers,
        "rollout_len": cfg.data.max_prompt_tokens + cfg.batch.max_new_tokens,
        "entropy_grad": cfg.algo.entropy_coef > 0,
        "reference_model": cfg.algo.kl_coef > 0,
        "tp": cfg.parallel.tensor_parallel,
        "pp": cfg.parallel.pipeline_parallel,
    }


def plan_value(cfg: PlanConfig, defaults: dict, name: str, fallback):
    """The field ``name`` of ``cfg`` when set, else the training config's (``defaults``), else ``fallback``."""
    value = getattr(cfg, name)
    if value is not None:
        return value
    return defaults.get(name, fallback)


def memory_model(cfg: PlanConfig, train) -> tuple[Workload, dict[str, Any]]:
    """The workload and :func:`estimate`'s options of ``cfg``, its unset fields taken from the
    training config ``train`` (None: their defaults)."""
    from stapo_megatron.trainer.config import BatchConfig

    defaults = training_config_defaults(train) if train is not None else {}
    work = Workload(
        seq_len=plan_value(cfg, defaults, "seq_len", field_default(BatchConfig, "max_tokens_per_microbatch")),
        micro_batch=plan_value(cfg, defaults, "micro_batch", 1),
        sequences_per_minibatch=plan_value(cfg, defaults, "sequences_per_minibatch", 512),
        recompute=plan_value(cfg, defaults, "recompute", "none"),
        sequence_parallel=plan_value(cfg, defaults, "sequence_parallel", False),
        kernels=cfg.kernels,
        params_dtype=plan_value(cfg, defaults, "dtype", "bfloat16"),
        distributed_optimizer=plan_value(cfg, defaults, "distributed_optimizer", True),
        logits_chunk=plan_value(cfg, defaults, "logits_chunk", 1024),
        entropy_grad=defaults.get("entropy_grad", False),
        reference_model=defaults.get("reference_model", False),
    )
    offload = plan_value(cfg, defaults, "offload", False)
    costs = DeviceCosts(
        cuda_context_gb=cfg.cuda_context_gb,
        nccl_communicator_gb=cfg.nccl_communicator_gb,
        nvls_gb=cfg.nvls_gb,
        nvls=shared_nccl_env()["NCCL_NVLS_ENABLE"] != "0",
        fragmentation_gb=cfg.reserve_gb,
    )
    options = {
        "gpu_memory_gb": cfg.gpu_memory_gb,
        "colocate_fraction": plan_value(cfg, defaults, "colocate_fraction", 0.0),
        "costs": costs,
        "server_tp": plan_value(cfg, defaults, "server_tp", 1),
        "sglang_released": plan_value(cfg, defaults, "sglang_released", False) or offload,
        "offload": offload,
    }
    return work, options
