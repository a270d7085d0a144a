"""Packed micro-batches (several sequences in one row, THD boundaries) give the numbers of the
padded layout on Megatron's local spec (CPU, gloo): per-token log-probs and entropies, the loss,
and the gradients, on sequences of very different lengths, at TP1, TP2, TP2 with sequence
parallelism, and PP2 with an uneven split of 3 layers.

One spawn per world size; each checks every case of its layouts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.runtime.launch import spawn_ranks
from stapo_megatron.trainer.batch import RolloutBatch, make_microbatches, model_tokens, pack_by_budget, token_slots

ARCH = Qwen3Config(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# (prompt, response) lengths: from 3 to 121 model tokens, none a multiple of 2
SHAPES = [(5, 80), (3, 2), (7, 1), (2, 25), (4, 9), (6, 40), (9, 113), (3, 0)]
BUDGET = 130  # packs several sequences per row, never all


def rollout_batch(seed: int = 0) -> RolloutBatch:
    generator = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1, ARCH.vocab_size, (n,), generator=generator).tolist()

    return RolloutBatch(
        prompt_ids=[ids(p) for p, _ in SHAPES],
        response_ids=[ids(r) for _, r in SHAPES],
        rollout_logprobs=[(-3 * torch.rand(r, generator=generator)).tolist() for _, r in SHAPES],
        truncated=torch.zeros(len(SHAPES), dtype=torch.bool),
        rewards=torch.zeros(len(SHAPES)),
        correct=torch.zeros(len(SHAPES)),
        advantages=torch.randn(len(SHAPES), generator=generator),
        group_ids=torch.arange(len(SHAPES)),
    )


def _layouts(batch, multiple: int):
    """(padded micro-batches, packed micro-batches, slots): the same sequences in both layouts."""
    everything = list(range(len(batch)))
    lengths = [model_tokens(batch, i) for i in everything]
    bins = pack_by_budget(everything, lengths, BUDGET)
    slots = token_slots(batch, everything)
    cpu = torch.device("cpu")
    padded = make_microbatches(batch, bins, cpu, packed=False, slots=slots, pad_to_multiple=multiple)
    packed = make_microbatches(batch, bins, cpu, packed=True, slots=slots, pad_to_multiple=multiple)
    return padded, packed, slots, len(bins)


def _run_layout(ctx, model, microbatches, slots, aggregation, correction, old_logprob):
    """(log-prob slots, entropy slots, total loss, gradients) of ``microbatches`` (last stage
    holds the first three; every rank its gradient shards)."""
    from stapo_megatron.loss import vocab_parallel_logprob_entropy
    from stapo_megatron.trainer.schedule import forward_backward
    from tests.loss._loss_call import loss_of

    logprob = torch.zeros(slots.size, dtype=torch.float64)
    entropy = torch.zeros(slots.size, dtype=torch.float64)
    losses = []

    def loss_fn(logits, batch):
        lp, h = vocab_parallel_logprob_entropy(
            logits, batch["labels"], tp_group=ctx.tp_group, vocab_size=ARCH.vocab_size, entropy_grad=True
        )
        index = batch["token_index"]
        logprob[index] = lp.detach().double()
        entropy[index] = h.detach().double()
        old = old_logprob[index].float() if old_logprob is not None else lp.detach()
        loss_sum, num_tokens, _ = loss_of(
            lp,
            old,
            batch["advantages"],
            batch["response_mask"],
            entropy=h,
            entropy_coef=0.01,
            aggregation=aggregation,
            response_mask=batch["response_mask"],
            rollout_logprob=batch["rollout_logprobs"],
            rollout_correction=correction,
            segment_ids=batch["segment_ids"],
        )
        losses.append(loss_sum.detach().double())
        return loss_sum, num_tokens, {}

    model.zero_grad()
    forward_backward(model, microbatches, loss_fn)
    for p in model.parameters():  # what finalize_model_grads does for sequence-parallel norms
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            torch.distributed.all_reduce(p.grad, group=ctx.tp_group)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprob, entropy, sum(losses) if losses else None, grads


def _compare(ctx, model, padded, packed, slots, out: dict, name: str) -> None:
    real = torch.ones(slots.size, dtype=torch.bool)
    real[slots.pad_slot] = False
    old = None
    for aggregation, correction in (("token_mean", "none"), ("seq_mean_token_mean", "tis_seq")):
        a = _run_layout(ctx, model, padded, slots, aggregation, correction, old)
        if old is None:  # the padded layout's log-probs, slightly moved, as pi_old for both layouts
            old = a[0] + 0.05 * torch.sin(torch.arange(slots.size, dtype=torch.float64))
            a = _run_layout(ctx, model, padded, slots, aggregation, correction, old)
        b = _run_layout(ctx, model, packed, slots, aggregation, correction, old)
        grad_rel = max(float((b[3][k] - g).norm() / g.norm().clamp(min=1e-30)) for k, g in a[3].items())
        row = {"grad_rel": grad_rel, "grads": len(a[3]), "same_grad_names": sorted(a[3]) == sorted(b[3])}
        if ctx.is_last_stage:
            row.update(
                logprob=float((a[0] - b[0])[real].abs().max()),
                entropy=float((a[1] - b[1])[real].abs().max()),
                loss_padded=float(a[2]),
                loss_packed=float(b[2]),
                logprob_span=float(a[0][real].max() - a[0][real].min()),
            )
        out[f"{name}/{aggregation}/rank{ctx.rank}"] = row


def packed_vs_padded(out_dir: str, layouts: list[dict]) -> None:
    """Every layout of ``layouts`` in turn (Megatron's groups rebuilt in between)."""
    from megatron.core import parallel_state

    from stapo_megatron.models.qwen3.parallelize import build_stage, sequence_multiple
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    out: dict = {}
    batch = rollout_batch()
    for layout in layouts:
        sp = layout.get("sequence_parallel", False)
        ctx = init_distributed(
            ParallelConfig(tensor_parallel=layout["tp"], pipeline_parallel=layout["pp"], sequence_parallel=sp), seed=7
        )
        model = build_stage(ARCH, ctx, calculate_per_token_loss=True, sequence_parallel=sp)
        with torch.no_grad():  # logits of a few units, not the near-uniform ones of std-0.02 weights
            for name, p in model.named_parameters():
                if "output_layer" in name:
                    p.mul_(25.0)
        padded, packed, slots, count = _layouts(batch, sequence_multiple(layout["tp"], sp))
        assert count >= 3 and all(mb["input_ids"].shape[0] == 1 for mb in packed)
        _compare(ctx, model, padded, packed, slots, out, layout["name"])
        parallel_state.destroy_model_parallel()
    world = torch.distributed.get_world_size()
    Path(out_dir, f"world{world}_rank{torch.distributed.get_rank()}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("packing")
    spawn_ranks(packed_vs_padded, 1, str(out), [{"name": "tp1", "tp": 1, "pp": 1}])
    spawn_ranks(
        packed_vs_padded,
        2,
        str(out),
        [
            {"name": "tp2", "tp": 2, "pp": 1},
            {"name": "tp2_sp", "tp": 2, "pp": 1, "sequence_parallel": True},
            {"name": "pp2_uneven", "tp": 1, "pp": 2},
        ],
    )
    merged = {}
    for path in sorted(out.glob("world*_rank*.json")):
        merged.update(json.loads(path.read_text()))
    return merged


@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2_sp", "pp2_uneven"])
def test_packed_rows_give_the_padded_numbers(results, layout):
    rows = {k: v for k, v in results.items() if k.startswith(layout + "/")}
    ranks = 1 if layout == "tp1" else 2
    assert len(rows) == 2 * ranks, sorted(results)
    last_stage = [r for r in rows.values() if "logprob" in r]
    assert last_stage, "no last-stage numbers"
    for key, row in rows.items():
        assert row["same_grad_names"] and row["grads"] > 0, key
        assert row["grad_rel"] <= 1e-5, (key, row)
    for row in last_stage:
        assert row["logprob_span"] > 1.0  # real, varied log-probs were compared
        assert row["logprob"] <= 1e-5 and row["entropy"] <= 1e-5, row
        assert row["loss_packed"] == pytest.approx(row["loss_padded"], rel=1e-6, abs=1e-7), row


def test_packed_row_layout_and_boundaries():
    batch = rollout_batch()
    lengths = [model_tokens(batch, i) for i in range(len(batch))]
    bins = pack_by_budget(range(len(batch)), lengths, BUDGET)
    slots = token_slots(batch, range(len(batch)))
    for mb, chunk in zip(make_microbatches(batch, bins, torch.device("cpu"), slots=slots, pad_to_multiple=4), bins):
        n = [lengths[i] for i in chunk]
        width = mb["input_ids"].shape[1]
        assert width % 4 == 0 and width - sum(n) < 4
        cu = mb["cu_seqlens"].tolist()
        assert mb["cu_seqlens"].dtype == torch.int32 and cu[-1] == width
        assert cu[: len(n) + 1] == [sum(n[:k]) for k in range(len(n) + 1)]
        assert mb["max_seqlen"] == max(b - a for a, b in zip(cu, cu[1:]))
        for k, i in enumerate(chunk):
            lo, hi = cu[k], cu[k + 1]
            tokens = batch.prompt_ids[i] + batch.response_ids[i]
            assert mb["input_ids"][0, lo:hi].tolist() == tokens[:-1]
            assert mb["labels"][0, lo:hi].tolist() == tokens[1:]
            assert mb["position_ids"][0, lo:hi].tolist() == list(range(hi - lo))
            assert mb["segment_ids"][0, lo:hi].tolist() == [k] * (hi - lo)
            assert int(mb["response_mask"][0, lo:hi].sum()) == len(batch.response_ids[i])
            assert mb["rollout_logprobs"][0, lo:hi][mb["response_mask"][0, lo:hi] > 0].tolist() == pytest.approx(
                batch.rollout_logprobs[i]
            )
            assert mb["token_index"][0, lo:hi].tolist() == list(range(slots.offsets[i], slots.offsets[i] + hi - lo))
        assert mb["response_mask"][0, sum(n) :].sum() == 0 and (mb["token_index"][0, sum(n) :] == slots.pad_slot).all()
