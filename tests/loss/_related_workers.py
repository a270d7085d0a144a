"""Rank functions for test_related_rules.py: one spawn of 2 ranks (TP=2 through Megatron's parallel
state; the same 2 ranks as a data-parallel group for the mini-batch quantile) runs every check of
the related-paper rules (STARE) and records its outcome; :func:`run_checks` also runs the checks
of another module (test_ablation_rules.py's ``_ablation_workers``) in the same setting.

Every check runs the same collectives on every rank and asserts only afterwards.
"""

from __future__ import annotations

import json
import math
import traceback
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB = 96  # divisible by 2: the vocabulary splits over TP=2 without padding


def _stare(**overrides):
    from stapo_megatron.loss import AlgoConfig

    return AlgoConfig(token_rule="stare", **overrides)


def _logit_batches(micro=2, rows=4, cols=12, seed=5):
    """Micro-batches of fp32 logits over the whole vocabulary, targets (half the argmax, half
    random: a wide range of surprisals), per-sequence advantages of both signs and padding."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro):
        logits = torch.randn(rows, cols, VOCAB, generator=gen) * 3
        pick_top = torch.rand(rows, cols, generator=gen) < 0.5
        targets = torch.where(pick_top, logits.argmax(-1), torch.randint(0, VOCAB, (rows, cols), generator=gen))
        adv = torch.tensor([1.1, -0.6, 0.7, -1.3])[:rows]
        mask = torch.ones(rows, cols, dtype=torch.bool)
        mask[-1, cols - 3 :] = False
        noise = torch.randn(rows, cols, generator=gen) * 0.2  # the old policy differs: ratios, clipping
        out.append(dict(logits=logits, targets=targets, advantages=adv, response_mask=mask, noise=noise))
    return out


def tp2_stare_selection_and_loss_equal_tp1(ctx):
    """Vocabulary-parallel log-probs at TP=2 give the same STARE weights, loss and logits gradient
    as TP=1 (gate on, variant C2 so both cuts are exercised; and O1)."""
    from stapo_megatron.loss import (
        TokenStats,
        minibatch_threshold,
        select_tokens,
        vocab_parallel_logprob_entropy,
    )
    from tests.loss._loss_call import loss_of

    batches = _logit_batches()
    local = VOCAB // 2
    for cfg in (_stare(stare_variant="C2"), _stare()):
        results = {}
        for tp in (1, 2):
            leaves, stats = [], []
            for b in batches:
                logits = b["logits"] if tp == 1 else b["logits"][..., ctx.tp_rank * local : (ctx.tp_rank + 1) * local]
                leaf = logits.clone().requires_grad_()
                lp, ent = vocab_parallel_logprob_entropy(
                    leaf, b["targets"], ctx.tp_group if tp == 2 else None, vocab_size=VOCAB
                )
                leaves.append((leaf, lp))
                stats.append(
                    TokenStats(lp.detach(), ent.detach(), b["advantages"], b["response_mask"], step_entropy=0.1)
                )
            cuts = minibatch_threshold(cfg, stats, None)
            keeps, loss, count = [], 0.0, 0
            for (_, lp), s, b in zip(leaves, stats, batches):
                keep = select_tokens(cfg, s, cuts).keep
                keeps.append(keep)
                loss_sum, n, _ = loss_of(
                    lp,
                    lp.detach() + b["noise"],
                    b["advantages"],
                    keep,
                    clip_ratio_c=cfg.clip_ratio_c,
                    response_mask=b["response_mask"],
                )
                loss = loss + loss_sum
                count += int(n)
            (loss / count).backward()
            grads = [
                leaf.grad if tp == 2 else leaf.grad[..., ctx.tp_rank * local : (ctx.tp_rank + 1) * local]
                for leaf, _ in leaves
            ]
            results[tp] = (cuts, keeps, float(loss.detach()) / count, grads)
        cuts1, keeps1, loss1, grads1 = results[1]
        cuts2, keeps2, loss2, grads2 = results[2]
        assert torch.allclose(cuts1, cuts2, rtol=1e-6, atol=0), (cuts1, cuts2)
        for k1, k2 in zip(keeps1, keeps2):
            assert torch.equal(k1, k2), "STARE weights differ between TP=1 and TP=2"
        weighted = sum(int((k > 1).sum()) for k in keeps1)
        assert weighted > 0, "the check needs L+ tokens"
        if cfg.stare_variant == "C2":
            assert sum(int(((k > 0) & (k < 1)).sum()) for k in keeps1) > 0, "the check needs L- tokens"
        assert math.isclose(loss1, loss2, rel_tol=1e-5), (loss1, loss2)
        for g1, g2 in zip(grads1, grads2):
            rel = (g1 - g2).abs().max() / g1.abs().max()
            assert rel < 1e-5, f"logits gradient relative difference {float(rel):.3g}"


def _synthetic_stats(rank, micro, seed=31):
    """Statistics of one micro-batch of one data-parallel rank, the same wherever they are built:
    distinct surprisals, advantages of both signs and zero, token counts that differ per rank."""
    from stapo_megatron.loss import TokenStats

    gen = torch.Generator().manual_seed(seed + 10 * rank + micro)
    rows, cols = 5, 17 + 6 * rank + 4 * micro
    lp = torch.log(torch.rand(rows, cols, generator=gen) * 0.999 + 1e-4)
    ent = torch.rand(rows, cols, generator=gen) * 3
    adv = torch.tensor([0.9, -0.4, 0.0, 1.6, -1.2])
    mask = torch.rand(rows, cols, generator=gen) < 0.85
    return TokenStats(lp, ent, adv, mask, step_entropy=0.2)


def dp2_stare_minibatch_cuts_equal_single_process(ctx):
    """The mini-batch scope's surprisal cuts over 2 ranks x 2 micro-batches equal one process
    holding all four; so do the numbers of reweighted tokens."""
    from stapo_megatron.loss import minibatch_threshold, select_tokens

    mine = [_synthetic_stats(ctx.rank, j) for j in range(2)]
    everything = [_synthetic_stats(r, j) for r in range(2) for j in range(2)]
    for cfg in (_stare(stare_variant="C2"), _stare(stare_top_fraction=0.37)):
        distributed = minibatch_threshold(cfg, mine, ctx.world)
        single = minibatch_threshold(cfg, everything, None)
        assert torch.equal(distributed, single), (distributed, single)
        counts = torch.zeros(2, dtype=torch.float64)
        for s in mine:
            keep = select_tokens(cfg, s, distributed).keep
            counts += torch.tensor(
                [float((keep > 1).sum()), float(((keep > 0) & (keep < 1)).sum())], dtype=torch.float64
            )
        dist.all_reduce(counts, group=ctx.world)
        single_counts = [0, 0]
        for s in everything:
            keep = select_tokens(cfg, s, single).keep
            single_counts[0] += int((keep > 1).sum())
            single_counts[1] += int(((keep > 0) & (keep < 1)).sum())
        assert counts.tolist() == single_counts, (counts.tolist(), single_counts)
        positives = sum(int((s.response_mask & (s.advantages > 0)).sum()) for s in everything)
        expected = math.ceil(Fraction(repr(cfg.stare_top_fraction)) * positives)
        assert single_counts[0] == expected, (single_counts[0], expected)


CHECKS = {
    fn.__name__: fn for fn in (tp2_stare_selection_and_loss_equal_tp1, dp2_stare_minibatch_cuts_equal_single_process)
}


class Ctx:
    def __init__(self):
        from megatron.core import parallel_state as ps

        self.rank = dist.get_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.world = dist.new_group([0, 1])


def run_checks(out_dir: str, checks_module: str = __name__) -> None:
    """Every check of ``checks_module`` (this module's; test_ablation_rules passes its own), each
    rank's outcomes to ``out_dir``/rank<r>.json."""
    import importlib
    import warnings

    warnings.filterwarnings("ignore")  # Megatron: TE and apex are absent
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    init_distributed(ParallelConfig(tensor_parallel=2, data_parallel=1, timeout_minutes=3))
    ctx = Ctx()
    results = {}
    for name, check in importlib.import_module(checks_module).CHECKS.items():
        try:
            check(ctx)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(results))
    shutdown_distributed()
