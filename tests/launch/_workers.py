"""What the planner tests measure inside one spawned 2-process gloo world (importable by the ranks).

One world does everything, re-initialising Megatron's parallel state per layout, because
starting processes (importing torch and Megatron on two cores) is what costs time here.
Rank r writes ``<out>/<r>.json``.
"""

from __future__ import annotations

import json
import os

import torch

from stapo_megatron.models.qwen3.config import Qwen3Config

# Activations: a small Qwen3 whose terms all differ (h != q != f, grouped-query attention) and
# whose vocabulary makes the logits a visible part of the peak.
ACT_ARCH = Qwen3Config(
    vocab_size=4096,
    hidden_size=192,
    intermediate_size=640,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
ACT_SEQ, ACT_BATCH, ACT_CHUNK = 256, 2, 256
# (tensor_parallel, recompute, sequence_parallel) cases of the activation measurement, fp32 (bf16
# matmuls are slow on CPU).
ACT_CASES = [
    (1, "none", False),
    (1, "selective", False),
    (1, "full", False),
    (2, "none", False),
    (2, "full", False),
    (2, "none", True),
    (2, "selective", True),
]

# Optimizer state: tied embeddings, so pipeline stages get the shared-embedding bucket.
OPT_ARCH = Qwen3Config(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
# (tensor, pipeline, data parallel, dtype) layouts of a 2-process world.
OPT_CASES = [(1, 1, 2, "bfloat16"), (1, 2, 1, "bfloat16"), (2, 1, 1, "float32"), (1, 1, 2, "float32")]

# Stages built inside the real world, to check the meta builder's stand-in groups against real ones
# (untied models: with tied embeddings Megatron all-reduces the initial weights, which meta
# tensors cannot do).
REAL_META_CASES = [("qwen3_14b", 2, 1), ("qwen3_32b", 1, 2)]
# Layouts whose every stage rank 0 builds with stand-in groups (the README's and the issue's).
META_LAYOUTS = {
    "qwen3_14b": [(4, 1), (4, 2), (8, 1), (8, 2)],
    "qwen3_32b": [(8, 1), (8, 2), (8, 4)],
    "qwen3_1.7b": [(1, 1), (1, 2), (2, 4)],
    "qwen3_8b": [(2, 1), (4, 2)],
}


def _init(tp: int, pp: int, dp: int):
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    return init_distributed(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp), seed=0)


def measure_all(out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from stapo_megatron.config import build
    from stapo_megatron.launch.measure import activation_peak, optimizer_footprint
    from stapo_megatron.launch.meta import meta_stage
    from stapo_megatron.models.qwen3.model import build_gpt_model, transformer_config

    result: dict = {"activations": [], "optimizer": [], "real_meta": []}
    world = 2
    for tp, recompute, sp in ACT_CASES:
        ctx = _init(tp, 1, world // tp)
        peak = activation_peak(
            ctx,
            ACT_ARCH,
            seq_len=ACT_SEQ,
            micro_batch=ACT_BATCH,
            recompute=recompute,
            sequence_parallel=sp,
            params_dtype=torch.float32,
            logits_chunk=ACT_CHUNK,
        )
        result["activations"].append({"tp": tp, "recompute": recompute, "sequence_parallel": sp, "peak": peak})
    for tp, pp, dp, dtype in OPT_CASES:
        ctx = _init(tp, pp, dp)
        found = optimizer_footprint(ctx, OPT_ARCH, params_dtype=getattr(torch, dtype))
        found.update(
            tp=tp,
            pp=pp,
            dp=dp,
            dtype=dtype,
            stage=ctx.pp_rank,
            dp_rank=ctx.dp_rank,
        )
        result["optimizer"].append(found)
    for preset, tp, pp in REAL_META_CASES:
        _init(tp, pp, world // (tp * pp))
        arch = build(Qwen3Config, preset)
        with torch.device("meta"):
            config = transformer_config(
                arch,
                tensor_parallel=tp,
                pipeline_parallel=pp,
                params_dtype=torch.bfloat16,
                perform_initialization=False,
                use_cpu_initialization=True,
            )
            model = build_gpt_model(
                arch, config, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()
            )
        stage = ps.get_pipeline_model_parallel_rank()
        result["real_meta"].append(
            {
                "preset": preset,
                "tp": tp,
                "pp": pp,
                "stage": stage,
                "real": stage_signature(model),
                "stand_in": stage_signature(meta_stage(arch, tp, pp, stage)),
            }
        )
    if dist.get_rank() == 0:
        result["meta"] = {
            f"{preset}/{tp}/{pp}/{stage}": stage_signature(meta_stage(build(Qwen3Config, preset), tp, pp, stage))
            for preset, layouts in META_LAYOUTS.items()
            for tp, pp in layouts
            for stage in range(pp)
        }
    with open(os.path.join(out, f"{dist.get_rank()}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


def stage_signature(model) -> list[list]:
    """(name, numel, shared embedding, dtype bytes) of every parameter, in registration order."""
    return [
        [name, p.numel(), bool(getattr(p, "shared_embedding", False)), p.element_size()]
        for name, p in model.named_parameters()
    ]
