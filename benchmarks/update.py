"""One full policy update, padded micro-batches vs packed ones, in the same process (issue 11).

    python benchmarks/update.py [--prompts 16] [--group 4] [--max-response 1024] [--budget 1280]

A small Qwen3-shaped model (local spec, CPU, gloo, one rank) runs ``PolicyUpdater.update_step``
(old-log-prob/statistics pass, S2T threshold, forward/backward, optimizer step; two mini-batches)
three times from the same weights on the same rollout batch:

- ``padded``: the layout before packing: the rank's sequences longest first, ``--padded-sequences``
  (4, the old ``micro_batch_size`` default) per micro-batch, each padded to its longest;
- ``packed``: token-budget micro-batches (``--budget`` for forward/backward, twice that for the
  statistics passes), sequences concatenated into one row with THD boundaries;
- ``packed+skip``: the same, zero-advantage sequences left out (``batch.skip_zero_advantage``).

Lengths are long-tailed like the paper's responses (most short, a tail up to the maximum):
prompt ~ U[32, 96] tokens; response = min(max, round(exp(N(ln 150, 1.0)))) tokens, median 150,
mean ~250, about 2% at the cap of 1024. A quarter of the groups are all-correct or all-wrong
(advantage 0), the rest mixed.

Each variant runs in its own fresh process (same weights, same batch). Printed per variant: tokens/s (all prompt + response tokens of the batch / wall time of the
update), padding fraction (padding / model tokens of the forward/backward micro-batches), the
peak resident memory above the process's level before the update (sampled every 2 ms), and
the ratios against ``padded``. Then the data-parallel token imbalance of the LPT split on a
paper-scale step (256 prompts x 8, responses up to 15,360 tokens, 4 mini-batches, DP = 8 and 16)
next to the round-robin deal it replaced.

Goals (issue 11): padding <= 5% packed; packed tokens/s >= 1.5x padded; DP imbalance <= 2%.
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
    vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False,
)


VARIANTS = {"padded": (False, False), "packed": (True, False), "packed+skip": (True, True)}  # (packed, skip)


def response_length(rng: random.Random, cap: int) -> int:
    return max(1, min(cap, round(math.exp(rng.gauss(math.log(150), 1.0)))))


def rollout(prompts: int, group: int, cap: int, vocab: int, seed: int = 0):
    from stapo_megatron.trainer.batch import RolloutBatch

    rng = random.Random(seed)
    n = prompts * group
    prompt_ids, response_ids, logprobs = [], [], []
    for g in range(prompts):
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
    return RolloutBatch(prompt_ids, response_ids, logprobs, torch.zeros(n, dtype=torch.bool), correct.reshape(-1),
                        correct.reshape(-1).clone(), advantages.reshape(-1), torch.arange(prompts).repeat_interleave(group))


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
    from stapo_megatron.trainer.update import MinibatchPlan, StepPlan

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


def measure(report: str, variant: str, prompts: int, group: int, cap: int, budget: int, per_microbatch: int) -> None:
    """One variant in a fresh process (the allocator's cache of an earlier variant would hide
    this one's peak memory), after a warm-up update on a few sequences."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from stapo_megatron.loss import AlgoConfig
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from stapo_megatron.trainer.update import PolicyUpdater

    ctx = init_distributed(ParallelConfig(), seed=1)
    arch = Qwen3Config(**SMALL_QWEN3)
    reference = build_stage(arch)
    weights = {k: v.clone() if torch.is_tensor(v) else v for k, v in reference.state_dict().items()}
    batch = rollout(prompts, group, cap, arch.vocab_size)
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))

    def updater(skip: bool):
        cfg = SimpleNamespace(
            batch=SimpleNamespace(minibatches_per_step=2, max_tokens_per_microbatch=budget, max_tokens_per_forward=2 * budget,
                                  skip_zero_advantage=skip, temperature=1.0),
            compute=SimpleNamespace(logits_chunk_size=256), parallel=SimpleNamespace(sequence_parallel=False),
            algo=AlgoConfig(),
        )
        model = build_stage(arch, calculate_per_token_loss=True)
        model.load_state_dict(weights)
        ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False))
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = ddp.no_sync
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, params_dtype=torch.float32,
                                                           use_distributed_optimizer=False), [ddp])
        return PolicyUpdater(ddp, optimizer, cfg, arch, ctx), cfg

    packed, skip = VARIANTS[variant]
    warm, cfg = updater(skip)  # one-off costs (first allocations, kernels) outside the timed run
    few = batch.select(range(2 * group))
    warm.update_step(few, plan=None if packed else padded_plan(few, cfg, ctx, per_microbatch))
    run, cfg = updater(skip)
    plan = None if packed else padded_plan(batch, cfg, ctx, per_microbatch)
    with PeakMemory() as memory:
        start = time.perf_counter()
        done = run.update_step(batch, plan=plan)
        seconds = time.perf_counter() - start
    metrics = done.metrics
    result = {
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "padding_fraction": metrics["batch/padding_fraction"],
        "skipped_fraction": metrics.get("batch/skipped_fraction", 0.0),
        "peak_memory_mb": memory.above_base / 2**20,
        "microbatches": sum(len(r.selections) for r in done.results),
        "pg_loss": [r.metrics["policy/pg_loss"] for r in done.results],
    }
    result["batch"] = {"sequences": len(batch), "tokens": tokens,
                       "longest": max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=1280, help="max_tokens_per_microbatch (forward passes: twice)")
    parser.add_argument("--padded-sequences", type=int, default=4, help="sequences per padded micro-batch")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            report = Path(tmp, "update.json")
            spawn_ranks(measure, 1, str(report), variant, args.prompts, args.group, args.max_response, args.budget,
                        args.padded_sequences)
            results[variant] = json.loads(report.read_text())
    b = results["padded"]["batch"]
    print(f"one update of a {SMALL_QWEN3['num_hidden_layers']}-layer, hidden-{SMALL_QWEN3['hidden_size']} Qwen3 (CPU, "
          f"{torch.get_num_threads()} threads): {b['sequences']} sequences, {b['tokens']} tokens, longest {b['longest']}")
    base = results["padded"]
    print(f"{'variant':<12} {'s':>7} {'tokens/s':>9} {'x padded':>9} {'padding':>8} {'skipped':>8} {'peak MB':>8} {'x padded':>9} {'micro-b.':>9}")
    for name, r in results.items():
        print(f"{name:<12} {r['seconds']:>7.1f} {r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / base['tokens_per_s']:>9.2f} "
              f"{r['padding_fraction']:>8.1%} {r['skipped_fraction']:>8.1%} {r['peak_memory_mb']:>8.0f} "
              f"{r['peak_memory_mb'] / max(base['peak_memory_mb'], 1e-9):>9.2f} {r['microbatches']:>9}")
    for dp in (8, 16):
        lpt, deal = dp_imbalance(dp)
        print(f"DP={dp} token imbalance on a paper-scale step: LPT {lpt:.2%} (round-robin deal {deal:.2%})")
    packed = results["packed"]
    print(f"goals: packed padding {packed['padding_fraction']:.1%} (<= 5%), packed tokens/s "
          f"{packed['tokens_per_s'] / base['tokens_per_s']:.2f}x padded (>= 1.5x; with skipping "
          f"{results['packed+skip']['tokens_per_s'] / base['tokens_per_s']:.2f}x), DP imbalance {dp_imbalance(8)[0]:.2%} (<= 2%)")


if __name__ == "__main__":
    main()
