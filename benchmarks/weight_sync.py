"""Per-rank weight export against the rank-0 path it replaces, at TP2 x PP2 on CPU (4 gloo ranks).

Both paths run in this one invocation on the same random Qwen3-shaped model, each in its own four
fresh processes (so peak RSS is each path's own):

* ``rank0``: the former shape of the export: every stage all-gathers each parameter across its TP
  group, the stage's TP-rank 0 sends every HF tensor to global rank 0, stage after stage, and rank 0
  hands the whole model to the engine;
* ``per-rank``: :func:`stapo_megatron.checkpoint.export.iter_rank_buckets` through the one-deep
  :func:`~stapo_megatron.checkpoint.export.pipelined` sender: each parameter gathered to its owner
  only, each rank handing its own buckets to its node's servers.

Handing a tensor to the engine/servers is counted, not performed (on a GPU it is a CUDA IPC handle
or an NCCL broadcast): "pushed" is what leaves the rank towards the servers, "sent"/"received" the
bytes its collectives and point-to-point calls carry (counted at the calls, ring all-gather as
(tp-1) shards each way). Peak RSS is the kernel's high-water mark (VmHWM), reset right before the
export, minus the RSS then: the memory the export itself added on top of the rank's own shards.

    python benchmarks/weight_sync.py --size small     # ~0.1 GB, first
    python benchmarks/weight_sync.py --size full      # ~1.5 GB
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {
    # Qwen3 shapes (head_dim 128, GQA 2:1, untied head); "full" is ~1.5 GB in bf16.
    "small": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
    ),
    "full": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
TP, PP = 2, 2


class ByteCounter:
    """Counts the bytes that pass through torch.distributed calls of this rank."""

    def __init__(self, tp_size: int):
        self.tp_size = tp_size
        self.sent = self.received = self.pushed = 0
        self._originals = {}

    def install(self) -> None:
        originals = {name: getattr(dist, name) for name in ("gather", "all_gather_into_tensor", "send", "recv")}
        self._originals = originals

        def gather(tensor, gather_list=None, dst=None, group=None, **kw):
            if gather_list is None:
                self.sent += tensor.numel() * tensor.element_size()
            else:
                self.received += (len(gather_list) - 1) * tensor.numel() * tensor.element_size()
            return originals["gather"](tensor, gather_list, dst=dst, group=group, **kw)

        def all_gather_into_tensor(output, input, group=None, **kw):
            shard = input.numel() * input.element_size()
            self.sent += (self.tp_size - 1) * shard
            self.received += (self.tp_size - 1) * shard
            return originals["all_gather_into_tensor"](output, input, group=group, **kw)

        def send(tensor, dst=None, group=None, tag=0, **kw):
            self.sent += tensor.numel() * tensor.element_size()
            return originals["send"](tensor, dst=dst, group=group, tag=tag, **kw)

        def recv(tensor, src=None, group=None, tag=0, **kw):
            self.received += tensor.numel() * tensor.element_size()
            return originals["recv"](tensor, src=src, group=group, tag=tag, **kw)

        for name, fn in (
            ("gather", gather),
            ("all_gather_into_tensor", all_gather_into_tensor),
            ("send", send),
            ("recv", recv),
        ):
            setattr(dist, name, fn)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


@torch.no_grad()
def rank0_path(model, arch, ctx, counter: ByteCounter) -> None:
    """The former export's data movement: TP all-gather everywhere, every tensor to global rank 0."""
    from stapo_megatron.checkpoint.export import stage_export_plan, unwrap
    from stapo_megatron.models.qwen3.state_dict_adapter import gather_dim, to_hf

    params = dict(unwrap(model).named_parameters())
    plan = stage_export_plan(model, arch, ctx.tp_size)
    shapes = [[(name, shape, dtype) for e in plan for name, shape, dtype in e.tensors]] if ctx.tp_rank == 0 else [None]
    per_rank = [None] * ctx.world_size
    dist.all_gather_object(per_rank, shapes[0], group=ctx.cpu_group)
    stage_leaders = dist.get_process_group_ranks(ctx.pp_group)

    def stage_tensors():
        for entry in plan:
            local = params[entry.mapping.megatron_name].detach()
            if entry.mapping.layout == "replicated":
                full = local
            else:
                stacked = local.new_empty((ctx.tp_size * local.shape[0], *local.shape[1:]))
                dist.all_gather_into_tensor(stacked, local.contiguous(), group=ctx.tp_group)
                full = stacked
                if gather_dim(entry.mapping) == 1:
                    full = stacked.reshape(ctx.tp_size, *local.shape).transpose(0, 1).reshape(local.shape[0], -1)
            for _, tensor in to_hf(entry.mapping, full, arch, ctx.tp_size):
                yield tensor.contiguous()

    for stage in range(ctx.pp_size):
        mine = ctx.pp_rank == stage
        if mine:
            for tensor in stage_tensors():
                if ctx.rank == 0:
                    counter.pushed += tensor.numel() * tensor.element_size()
                elif ctx.tp_rank == 0:
                    dist.send(tensor, dst=0, group=ctx.cpu_group)
        elif ctx.rank == 0:
            for _, shape, dtype in per_rank[stage_leaders[stage]]:
                tensor = torch.empty(shape, dtype=dtype)
                dist.recv(tensor, src=stage_leaders[stage], group=ctx.cpu_group)
                counter.pushed += tensor.numel() * tensor.element_size()


def per_rank_path(model, arch, ctx, counter: ByteCounter, bucket_bytes: int) -> None:
    from stapo_megatron.checkpoint.export import iter_rank_buckets, pipelined

    def push(bucket) -> None:
        counter.pushed += bucket.nbytes

    pipelined(iter_rank_buckets(model, arch, ctx, bucket_bytes=bucket_bytes), push)


def run_rank(path: str, size: str, dtype_name: str, bucket_bytes: int, out_dir: str) -> None:
    import gc

    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    ctx = init_distributed(ParallelConfig(tensor_parallel=TP, pipeline_parallel=PP))
    arch = Qwen3Config(**SIZES[size], tie_word_embeddings=False)
    model = build_stage(
        arch, ctx, params_dtype=getattr(torch, dtype_name), perform_initialization=False, device=ctx.device
    )
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-0.02, 0.02)  # random, and every page touched before the measurement
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    counter = ByteCounter(ctx.tp_size)
    counter.install()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
    rss_before = _rss_kib("VmRSS")
    dist.barrier(group=ctx.cpu_group)
    start = time.perf_counter()
    if path == "rank0":
        rank0_path(model, arch, ctx, counter)
    else:
        per_rank_path(model, arch, ctx, counter, bucket_bytes)
    dist.barrier(group=ctx.cpu_group)
    wall = time.perf_counter() - start
    peak_added = (_rss_kib("VmHWM") - rss_before) * 1024
    total = [torch.tensor([own])]
    dist.all_reduce(total[0], group=ctx.cpu_group)
    result = dict(
        rank=ctx.rank,
        wall_s=wall,
        sent=counter.sent,
        received=counter.received,
        pushed=counter.pushed,
        own_bytes=own,
        peak_added=peak_added,
        model_bytes=int(total[0].item()),
    )
    Path(out_dir, f"{path}.{ctx.rank}.json").write_text(json.dumps(result))


def main() -> None:
    from stapo_megatron.runtime.launch import spawn_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bucket-mb", type=int, default=128)
    args = parser.parse_args()
    bucket_bytes = args.bucket_mb * 1024**2
    out = Path(tempfile.mkdtemp(prefix="stapo-weight-sync-bench-"))
    for path in ("rank0", "per-rank"):
        spawn_ranks(run_rank, TP * PP, path, args.size, args.dtype, bucket_bytes, str(out))
    rows = {
        path: [json.loads(Path(out, f"{path}.{r}.json").read_text()) for r in range(TP * PP)]
        for path in ("rank0", "per-rank")
    }
    model_bytes = rows["rank0"][0]["model_bytes"]
    gb = 1024**3
    print(
        f"model: {args.size}, {model_bytes / gb:.2f} GiB ({args.dtype}), TP{TP} x PP{PP}, bucket {args.bucket_mb} MiB"
    )
    print(
        f"{'path':9} {'rank':>4} {'wall s':>7} {'sent GiB':>9} {'recv GiB':>9} {'pushed GiB':>10} {'moved GiB':>9} "
        f"{'own GiB':>8} {'peak+ GiB':>9}"
    )
    for path, ranks in rows.items():
        for r in ranks:
            moved = r["sent"] + r["received"] + r["pushed"]
            print(
                f"{path:9} {r['rank']:>4} {r['wall_s']:>7.2f} {r['sent'] / gb:>9.3f} {r['received'] / gb:>9.3f} "
                f"{r['pushed'] / gb:>10.3f} {moved / gb:>9.3f} {r['own_bytes'] / gb:>8.3f} {r['peak_added'] / gb:>9.3f}"
            )
    wall = {path: max(r["wall_s"] for r in ranks) for path, ranks in rows.items()}
    moved = {path: max(r["sent"] + r["received"] + r["pushed"] for r in ranks) for path, ranks in rows.items()}
    peak = {path: max(r["peak_added"] for r in ranks) for path, ranks in rows.items()}
    print(f"wall time per-rank / rank0:        {wall['per-rank'] / wall['rank0']:.2f}  (goal <= 0.6)")
    print(
        f"max bytes moved by one rank ratio: {moved['per-rank'] / moved['rank0']:.2f}  "
        f"(per-rank max {moved['per-rank'] / gb:.3f} GiB; goal <= model/PP + bucket = "
        f"{(model_bytes / PP + bucket_bytes) / gb:.3f} GiB)"
    )
    print(
        f"max peak added on one rank ratio:  {peak['per-rank'] / max(peak['rank0'], 1):.2f}  "
        f"(per-rank max {peak['per-rank'] / gb:.3f} GiB; goal <= 2 buckets = {2 * bucket_bytes / gb:.3f} GiB)"
    )


if __name__ == "__main__":
    main()
