"""vocab_parallel_logprob_entropy in one process (TP=1); TP=2 and 4 are in test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from stapo_megatron.loss import DEFAULT_CHUNK_SIZE, vocab_parallel_logprob_entropy
from tests.loss._reference import (
    QWEN3_VOCAB,
    logits_with_padding,
    mask_logits,
    padded_vocab,
    reference_logprob_entropy,
    targets_on_every_shard,
)


def _weights(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("vocab", [QWEN3_VOCAB, 151_901])
def test_tp1_matches_fp64_reference_with_padding(vocab):
    padded = padded_vocab(vocab, 1)
    assert (padded > vocab) == (vocab == 151_901)  # Qwen3's vocabulary needs no padding at TP=1
    tokens = 6
    logits = logits_with_padding(tokens, vocab, padded, seed=0).requires_grad_()
    targets = targets_on_every_shard(tokens, vocab, padded, 1, seed=1)
    before = logits.detach().clone()
    lp, ent = vocab_parallel_logprob_entropy(logits, targets, vocab_size=vocab)
    w_lp = _weights(tokens, 2)
    (lp * w_lp).sum().backward()

    ref_in = before.double().requires_grad_()
    ref_lp, ref_ent = reference_logprob_entropy(ref_in, targets, vocab)
    (ref_lp * w_lp).sum().backward()
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits.grad.double(), ref_in.grad, atol=1e-6, rtol=0)
    assert torch.equal(logits.grad[:, vocab:], torch.zeros_like(logits.grad[:, vocab:]))
    assert torch.equal(logits.detach(), before)
    assert not ent.requires_grad


def test_entropy_gradient_temperature_and_chunking_match_reference():
    vocab, padded, tokens, temperature = 3001, 3072, 11, 0.7
    logits = logits_with_padding(tokens, vocab, padded, seed=3).requires_grad_()
    targets = targets_on_every_shard(tokens, vocab, padded, 1, seed=4)
    before = logits.detach().clone()
    w_lp, w_ent = _weights(tokens, 5), _weights(tokens, 6)
    ref_in = before.double().requires_grad_()
    ref_lp, ref_ent = reference_logprob_entropy(ref_in, targets, vocab, temperature)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()

    grads = {}
    for chunk in (1, 4, None):
        logits.grad = None
        lp, ent = vocab_parallel_logprob_entropy(
            logits, targets, temperature=temperature, chunk_size=chunk, vocab_size=vocab, entropy_grad=True
        )
        assert ent.requires_grad
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(logits.grad.double(), ref_in.grad, atol=1e-6, rtol=0)
        grads[chunk] = logits.grad.clone()
        assert torch.equal(logits.detach(), before)
    torch.testing.assert_close(grads[1], grads[None], atol=1e-7, rtol=0)
    torch.testing.assert_close(grads[4], grads[None], atol=1e-7, rtol=0)

    # Only the entropy in the loss: the log-prob's gradient is absent, not assumed.
    logits.grad = None
    _, ent = vocab_parallel_logprob_entropy(
        logits, targets, temperature=temperature, vocab_size=vocab, entropy_grad=True
    )
    (ent * w_ent).sum().backward()
    ref_in.grad = None
    _, ref_ent = reference_logprob_entropy(ref_in, targets, vocab, temperature)
    (ref_ent * w_ent).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_in.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_logits(dtype):
    # -inf logits (token 1: all but its target, token 2: every 7th column) add nothing and get no gradient
    vocab, padded, tokens = 1000, 1024, 4
    targets = targets_on_every_shard(tokens, vocab, padded, 1, seed=13)
    full = mask_logits(logits_with_padding(tokens, vocab, padded, seed=14), targets, vocab, 1).to(dtype)
    logits = full.clone().requires_grad_()
    lp, ent = vocab_parallel_logprob_entropy(logits, targets, vocab_size=vocab, temperature=0.8, entropy_grad=True)
    (lp.sum() + ent.sum()).backward()
    ref_in = full.double().requires_grad_()
    ref_lp, ref_ent = reference_logprob_entropy(ref_in, targets, vocab, 0.8)
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert abs(lp[1].item()) < 1e-6 and abs(ent[1].item()) < 1e-6  # one token left: certain
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        logits.grad.double(), ref_in.grad, atol=1e-6, rtol=2.0**-8 if dtype == torch.bfloat16 else 0
    )
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradcheck_fp64(temperature):
    vocab, padded = 37, 48
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(2, 3, padded, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    targets = torch.randint(0, vocab, (2, 3), generator=gen)

    def logprob_only(x):
        return vocab_parallel_logprob_entropy(x, targets, temperature=temperature, chunk_size=2, vocab_size=vocab)[0]

    def both(x):
        return vocab_parallel_logprob_entropy(
            x, targets, temperature=temperature, chunk_size=4, vocab_size=vocab, entropy_grad=True
        )

    assert torch.autograd.gradcheck(logprob_only, (logits,))
    assert torch.autograd.gradcheck(both, (logits,))
    lp, ent = both(logits)
    assert lp.dtype == torch.float64  # fp64 logits are not demoted: gradcheck needs it


def test_bf16_input():
    vocab, padded, tokens = 151_901, padded_vocab(151_901, 1), 5
    logits = logits_with_padding(tokens, vocab, padded, seed=8).to(torch.bfloat16).requires_grad_()
    targets = targets_on_every_shard(tokens, vocab, padded, 1, seed=9)
    before = logits.detach().clone()
    lp, ent = vocab_parallel_logprob_entropy(logits, targets, vocab_size=vocab, temperature=0.9)
    w = _weights(tokens, 10)
    (lp * w).sum().backward()
    # the reference sees the same bf16 values: what remains is the fp32 arithmetic
    ref_in = before.double().requires_grad_()
    ref_lp, ref_ent = reference_logprob_entropy(ref_in, targets, vocab, 0.9)
    (ref_lp * w).sum().backward()
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=0)
    assert logits.grad.dtype == torch.bfloat16
    # a bf16 gradient is the fp32 one rounded to 8 significant bits
    torch.testing.assert_close(logits.grad.double(), ref_in.grad, atol=1e-6, rtol=2.0**-8)
    assert torch.equal(logits.detach(), before)


def test_batched_shapes_and_noncontiguous_targets():
    vocab = 500
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 3, vocab, generator=gen)  # [s, b, V] like Megatron's output
    labels = torch.randint(0, vocab, (3, 4), generator=gen)  # [b, s]
    lp, ent = vocab_parallel_logprob_entropy(logits, labels.t())
    assert lp.shape == ent.shape == (4, 3)
    ref_lp, ref_ent = reference_logprob_entropy(logits, labels.t().contiguous(), vocab)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    # no tokens at all: empty outputs, and a zero gradient
    empty = torch.zeros(0, vocab, requires_grad=True)
    lp, ent = vocab_parallel_logprob_entropy(empty, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    lp.sum().backward()
    assert empty.grad.shape == (0, vocab)


def test_default_chunk_is_used_and_large_inputs_stay_exact():
    # more tokens than one default chunk, so the chunk loop runs several times
    vocab, tokens = 257, DEFAULT_CHUNK_SIZE * 2 + 3
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(tokens, vocab, generator=gen) * 30  # large logits: the shifted sums keep precision
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    lp, ent = vocab_parallel_logprob_entropy(logits, targets)
    ref_lp, ref_ent = reference_logprob_entropy(logits, targets, vocab)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(targets=torch.zeros(3, dtype=torch.long)), ValueError, r"^targets: shape \(3,\)"),
        (dict(targets=torch.zeros(4)), TypeError, r"^targets: expected integer"),
        (dict(logits=torch.zeros(4, 10, dtype=torch.long)), TypeError, r"^logits: expected a floating"),
        (dict(targets=torch.tensor([0, 1, 2, 10])), ValueError, r"^targets: token id 10 is outside"),
        (dict(targets=torch.tensor([0, 1, 2, 8]), vocab_size=8), ValueError, r"^targets: token id 8"),
        (dict(vocab_size=11), ValueError, r"^vocab_size: 11 is not in \[1, 10\]"),
        (dict(temperature=0.0), ValueError, r"^temperature: must be > 0"),
        (dict(chunk_size=0), ValueError, r"^chunk_size: must be >= 1"),
    ],
)
def test_errors_name_the_tensor(kwargs, error, match):
    args = dict(logits=torch.zeros(4, 10), targets=torch.tensor([0, 1, 2, 3]))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        vocab_parallel_logprob_entropy(**args)
