"""fp64 single-process references and data builders shared by the loss tests and their workers."""

from __future__ import annotations

import torch

QWEN3_VOCAB = 151936


def padded_vocab(vocab: int, tp: int) -> int:
    """Megatron's padding: up to a multiple of make_vocab_size_divisible_by (128) times TP."""
    multiple = 128 * tp
    return -(-vocab // multiple) * multiple


def reference_logprob_entropy(
    full_logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0
):
    """log p(target) and entropy from fp64 log_softmax over the real columns (autograd-capable)."""
    logp = torch.log_softmax(full_logits[..., :vocab_size].double() / temperature, dim=-1)
    logprob = logp.gather(-1, targets[..., None]).squeeze(-1)
    # masked (-inf) logits: p log p = 0, without a 0 * inf in value or gradient
    entropy = -(logp.exp() * torch.where(torch.isfinite(logp), logp, 0.0)).sum(-1)
    return logprob, entropy


def logits_with_padding(tokens: int, vocab: int, padded: int, seed: int, scale: float = 3.0, pad_value: float = 1e4):
    """fp32 [tokens, padded] logits; the padded columns hold ``pad_value`` (a leak would dominate)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, padded, generator=gen) * scale
    logits[:, vocab:] = pad_value
    return logits


def mask_logits(logits: torch.Tensor, targets: torch.Tensor, vocab: int, shards: int) -> torch.Tensor:
    """Set masked (-inf) logits, never on a target: token 1 loses a whole vocabulary shard that
    does not hold its target (with one shard: every column but the target), token 2 every 7th column."""
    local = logits.shape[-1] // shards
    own = int(targets[1]) // local
    if shards == 1:
        keep = logits[1, targets[1]].clone()
        logits[1, :vocab] = float("-inf")
        logits[1, targets[1]] = keep
    else:
        s = 0 if own != 0 else 1
        logits[1, s * local : (s + 1) * local] = float("-inf")
    cols = torch.arange(3, vocab, 7)
    logits[2, cols[cols != targets[2]]] = float("-inf")
    return logits


def targets_on_every_shard(tokens: int, vocab: int, padded: int, tp: int, seed: int) -> torch.Tensor:
    """Token ids that include both edges of every shard's real range, the last real id, and random ids."""
    local = padded // tp
    edges = []
    for r in range(tp):
        lo, hi = r * local, min((r + 1) * local, vocab) - 1
        if lo < vocab:
            edges += [lo, hi]
    edges.append(vocab - 1)
    gen = torch.Generator().manual_seed(seed)
    rest = torch.randint(0, vocab, (max(0, tokens - len(edges)),), generator=gen)
    targets = torch.cat([torch.tensor(edges[:tokens]), rest])
    return targets
