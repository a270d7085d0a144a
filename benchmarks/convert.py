"""HF -> Megatron -> HF conversion: throughput and peak memory of each process.

Writes a random bf16 Qwen3 checkpoint (tied embeddings, real 151,936 vocabulary) of about
0.5 GB and 2 GB, converts it to Megatron and back at TP=1 and TP=2 x PP=2, and prints GB/s and
each rank's peak RSS. A rank's peak should follow its own shards plus one tensor, not the
whole model; the baseline row is the peak of a rank that only starts torch, Megatron and the
process group, measured in the same run.

    python benchmarks/convert.py [--sizes 0.5,2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from stapo_megatron.checkpoint import convert
from stapo_megatron.checkpoint.hf_io import SafetensorsStreamWriter, finalize_shards
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.state_dict_adapter import hf_tensor_shapes
from stapo_megatron.runtime.launch import spawn_ranks

SHAPES = {
    0.5: dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
    ),
    2: dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=14,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
LAYOUTS = [(1, 1), (2, 2)]
GB = 1e9


def write_random_hf(arch: Qwen3Config, directory: Path) -> int:
    directory.mkdir(parents=True)
    plan = [(name, shape, torch.bfloat16) for name, shape in hf_tensor_shapes(arch).items()]
    writer = SafetensorsStreamWriter(directory, plan, max_file_bytes=1 << 30)
    generator = torch.Generator().manual_seed(0)
    for name, shape, dtype in plan:
        writer.write(name, (torch.randn(shape, generator=generator) * 0.02).to(dtype))
    writer.close()
    finalize_shards(directory, writer.files)
    (directory / "config.json").write_text(json.dumps(arch.to_hf_dict()))
    return sum(f[2] for f in writer.files)


def peak_rss_bytes() -> int:
    # VmHWM belongs to this process image; ru_maxrss would carry the parent's peak across exec.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def baseline_rank(tp: int, pp: int) -> None:
    """What every rank pays before converting anything: torch, Megatron, the process group."""
    convert._init_ranks(tp, pp)


def measured(report_dir: str, fn, *args) -> None:
    """Run one rank's work and record its peak RSS."""
    import torch.distributed as dist

    fn(*args)
    Path(report_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps({"peak": peak_rss_bytes()}))


def run(world: int, fn, *args) -> tuple[float, list[int]]:
    report = Path(tempfile.mkdtemp())
    start = time.perf_counter()
    spawn_ranks(measured, world, str(report), fn, *args)
    seconds = time.perf_counter() - start
    peaks = [json.loads((report / f"rank{r}.json").read_text())["peak"] for r in range(world)]
    shutil.rmtree(report)
    return seconds, peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.5,2", help=f"model sizes in GB (of {sorted(SHAPES)})")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="stapo-convert-bench-"))
    rows = []
    for size in [float(s) for s in args.sizes.split(",")]:
        arch = Qwen3Config(vocab_size=151936, tie_word_embeddings=True, **SHAPES[size])
        hf_dir = work / f"hf-{size}"
        if hf_dir.exists():
            shutil.rmtree(hf_dir)
        nbytes = write_random_hf(arch, hf_dir)
        biggest = max(torch.Size(s).numel() for s in hf_tensor_shapes(arch).values()) * 2
        for tp, pp in LAYOUTS:
            world = tp * pp
            _, base = run(world, baseline_rank, tp, pp)
            mg_dir, back_dir = work / f"mg-{size}-{tp}x{pp}", work / f"back-{size}-{tp}x{pp}"
            for d in (mg_dir, back_dir):
                shutil.rmtree(d, ignore_errors=True)
            to_mg, peaks_in = run(world, convert.hf_to_megatron_rank, str(hf_dir), str(mg_dir), tp, pp, None)
            staging = work / f".stage-{size}-{tp}x{pp}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            to_hf, peaks_out = run(world, convert.megatron_to_hf_rank, str(mg_dir), tp, pp, None, 1 << 30, str(staging))
            for direction, seconds, peaks in (("HF->Megatron", to_mg, peaks_in), ("Megatron->HF", to_hf, peaks_out)):
                rows.append(
                    (
                        size,
                        nbytes,
                        f"TP{tp}xPP{pp}",
                        direction,
                        seconds,
                        nbytes / seconds / GB,
                        max(base),
                        peaks,
                        nbytes / world,
                        biggest,
                    )
                )
            for d in (mg_dir, staging):
                shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(hf_dir)
    print(
        f"{'model':>8} {'layout':>9} {'direction':>13} {'seconds':>8} {'GB/s':>6} {'baseline':>9}  peak RSS per rank "
        "(GB), minus baseline, / (model/ranks + largest tensor)"
    )
    for _size, nbytes, layout, direction, seconds, rate, base, peaks, share, biggest in rows:
        extra = [(p - base) / GB for p in peaks]
        ratio = [(p - base) / (share + biggest) for p in peaks]
        print(
            f"{nbytes / GB:7.2f}G {layout:>9} {direction:>13} {seconds:8.1f} {rate:6.3f} {base / GB:8.2f}G  "
            + "  ".join(f"{p / GB:.2f} (+{e:.2f}, x{r:.2f})" for p, e, r in zip(peaks, extra, ratio))
        )
    print(
        "Each rank's growth over the baseline is shown as a multiple of (model/ranks + largest tensor):"
        " it stays flat from 0.5 GB to 2 GB instead of growing with the whole model."
    )


if __name__ == "__main__":
    main()
