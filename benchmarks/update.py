"""One full policy update, padded micro-batches vs packed ones, in the same run (issue 11).

    python benchmarks/update.py [--prompts 16] [--group 4] [--max-response 1024] [--budget 1280]
                                [--padded-sequences 1,4,16]

A small Qwen3-shaped model (local spec, CPU, gloo, one rank) runs ``PolicyUpdater.update_step``
(old-log-prob/statistics pass, S2T threshold, forward/backward, optimizer step; two mini-batches)
from the same weights on the same rollout batch, each variant in a fresh process:

- ``padded/N``: the layout the trainer used before packing (``trainer.py::_microbatches`` and
  ``batch.py::make_microbatches`` of commit 9133d94): each mini-batch's sequences longest first,
  ``micro_batch_size`` = N per micro-batch, each micro-batch padded to its own longest, the same
  micro-batches for the statistics pass. N = 4 was the default, the GPU configs used 1;
- ``packed``: token-budget micro-batches (``--budget`` for forward/backward, twice that for the
  statistics passes), sequences concatenated into one row with THD boundaries;
- ``packed+skip``: the same, zero-advantage sequences left out (``batch.skip_zero_advantage``).

Lengths are long-tailed like the paper's responses (most short, a tail up to the maximum):
prompt ~ U[32, 96] tokens; response = min(max, round(exp(N(ln 150, 1.0)))) tokens, median 150,
mean ~250, about 2% at the cap of 1024 (the measured quantiles are printed). A quarter of the
groups are all-correct or all-wrong (advantage 0), the rest mixed.

Printed per variant: wall seconds of the update (micro-batch building included), tokens/s (all
prompt + response tokens of the batch / those seconds), model tokens (positions the forward/backward
micro-batches compute, padding included; the statistics pass runs as many again) and their
padding fraction, micro-batch count, the peak resident memory above the level before the update
(sampled every 2 ms), and the ratios against ``padded/4``. Then where a forward pass's time goes
(profiled statistics pass of the first mini-batch: linear-layer matmuls, attention, the rest of
the ops, and the wall time outside any op: Python and dispatch), and the data-parallel token
imbalance of the LPT split on a paper-scale step (256 prompts x 8, responses up to 15,360 tokens,
4 mini-batches, DP = 8 and 16) next to the round-robin deal it replaced.

Goals (issue 11): padding <= 5% packed; packed tokens/s >= 1.5x padded; DP imbalance <= 2%.

Reading it on CPU: the work of a pass grows with the positions computed (the ``model tok``
column), and a CPU runs a [1, 1280] row about as efficiently per position as a [4, 320] block, so
packing gains over ``padded/N`` at most the ratio of their model tokens. The old layout sorted each
mini-batch longest first, which keeps its padding low (``padded/4``: ~14% on this distribution,
so <= ~1.16x is on offer); ``padded/1`` has no padding but runs one sequence per micro-batch, and
pays the fixed cost of a micro-batch (schedule, Python, small matmuls) many times; large N pays
for padding. Most of a forward pass on CPU is memory-bound element-wise work (norms, SwiGLU,
rotary, the log-prob/entropy over the vocabulary), not matmuls, and the local spec's packed
attention runs one attention call per sequence (its causal mask built per call). A speed-up
against ``padded/1`` on a GPU (kernel launches, under-filled matmuls) is not measured here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from stapo_megatron.runtime.launch import spawn_ranks  # noqa: E402

SMALL_QWEN3 = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


BASELINE = "padded/4"  # the old default micro_batch_size
LINEAR_OPS = ("aten::mm", "aten::addmm")  # the linear layers and the LM head
ATTENTION_OPS = ("aten::bmm", "aten::baddbmm", "aten::_softmax")  # the local spec's core attention


def variant_layout(variant: str) -> tuple[bool, bool, int]:
    """(packed, skip, sequences per padded micro-batch) of ``padded/N``, ``packed``, ``packed+skip``."""
    if variant.startswith("padded/"):
        return False, False, int(variant.split("/")[1])
    return True, variant == "packed+skip", 0


def response_length(rng: random.Random, cap: int) -> int:
    return max(1, min(cap, round(math.exp(rng.gauss(math.log(150), 1.0)))))


def rollout(prompts: int, group: int, cap: int, vocab: int, seed: int = 0):
    from stapo_megatron.trainer.batch import RolloutBatch

    rng = random.Random(seed)
    n = prompts * group
    prompt_ids, response_ids, logprobs = [], [], []
    for _ in range(prompts):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(32, 96))]
        for _ in range(group):
            r = response_length(rng, cap)
            prompt_ids.append(prompt)
            response_ids.append([rng.randrange(1, vocab) for _ in range(r)])
            logprobs.append([-3 * rng.random() for _ in range(r)])
    correct = torch.tensor([float(rng.random() < 0.5) for _ in range(n)]).view(prompts, group)
    correct[:, 0], correct[:, 1] = 1.0, 0.0
    correct[: prompts // 4] = torch.tensor([float(i % 2) for i in range(prompts // 4)])[:, None]  # advantage 0
    advantages = (correct - correct.mean(1, keepdim=True)) / (correct.std(1, keepdim=True) + 1e-6)
    return RolloutBatch(
        prompt_ids,
        response_ids,
        logprobs,
        torch.zeros(n, dtype=torch.bool),
        correct.reshape(-1),
        correct.reshape(-1).clone(),
        advantages.reshape(-1),
        torch.arange(prompts).repeat_interleave(group),
    )


class PeakMemory:
    """Peak resident set size above the level at entry, sampled from /proc/self/statm."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.peak, self._stop = interval_s, 0, threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval_s)

    def __enter__(self):
        self.base = self.peak = self.rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        return False

    @property
    def above_base(self) -> int:
        return self.peak - self.base


def padded_plan(batch, cfg, ctx, per_microbatch: int):
    """The layout before packing, as the trainer built it: each mini-batch's sequences longest
    first, ``per_microbatch`` per micro-batch, padded to the longest of each."""
    from stapo_megatron.trainer.batch import make_microbatches, model_tokens, token_slots
    from stapo_megatron.trainer.step_plan import MinibatchPlan, StepPlan

    groups = int(batch.group_ids.max()) + 1
    count = cfg.batch.minibatches_per_step
    bounds = [round(i * groups / count) for i in range(count + 1)]
    orders = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sequences = [i for i in range(len(batch)) if lo <= int(batch.group_ids[i]) < hi]
        orders.append(sorted(sequences, key=lambda i: (-model_tokens(batch, i), i)))
    slots = token_slots(batch, [i for order in orders for i in order])
    minibatches = []
    for order in orders:
        bins = [order[k : k + per_microbatch] for k in range(0, len(order), per_microbatch)]
        mbs = make_microbatches(batch, bins, ctx.device, packed=False, slots=slots)
        minibatches.append(MinibatchPlan(update=mbs, forward=mbs, skipped_tokens=0, skipped_sequences=0))
    real = sum(model_tokens(batch, i) for i in range(len(batch)))
    width = sum(mb["input_ids"].numel() for m in minibatches for mb in m.update)
    return StepPlan(minibatches, slots, {"batch/padding_fraction": 1 - real / width})


def forward_profile(updater, microbatches) -> dict[str, float]:
    """Seconds of one forward-only statistics pass over ``microbatches``, split by the profiler
    into linear-layer matmuls, core attention, the other ops and the time outside any op."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        updater.statistics(microbatches)
        wall = time.perf_counter() - start
    split = {"linear": 0.0, "attention": 0.0, "other_ops": 0.0}
    others = []
    for event in prof.key_averages():
        kind = "linear" if event.key in LINEAR_OPS else "attention" if event.key in ATTENTION_OPS else "other_ops"
        split[kind] += event.self_cpu_time_total / 1e6
        if kind == "other_ops":
            others.append((event.self_cpu_time_total / 1e6, event.key))
    split["outside_ops"] = max(0.0, wall - sum(split.values()))
    split["wall"] = wall
    split["top_other"] = sorted(others, reverse=True)[:3]
    return split


def measure(report: str, variant: str, prompts: int, group: int, cap: int, budget: int) -> None:
    """One variant in a fresh process (the allocator's cache of an earlier variant would hide
    this one's peak memory), after a warm-up update on a few sequences."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from stapo_megatron.loss import AlgoConfig, resolve_rollout_correction
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from stapo_megatron.trainer.batch import model_tokens
    from stapo_megatron.trainer.step_plan import plan_step
    from stapo_megatron.trainer.update import PolicyUpdater

    ctx = init_distributed(ParallelConfig(), seed=1)
    arch = Qwen3Config(**SMALL_QWEN3)
    reference = build_stage(arch, ctx)
    weights = {k: v.clone() if torch.is_tensor(v) else v for k, v in reference.state_dict().items()}
    batch = rollout(prompts, group, cap, arch.vocab_size)
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))

    def updater(skip: bool):
        cfg = SimpleNamespace(
            batch=SimpleNamespace(
                minibatches_per_step=2,
                max_tokens_per_microbatch=budget,
                max_tokens_per_forward=2 * budget,
                skip_zero_advantage=skip,
                entropy_over_skipped=True,  # the default: skipped sequences still get a forward for the metrics
                temperature=1.0,
            ),
            compute=SimpleNamespace(logits_chunk_size=256),
            run=SimpleNamespace(seed=0),
            parallel=SimpleNamespace(sequence_parallel=False),
            algo=resolve_rollout_correction(AlgoConfig(), 0),
        )
        model = build_stage(arch, ctx, calculate_per_token_loss=True)
        model.load_state_dict(weights)
        ddp = DistributedDataParallel(
            config=model.config,
            module=model,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            ),
        )
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = ddp.no_sync
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-5, params_dtype=torch.float32, use_distributed_optimizer=False),
            [ddp],
        )
        return PolicyUpdater(ddp, optimizer, cfg, arch, ctx), cfg

    packed, skip, per_microbatch = variant_layout(variant)

    def layout(rollouts, cfg):  # None: update_step plans the packed layout itself
        return None if packed else padded_plan(rollouts, cfg, ctx, per_microbatch)

    warm, cfg = updater(skip)  # one-off costs (first allocations, kernels) outside the timed run
    few = batch.select(range(2 * group))
    warm.update_step(few, plan=layout(few, cfg))
    run, cfg = updater(skip)
    with PeakMemory() as memory:
        start = time.perf_counter()
        done = run.update_step(batch, plan=layout(batch, cfg))  # micro-batch building included, as in training
        seconds = time.perf_counter() - start
    metrics = done.metrics
    plan = layout(batch, cfg) or plan_step(batch, cfg, ctx)
    model_positions = sum(mb["input_ids"].numel() for m in plan.minibatches for mb in m.update)
    result = {
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "model_tokens": model_positions,
        "padding_fraction": metrics["batch/padding_fraction"],
        "skipped_fraction": metrics.get("batch/skipped_fraction", 0.0),
        "peak_memory_mb": memory.above_base / 2**20,
        "microbatches": sum(len(m.update) for m in plan.minibatches),
        "pg_loss": [r.metrics["policy/pg_loss"] for r in done.results],
        "forward_profile": forward_profile(run, plan.minibatches[0].forward),
    }
    responses = sorted(len(r) for r in batch.response_ids)
    result["batch"] = {
        "sequences": len(batch),
        "tokens": tokens,
        "model_lengths": [model_tokens(batch, i) for i in range(len(batch))],
        "longest": max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)),
        "response_quantiles": {
            q: responses[min(len(responses) - 1, int(q * len(responses)))] for q in (0.1, 0.5, 0.9, 0.99)
        },
        "response_mean": sum(responses) / len(responses),
        "at_cap": sum(r >= cap for r in responses) / len(responses),
        "prompt_range": (min(len(p) for p in batch.prompt_ids), max(len(p) for p in batch.prompt_ids)),
    }
    Path(report).write_text(json.dumps(result))


def dp_imbalance(dp: int, seed: int = 0) -> tuple[float, float]:
    """(LPT, round-robin) largest-rank excess over the mean, worst of the 4 mini-batches of a
    paper-scale step: 256 prompts x 8 responses, prompts U[100, 1500], responses up to 15,360."""
    from stapo_megatron.trainer.batch import balance_over_ranks, token_imbalance

    rng = random.Random(seed)
    lpt = deal = 0.0
    for _ in range(4):
        lengths = []
        for _ in range(64):
            prompt = rng.randint(100, 1500)
            lengths += [prompt + max(1, min(15360, round(math.exp(rng.gauss(math.log(2500), 1.0))))) for _ in range(8)]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        lpt = max(lpt, token_imbalance(balance_over_ranks(range(len(lengths)), lengths, dp), lengths))
        deal = max(deal, token_imbalance([order[r::dp] for r in range(dp)], lengths))
    return lpt, deal


def flops_split(lengths: list[int]) -> tuple[float, float]:
    """(linear, attention) forward FLOPs of the model over sequences of ``lengths`` tokens: 2 per
    weight per token (layers and LM head); attention 2 x 2 L^2 x heads x head_dim per layer (QK^T
    and AV; the local spec computes the whole L x L score matrix and masks it)."""
    a = SMALL_QWEN3
    q, kv = a["num_attention_heads"] * a["head_dim"], a["num_key_value_heads"] * a["head_dim"]
    per_layer = a["hidden_size"] * (2 * q + 2 * kv) + 3 * a["hidden_size"] * a["intermediate_size"]
    weights = a["num_hidden_layers"] * per_layer + a["hidden_size"] * a["vocab_size"]
    tokens = sum(lengths)
    attention = sum(4 * n * n * q for n in lengths) * a["num_hidden_layers"]
    return 2 * weights * tokens, attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=1280, help="max_tokens_per_microbatch (forward passes: twice)")
    parser.add_argument(
        "--padded-sequences",
        default="1,4,16",
        help="micro_batch_size values of the padded baseline, comma-separated (4 is the reference)",
    )
    args = parser.parse_args()
    sizes = sorted({int(n) for n in args.padded_sequences.split(",")} | {4})
    variants = [f"padded/{n}" for n in sizes] + ["packed", "packed+skip"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            report = Path(tmp, "update.json")
            spawn_ranks(measure, 1, str(report), variant, args.prompts, args.group, args.max_response, args.budget)
            results[variant] = json.loads(report.read_text())
    b = results[BASELINE]["batch"]
    quantiles = ", ".join(f"p{round(float(q) * 100)} {v}" for q, v in b["response_quantiles"].items())
    print(
        f"one update of a {SMALL_QWEN3['num_hidden_layers']}-layer, hidden-{SMALL_QWEN3['hidden_size']} Qwen3 (CPU, "
        f"{torch.get_num_threads()} threads): {b['sequences']} sequences, {b['tokens']} tokens, longest {b['longest']}"
    )
    print(
        f"response lengths: mean {b['response_mean']:.0f}, {quantiles}, {b['at_cap']:.1%} at the cap of "
        f"{args.max_response}; prompts {b['prompt_range'][0]}-{b['prompt_range'][1]} tokens"
    )
    base = results[BASELINE]
    print(
        f"{'variant':<12} {'s':>7} {'tokens/s':>9} {'x pad/4':>8} {'model tok':>10} {'padding':>8} {'skipped':>8} "
        f"{'micro-b.':>9} {'peak MB':>8} {'x pad/4':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:<12} {r['seconds']:>7.1f} {r['tokens_per_s']:>9.0f} "
            f"{r['tokens_per_s'] / base['tokens_per_s']:>8.2f} "
            f"{r['model_tokens']:>10} {r['padding_fraction']:>8.1%} {r['skipped_fraction']:>8.1%} "
            f"{r['microbatches']:>9} "
            f"{r['peak_memory_mb']:>8.0f} {r['peak_memory_mb'] / max(base['peak_memory_mb'], 1e-9):>8.2f}"
        )
    print("where a forward pass goes (profiled statistics pass of mini-batch 1, seconds and share of its wall time):")
    print(f"{'variant':<12} {'wall':>7} {'linear':>13} {'attention':>13} {'other ops':>13} {'outside ops':>13}")
    for name, r in results.items():
        p = r["forward_profile"]
        parts = " ".join(
            f"{p[k]:>6.2f} ({p[k] / p['wall']:>4.0%})" for k in ("linear", "attention", "other_ops", "outside_ops")
        )
        top = ", ".join(f"{op.removeprefix('aten::')} {seconds:.2f}" for seconds, op in p["top_other"])
        print(f"{name:<12} {p['wall']:>7.2f} {parts}   largest other: {top}")
    linear, attention = flops_split(b["model_lengths"])
    print(
        f"forward FLOPs of the batch without padding: linear layers {linear / 1e9:.1f} G, attention "
        f"{attention / 1e9:.1f} G "
        f"({attention / (linear + attention):.0%})"
    )
    for dp in (8, 16):
        lpt, deal = dp_imbalance(dp)
        print(f"DP={dp} token imbalance on a paper-scale step: LPT {lpt:.2%} (round-robin deal {deal:.2%})")
    packed = results["packed"]
    print(
        f"goals: packed padding {packed['padding_fraction']:.1%} (<= 5%), packed tokens/s "
        + ", ".join(f"{packed['tokens_per_s'] / results[f'padded/{n}']['tokens_per_s']:.2f}x padded/{n}" for n in sizes)
        + f" (>= 1.5x; with skipping {results['packed+skip']['tokens_per_s'] / base['tokens_per_s']:.2f}x padded/4), "
        f"DP imbalance {dp_imbalance(8)[0]:.2%} (<= 2%)"
    )


if __name__ == "__main__":
    main()
