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


def rule_keeps(cfg, micro):
    """Keep weights of each micro-batch statistics in ``micro`` under ``cfg``, as the trainer takes
    them: one threshold over the whole list when the rule needs one, then each selection."""
    from stapo_megatron.loss import minibatch_threshold, needs_statistics_pass, select_tokens

    threshold = minibatch_threshold(cfg, micro) if needs_statistics_pass(cfg) else None
    return [select_tokens(cfg, s, threshold).keep for s in micro]


def reference_random_score(sample: int, position: int, run_seed: int, step: int) -> int:
    """The s2t_random score of one token in Python integers, from its definition in
    loss.token_rules: six Feistel rounds on (sequence index, position) as two 31-bit halves, round
    keys from sha256("s2t_random:<seed>:<step>"), round function x -> ((x ^ k) * m, fold 31) for
    the two multipliers; the score is left * 2^31 + right."""
    import hashlib

    half = 2**31
    digest = hashlib.sha256(f"s2t_random:{run_seed}:{step}".encode()).digest()
    keys = [int.from_bytes(digest[4 * r : 4 * r + 4], "little") % half for r in range(6)]
    left, right = sample, position
    for key in keys:
        y = right ^ key
        for multiplier in (0x5BD1E995, 0x1B873593):
            y *= multiplier
            y = (y ^ (y // half)) % half
        left, right = right, left ^ y
    return left * half + right


def reference_ablation_keeps(rule: str, micro, q: float, tau_p: float) -> list[torch.Tensor]:
    """fp64 keep weights of the STAPO paper's masking ablations over every micro-batch of
    ``micro`` (TokenStats) as one population, written from the paper's description: among the
    candidates C = {response token, A > 0, p < tau_p}, silence the floor(q |C|) of highest entropy
    (``s2t_high_entropy``), of lowest random score (``s2t_random``), of lowest entropy (``s2t``), or
    all of C (``lowprob_all``); padding 0, everything else 1."""
    import math
    from fractions import Fraction

    lp = torch.cat([s.logprob.double().reshape(-1) for s in micro])
    ent = torch.cat([s.entropy.double().reshape(-1) for s in micro])
    adv = torch.cat([s.advantages.double().reshape(-1) for s in micro])
    real = torch.cat([(s.response_mask != 0).reshape(-1) for s in micro])
    members = torch.nonzero(real & (adv > 0) & (lp < math.log(tau_p))).reshape(-1).tolist()
    budget = len(members) if rule == "lowprob_all" else math.floor(Fraction(repr(q)) * len(members))
    if rule == "s2t_random":
        ids = torch.cat([s.sample_ids.reshape(-1) for s in micro]).tolist()
        pos = torch.cat([s.positions.reshape(-1) for s in micro]).tolist()
        seed, step = micro[0].run_seed, micro[0].step
        members.sort(key=lambda t: reference_random_score(ids[t], pos[t], seed, step))
    elif rule == "s2t_high_entropy":
        members.sort(key=lambda t: -float(ent[t]))
    elif rule == "s2t":
        members.sort(key=lambda t: float(ent[t]))
    keep = real.double()
    keep[members[:budget]] = 0.0
    return list(keep.split([s.logprob.numel() for s in micro]))


def reference_off_policy_loss(
    logprob,
    prox_logprob,
    behaviour_logprob,
    advantages,
    keep,
    response_mask,
    mode: str,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float,
    cap: float,
    floor: float | None = None,
):
    """fp64 decoupled-PPO loss of docs/async.md ("The objective off-policy") for [sequences, tokens]
    inputs, written from its definition as the objective J to maximise: per response token
    J_t = rho_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A), raised to clip_ratio_c * A
    where A < 0 (dual-clip), r_t = pi_theta / pi_prox; rho_t and the acceptance from
    w_t = pi_prox / mu (``mode``: none, tis_token, tis_seq, mis_token, mis_seq); averaged over the
    kept, accepted tokens. Returns (loss = -J, the number of tokens averaged over, the mean |J_t|
    over them: the scale of the rounding error of a sum of those terms); autograd-capable in
    ``logprob``."""
    lp = logprob.double()
    prox = prox_logprob.double()
    response = response_mask != 0
    a = advantages.double()[:, None].expand_as(lp)
    ratio = torch.exp(torch.where(response, lp - prox, 0.0))
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)
    surrogate = torch.where(a < 0, torch.maximum(surrogate, clip_ratio_c * a), surrogate)
    log_w = torch.where(response, prox - behaviour_logprob.double(), 0.0)
    token_w = log_w.exp()
    sequence_w = log_w.sum(-1, keepdim=True).exp().expand_as(lp)
    floor = 1 / cap if floor is None else floor
    rho, accepted = torch.ones_like(lp), response
    if mode == "tis_token":
        rho = token_w.clamp(max=cap)
    elif mode == "tis_seq":
        rho = sequence_w.clamp(max=cap)
    elif mode == "mis_token":
        accepted = response & (token_w >= floor) & (token_w <= cap)
    elif mode == "mis_seq":
        accepted = response & (sequence_w >= floor) & (sequence_w <= cap)
    elif mode != "none":
        raise ValueError(f"mode: {mode!r} has no reference here")
    counted = accepted & (keep != 0)
    terms = torch.where(counted, keep.double() * rho * surrogate, 0.0)
    scale = float(terms.detach().abs().sum() / counted.sum())
    return -terms.sum() / counted.sum(), int(counted.sum()), scale
