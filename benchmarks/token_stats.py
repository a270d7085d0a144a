"""Forward + backward of the token statistics: ours vs the naive path vs Megatron's cross-entropy.

    python benchmarks/token_stats.py [--tokens 4096] [--vocab 151936] [--tp 1 2] [--sweep 64 128 256 512]

Each case runs in fresh processes (``spawn_ranks``, gloo; TP=2 splits the vocabulary over two
processes on this machine) and does: one cold forward + backward for memory, then timed repeats.

- ours: ``vocab_parallel_logprob_entropy`` (log-prob with gradient, entropy without);
- naive: gather the full logits (TP > 1: autograd all-gather), ``log_softmax`` in fp32, gather the
  target, entropy -sum p log p from the same log-softmax (under no_grad: like ours, it feeds no
  gradient);
- megatron: ``tensor_parallel.vocab_parallel_cross_entropy`` (log-prob only). It works in place
  on fp32 input, so fp32 logits are cloned first (bf16 input it converts to an fp32 copy itself).

The loss is sum_t w_t log p_t with random w, backpropagated to the logits.

Memory: the kernel's peak resident set (VmHWM, reset through /proc/self/clear_refs), measured
separately over the cold forward and the cold backward, minus the resident set before the
forward (logits, targets, weights already touched), with ``MALLOC_MMAP_THRESHOLD_=65536`` so
freed buffers leave the resident set at once. "extra" is the larger of the two peaks; "work"
is the larger of the forward peak and the backward peak less the logits-sized gradient that
every method must return. Ratios are
against one fp32 copy of the logits slice (tokens x V/tp x 4 bytes) and against the other methods.
Goals: work <= 0.25 x fp32 logits; time <= 1.0 x naive and <= 1.5 x Megatron.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the spawned ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from stapo_megatron.runtime.launch import spawn_ranks  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
METHODS = ("ours", "naive", "megatron")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _case(dtype_name, tokens, vocab, tp, chunk, repeats, methods, out_dir):
    import warnings

    warnings.filterwarnings("ignore")  # Megatron warns that TE and apex are absent
    import torch.distributed as dist

    from stapo_megatron.loss import vocab_parallel_logprob_entropy
    from stapo_megatron.models.qwen3.config import padded_vocab_size
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    rank = int(os.environ["RANK"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    init_distributed(ParallelConfig(tensor_parallel=tp))  # Megatron's CE reads its parallel state
    from megatron.core import parallel_state, tensor_parallel

    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    dtype = DTYPES[dtype_name]
    local = padded_vocab_size(vocab, tp) // tp
    gen = torch.Generator().manual_seed(1 + rank)
    logits = (torch.randn(tokens, local, generator=gen) * 2).to(dtype)
    real = max(0, min(vocab - rank * local, local))
    logits[:, real:] = float("-inf")  # padding: excluded by ours and naive, exp() == 0 for Megatron
    targets = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(7))
    weights = torch.randn(tokens, generator=torch.Generator().manual_seed(8))
    logits.requires_grad_(True)

    def forward(method):
        logits.grad = None
        if method.startswith("ours"):  # "ours@128": chunk_size 128
            size = int(method.split("@")[1]) if "@" in method else chunk
            lp, _ = vocab_parallel_logprob_entropy(logits, targets, group, chunk_size=size, vocab_size=vocab)
        elif method == "naive":
            if tp > 1:
                parts = torch.distributed.nn.functional.all_gather(logits, group=group)
                full = torch.cat(parts, dim=-1)[:, :vocab]
            else:
                full = logits[:, :vocab]
            logp = torch.log_softmax(full.float(), dim=-1)
            lp = logp.gather(-1, targets[:, None]).squeeze(-1)
            with torch.no_grad():
                _ = -(logp.exp() * logp).sum(-1)
        else:
            x = logits.clone() if dtype == torch.float32 else logits
            lp = -tensor_parallel.vocab_parallel_cross_entropy(x[None], targets[None])[0]
        return (lp * weights).sum()

    def sync():
        if group is not None:
            dist.barrier(group=group)

    grad_bytes = logits.numel() * logits.element_size()
    result = {}
    for method in methods:
        # Cold run, forward and backward measured apart: their peaks need not overlap, and only
        # the backward holds the logits-sized gradient.
        sync()
        base = _status("VmRSS")
        _reset_peak()
        loss = forward(method)
        fwd_peak = _status("VmHWM") - base
        _reset_peak()
        loss.backward()
        bwd_peak = _status("VmHWM") - base
        del loss
        logits.grad = None
        result[method] = dict(
            extra=max(fwd_peak, bwd_peak),
            work=max(fwd_peak, bwd_peak - grad_bytes),
            time=float("inf"),
            fp32_logits=tokens * local * 4,
        )
    # Timed rounds interleave the methods, so that load from elsewhere hits them alike; best of rounds.
    for _ in range(repeats):
        for method in methods:
            sync()
            t0 = time.perf_counter()
            forward(method).backward()
            sync()
            result[method]["time"] = min(result[method]["time"], time.perf_counter() - t0)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def run_case(dtype_name, tokens, vocab, tp, chunk, repeats, methods=METHODS):
    """{method: {extra, work, time, fp32_logits}}, the worst rank's value of each."""
    with tempfile.TemporaryDirectory() as out:
        spawn_ranks(_case, tp, dtype_name, tokens, vocab, tp, chunk, repeats, list(methods), out)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]
    return {m: {k: max(r[m][k] for r in ranks) for k in ranks[0][m]} for m in methods}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tp", type=int, nargs="*", default=[1])
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--chunk", type=int, default=None, help="chunk_size of ours (default: the library's)")
    parser.add_argument("--sweep", type=int, nargs="*", default=[], help="also time ours at these chunk sizes (fp32)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    gib = 1 << 30

    print(
        f"tokens={args.tokens} vocab={args.vocab} cpus={os.cpu_count()}; work/fp32: working memory / one fp32 copy "
        "of the logits slice; t/..: time ratio; x/..: extra-memory ratio"
    )
    header = (
        f"{'tp':>2} {'dtype':>5} {'method':>8} {'time s':>7} {'extra GiB':>9} {'work GiB':>8} "
        f"{'work/fp32':>9} {'t/naive':>7} {'t/meg':>6} {'x/naive':>7} {'x/meg':>6}"
    )
    print(header)
    print("-" * len(header))
    for tp in args.tp:
        for dtype_name in args.dtypes:
            res = run_case(dtype_name, args.tokens, args.vocab, tp, args.chunk, args.repeats)
            for m, r in res.items():
                print(
                    f"{tp:>2} {dtype_name:>5} {m:>8} {r['time']:>7.3f} {r['extra'] / gib:>9.3f} "
                    f"{r['work'] / gib:>8.3f} {r['work'] / r['fp32_logits']:>9.3f} "
                    f"{r['time'] / res['naive']['time']:>7.2f} {r['time'] / res['megatron']['time']:>6.2f} "
                    f"{r['extra'] / res['naive']['extra']:>7.2f} {r['extra'] / res['megatron']['extra']:>6.2f}"
                )
    if args.sweep:
        methods = [f"ours@{c}" for c in args.sweep]
        res = run_case("fp32", args.tokens, args.vocab, 1, None, args.repeats, methods=methods)
        print(f"\nchunk sweep (ours, fp32, tp=1, interleaved)\n{'chunk':>6} {'time s':>7} {'work/fp32':>9}")
        for c, m in zip(args.sweep, methods):
            print(f"{c:>6} {res[m]['time']:>7.3f} {res[m]['work'] / res[m]['fp32_logits']:>9.3f}")


if __name__ == "__main__":
    main()
