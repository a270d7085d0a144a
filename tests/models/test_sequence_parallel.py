"""Sequence parallelism on Megatron's local spec (CPU, gloo): the same numbers as without it.

One TP2 x PP2 world (4 ranks; 3 layers, so the pipeline split is uneven) builds the same
weights with sequence parallelism off and on, and runs the trainer's path on micro-batches of
sequences of very different lengths, each padded to a multiple of TP: Megatron's schedule, the
vocabulary-parallel log-prob/entropy kernel, the policy loss with an entropy term, and Megatron's
DDP with ``finalize_model_grads`` (which sums the norm weights' partial gradients over TP only
when they are marked sequence-parallel).
"""

from __future__ import annotations

import json

import pytest
import torch

from stapo_megatron.config import ConfigError
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.parallelize import sequence_multiple
from stapo_megatron.runtime.launch import spawn_ranks

ARCH = Qwen3Config(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
# (prompt, response) lengths: a long and a short one per micro-batch, lengths not multiples of 2
SEQUENCES = [[(5, 30), (3, 4)], [(7, 1), (2, 12)], [(4, 22)]]
TP, PP = 2, 2


def _microbatches(multiple: int, seed: int = 0) -> list[dict]:
    """Padded micro-batches (the trainer's layout: labels shifted by one, response mask) whose
    length is rounded up to ``multiple``."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for chunk in SEQUENCES:
        width = max(p + r for p, r in chunk) - 1
        width = -(-width // multiple) * multiple
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        labels = torch.zeros_like(ids)
        mask = torch.zeros(len(chunk), width)
        advantages = torch.zeros(len(chunk), width)
        for row, (prompt, response) in enumerate(chunk):
            tokens = torch.randint(0, ARCH.vocab_size, (prompt + response,), generator=generator)
            n = prompt + response - 1
            ids[row, :n], labels[row, :n] = tokens[:-1], tokens[1:]
            mask[row, prompt - 1 : n] = 1.0
            advantages[row, prompt - 1 : n] = float(torch.randn((), generator=generator))
        batches.append(
            {
                "input_ids": ids,
                "labels": labels,
                "response_mask": mask,
                "advantages": advantages,
                "position_ids": torch.arange(width).expand(len(chunk), width).contiguous(),
            }
        )
    return batches


def run_with_and_without_sequence_parallel(out: str) -> None:
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from stapo_megatron.loss import vocab_parallel_logprob_entropy
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from stapo_megatron.trainer.schedule import forward_backward, forward_only
    from tests.loss._loss_call import loss_of

    ctx = init_distributed(ParallelConfig(tensor_parallel=TP, pipeline_parallel=PP), seed=7)
    weights = None
    results = {}
    for sp in (False, True):
        model = build_stage(ARCH, ctx, sequence_parallel=sp, calculate_per_token_loss=True)
        if weights is None:
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        else:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(weights[n])
        ddp = DistributedDataParallel(
            config=model.config,
            module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        )
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = ddp.no_sync
        batches = _microbatches(sequence_multiple(TP, sp))

        def statistics(logits, batch):
            return vocab_parallel_logprob_entropy(
                logits, batch["labels"], tp_group=ctx.tp_group, chunk_size=16, vocab_size=ARCH.vocab_size
            )

        stats = forward_only(ddp, batches, statistics)

        def loss_fn(logits, batch):
            logprob, entropy = vocab_parallel_logprob_entropy(
                logits,
                batch["labels"],
                tp_group=ctx.tp_group,
                chunk_size=16,
                vocab_size=ARCH.vocab_size,
                entropy_grad=True,
            )
            old = logprob.detach() - 0.05 * batch["response_mask"]  # ratios off 1: the clip terms matter
            loss_sum, tokens, _ = loss_of(
                logprob,
                old,
                batch["advantages"],
                batch["response_mask"],
                entropy=entropy,
                entropy_coef=0.01,
                response_mask=batch["response_mask"],
            )
            return loss_sum, tokens, {"loss_sum": loss_sum.detach()}

        ddp.zero_grad_buffer()
        reports = forward_backward(ddp, batches, loss_fn)
        norm_marked = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]
        results["stage"] = ctx.pp_rank
        results["on" if sp else "off"] = {
            "logprob": [lp[b["response_mask"] > 0].tolist() for (lp, _), b in zip(stats, batches)],
            "entropy": [h[b["response_mask"] > 0].tolist() for (_, h), b in zip(stats, batches)],
            "width": [b["input_ids"].shape[1] for b in batches],
            "loss": sum(float(r["loss_sum"]) for r in reports),
            "grads": {n: p.main_grad.flatten().tolist() for n, p in model.named_parameters()},
            "sequence_parallel": model.config.sequence_parallel,
            "norm_marked": norm_marked,
        }
    with open(f"{out}/{dist.get_rank()}.json", "w", encoding="utf-8") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    spawn_ranks(run_with_and_without_sequence_parallel, TP * PP, str(out))
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(TP * PP)]


def test_sequence_parallel_reaches_the_model_and_pads_to_tp(results):
    for rank in results:
        assert rank["off"]["sequence_parallel"] is False and rank["on"]["sequence_parallel"] is True
        # micro-batch widths 34, 13, 25 without; rounded up to multiples of TP with
        assert rank["off"]["width"] == [34, 13, 25] and rank["on"]["width"] == [34, 14, 26]
        # the norms are the parameters whose gradients TP must sum (each rank saw half the sequence);
        # two layers on the first stage, one and the final norm on the last
        layers = 2 if rank["stage"] == 0 else 1
        norms = ("input_layernorm", "pre_mlp_layernorm", "self_attention.q_layernorm", "self_attention.k_layernorm")
        marked = {f"decoder.layers.{i}.{n}.weight" for i in range(layers) for n in norms}
        if rank["stage"] == 1:
            marked.add("decoder.final_layernorm.weight")
        assert set(rank["on"]["norm_marked"]) == marked
        assert rank["off"]["norm_marked"] == []


def test_logprobs_entropies_loss_and_gradients_equal_with_sequence_parallel(results):
    assert [rank["stage"] for rank in results] == [0, 0, 1, 1]
    for rank in results:
        off, on = rank["off"], rank["on"]
        assert (len(off["logprob"]) == 3) == (rank["stage"] == 1)  # statistics on the last stage only
        for name in ("logprob", "entropy"):
            for a, b in zip(off[name], on[name]):
                assert len(a) == len(b) > 0
                assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0), name
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-6, abs=1e-7)
        assert off["grads"].keys() == on["grads"].keys()
        for name in off["grads"]:
            a, b = torch.tensor(off["grads"][name]), torch.tensor(on["grads"][name])
            scale, err = float(a.abs().max()), float((a - b).abs().max())
            assert scale > 0 and err <= 1e-5 * scale, (name, err, scale)


def test_sequence_parallel_needs_tensor_parallel():
    from stapo_megatron.runtime.distributed import ParallelConfig

    with pytest.raises(ConfigError, match="sequence_parallel: needs tensor_parallel > 1"):
        ParallelConfig(sequence_parallel=True)
    assert sequence_multiple(4, True) == 4 and sequence_multiple(4, False) == 1


def test_training_config_accepts_sequence_parallel_and_uneven_stages_and_explains_context_parallel():
    from stapo_megatron.config import load_config
    from stapo_megatron.trainer.config import TrainConfig
    from stapo_megatron.trainer.validation import check_train_config
    from tests.helpers import REPO_ROOT

    tiny = REPO_ROOT / "configs" / "tiny_cpu.yaml"
    # the local spec (no Transformer Engine here) trains with sequence parallelism; 3 layers over 2 stages
    cfg = load_config(
        TrainConfig,
        tiny,
        [
            "parallel.tensor_parallel=2",
            "parallel.sequence_parallel=true",
            "parallel.pipeline_parallel=2",
            "model.num_hidden_layers=3",
        ],
    )
    check_train_config(cfg, files=False)
    cfg = load_config(TrainConfig, tiny, ["parallel.context_parallel=2"])
    with pytest.raises(
        ConfigError,
        match=r"^parallel.context_parallel: must be 1 \(context parallelism needs "
        r"Transformer Engine's attention",
    ):
        check_train_config(cfg, files=False)
