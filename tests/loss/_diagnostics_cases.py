"""Cases and fp64 references of the quadrant diagnostics (loss.diagnostics), shared by the TP=1
tests (test_diagnostics.py) and the 2-rank workers (_diagnostics_workers.py).

The reference is plain torch on the whole vocabulary in fp64: log_softmax, the real
:class:`PolicyLoss` on those log-probs, and autograd of the summed loss down to the logits, whose
row norms are the per-token gradient norms ||d loss_sum / dz_t|| (z = logits / temperature).
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from tests.loss._reference import reference_logprob_entropy

ADVANTAGES = (1.2, -0.7, 0.5, 0.0, 0.9)
LOSS_SETTINGS = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)


def case(vocab: int, padded: int, seed: int, rows: int = 5, cols: int = 14) -> dict:
    """fp32 logits [rows, cols, padded] (padding columns 1e4, which must never leak), targets half the
    argmax (p above tau_p) and half uniform (rare), a logit scale per row so that entropies
    spread, advantages of both signs and 0, padding at the end of the last row, an old policy
    off by noise (ratios beyond the clip), and two positive-advantage tokens silenced by the rule."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.5, 6.0, rows * cols).reshape(rows, cols, 1)
    scale = scale.reshape(-1)[torch.randperm(rows * cols, generator=gen)].reshape(rows, cols, 1)
    logits = torch.randn(rows, cols, padded, generator=gen) * scale
    logits[..., vocab:] = 1e4
    top = logits[..., :vocab].argmax(-1)
    targets = torch.where(
        torch.rand(rows, cols, generator=gen) < 0.5, top, torch.randint(0, vocab, top.shape, generator=gen)
    )
    mask = torch.ones(rows, cols, dtype=torch.bool)
    mask[-1, cols - 3 :] = False
    advantages = torch.tensor(ADVANTAGES[:rows])
    noise = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.3
    keep = mask.to(torch.float32)
    keep[0, 1] = keep[2, 5] = 0.0
    return dict(logits=logits, targets=targets, mask=mask, advantages=advantages, noise=noise, keep=keep)


def old_logprob(c: dict, vocab: int, temperature: float) -> torch.Tensor:
    """The old policy's log-probs: the current ones (fp64) plus the case's noise."""
    lp, _ = reference_logprob_entropy(c["logits"].double(), c["targets"], vocab, temperature)
    return lp + c["noise"]


def reference_positive_tokens(c: dict, vocab: int, temperature: float, aggregation: str) -> dict:
    """fp64 per positive-advantage token: log p, entropy, sum_v p_v^2, w = d loss_sum / d log p and
    the gradient norm of the summed loss w.r.t. z_t by autograd down to the logits."""
    from tests.loss._loss_call import loss_of

    x = c["logits"].double().requires_grad_()
    lp, ent = reference_logprob_entropy(x, c["targets"], vocab, temperature)
    lp.retain_grad()
    loss_sum, _, _ = loss_of(
        lp,
        old_logprob(c, vocab, temperature),
        c["advantages"].double(),
        c["keep"],
        response_mask=c["mask"],
        aggregation=aggregation,
        **LOSS_SETTINGS,
    )
    loss_sum.backward()
    probs = torch.softmax(x.detach()[..., :vocab] / temperature, dim=-1)
    positive = c["mask"] & (c["advantages"][:, None] > 0)
    grad_z = x.grad[..., :vocab] * temperature  # d/dz = T d/dlogits
    return {
        "logprob": lp.detach()[positive],
        "entropy": ent.detach()[positive],
        "square_sum": probs.square().sum(-1)[positive],
        "weight": lp.grad[positive],
        "grad_norm": grad_z.norm(dim=-1)[positive],
    }


def reference_quadrants(positives: list[dict], tau_p: float, tau_h: float | None) -> dict[str, float]:
    """The quadrant/* metrics from fp64 reference tokens (several cases: several ranks or micro-batches)."""
    lp = torch.cat([p["logprob"] for p in positives])
    ent = torch.cat([p["entropy"] for p in positives])
    norm = torch.cat([p["grad_norm"] for p in positives])
    if tau_h is None:
        ordered = torch.sort(ent).values
        split = float(ordered[math.floor(Fraction(1, 2) * len(ordered))])  # the (floor(n/2) + 1)-th smallest
    else:
        split = tau_h
    lowp, lowh = lp.exp() < tau_p, ent < split
    members = {
        "lowp_lowh": lowp & lowh,
        "lowp_highh": lowp & ~lowh,
        "highp_lowh": ~lowp & lowh,
        "highp_highh": ~lowp & ~lowh,
    }
    total = float(norm.sum())
    out = {"quadrant/positive_tokens": float(len(lp)), "quadrant/grad_norm_sum": total, "quadrant/entropy_split": split}
    for name, m in members.items():
        out[f"quadrant/{name}_tokens"] = float(m.sum())
        out[f"quadrant/{name}_grad_share"] = float(norm[m].sum()) / total
    return out


def compare_quadrants(got: dict[str, float], expected: dict[str, float], rel: float = 1e-5) -> None:
    """Counts equal, sums and shares to ``rel``; every quadrant populated (the case exercises all four)."""
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    for key, value in expected.items():
        if key.endswith("_tokens"):
            assert got[key] == value, (key, got[key], value)
            if key != "quadrant/positive_tokens":
                assert value > 0, f"{key}: the case leaves the quadrant empty"
        else:
            assert math.isclose(got[key], value, rel_tol=rel, abs_tol=1e-9), (key, got[key], value)
