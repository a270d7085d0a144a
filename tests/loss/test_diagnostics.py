"""The paper's diagnostics in one process (TP=1): sum_v p_v^2 beside the entropy, the per-token
gradient norms of Theorem 3.3 read from the real loss, the four quadrants and the entropy
quantiles, each against an fp64 reference on the whole vocabulary. TP=2 and two data-parallel
ranks: test_diagnostics_tp.py."""

from __future__ import annotations

import math

import pytest
import torch

from stapo_megatron.loss import vocab_parallel_logprob_entropy
from stapo_megatron.loss.diagnostics import (
    ENTROPY_QUANTILES,
    entropy_quantiles,
    positive_token_gradients,
    quadrant_metrics,
)
from stapo_megatron.loss.logprob_entropy import vocab_parallel_token_statistics
from tests.loss._diagnostics_cases import (
    LOSS_SETTINGS,
    case,
    compare_quadrants,
    old_logprob,
    reference_positive_tokens,
    reference_quadrants,
)
from tests.loss._loss_call import loss_of
from tests.loss._reference import logits_with_padding, mask_logits, targets_on_every_shard

VOCAB, PADDED = 3001, 3072


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_square_sum_matches_fp64_reference(dtype):
    """R = sum_{v != y} p_v^2 (and sum_v p_v^2 = p_y^2 + R) against fp64 softmax: padded columns
    left out, masked logits, temperatures, chunk sizes; log-prob and entropy are those of
    vocab_parallel_logprob_entropy, and the logits are not modified."""
    tokens = 9
    targets = targets_on_every_shard(tokens, VOCAB, PADDED, 1, seed=2)
    full = mask_logits(logits_with_padding(tokens, VOCAB, PADDED, seed=1), targets, VOCAB, 1).to(dtype)
    before = full.clone()
    for temperature, chunk in ((1.0, None), (0.7, 2), (1.3, 1)):
        lp, ent, others = vocab_parallel_token_statistics(
            full, targets, temperature=temperature, chunk_size=chunk, vocab_size=VOCAB
        )
        lp2, ent2 = vocab_parallel_logprob_entropy(
            full, targets, temperature=temperature, chunk_size=chunk, vocab_size=VOCAB
        )
        assert torch.equal(lp, lp2) and torch.equal(ent, ent2)
        probs = torch.softmax(full.double()[:, :VOCAB] / temperature, dim=-1)
        p_y = probs.gather(-1, targets[:, None]).squeeze(-1)
        ref_all = probs.square().sum(-1)
        ref_others = ref_all - p_y.square()
        assert others.dtype == torch.float32 and not others.requires_grad
        torch.testing.assert_close(others.double(), ref_others, rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(others.double() + lp.double().exp().square(), ref_all, rtol=1e-5, atol=1e-7)
        # token 1 has only its target left (the rest masked): nothing else, R = 0 exactly
        assert float(others[1]) == 0.0
    assert torch.equal(full, before)


def test_the_target_is_left_out_because_the_textbook_form_cancels_in_fp32():
    """At p_y = 1 - 1e-4 the squared gradient norm (1 - p)^2 + R from fp32 statistics is within
    1% (the fp32 log-prob's own precision there), where 1 - 2 p + sum_v p_v^2 formed in fp32 is 0."""
    logits = torch.zeros(1, 200)
    logits[0, 7] = math.log(199 * (1 - 1e-4) / 1e-4)  # p_7 = 1 - 1e-4, the rest 1e-4 / 199 each
    lp, _, others = vocab_parallel_token_statistics(logits, torch.tensor([7]))
    probs = torch.softmax(logits.double(), -1)[0]
    exact = float((1 - probs[7]) ** 2 + (probs.square().sum() - probs[7] ** 2))
    ours = float(torch.expm1(lp.double()).square() + others.double())
    p32 = lp.exp()
    textbook = float(1 - 2 * p32 + (p32.square() + others))  # in fp32
    assert math.isclose(ours, exact, rel_tol=1e-2)
    assert abs(textbook - exact) > 0.5 * exact


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_gradient_norms_match_autograd_of_the_loss_in_fp64(aggregation, temperature):
    """positive_token_gradients' |w| sqrt((1 - p)^2 + R) equals the fp64 row norm of
    d loss_sum / dz_t on the whole vocabulary (clipped and silenced tokens: 0), the closed form
    1 - 2 p + sum_v p_v^2 of Theorem 3.3 holds in fp64, and the real backward afterwards still
    gives the logits' gradient."""
    c = case(VOCAB, PADDED, seed=3)
    ref = reference_positive_tokens(c, VOCAB, temperature, aggregation)
    closed = ref["weight"].abs() * torch.sqrt(1 - 2 * ref["logprob"].exp() + ref["square_sum"])
    torch.testing.assert_close(closed, ref["grad_norm"], rtol=1e-9, atol=1e-12)

    logits = c["logits"].clone().requires_grad_()
    lp, ent, others = vocab_parallel_token_statistics(logits, c["targets"], temperature=temperature, vocab_size=VOCAB)
    assert lp.requires_grad and not ent.requires_grad and not others.requires_grad
    loss_sum, _, metrics = loss_of(
        lp,
        old_logprob(c, VOCAB, temperature).float(),
        c["advantages"],
        c["keep"],
        response_mask=c["mask"],
        aggregation=aggregation,
        **LOSS_SETTINGS,
    )
    assert int(metrics["clip_high_tokens"]) > 0 and int(metrics["silenced_tokens"]) == 2  # zero-weight tokens
    got = positive_token_gradients(loss_sum, lp, ent, others, c["advantages"], c["mask"])
    assert got.grad_norm.dtype == torch.float64 and int((got.grad_norm == 0).sum()) >= 3
    torch.testing.assert_close(got.grad_norm, ref["grad_norm"], rtol=2e-5, atol=1e-7)
    torch.testing.assert_close(got.entropy.double(), ref["entropy"], rtol=0, atol=1e-5)
    torch.testing.assert_close(got.logprob.double(), ref["logprob"], rtol=0, atol=1e-5)
    assert logits.grad is None  # only the loss's own graph was differentiated
    loss_sum.backward()
    row_norm = (logits.grad[..., :VOCAB] * temperature).norm(dim=-1)[c["mask"] & (c["advantages"][:, None] > 0)]
    torch.testing.assert_close(row_norm.double(), ref["grad_norm"], rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("tau_h", [None, 0.9])
def test_quadrants_match_fp64_reference(tau_h):
    """Counts, gradient-norm sum and shares of the four quadrants over two micro-batches, the
    split the median of the positive tokens' entropy (or the fixed tau_h)."""
    tau_p, temperature = 2e-3, 1.0
    cases = [case(VOCAB, PADDED, seed=s) for s in (4, 5)]
    tokens = []
    for c in cases:
        lp, ent, others = vocab_parallel_token_statistics(c["logits"], c["targets"], vocab_size=VOCAB)
        lp.requires_grad_()  # the loss's graph from log p on (the model's part is not needed)
        loss_sum, _, _ = loss_of(
            lp, old_logprob(c, VOCAB, temperature).float(), c["advantages"], c["keep"], response_mask=c["mask"]
        )
        tokens.append(positive_token_gradients(loss_sum, lp, ent, others, c["advantages"], c["mask"]))
    got = quadrant_metrics(tokens, tau_p, tau_h)
    expected = reference_quadrants(
        [reference_positive_tokens(c, VOCAB, temperature, "token_mean") for c in cases], tau_p, tau_h
    )
    compare_quadrants(got, expected)
    n = got["quadrant/positive_tokens"]
    below = got["quadrant/lowp_lowh_tokens"] + got["quadrant/highp_lowh_tokens"]
    if tau_h is None:
        assert below == math.floor(n / 2)  # the median: exactly floor(n / 2) below it
    assert sum(got[f"quadrant/{q}_grad_share"] for q in ("lowp_lowh", "lowp_highh", "highp_lowh", "highp_highh")) == (
        pytest.approx(1.0)
    )


def test_quadrants_without_positive_tokens_are_null_not_zero():
    got = quadrant_metrics([], 2e-3, None, device=torch.device("cpu"))
    assert got["quadrant/positive_tokens"] == 0 and got["quadrant/grad_norm_sum"] == 0
    assert math.isnan(got["quadrant/entropy_split"]) and math.isnan(got["quadrant/lowp_lowh_grad_share"])


def test_entropy_quantiles_are_the_exact_order_statistics():
    """p50 .. p99 over several tensors are the (floor(q n) + 1)-th smallest values (no interpolation)."""
    gen = torch.Generator().manual_seed(6)
    parts = [torch.rand(n, generator=gen) * 3 for n in (37, 0, 64)]
    got = entropy_quantiles(parts)
    ordered = torch.sort(torch.cat(parts).double()).values
    for name, q in ENTROPY_QUANTILES:
        assert got[f"policy/entropy_{name}"] == float(ordered[math.floor(q * len(ordered))]), name
    assert list(got) == ["policy/entropy_p50", "policy/entropy_p80", "policy/entropy_p90", "policy/entropy_p99"]
    assert all(math.isnan(v) for v in entropy_quantiles([], device=torch.device("cpu")).values())
