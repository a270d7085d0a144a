"""Rank functions for test_distributed.py: one spawn of 4 ranks (TP=2 x DP=2 through Megatron's
parallel state, and the whole world as a TP=4 group) runs every check and records its outcome.

Every check runs the same collectives on every rank and asserts only afterwards, so that one
failing check does not desynchronise the ones after it.
"""

from __future__ import annotations

import json
import math
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from tests.loss._reference import (
    QWEN3_VOCAB,
    logits_with_padding,
    mask_logits,
    padded_vocab,
    reference_logprob_entropy,
    rule_keeps,
    targets_on_every_shard,
)


class Ctx:
    def __init__(self):
        from megatron.core import parallel_state as ps

        self.rank = dist.get_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.world = dist.new_group(list(range(dist.get_world_size())))


def _close(actual, expected, atol, what, rtol=0.0):
    excess = (actual.double() - expected.double()).abs() - rtol * expected.double().abs()
    worst = excess.max().item() if actual.numel() else 0.0
    assert worst <= atol, f"{what}: max difference {worst:.3g} beyond {atol:g} + {rtol:g} x |expected|"


def _shard(full, rank, size):
    local = full.shape[-1] // size
    return full[..., rank * local : (rank + 1) * local]


def _check_against_reference(group, rank, size, vocab, tokens, seed, dtype=torch.float32, masked=False):
    """Log-prob, entropy and gradients of this rank's shard against the fp64 full-vocabulary reference,
    for several temperatures / chunk sizes / entropy_grad; the input is never modified."""
    from stapo_megatron.loss import vocab_parallel_logprob_entropy

    padded = padded_vocab(vocab, size) if vocab > 1000 else -(-vocab // size) * size
    full = logits_with_padding(tokens, vocab, padded, seed)
    targets = targets_on_every_shard(tokens, vocab, padded, size, seed + 1)
    if masked:
        full = mask_logits(full, targets, vocab, size)
    full = full.to(dtype)
    gen = torch.Generator().manual_seed(seed + 2)
    w_lp = torch.randn(tokens, generator=gen, dtype=torch.float64)
    w_ent = torch.randn(tokens, generator=gen, dtype=torch.float64)
    failures = []
    for temperature, chunk, entropy_grad in ((1.0, None, False), (0.7, 2, True), (1.3, 1, False)):
        shard = _shard(full, rank, size).clone().requires_grad_()
        before = shard.detach().clone()
        lp, ent = vocab_parallel_logprob_entropy(
            shard,
            targets,
            group,
            temperature=temperature,
            chunk_size=chunk,
            vocab_size=vocab,
            entropy_grad=entropy_grad,
        )
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0)
        loss.backward()
        ref_in = full.double().requires_grad_()
        ref_lp, ref_ent = reference_logprob_entropy(ref_in, targets, vocab, temperature)
        ((ref_lp * w_lp).sum() + ((ref_ent * w_ent).sum() if entropy_grad else 0)).backward()
        # a bf16 gradient is the fp32 one rounded to 8 significant bits
        grad_atol, grad_rtol = (1e-6, 0.0) if dtype == torch.float32 else (1e-6, 2.0**-8)
        try:
            _close(lp, ref_lp.detach(), 1e-5, f"logprob T={temperature} chunk={chunk}")
            _close(ent, ref_ent.detach(), 1e-5, f"entropy T={temperature} chunk={chunk}")
            _close(
                shard.grad, _shard(ref_in.grad, rank, size), grad_atol, f"grad T={temperature} chunk={chunk}", grad_rtol
            )
            assert shard.grad.dtype == dtype
            assert torch.equal(shard.detach(), before), "the logits were modified"
            assert ent.requires_grad == entropy_grad
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "; ".join(failures)


# ---- checks -----------------------------------------------------------------------------------


def tp2_matches_fp64_reference(ctx):
    _check_against_reference(ctx.tp_group, ctx.tp_rank, 2, QWEN3_VOCAB, tokens=8, seed=10)


def tp2_bf16_matches_fp64_reference(ctx):
    _check_against_reference(ctx.tp_group, ctx.tp_rank, 2, QWEN3_VOCAB, tokens=5, seed=20, dtype=torch.bfloat16)


def tp4_matches_fp64_reference(ctx):
    _check_against_reference(ctx.world, ctx.rank, 4, QWEN3_VOCAB, tokens=9, seed=30)


def tp4_masked_logits_and_a_rank_with_none_left(ctx):
    # token 1's logits are -inf on a whole rank: that rank's max is -inf
    _check_against_reference(ctx.world, ctx.rank, 4, QWEN3_VOCAB, tokens=5, seed=35, masked=True)


def tp4_rank_without_real_columns(ctx):
    # vocab 10 over 4 ranks of 4 columns: rank 2 holds 2 real columns, rank 3 none
    _check_against_reference(ctx.world, ctx.rank, 4, 10, tokens=7, seed=40)


def tp2_two_collectives_in_forward_none_in_backward(ctx):
    from stapo_megatron.loss import vocab_parallel_logprob_entropy

    vocab, padded, tokens = 1000, 1024, 9
    full = logits_with_padding(tokens, vocab, padded, 50)
    shard = _shard(full, ctx.tp_rank, 2).clone().requires_grad_()
    targets = targets_on_every_shard(tokens, vocab, padded, 2, 51)
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        lp, ent = vocab_parallel_logprob_entropy(
            shard, targets, ctx.tp_group, chunk_size=2, vocab_size=vocab, entropy_grad=True
        )
        forward_calls = list(calls)
        (lp.sum() + ent.sum()).backward()
    finally:
        dist.all_reduce = original
    assert forward_calls == [(tokens,), (3, tokens)], forward_calls  # 5 chunks, still one MAX and one SUM
    assert calls == forward_calls, "backward communicated"


def tp2_matches_megatron_cross_entropy(ctx):
    from megatron.core import tensor_parallel

    from stapo_megatron.loss import vocab_parallel_logprob_entropy

    vocab, tokens = QWEN3_VOCAB, 6
    padded = padded_vocab(vocab, 2)
    full = logits_with_padding(tokens, vocab, padded, 60, pad_value=float("-inf"))  # Megatron cannot exclude padding
    targets = targets_on_every_shard(tokens, vocab, padded, 2, 61)
    ours_in = _shard(full, ctx.tp_rank, 2).clone().requires_grad_()
    meg_in = ours_in.detach().clone().requires_grad_()
    lp, _ = vocab_parallel_logprob_entropy(ours_in, targets, ctx.tp_group, vocab_size=vocab)
    meg_lp = -tensor_parallel.vocab_parallel_cross_entropy(meg_in.clone()[None], targets[None])[0]
    w = torch.linspace(-1, 1, tokens)
    (lp * w).sum().backward()
    (meg_lp * w).sum().backward()
    _close(lp, meg_lp, 1e-5, "logprob vs Megatron")
    local = ours_in.shape[1]
    n_real = max(0, min(vocab - ctx.tp_rank * local, local))
    _close(ours_in.grad[:, :n_real], meg_in.grad[:, :n_real], 1e-6, "grad vs Megatron")
    assert torch.equal(ours_in.grad[:, n_real:], torch.zeros_like(ours_in.grad[:, n_real:]))


def dp_gather_uneven_counts(ctx):
    from stapo_megatron.loss import gather_values

    mine = torch.arange(ctx.rank, dtype=torch.float32) + 10 * ctx.rank  # rank r holds r values; rank 0 none
    everything = gather_values(mine, ctx.world)
    expected = torch.cat([torch.arange(r, dtype=torch.float32) + 10 * r for r in range(4)])
    assert torch.equal(everything, expected), everything
    nothing = gather_values(torch.zeros(0), ctx.dp_group)
    assert nothing.numel() == 0


def _synthetic_stats(dp_rank, micro, seed=70):
    """Statistics of one micro-batch of one DP rank, the same wherever they are built."""
    from stapo_megatron.loss import TokenStats

    gen = torch.Generator().manual_seed(seed + 10 * dp_rank + micro)
    rows, cols = 4, 25 + 7 * dp_rank + 3 * micro  # different token counts per rank and micro-batch
    lp = torch.where(torch.rand(rows, cols, generator=gen) < 0.6, math.log(1e-4), math.log(0.4))
    ent = torch.rand(rows, cols, generator=gen) * 4
    adv = torch.randn(rows, generator=gen)
    mask = torch.rand(rows, cols, generator=gen) < 0.85
    return TokenStats(lp, ent, adv, mask)


def dp_minibatch_quantile_equals_single_process(ctx):
    from stapo_megatron.loss import AlgoConfig, minibatch_threshold, select_tokens

    mine = [_synthetic_stats(ctx.dp_rank, j) for j in range(2)]
    everything = [_synthetic_stats(d, j) for d in range(2) for j in range(2)]
    for cfg in (
        AlgoConfig(),
        AlgoConfig(population="all_response_tokens", q=0.37),
        AlgoConfig(token_rule="high_entropy", top_fraction=0.2),
    ):
        distributed = minibatch_threshold(cfg, mine, ctx.dp_group)
        single = minibatch_threshold(cfg, everything, None)
        assert torch.equal(distributed, single), (cfg.token_rule, cfg.population, distributed, single)
        kept = sum(float(select_tokens(cfg, s, distributed).keep.sum()) for s in mine)
        total = torch.tensor(kept, dtype=torch.float64)
        dist.all_reduce(total, group=ctx.dp_group)
        single_kept = sum(float(select_tokens(cfg, s, single).keep.sum()) for s in everything)
        assert float(total) == single_kept
    # the micro-batch scope: each micro-batch's own threshold, nothing shared
    local = AlgoConfig(scope="micro_batch")
    for s in mine:
        assert torch.equal(select_tokens(local, s, None).threshold, minibatch_threshold(AlgoConfig(), [s], None))


def _model_minibatch(vocab, hidden=16, micro=2, rows=3, cols=6, seed=80):
    """A toy last layer (h @ W) and a mini-batch of 2 DP ranks x ``micro`` micro-batches."""
    padded = padded_vocab(vocab, 2)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(hidden, padded, generator=gen) * 0.5
    batches = []
    for _ in range(2 * micro):
        h = torch.randn(rows, cols, hidden, generator=gen)
        logits = h @ weight[:, :vocab]
        # half the targets the most likely token (not rare), half random (rare): S2T has work to do
        pick_top = torch.rand(rows, cols, generator=gen) < 0.5
        targets = torch.where(pick_top, logits.argmax(-1), torch.randint(0, vocab, (rows, cols), generator=gen))
        adv = torch.tensor([1.3, -0.7, 0.4])[:rows]
        mask = torch.ones(rows, cols, dtype=torch.bool)
        mask[-1, cols - 2 :] = False  # padding at the end of the last sequence
        noise = torch.randn(rows, cols, generator=gen) * 0.3  # old policy differs: ratios, clipping
        batches.append(dict(h=h, targets=targets, advantages=adv, response_mask=mask, noise=noise))
    return weight, batches


def dp_tp_token_mean_gradient_equals_single_process(ctx):
    """STAPO over TP=2 x DP=2 x 2 micro-batches (mini-batch scope, Megatron's per-token
    normalisation emulated: sums of loss sums and counts, gradient / global count) equals one
    process holding the whole mini-batch at TP=1."""
    from stapo_megatron.loss import (
        AlgoConfig,
        TokenStats,
        all_reduce_metrics,
        minibatch_threshold,
        reduce_metrics,
        select_tokens,
        vocab_parallel_logprob_entropy,
    )
    from tests.loss._loss_call import loss_of

    vocab = QWEN3_VOCAB
    cfg = AlgoConfig()
    weight, batches = _model_minibatch(vocab)

    # --- one process, TP=1, the whole mini-batch as one batch ---
    w_full = weight.clone().requires_grad_()
    cat = {k: torch.cat([b[k] for b in batches]) for k in ("h", "targets", "advantages", "response_mask", "noise")}
    lp, ent = vocab_parallel_logprob_entropy(cat["h"] @ w_full, cat["targets"], vocab_size=vocab)
    old_all = lp.detach() + cat["noise"]
    (keep,) = rule_keeps(cfg, [TokenStats(lp.detach(), ent.detach(), cat["advantages"], cat["response_mask"])])
    ref_sum, ref_n, ref_metrics = loss_of(
        lp, old_all, cat["advantages"], keep, response_mask=cat["response_mask"], entropy=ent.detach()
    )
    (ref_sum / ref_n).backward()
    ref_grad = w_full.grad
    olds = old_all.split([b["h"].shape[0] for b in batches])

    # --- this rank: its TP shard of W, its DP share of the micro-batches ---
    mine = [2 * ctx.dp_rank + j for j in range(2)]
    w_shard = _shard(weight, ctx.tp_rank, 2).clone().requires_grad_()

    def stats(i):
        b = batches[i]
        lp, ent = vocab_parallel_logprob_entropy(b["h"] @ w_shard, b["targets"], ctx.tp_group, vocab_size=vocab)
        return lp, ent, TokenStats(lp.detach(), ent.detach(), b["advantages"], b["response_mask"])

    with torch.no_grad():  # the statistics pass
        threshold = minibatch_threshold(cfg, [stats(i)[2] for i in mine], ctx.dp_group)
    count = torch.zeros((), dtype=torch.int32)
    reports, keeps = [], []
    for i in mine:  # the micro-batches of the update
        lp, ent, st = stats(i)
        sel = select_tokens(cfg, st, threshold)
        keeps.append(sel.keep)
        loss_sum, n, metrics = loss_of(
            lp,
            olds[i],
            st.advantages,
            sel.keep,
            response_mask=st.response_mask,
            candidates=sel.candidates,
            tau_h=sel.tau_h,
            entropy=ent,
        )
        loss_sum.backward()
        count += n
        reports.append(metrics)
    dist.all_reduce(count, group=ctx.dp_group)
    grad = w_shard.grad.clone()
    dist.all_reduce(grad, group=ctx.dp_group)
    grad /= count
    metrics = all_reduce_metrics(reduce_metrics(reports), ctx.dp_group)

    assert int(count) == int(ref_n), (int(count), int(ref_n))
    for j, i in enumerate(mine):
        rows = slice(sum(b["h"].shape[0] for b in batches[:i]), sum(b["h"].shape[0] for b in batches[: i + 1]))
        assert torch.equal(keeps[j], keep[rows]), f"keep mask of micro-batch {i}"
    assert int(metrics["silenced_tokens"]) == int(ref_metrics["silenced_tokens"]) > 0
    assert int(metrics["candidate_tokens"]) > int(metrics["silenced_tokens"])
    assert float(metrics["tau_h_count"]) == 2 * 2  # one threshold per micro-batch, the same everywhere
    ref_shard = _shard(ref_grad, ctx.tp_rank, 2)
    rel = (grad - ref_shard).abs().max() / ref_shard.abs().max()
    assert rel < 1e-5, f"gradient relative difference {float(rel):.3g}"
    assert math.isclose(float(metrics["pg_loss_sum"]), float(ref_metrics["pg_loss_sum"]), rel_tol=1e-5)


def dp_tp_off_policy_loss_matches_fp64_reference(ctx):
    """The decoupled objective with tis_token (docs/async.md) over TP=2 x DP=2 x 2 micro-batches:
    each sequence's prefix sampled by an older weight version than its continuation, the
    proximal policy another version on; S2T from the current policy's statistics over the whole
    mini-batch. The token-mean gradient of the shard, reduced over DP, equals the fp64 reference's
    on the whole mini-batch at TP=1 (fp32 in the loss: relative 1e-5)."""
    from stapo_megatron.loss import AlgoConfig, TokenStats, minibatch_threshold, select_tokens
    from stapo_megatron.loss import vocab_parallel_logprob_entropy as token_statistics
    from tests.loss._loss_call import loss_of
    from tests.loss._reference import reference_ablation_keeps, reference_off_policy_loss

    vocab = QWEN3_VOCAB
    cfg = AlgoConfig(rollout_correction="tis_token")
    weight, batches = _model_minibatch(vocab, seed=90)
    gen = torch.Generator().manual_seed(91)
    w64 = weight.double()
    older = w64 + 0.15 * torch.randn(w64.shape, generator=gen, dtype=torch.float64)  # v0
    newer = older + 0.15 * torch.randn(w64.shape, generator=gen, dtype=torch.float64)  # v1
    prox = newer + 0.15 * torch.randn(w64.shape, generator=gen, dtype=torch.float64)
    for b in batches:
        rows, cols = b["targets"].shape
        h = b["h"].double()

        def lp_of(w, h=h, b=b):
            return reference_logprob_entropy(h @ w, b["targets"], vocab)[0]

        from_older = torch.arange(cols)[None, :] < torch.randint(0, cols + 1, (rows, 1), generator=gen)
        b["behaviour"] = torch.where(from_older, lp_of(older), lp_of(newer))
        b["prox"] = lp_of(prox)

    # --- the reference: fp64, TP=1, the whole mini-batch ---
    w_ref = w64.clone().requires_grad_()
    cat = {k: torch.cat([b[k] for b in batches]) for k in ("h", "targets", "advantages", "response_mask")}
    cat.update({k: torch.cat([b[k] for b in batches]) for k in ("behaviour", "prox")})
    ref_lp, ref_ent = reference_logprob_entropy(cat["h"].double() @ w_ref, cat["targets"], vocab)
    ref_stats = [TokenStats(ref_lp.detach().float(), ref_ent.detach().float(), cat["advantages"], cat["response_mask"])]
    (ref_keep,) = reference_ablation_keeps("s2t", ref_stats, cfg.q, cfg.tau_p)
    ref_keep = ref_keep.view_as(ref_lp)
    ref_loss, ref_n, _ = reference_off_policy_loss(
        ref_lp,
        cat["prox"],
        cat["behaviour"],
        cat["advantages"],
        ref_keep,
        cat["response_mask"],
        "tis_token",
        cfg.eps_low,
        cfg.eps_high,
        cfg.clip_ratio_c,
        cfg.rollout_correction_cap,
    )
    ref_loss.backward()

    # --- this rank: its TP shard of W, its DP share of the micro-batches ---
    mine = [2 * ctx.dp_rank + j for j in range(2)]
    w_shard = _shard(weight, ctx.tp_rank, 2).clone().requires_grad_()

    def stats(i):
        b = batches[i]
        lp, ent = token_statistics(b["h"] @ w_shard, b["targets"], ctx.tp_group, vocab_size=vocab)
        return lp, TokenStats(lp.detach(), ent.detach(), b["advantages"], b["response_mask"])

    with torch.no_grad():  # the statistics pass of the current policy
        threshold = minibatch_threshold(cfg, [stats(i)[1] for i in mine], ctx.dp_group)
    count = torch.zeros((), dtype=torch.int32)
    keeps = []
    for i in mine:
        lp, st = stats(i)
        sel = select_tokens(cfg, st, threshold)
        keeps.append(sel.keep)
        b = batches[i]
        loss_sum, n, _ = loss_of(
            lp,
            b["prox"],
            b["advantages"],
            sel.keep,
            cfg,
            response_mask=b["response_mask"],
            rollout_logprob=b["behaviour"],
        )
        loss_sum.backward()
        count += n
    dist.all_reduce(count, group=ctx.dp_group)
    grad = w_shard.grad.double()
    dist.all_reduce(grad, group=ctx.dp_group)
    grad /= int(count)

    assert int(count) == ref_n, (int(count), ref_n)
    rows = [b["h"].shape[0] for b in batches]
    for j, i in enumerate(mine):
        part = slice(sum(rows[:i]), sum(rows[: i + 1]))
        assert torch.equal(keeps[j].double(), ref_keep[part]), f"keep mask of micro-batch {i}"
    assert int((cat["response_mask"] & (ref_keep == 0)).sum()) > 0, "S2T silenced nothing"
    log_w = (cat["prox"] - cat["behaviour"])[cat["response_mask"]]
    assert int((log_w > math.log(cfg.rollout_correction_cap)).sum()) > 0, "TIS truncated nothing"
    ref_shard = _shard(w_ref.grad, ctx.tp_rank, 2)
    rel = (grad - ref_shard).abs().max() / ref_shard.abs().max()
    assert rel < 1e-5, f"gradient relative difference {float(rel):.3g}"


CHECKS = {
    fn.__name__: fn
    for fn in (
        tp2_matches_fp64_reference,
        tp2_bf16_matches_fp64_reference,
        tp4_matches_fp64_reference,
        tp4_masked_logits_and_a_rank_with_none_left,
        tp4_rank_without_real_columns,
        tp2_two_collectives_in_forward_none_in_backward,
        tp2_matches_megatron_cross_entropy,
        dp_gather_uneven_counts,
        dp_minibatch_quantile_equals_single_process,
        dp_tp_token_mean_gradient_equals_single_process,
        dp_tp_off_policy_loss_matches_fp64_reference,
    )
}


def run_checks(out_dir: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")  # Megatron: TE and apex are absent
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    init_distributed(ParallelConfig(tensor_parallel=2, data_parallel=2, timeout_minutes=3))
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
