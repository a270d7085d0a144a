"""Rank functions for test_ablation_rules.py, run by ``_related_workers.run_checks`` in one spawn of
2 ranks (TP=2 through Megatron's parallel state; the same 2 ranks as a data-parallel group), and
the rollout-batch builders the single-process tests share with them.

Every check runs the same collectives on every rank and asserts only afterwards.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.distributed as dist

from tests.loss._reference import reference_ablation_keeps
from tests.loss._related_workers import VOCAB, _logit_batches

ABLATIONS = ("s2t_high_entropy", "s2t_random", "lowprob_all")
RUN_SEED, STEP = 1234, 17


# ---- a rollout step whose statistics belong to its tokens, whatever the layout -----------------


def rollout_step(seed: int = 3, groups: int = 4, size: int = 4):
    """A RolloutBatch of ``groups`` groups (one with all-zero advantages) and, per sequence, a
    log-prob and an entropy for each model token: a model's statistics, read the same under any
    packing or data-parallel split. About half the response tokens are below tau_p = 0.01."""
    from stapo_megatron.trainer.batch import RolloutBatch, model_tokens

    gen = torch.Generator().manual_seed(seed)
    n = groups * size
    prompts = [[5] * int(torch.randint(2, 6, (1,), generator=gen)) for _ in range(n)]
    responses = [[7] * int(torch.randint(3, 30, (1,), generator=gen)) for _ in range(n)]
    advantages = torch.randn(n, generator=gen)
    advantages[:size] = 0.0  # the first group's rewards are all equal
    batch = RolloutBatch(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        truncated=torch.zeros(n, dtype=torch.bool),
        rewards=advantages.clone(),
        correct=(advantages > 0).float(),
        advantages=advantages,
        group_ids=torch.arange(n) // size,
    )
    lengths = [model_tokens(batch, i) for i in range(n)]
    rare = [torch.rand(k, generator=gen) < 0.5 for k in lengths]
    logprob = [
        torch.where(r, torch.log(torch.rand(k, generator=gen) * 0.009 + 1e-5), -0.5) for r, k in zip(rare, lengths)
    ]
    entropy = [torch.rand(k, generator=gen) * 3 for k in lengths]
    return batch, lengths, logprob, entropy


def layout_stats(batch, logprob, entropy, bins, packed=True, run_seed=RUN_SEED, step=STEP):
    """TokenStats of the micro-batches of ``bins`` (trainer.batch's layout, packed or padded),
    each token's statistics looked up by its (sample_ids, position_ids)."""
    from stapo_megatron.loss import TokenStats
    from stapo_megatron.trainer.batch import make_microbatches

    offsets = torch.tensor([0] + [t.numel() for t in logprob]).cumsum(0)
    flat_lp, flat_ent = torch.cat(logprob), torch.cat(entropy)
    out = []
    for mb in make_microbatches(batch, bins, torch.device("cpu"), packed=packed):
        ids, pos = mb["sample_ids"], mb["position_ids"]
        index = torch.where(ids >= 0, offsets[ids.clamp(min=0)] + pos, 0)
        out.append(
            TokenStats(
                flat_lp[index],
                flat_ent[index],
                mb["advantages"],
                mb["response_mask"],
                sample_ids=ids,
                positions=pos,
                run_seed=run_seed,
                step=step,
            )
        )
    return out


def silenced_tokens(cfg, stats_list, threshold) -> set[tuple[int, int]]:
    """The (sequence index, position) of every response token the rule silences."""
    from stapo_megatron.loss import select_tokens

    out = set()
    for s in stats_list:
        off = (s.response_mask != 0) & (select_tokens(cfg, s, threshold).keep == 0)
        out |= set(zip(s.sample_ids[off].tolist(), s.positions[off].tolist()))
    return out


def candidate_count(cfg, stats_list) -> int:
    from stapo_megatron.loss import get_token_rule

    return sum(int(get_token_rule(cfg.token_rule).candidates(s, cfg).sum()) for s in stats_list)


# ---- checks ------------------------------------------------------------------------------------


def _cfg(rule, **fields):
    from stapo_megatron.loss import AlgoConfig

    return AlgoConfig(token_rule=rule, **{"tau_p": 0.01, **fields})


def tp2_ablation_selection_and_loss_equal_tp1_and_fp64(ctx):
    """Vocabulary-parallel statistics at TP=2 give every ablation the same keep mask as TP=1 and
    as the fp64 reference (from fp64 log-softmax statistics), the same on both TP ranks, with
    the budget floor(q * #candidates); loss and logits gradient match TP=1."""
    from stapo_megatron.loss import (
        TokenStats,
        minibatch_threshold,
        select_tokens,
        vocab_parallel_logprob_entropy,
    )
    from tests.loss._loss_call import loss_of
    from tests.loss._reference import reference_logprob_entropy

    batches = _logit_batches(micro=3, rows=4, cols=16, seed=11)
    local = VOCAB // 2
    failures: list[str] = []

    def identity(j, b):
        rows, cols = b["targets"].shape
        ids = (j * rows + torch.arange(rows))[:, None].expand(rows, cols)
        return dict(sample_ids=ids, positions=torch.arange(cols).expand(rows, cols), run_seed=RUN_SEED, step=STEP)

    for rule in ABLATIONS:
        for q in (0.75, 0.4):
            cfg = _cfg(rule, q=q)
            results = {}
            for tp in (1, 2):
                leaves, stats = [], []
                for j, b in enumerate(batches):
                    logits = (
                        b["logits"] if tp == 1 else b["logits"][..., ctx.tp_rank * local : (ctx.tp_rank + 1) * local]
                    )
                    leaf = logits.clone().requires_grad_()
                    lp, ent = vocab_parallel_logprob_entropy(
                        leaf, b["targets"], ctx.tp_group if tp == 2 else None, vocab_size=VOCAB
                    )
                    leaves.append((leaf, lp))
                    stats.append(
                        TokenStats(lp.detach(), ent.detach(), b["advantages"], b["response_mask"], **identity(j, b))
                    )
                threshold = minibatch_threshold(cfg, stats, None)
                keeps, loss, count = [], 0.0, 0
                for (_, lp), s, b in zip(leaves, stats, batches):
                    keep = select_tokens(cfg, s, threshold).keep
                    keeps.append(keep)
                    loss_sum, n, _ = loss_of(
                        lp, lp.detach() + b["noise"], b["advantages"], keep, response_mask=b["response_mask"]
                    )
                    loss, count = loss + loss_sum, count + int(n)
                (loss / count).backward()
                grads = [
                    leaf.grad if tp == 2 else leaf.grad[..., ctx.tp_rank * local : (ctx.tp_rank + 1) * local]
                    for leaf, _ in leaves
                ]
                results[tp] = (keeps, float(loss.detach()) / count, grads, stats)
            keeps1, loss1, grads1, stats1 = results[1]
            keeps2, loss2, grads2, _ = results[2]
            across_ranks = []
            for k in keeps2:
                gathered = [torch.empty_like(k) for _ in range(2)]
                dist.all_gather(gathered, k, group=ctx.tp_group)
                across_ranks.append(torch.equal(gathered[0], gathered[1]))
            fp64 = []
            for j, b in enumerate(batches):
                lp64, ent64 = reference_logprob_entropy(b["logits"], b["targets"], VOCAB)
                fp64.append(TokenStats(lp64, ent64, b["advantages"], b["response_mask"], **identity(j, b)))
            expected = reference_ablation_keeps(rule, fp64, q, cfg.tau_p)
            candidates = candidate_count(cfg, stats1)
            silenced = sum(int(((s.response_mask != 0) & (k == 0)).sum()) for s, k in zip(stats1, keeps1))
            budget = candidates if rule == "lowprob_all" else math.floor(Fraction(repr(q)) * candidates)
            worst = max(float((g1 - g2).abs().max() / g1.abs().max()) for g1, g2 in zip(grads1, grads2))
            checks = {
                "keep equal at TP=1 and TP=2": all(torch.equal(k1, k2) for k1, k2 in zip(keeps1, keeps2)),
                "keep equal on both TP ranks": all(across_ranks),
                "keep equal to fp64": all(torch.equal(k.reshape(-1).double(), w) for k, w in zip(keeps1, expected)),
                f"budget {budget} of {candidates} candidates silenced (got {silenced})": candidates > 10
                and silenced == budget > 0,
                f"loss {loss1} at TP=1 = {loss2} at TP=2": math.isclose(loss1, loss2, rel_tol=1e-5),
                f"logits gradient relative difference {worst:.3g} < 1e-5": worst < 1e-5,
            }
            failures += [f"{rule} q={q}: {what}" for what, ok in checks.items() if not ok]
    assert not failures, "\n".join(failures)


def dp2_random_mask_is_the_single_process_mask(ctx):
    """s2t_random (and s2t_high_entropy) over 2 data-parallel ranks, each with its share packed
    into micro-batches of its own, silence exactly the tokens one process silences holding the
    whole mini-batch under another packing: floor(q * #candidates) of them."""
    from stapo_megatron.loss import minibatch_threshold
    from stapo_megatron.trainer.batch import balance_over_ranks, pack_by_budget

    batch, lengths, logprob, entropy = rollout_step()
    everyone = list(range(len(batch)))
    share = balance_over_ranks(everyone, lengths, 2)[ctx.rank]
    mine = layout_stats(batch, logprob, entropy, pack_by_budget(share, lengths, 40))
    single = layout_stats(batch, logprob, entropy, [[i] for i in reversed(everyone)], packed=False)
    failures = []
    for rule, q in (("s2t_random", 0.75), ("s2t_random", 0.3), ("s2t_high_entropy", 0.75)):
        cfg = _cfg(rule, q=q)
        distributed = minibatch_threshold(cfg, mine, ctx.world)
        parts: list = [None, None]
        dist.all_gather_object(parts, sorted(silenced_tokens(cfg, mine, distributed)), group=ctx.world)
        union = set(map(tuple, parts[0])) | set(map(tuple, parts[1]))
        alone = minibatch_threshold(cfg, single, None)
        budget = math.floor(Fraction(repr(q)) * candidate_count(cfg, single))
        checks = {
            f"threshold {distributed} over DP=2 = {alone} in one process": torch.equal(distributed, alone),
            "the same tokens silenced over DP=2 as in one process": union == silenced_tokens(cfg, single, alone),
            f"{len(union)} silenced = budget {budget}": len(union) == budget > 0,
        }
        failures += [f"{rule} q={q}: {what}" for what, ok in checks.items() if not ok]
    assert not failures, "\n".join(failures)


CHECKS = {
    fn.__name__: fn
    for fn in (tp2_ablation_selection_and_loss_equal_tp1_and_fp64, dp2_random_mask_is_the_single_process_mask)
}
