"""Log-prob of the sampled token and entropy of the next-token distribution, vocabulary-parallel.

Each tensor-parallel rank holds a slice of the vocabulary. With z = logits / temperature,
m the global max of z, S = sum_v exp(z_v - m) and U = sum_v exp(z_v - m) (z_v - m):

    log p_y = (z_y - m) - log S          H = log S - U / S

which are the notes' formulas (E = m + U/S) with every sum taken relative to m: forming E and
then m + log S - E cancels digits when the logits are large.

:func:`vocab_parallel_token_statistics` also gives R = sum_{v != y} p_v^2 = Q / S^2 with
Q = sum_{v != y} exp(2 (z_v - m)), for the per-token gradient norm of Theorem 3.3 of the STAPO
paper, ||d log p_y / dz||^2 = 1 - 2 p_y + sum_v p_v^2 = (1 - p_y)^2 + R. The target is left out
of Q because 1 - 2 p_y + sum_v p_v^2 cancels every digit in fp32 as p_y -> 1 (at p_y = 1 - 1e-5
it is 1e-10 next to rounding errors of 1e-7), where (1 - p_y)^2 + R is a sum of two exact
non-negative terms; sum_v p_v^2 itself is p_y^2 + R.

The chunk loop makes one sweep over the logits with no collective inside: each chunk's sums
are taken relative to this rank's own per-token max m_r, found chunk by chunk. After the loop,
one all-reduce MAX gives m, each rank rescales its partial sums to m (S_r <- a S_r,
U_r <- a (U_r + (m_r - m) S_r), a = exp(m_r - m); Q_r <- a^2 Q_r), and one all-reduce SUM over
the stacked [3, tokens] tensor (S, U, z_y - m from the owning rank; [4, tokens] with Q) ends the
forward: two collectives per call, whatever the number of chunks. Backward needs none:
d log p_y / dz_v = 1[v=y] - p_v and dH/dz_v = p_v (E - z_v), each times 1/temperature, with p
recomputed per chunk from the saved per-token m and log S, so nothing of size tokens x V/tp is
kept between forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

# Tokens per chunk. Working memory is two fp32 buffers of chunk x V/tp in forward (none in
# backward for fp32 logits, one for 16-bit logits, one more with entropy_grad), whatever the
# number of tokens: 256 keeps it at 1/8 of an fp32 copy of a 4,096-token slice. In
# benchmarks/token_stats.py (CPU) chunks of 128 to 512 tokens take about the same time and
# 64 is slower.
DEFAULT_CHUNK_SIZE = 256


def _group_rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _scaled(x: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """out = x / temperature in out's dtype (a copy-convert first: mixed-dtype arithmetic is slow on CPU)."""
    out.copy_(x)
    return out.div_(temperature) if temperature != 1.0 else out


def _shifted(x: torch.Tensor, temperature: float, shift: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x / temperature - shift; one pass for same-dtype logits at temperature 1."""
    if temperature == 1.0 and x.dtype == out.dtype:
        return torch.sub(x, shift, out=out)
    return _scaled(x, temperature, out).sub_(shift)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, temperature, chunk_size, vocab_size, entropy_grad, square_sum):
        rank, world = _group_rank_size(group)
        local_vocab = logits.shape[-1]
        x = logits.reshape(-1, local_vocab)  # a view for contiguous logits
        y = targets.reshape(-1)
        tokens = x.shape[0]
        start = rank * local_vocab
        # Megatron pads the vocabulary at the end, so this rank's real columns are a prefix.
        n_real = max(0, min(vocab_size - start, local_vocab))
        xr = x[:, :n_real]
        owned = (y >= start) & (y < start + n_real)
        local_y = torch.where(owned, y - start, torch.zeros_like(y))

        # fp32 for 16- and 32-bit logits; fp64 logits keep fp64 (gradcheck).
        cdtype = torch.promote_types(logits.dtype, torch.float32)
        opts = dict(dtype=cdtype, device=logits.device)
        m = torch.full((tokens,), float("-inf"), **opts)  # this rank's max, then the global one
        # S, U, z_y - m (only where owned), and with square_sum Q = sum_{v != y} exp(2 (z_v - m))
        sums = torch.zeros(4 if square_sum else 3, tokens, **opts)
        if n_real > 0 and tokens > 0:
            lowest = torch.finfo(cdtype).min
            rows = min(chunk_size, tokens)
            shifted = torch.empty(rows, n_real, **opts)
            expd = torch.empty(rows, n_real, **opts)
            for lo in range(0, tokens, rows):
                hi = min(lo + rows, tokens)
                s, e = shifted[: hi - lo], expd[: hi - lo]
                if x.dtype == cdtype:
                    # max(x / T) == max(x) / T (rounding is monotone): no scaled copy needed first
                    torch.amax(xr[lo:hi], dim=-1, out=m[lo:hi])
                    if temperature != 1.0:
                        m[lo:hi].div_(temperature)
                    # a slice that is all -inf (masked) on this rank: shift by a finite number instead
                    m[lo:hi].clamp_(min=lowest)
                    _shifted(xr[lo:hi], temperature, m[lo:hi, None], out=s)
                else:
                    _scaled(xr[lo:hi], temperature, out=s)
                    torch.amax(s, dim=-1, out=m[lo:hi]).clamp_(min=lowest)
                    s.sub_(m[lo:hi, None])
                torch.exp(s, out=e)
                torch.sum(e, dim=-1, out=sums[0, lo:hi])
                if square_sum:
                    # the target's column out of Q (on the rank that owns it), then back for U
                    at_y = local_y[lo:hi, None]
                    e_y = e.gather(1, at_y)
                    e.scatter_(1, at_y, torch.where(owned[lo:hi, None], torch.zeros_like(e_y), e_y))
                    torch.linalg.vecdot(e, e, dim=-1, out=sums[3, lo:hi])
                    e.scatter_(1, at_y, e_y)
                # nansum: a -inf logit contributes exp(-inf) * -inf = 0 * -inf, which is 0 here
                torch.nansum(e.mul_(s), dim=-1, out=sums[1, lo:hi])
        if world > 1 and tokens > 0:
            local_m = m.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            if n_real > 0:
                delta = local_m - m
                scale = delta.exp()
                sums[1] = scale * (sums[1] + delta * sums[0])
                sums[0] = scale * sums[0]
                if square_sum:
                    sums[3] = scale.square() * sums[3]
        if n_real > 0 and tokens > 0:
            z_y = xr.gather(-1, local_y[:, None]).squeeze(-1).to(cdtype)
            if temperature != 1.0:
                z_y = z_y / temperature
            sums[2] = torch.where(owned, z_y - m, torch.zeros_like(z_y))
        if world > 1 and tokens > 0:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)

        log_s = sums[0].log()
        e_shift = sums[1] / sums[0]  # E - m
        logprob = (sums[2] - log_s).view(targets.shape)
        entropy = (log_s - e_shift).view(targets.shape)
        # R = Q / S^2; an empty tensor when not asked for
        others = (sums[3] / sums[0].square()).view(targets.shape) if square_sum else sums.new_empty(0)

        ctx.save_for_backward(logits, local_y, owned, m, log_s, e_shift)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.n_real = n_real
        ctx.set_materialize_grads(False)
        # one call: each call replaces the set of the previous one
        ctx.mark_non_differentiable(others, *(() if entropy_grad else (entropy,)))
        return logprob, entropy, others

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprob, grad_entropy, grad_others):
        logits, local_y, owned, m, log_s, e_shift = ctx.saved_tensors
        temperature, n_real = ctx.temperature, ctx.n_real
        local_vocab = logits.shape[-1]
        x = logits.reshape(-1, local_vocab)
        tokens = x.shape[0]
        grad = torch.empty(tokens, local_vocab, dtype=logits.dtype, device=logits.device)
        grad[:, n_real:] = 0  # padded columns do not exist for the softmax
        no_grads = (None,) * 7
        if (grad_logprob is None and grad_entropy is None) or n_real == 0 or tokens == 0:
            grad[:, :n_real] = 0
            return (grad.view(logits.shape), *no_grads)
        cdtype = m.dtype
        opts = dict(dtype=cdtype, device=logits.device)
        g_lp = grad_logprob.reshape(-1).to(cdtype) if grad_logprob is not None else torch.zeros(tokens, **opts)
        g_h = grad_entropy.reshape(-1).to(cdtype) if grad_entropy is not None else None

        shift = m + log_s
        g_own = torch.where(owned, g_lp, torch.zeros_like(g_lp))
        rows = min(ctx.chunk_size, tokens)
        # same-dtype logits: work directly in the gradient's own memory; otherwise in an fp32 buffer.
        direct = logits.dtype == cdtype
        work_buf = None if direct else torch.empty(rows, n_real, **opts)
        prob_buf = torch.empty(rows, n_real, **opts) if g_h is not None else None
        for lo in range(0, tokens, rows):
            hi = min(lo + rows, tokens)
            w = grad[lo:hi, :n_real] if work_buf is None else work_buf[: hi - lo]  # None: direct
            if g_h is None:
                # dlogp/dz = onehot - p, p = exp(z - m - log S)
                _shifted(x[lo:hi, :n_real], temperature, shift[lo:hi, None], out=w).exp_().mul_(-g_lp[lo:hi, None])
            else:
                _shifted(x[lo:hi, :n_real], temperature, m[lo:hi, None], out=w)  # z - m
                assert prob_buf is not None  # allocated when g_h is
                p = prob_buf[: hi - lo]
                torch.sub(w, log_s[lo:hi, None], out=p).exp_()
                # p * (g_h (E - z) - g_lp), with E - z = e_shift - (z - m). Where p underflows to 0 the
                # product must be 0, also for masked logits (0 * inf): below z - m = -1e4, p is 0 anyway.
                w.clamp_(min=-1e4).neg_().add_(e_shift[lo:hi, None]).mul_(g_h[lo:hi, None])
                w.sub_(g_lp[lo:hi, None]).mul_(p)
            # + g_lp at the target, on the rank that owns it (elsewhere + 0: no host sync for a nonzero())
            w.scatter_add_(1, local_y[lo:hi, None], g_own[lo:hi, None])
            if temperature != 1.0:
                w.div_(temperature)
            if not direct:
                grad[lo:hi, :n_real].copy_(w)
        return (grad.view(logits.shape), *no_grads)


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of ``targets`` and entropy of softmax(logits / temperature).

    Computed and returned in fp32 for 16- and 32-bit logits (fp64 for fp64 logits).

    ``logits``: this rank's vocabulary slice ``[..., V/tp]`` (rank r of ``tp_group`` holds global
    ids [r*V/tp, (r+1)*V/tp)), any float dtype; never modified; -inf (masked) entries are allowed,
    +inf and nan are not. Contiguous logits are read in place; other layouts are copied, in
    forward and again in backward. ``targets``: global token ids, shape ``logits.shape[:-1]``.
    ``tp_group=None``: the logits are the whole vocabulary. ``vocab_size``: the true vocabulary
    size when it was padded for TP; columns with global id >= vocab_size are left out of the
    softmax and get zero gradient. ``chunk_size``: tokens per chunk (default
    :data:`DEFAULT_CHUNK_SIZE`); extra memory is O(chunk_size x V/tp). ``entropy_grad``: let the
    entropy carry a gradient (entropy bonus); otherwise it is returned without one.
    Returns ``(logprob, entropy)`` of shape ``targets.shape``; the gradient w.r.t. the logits
    has the logits' dtype.
    """
    logprob, entropy, _ = _checked_apply(
        logits, targets, tp_group, temperature, chunk_size, vocab_size, entropy_grad, square_sum=False
    )
    return logprob, entropy


def vocab_parallel_token_statistics(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`vocab_parallel_logprob_entropy` (same arguments) and, third, R = sum_{v != y} p_v^2
    over every vocabulary column but the target's (the module docstring says why the target is
    left out; sum_v p_v^2 = p_y^2 + R), exact under TP, without a gradient, in the entropy's
    dtype. The same two collectives; per chunk one more product over the slice."""
    return _checked_apply(logits, targets, tp_group, temperature, chunk_size, vocab_size, entropy_grad, square_sum=True)


def _checked_apply(logits, targets, tp_group, temperature, chunk_size, vocab_size, entropy_grad, square_sum):
    if not torch.is_tensor(logits) or not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating-point tensor, got {getattr(logits, 'dtype', type(logits))}")
    if not torch.is_tensor(targets) or targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError(f"targets: expected integer token ids, got {getattr(targets, 'dtype', type(targets))}")
    if logits.dim() < 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets: shape {tuple(targets.shape)} does not match the leading shape of logits {tuple(logits.shape)}"
        )
    if targets.device != logits.device:
        raise ValueError(f"targets: on {targets.device}, logits on {logits.device}")
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be >= 1, got {chunk_size}")
    _, world = _group_rank_size(tp_group)
    padded_vocab = logits.shape[-1] * world
    vocab_size = padded_vocab if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= padded_vocab:
        raise ValueError(
            f"vocab_size: {vocab_size} is not in [1, {padded_vocab}] (logits slice of "
            f"{logits.shape[-1]} columns x {world} ranks)"
        )
    if targets.numel() and bool(((targets < 0) | (targets >= vocab_size)).any()):
        bad = targets[(targets < 0) | (targets >= vocab_size)][0].item()
        raise ValueError(f"targets: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return _VocabParallelLogprobEntropy.apply(
        logits, targets.long(), tp_group, float(temperature), chunk_size, vocab_size, bool(entropy_grad), square_sum
    )
