"""Rank functions for test_objectives.py::test_objectives_tp: 2 gloo ranks form one TP=2 group.

For each objective, each rank computes the log-probs of a packed row from its vocabulary shard
(the trainer's vocab-parallel path), the objective's token choice and :class:`PolicyLoss` with its
gradient, and compares them with the other rank (bit-identical) and with TP=1 on the whole
vocabulary in the same process. Every check runs the same collectives on every rank and records
its outcome instead of raising, so one failure does not desynchronise the next.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB, PADDED, TP = 1000, 1024, 2
ROWS, COLS = 5, 48
ADVANTAGES = (1.0, -1.0, 0.5, 0.0, -0.5)
OBJECTIVES = ("clip_cov", "kl_cov", "gspo")


def _config(objective):
    from stapo_megatron.loss import AlgoConfig

    if objective == "clip_cov":
        return AlgoConfig(objective="clip_cov", token_rule="all", clip_cov_ratio=0.02)
    if objective == "kl_cov":
        return AlgoConfig(objective="kl_cov", token_rule="all", kl_cov_ratio=0.05)
    return AlgoConfig(
        objective="gspo", token_rule="all", aggregation="seq_mean_token_mean", eps_low=3e-4, eps_high=4e-4
    )


def _packed_inputs(objective):
    """One packed row [1, ROWS * COLS + 4]: ROWS sequences of ragged response length, then a
    padding segment; the same on every rank."""
    from tests.loss._reference import reference_logprob_entropy

    gen = torch.Generator().manual_seed(11)
    tokens = ROWS * COLS + 4
    logits = torch.randn(1, tokens, PADDED, generator=gen) * 3
    logits[..., VOCAB:] = 1e4  # padded columns: a leak would dominate
    targets = torch.randint(0, VOCAB, (1, tokens), generator=gen)
    segments = torch.cat([torch.arange(ROWS).repeat_interleave(COLS), torch.full((4,), ROWS)])[None]
    lengths = torch.randint(COLS // 2, COLS + 1, (ROWS,), generator=gen)
    position = torch.arange(COLS).repeat(ROWS)
    mask = torch.cat([position < lengths.repeat_interleave(COLS), torch.zeros(4, dtype=torch.bool)])[None]
    advantages = torch.cat([torch.tensor(ADVANTAGES).repeat_interleave(COLS), torch.zeros(4)])[None]
    ref_lp, _ = reference_logprob_entropy(logits, targets, VOCAB)
    if objective == "gspo":
        # per-sequence shifts of log pi_old around GSPO's clip range [1 - 3e-4, 1 + 4e-4]: sequences 0 and 1
        # clipped on the side their advantage pushes, 2 and 4 inside, 3 has A = 0
        shift = torch.cat(
            [
                torch.tensor([-1e-3, 1e-3, 1e-4, 0.0, -1e-4], dtype=torch.float64).repeat_interleave(COLS),
                torch.zeros(4, dtype=torch.float64),
            ]
        )
        old = (ref_lp + shift + torch.randn(ref_lp.shape, generator=gen, dtype=torch.float64) * 1e-4).float()
    else:
        old = (ref_lp + torch.randn(ref_lp.shape, generator=gen, dtype=torch.float64) * 0.3).float()
    return logits, targets, segments, mask, advantages, old


def _run(objective, logits, group, inputs):
    """Selection, loss, metrics and the gradient w.r.t. ``logits`` (a shard with ``group``)."""
    from stapo_megatron.loss import get_objective, token_seed, vocab_parallel_logprob_entropy
    from stapo_megatron.loss.objectives import SurrogateInputs
    from tests.loss._loss_call import loss_of

    _, targets, segments, mask, advantages, old = inputs
    cfg = _config(objective)
    x = logits.clone().requires_grad_()
    logprob, _ = vocab_parallel_logprob_entropy(x, targets, group, vocab_size=VOCAB)
    seed = token_seed(targets)
    log_ratio = torch.where(mask, logprob.detach() - old, 0.0).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    surrogate = get_objective(objective).surrogate(
        SurrogateInputs(
            logprob.detach(),
            log_ratio,
            advantages,
            mask,
            cfg.eps_low,
            cfg.eps_high,
            cfg.clip_ratio_c,
            cfg.log_ratio_clamp,
            segments,
            cfg,
            seed,
        )
    )
    loss_sum, n, metrics = loss_of(
        logprob,
        old,
        advantages,
        mask.float(),
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        clip_ratio_c=cfg.clip_ratio_c,
        aggregation=cfg.aggregation,
        response_mask=mask,
        segment_ids=segments,
        objective=objective,
        cfg=cfg,
        objective_seed=seed,
    )
    loss = loss_sum / n
    loss.backward()
    chosen = surrogate.selected if surrogate.selected is not None else torch.zeros_like(mask)
    return loss.detach(), chosen, metrics, x.grad, logprob.detach()


def _check(objective, group, rank):
    inputs = _packed_inputs(objective)
    full = inputs[0]
    local = PADDED // TP
    loss, chosen, metrics, grad, logprob = _run(objective, full[..., rank * local : (rank + 1) * local], group, inputs)
    # every TP rank: bit-identical log-probs, choice, loss and metrics
    for name, value in (
        ("logprob", logprob),
        ("selection", chosen.to(torch.float32)),
        ("loss", loss.reshape(1)),
        ("metrics", torch.stack([metrics[k].double() for k in sorted(metrics)]).float()),
    ):
        gathered = [torch.zeros_like(value) for _ in range(TP)]
        dist.all_gather(gathered, value.contiguous(), group=group)
        assert torch.equal(gathered[0], gathered[1]), f"{objective}: {name} differs between TP ranks"
    # TP=2 against TP=1 on the whole vocabulary
    loss1, chosen1, metrics1, grad1, _ = _run(objective, full, None, inputs)
    assert torch.equal(chosen, chosen1), (
        f"{objective}: TP=2 picks {int(chosen.sum())} tokens, TP=1 {int(chosen1.sum())}"
    )
    assert abs(float(loss) - float(loss1)) <= 1e-6 * max(1.0, abs(float(loss1))), (
        f"{objective}: loss {float(loss)} vs {float(loss1)}"
    )
    worst = (grad - grad1[..., rank * local : (rank + 1) * local]).abs().max().item()
    assert worst <= 1e-6, f"{objective}: logits gradient differs from TP=1 by {worst:.3g}"
    for key in metrics:
        assert abs(float(metrics[key]) - float(metrics1[key])) <= 1e-5 * max(1.0, abs(float(metrics1[key]))), key
    if objective == "gspo":
        assert float(metrics["gspo_clipped_sequences"]) == 2, (
            f"gspo: {float(metrics['gspo_clipped_sequences'])} clipped sequences, want 2"
        )
    else:
        assert int(chosen.sum()) >= 2, f"{objective}: the covariance picked {int(chosen.sum())} tokens"
        assert float(metrics["cov_selected_tokens"]) == int(chosen.sum())


def run_checks(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(list(range(TP)))
    results = {}
    for objective in OBJECTIVES:
        try:
            _check(objective, group, rank)
            results[objective] = "ok"
        except Exception:
            results[objective] = traceback.format_exc()
        dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
