"""How close `stapo plan` is to Megatron: parameters per stage and activation peaks, printed.

    python benchmarks/plan.py [--seq 256 512] [--tp 1 2] [--dtypes float32 bfloat16]

1. Parameters: every stage of the 14B and 32B layouts of examples/qwen3 (and a few more), built
   on the meta device with stand-in process groups (stapo_megatron/launch/meta.py), against the
   planner's count; optimizer bytes per DP rank from the meta model's own parameter list.
2. Activations: forward + backward of a small Qwen3 (local spec, CPU, gloo; TP ranks spawned),
   peak bytes from the CPU allocator's events (stapo_megatron/launch/measure.py) against the
   planner's kept + max(work, logits), for each recompute mode, sequence length, TP and dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from stapo_megatron.config import build
from stapo_megatron.launch import plan
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.runtime.launch import spawn_ranks

LAYOUTS = {"qwen3_14b": [(4, 1), (4, 2), (8, 1), (8, 2)], "qwen3_32b": [(8, 1), (8, 2), (8, 4)]}
ARCH = Qwen3Config(
    vocab_size=4096,
    hidden_size=192,
    intermediate_size=640,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def _meta_rank(out: str) -> None:
    from stapo_megatron.launch.meta import meta_stage

    result = {}
    for preset, layouts in LAYOUTS.items():
        arch = build(Qwen3Config, preset)
        for tp, pp in layouts:
            for stage in range(pp):
                model = meta_stage(arch, tp, pp, stage)
                result[f"{preset}/{tp}/{pp}/{stage}"] = [
                    [n, p.numel(), bool(getattr(p, "shared_embedding", False)), p.element_size()]
                    for n, p in model.named_parameters()
                ]
    with open(os.path.join(out, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


def _activation_rank(out: str, tp: int, cases: list) -> None:
    import torch.distributed as dist

    from stapo_megatron.launch.measure import activation_peak
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    ctx = init_distributed(ParallelConfig(tensor_parallel=tp), seed=0)
    rows = []
    for seq, recompute, dtype in cases:
        peak = activation_peak(
            ctx,
            ARCH,
            seq_len=seq,
            micro_batch=2,
            recompute=recompute,
            params_dtype=getattr(torch, dtype),
            logits_chunk=256,
        )
        rows.append([seq, recompute, dtype, peak])
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"act_tp{tp}.json"), "w", encoding="utf-8") as f:
            json.dump(rows, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="plan-bench-")

    start = time.perf_counter()
    spawn_ranks(_meta_rank, 1, out)
    with open(os.path.join(out, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    print(f"parameters per stage, planner vs meta device ({time.perf_counter() - start:.1f} s for {len(meta)} stages):")
    for key, signature in meta.items():
        preset, tp, pp, stage = key.split("/")
        arch = build(Qwen3Config, preset)
        mine = plan.stage_parameters(arch, int(tp), int(pp), int(stage))
        same = [[p.name, p.numel] for p in mine] == [row[:2] for row in signature]
        st = plan.stage_memory(
            arch, plan.Layout(int(tp), int(pp), 4), plan.Workload(seq_len=8, kernels="local"), int(stage)
        )
        print(
            f"  {preset} TP{tp} PP{pp} stage {stage}: {sum(r[1] for r in signature):>14,} (meta) "
            f"{sum(p.numel for p in mine):>14,} (plan) {'exact' if same else 'DIFFERENT'}; "
            f"optimizer at DP4 {st.optimizer / 2**30:.3f} GiB"
        )

    print("\nactivation peak of forward + backward, small Qwen3 on CPU (local spec), micro-batch 2:")
    print(f"  {'TP':>2} {'seq':>5} {'recompute':>9} {'dtype':>8} {'measured MiB':>12} {'planned MiB':>11} {'error':>7}")
    for tp in args.tp:
        cases = [[s, r, d] for s in args.seq for r in ("none", "selective", "full") for d in args.dtypes]
        spawn_ranks(_activation_rank, tp, out, tp, cases)
        with open(os.path.join(out, f"act_tp{tp}.json"), encoding="utf-8") as f:
            measured = json.load(f)
        for seq, recompute, dtype, peak in measured:
            work = plan.Workload(
                seq_len=seq, micro_batch=2, recompute=recompute, kernels="local", params_dtype=dtype, logits_chunk=256
            )
            est = plan.stage_memory(ARCH, plan.Layout(tp, 1, 1), work, 0).peak_activations
            print(
                f"  {tp:>2} {seq:>5} {recompute:>9} {dtype:>8} {peak / 2**20:>12.1f} {est / 2**20:>11.1f} "
                f"{100 * (est - peak) / peak:>+6.1f}%"
            )


if __name__ == "__main__":
    main()
