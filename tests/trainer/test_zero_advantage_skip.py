"""Leaving zero-advantage sequences out of every pass does not change the update, nor the
step's entropy metrics.

Two data-parallel ranks (gloo) run ``PolicyUpdater.update_step`` twice from the same weights on
the same rollout batch, with ``batch.skip_zero_advantage`` on and off, and compare the reduced
gradients (Megatron's DDP buffers after ``finalize_model_grads``), the weights after the optimizer
step and the loss metrics. The gradients agree to float rounding only, not bit for bit: leaving
sequences out changes how the others are packed, so the per-token terms are summed in a
different order (micro-batches, then data-parallel ranks); each term and the denominator
(the left-out kept tokens are added to it) are the same.

The entropy metrics cover every response token of the step either way (the left-out sequences
get a forward-only pass for them): ``policy/entropy`` and its quantiles equal an fp64 reference
over every response token of the batch, from the model's own logits one sequence at a time; the
quadrant metrics of the positive-advantage tokens are those of the full update.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stapo_megatron.loss import AlgoConfig, resolve_rollout_correction
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.runtime.launch import spawn_ranks
from stapo_megatron.trainer.batch import RolloutBatch

ARCH = Qwen3Config(
    vocab_size=200,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
GROUP = 4


def rollout(dynamic_sampling: bool, seed: int = 0) -> RolloutBatch:
    """12 groups of 4, response lengths 1-60. Without dynamic sampling 5 groups are all correct
    or all wrong (advantage 0); with it those groups were replaced by mixed ones, of which one
    has two responses at the group mean (advantage 0 on a single sequence)."""
    generator = torch.Generator().manual_seed(seed)
    groups = 12
    correct = (torch.rand(groups, GROUP, generator=generator) < 0.5).float()
    correct[:, 0], correct[:, 1] = 1.0, 0.0  # mixed
    if not dynamic_sampling:
        correct[[1, 4, 5, 8, 11]] = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])[:, None]
    rewards = correct.clone()
    if dynamic_sampling:
        rewards[3] = torch.tensor([1.0, 0.0, 0.5, 0.5])  # shaped rewards: two at the mean
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    n = groups * GROUP
    prompts, responses, logprobs = [], [], []
    for _ in range(n):
        p = int(torch.randint(3, 9, (), generator=generator))
        r = int(torch.randint(1, 61, (), generator=generator))
        prompts.append(torch.randint(1, ARCH.vocab_size, (p,), generator=generator).tolist())
        responses.append(torch.randint(1, ARCH.vocab_size, (r,), generator=generator).tolist())
        logprobs.append((-4 * torch.rand(r, generator=generator)).tolist())
    return RolloutBatch(
        prompts,
        responses,
        logprobs,
        torch.zeros(n, dtype=torch.bool),
        rewards.reshape(-1),
        correct.reshape(-1),
        advantages.reshape(-1),
        torch.arange(groups).repeat_interleave(GROUP),
    )


def _cfg(skip: bool, **algo) -> SimpleNamespace:
    return SimpleNamespace(
        batch=SimpleNamespace(
            minibatches_per_step=2,
            max_tokens_per_microbatch=160,
            max_tokens_per_forward=400,
            skip_zero_advantage=skip,
            entropy_over_skipped=True,
            temperature=1.0,
        ),
        compute=SimpleNamespace(logits_chunk_size=64),
        run=SimpleNamespace(seed=0),
        parallel=SimpleNamespace(sequence_parallel=False),
        algo=resolve_rollout_correction(AlgoConfig(**algo), 0),
    )


def _updater(ctx, weights, cfg):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.trainer.update import PolicyUpdater

    model = build_stage(ARCH, ctx, calculate_per_token_loss=True)
    model.load_state_dict(weights)
    ddp = DistributedDataParallel(
        config=model.config,
        module=model,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-3, clip_grad=0.0, params_dtype=torch.float32, use_distributed_optimizer=False
        ),
        [ddp],
    )
    return ddp, PolicyUpdater(ddp, optimizer, cfg, ARCH, ctx)


QUANTILES = {
    "policy/entropy_p50": 0.5,
    "policy/entropy_p80": 0.8,
    "policy/entropy_p90": 0.9,
    "policy/entropy_p99": 0.99,
}


def reference_entropy(model, batch: RolloutBatch) -> dict:
    """fp64 entropies of every response token of ``batch`` from ``model``'s logits, each sequence
    alone in its own forward (plain log_softmax over the real vocabulary): mean, count and the
    (floor(q n) + 1)-th smallest for each quantile."""
    from stapo_megatron.models.qwen3.model import packed_seq_params
    from stapo_megatron.trainer.batch import make_microbatches

    values = []
    with torch.no_grad():
        for mb in make_microbatches(batch, [[i] for i in range(len(batch))], torch.device("cpu")):
            logits = model(
                mb["input_ids"],
                mb["position_ids"],
                None,
                packed_seq_params=packed_seq_params(mb["cu_seqlens"], mb["max_seqlen"]),
            )
            logp = torch.log_softmax(logits[..., : ARCH.vocab_size].double(), dim=-1)  # Megatron pads to 256
            values.append(-(logp.exp() * logp).sum(-1)[mb["response_mask"] > 0])
    everything = torch.sort(torch.cat(values)).values
    n = len(everything)
    return {
        "tokens": float(n),
        "mean": float(everything.mean()),
        **{key: float(everything[int(q * n)]) for key, q in QUANTILES.items()},
    }


def skip_matches_full_update(out_dir: str) -> None:
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    ctx = init_distributed(ParallelConfig(data_parallel=2), seed=3)
    reference = build_stage(ARCH, ctx)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "output_layer" in name:
                p.mul_(30.0)  # varied probabilities: S2T finds candidates below tau_p
    weights = {k: v.clone() if torch.is_tensor(v) else v for k, v in reference.state_dict().items()}
    start = torch.cat([p.detach().reshape(-1).clone() for p in reference.parameters()])
    cases = {
        "no_dynamic_sampling": (False, dict(tau_p=0.05)),
        "dynamic_sampling": (True, dict(tau_p=0.05, dynamic_sampling=True)),
        "seq_mean_tis": (False, dict(tau_p=0.05, aggregation="seq_mean_token_mean", rollout_correction="tis_seq")),
    }
    out = {}
    for name, (dynamic, algo) in cases.items():
        batch = rollout(dynamic)
        positive_tokens = float(sum(len(r) for r, a in zip(batch.response_ids, batch.advantages) if a > 0))
        runs = []
        for skip in (True, False):
            ddp, updater = _updater(ctx, weights, _cfg(skip, **algo))
            done = updater.update_step(batch)
            grads = torch.cat([b.grad_data.clone() for b in ddp.buffers])
            params = torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])
            runs.append((grads, params, done.metrics, [r.metrics for r in done.results]))
        (g1, p1, m1, r1), (g0, p0, m0, r0) = runs
        out[name] = {
            "grad_rel": float((g1 - g0).norm() / g0.norm()),
            "grad_bit_identical": bool(torch.equal(g1, g0)),
            "param_max_diff": float((p1 - p0).abs().max()),
            "param_moved": float((p0 - start).abs().max()),
            "skipped_fraction": [m1["batch/skipped_fraction"], m0["batch/skipped_fraction"]],
            "kept_tokens": [[r["policy/kept_tokens"] for r in r1], [r["policy/kept_tokens"] for r in r0]],
            "pg_loss": [[r["policy/pg_loss"] for r in r1], [r["policy/pg_loss"] for r in r0]],
            "silenced": [[r["s2t/silenced_tokens"] for r in r1], [r["s2t/silenced_tokens"] for r in r0]],
            "tau_h": [[r["s2t/tau_h"] for r in r1], [r["s2t/tau_h"] for r in r0]],
            "entropy": [
                {k: m[k] for k in ("policy/entropy", "policy/statistics_tokens", *QUANTILES)} for m in (m1, m0)
            ],
            "entropy_reference": reference_entropy(reference, batch),
            "quadrants": [[{k: v for k, v in r.items() if k.startswith("quadrant/")} for r in rs] for rs in (r1, r0)],
            "positive_tokens": positive_tokens,
        }
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("skip")
    spawn_ranks(skip_matches_full_update, 2, str(out))
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", ["no_dynamic_sampling", "dynamic_sampling", "seq_mean_tis"])
def test_leaving_out_zero_advantage_sequences_gives_the_same_update(results, case):
    for rank in results:
        row = rank[case]
        skipped, full = row["skipped_fraction"]
        assert full == 0.0
        expected = {"no_dynamic_sampling": 5 * GROUP / 48, "dynamic_sampling": 2 / 48, "seq_mean_tis": 5 * GROUP / 48}[
            case
        ]
        assert skipped == pytest.approx(expected)
        assert row["grad_rel"] <= 1e-6, row
        assert row["param_max_diff"] <= 1e-6 and row["param_moved"] > 1e-4, row
        assert row["kept_tokens"][0] == row["kept_tokens"][1]
        assert row["silenced"][0] == row["silenced"][1] and sum(row["silenced"][0]) > 0
        assert row["tau_h"][0] == pytest.approx(row["tau_h"][1], rel=1e-6)
        assert row["pg_loss"][0] == pytest.approx(row["pg_loss"][1], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("case", ["no_dynamic_sampling", "dynamic_sampling", "seq_mean_tis"])
def test_the_entropy_covers_every_response_token_also_when_sequences_are_left_out(results, case):
    """With the skip on, policy/entropy and its quantiles are over every response token of the
    step, zero-advantage groups included (before, they covered only the sequences that ran)."""
    for rank in results:
        row = rank[case]
        ref = row["entropy_reference"]
        for metrics in row["entropy"]:  # skip on, skip off
            assert metrics["policy/statistics_tokens"] == ref["tokens"]
            assert metrics["policy/entropy"] == pytest.approx(ref["mean"], rel=1e-5)
            for key in QUANTILES:
                assert metrics[key] == pytest.approx(ref[key], rel=1e-5), key
        skipped, full = row["entropy"]
        assert skipped["policy/entropy"] == pytest.approx(full["policy/entropy"], rel=1e-6)


@pytest.mark.parametrize("case", ["no_dynamic_sampling", "dynamic_sampling", "seq_mean_tis"])
def test_the_quadrants_are_those_of_the_full_update(results, case):
    for rank in results:
        row = rank[case]
        skipped, full = row["quadrants"]
        assert len(skipped) == len(full) == 2  # one row per optimizer step
        for with_skip, without in zip(skipped, full):
            assert with_skip.keys() == without.keys() and len(with_skip) == 11
            for key, value in without.items():
                assert with_skip[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
        assert sum(r["quadrant/positive_tokens"] for r in full) == row["positive_tokens"]
        assert all(r["quadrant/grad_norm_sum"] > 0 for r in full)
