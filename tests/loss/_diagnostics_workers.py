"""Rank functions for test_diagnostics_tp.py: one spawn of 2 ranks, as a TP=2 group through
Megatron's parallel state (Qwen3's vocabulary padded and split) and as a 2-rank data-parallel
group (each rank its own micro-batches), runs every check and records its outcome.

Every check runs the same collectives on every rank and asserts only afterwards.
"""

from __future__ import annotations

import json
import math
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from tests.loss._diagnostics_cases import (
    LOSS_SETTINGS,
    case,
    compare_quadrants,
    old_logprob,
    reference_positive_tokens,
    reference_quadrants,
)
from tests.loss._reference import (
    QWEN3_VOCAB,
    logits_with_padding,
    mask_logits,
    padded_vocab,
    targets_on_every_shard,
)

PADDED = padded_vocab(QWEN3_VOCAB, 2)


def _shard(full: torch.Tensor, rank: int) -> torch.Tensor:
    local = full.shape[-1] // 2
    return full[..., rank * local : (rank + 1) * local]


def tp2_square_sum_matches_fp64_reference(ctx):
    """R = sum_{v != y} p_v^2 at TP=2 with Qwen3's padded vocabulary, targets on both shards, masked
    logits (a whole shard of token 1), temperatures and chunks; two collectives in forward
    ([tokens] MAX, [4, tokens] SUM), none in backward."""
    from stapo_megatron.loss.logprob_entropy import vocab_parallel_token_statistics

    tokens = 8
    targets = targets_on_every_shard(tokens, QWEN3_VOCAB, PADDED, 2, seed=11)
    full = mask_logits(logits_with_padding(tokens, QWEN3_VOCAB, PADDED, seed=10), targets, QWEN3_VOCAB, 2)
    failures = []
    calls: list[tuple] = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return original(tensor, *args, **kwargs)

    for temperature, chunk in ((1.0, None), (0.7, 3)):
        shard = _shard(full, ctx.tp_rank).clone().requires_grad_()
        calls.clear()
        dist.all_reduce = counting
        try:
            lp, _, others = vocab_parallel_token_statistics(
                shard, targets, ctx.tp_group, temperature=temperature, chunk_size=chunk, vocab_size=QWEN3_VOCAB
            )
            forward_calls = list(calls)
            lp.sum().backward()
        finally:
            dist.all_reduce = original
        probs = torch.softmax(full.double()[:, :QWEN3_VOCAB] / temperature, dim=-1)
        p_y = probs.gather(-1, targets[:, None]).squeeze(-1)
        ref_all = probs.square().sum(-1)
        try:
            assert forward_calls == [(tokens,), (4, tokens)], forward_calls
            assert calls == forward_calls, "backward communicated"
            torch.testing.assert_close(others.double(), ref_all - p_y.square(), rtol=1e-5, atol=1e-12)
            torch.testing.assert_close(others.double() + lp.double().exp().square(), ref_all, rtol=1e-5, atol=1e-7)
        except AssertionError as err:
            failures.append(f"T={temperature} chunk={chunk}: {err}")
    assert not failures, "; ".join(failures)


def tp2_gradient_norms_and_quadrants_match_fp64_reference(ctx):
    """At TP=2 (vocabulary split), the positive tokens' gradient norms from the real loss equal the
    fp64 autograd reference on the whole vocabulary, and so do the quadrant metrics (one rank's
    micro-batches: no data-parallel group)."""
    from stapo_megatron.loss.diagnostics import positive_token_gradients, quadrant_metrics
    from stapo_megatron.loss.logprob_entropy import vocab_parallel_token_statistics
    from tests.loss._loss_call import loss_of

    temperature, tau_p = 0.9, 2e-3
    cases = [case(QWEN3_VOCAB, PADDED, seed=s, rows=5, cols=6) for s in (20, 21)]
    tokens, references = [], []
    for c in cases:
        shard = _shard(c["logits"], ctx.tp_rank).clone().requires_grad_()
        lp, ent, others = vocab_parallel_token_statistics(
            shard, c["targets"], ctx.tp_group, temperature=temperature, vocab_size=QWEN3_VOCAB
        )
        loss_sum, _, _ = loss_of(
            lp,
            old_logprob(c, QWEN3_VOCAB, temperature).float(),
            c["advantages"],
            c["keep"],
            response_mask=c["mask"],
            **LOSS_SETTINGS,
        )
        tokens.append(positive_token_gradients(loss_sum, lp, ent, others, c["advantages"], c["mask"]))
        references.append(reference_positive_tokens(c, QWEN3_VOCAB, temperature, "token_mean"))
    for got, ref in zip(tokens, references):
        torch.testing.assert_close(got.grad_norm, ref["grad_norm"], rtol=2e-5, atol=1e-7)
    compare_quadrants(quadrant_metrics(tokens, tau_p, None), reference_quadrants(references, tau_p, None))


def dp2_quadrants_and_entropy_quantiles_equal_single_process(ctx):
    """Over 2 data-parallel ranks holding different micro-batches (and different token counts), the
    quadrant metrics (the median split exact across ranks) and the entropy quantiles equal one
    process holding everything, and the fp64 reference."""
    from stapo_megatron.loss.diagnostics import entropy_quantiles, positive_token_gradients, quadrant_metrics
    from stapo_megatron.loss.logprob_entropy import vocab_parallel_token_statistics
    from tests.loss._loss_call import loss_of

    vocab = 1000
    tau_p = 2e-3
    cases = {rank: [case(vocab, vocab, seed=30 + 3 * rank + j, cols=9 + 4 * rank) for j in range(2)] for rank in (0, 1)}

    def positives(c):
        lp, ent, others = vocab_parallel_token_statistics(c["logits"], c["targets"], vocab_size=vocab)
        lp.requires_grad_()
        loss_sum, _, _ = loss_of(
            lp, old_logprob(c, vocab, 1.0).float(), c["advantages"], c["keep"], response_mask=c["mask"]
        )
        return positive_token_gradients(loss_sum, lp, ent, others, c["advantages"], c["mask"]), ent[c["mask"]]

    mine = [positives(c) for c in cases[ctx.rank]]
    everything = [positives(c) for r in (0, 1) for c in cases[r]]
    for tau_h in (None, 1.5):
        distributed = quadrant_metrics([t for t, _ in mine], tau_p, tau_h, ctx.world)
        single = quadrant_metrics([t for t, _ in everything], tau_p, tau_h)
        assert distributed.keys() == single.keys()
        for key, value in single.items():  # the same values, summed in another order
            assert math.isclose(distributed[key], value, rel_tol=1e-12), (key, distributed[key], value)
        references = [reference_positive_tokens(c, vocab, 1.0, "token_mean") for r in (0, 1) for c in cases[r]]
        compare_quadrants(distributed, reference_quadrants(references, tau_p, tau_h))
    quantiles = entropy_quantiles([e for _, e in mine], ctx.world)
    assert quantiles == entropy_quantiles([e for _, e in everything]), quantiles


CHECKS = {
    fn.__name__: fn
    for fn in (
        tp2_square_sum_matches_fp64_reference,
        tp2_gradient_norms_and_quadrants_match_fp64_reference,
        dp2_quadrants_and_entropy_quantiles_equal_single_process,
    )
}


class Ctx:
    def __init__(self):
        from megatron.core import parallel_state as ps

        self.rank = dist.get_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.world = dist.new_group([0, 1])  # the same 2 ranks as a data-parallel group


def run_checks(out_dir: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")  # Megatron: TE and apex are absent
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    init_distributed(ParallelConfig(tensor_parallel=2, data_parallel=1, timeout_minutes=3))
    ctx = Ctx()
    results = {}
    for name, check in CHECKS.items():
        try:
            check(ctx)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(results))
    shutdown_distributed()
