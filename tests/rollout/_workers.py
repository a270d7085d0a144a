"""Functions run on every rank of a spawned rollout test."""

from __future__ import annotations

import torch
import torch.distributed as dist


def check_local_engine_matches_megatron(hf_dir: str, tp: int, pp: int) -> None:
    """Weights streamed from a Megatron model into the local engine: the log-probs it samples with
    equal the Megatron model's log-probs of the same tokens."""
    from megatron.core import parallel_state as ps

    from stapo_megatron.checkpoint.convert import fill_from_hf
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.loss import vocab_parallel_logprob_entropy
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.rollout.engine import SamplingParams
    from stapo_megatron.rollout.local_engine import LocalEngine
    from stapo_megatron.rollout.weight_sync.in_process import gather_to_controller
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from stapo_megatron.trainer.batch import RolloutBatch, broadcast_rollouts, make_microbatches
    from stapo_megatron.trainer.schedule import forward_only

    ctx = init_distributed(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp))
    arch = Qwen3Config.from_hf(hf_dir)
    model = build_stage(arch, ctx, perform_initialization=False)
    fill_from_hf(model, arch, HFCheckpoint(hf_dir), ctx)
    engine = LocalEngine(arch) if dist.get_rank() == 0 else None
    # Small buckets: several per rank, so the controller interleaves its own and the others'.
    gather_to_controller(
        ctx, model, arch, lambda stream: engine.load_weights(stream, version=1), bucket_bytes=64 * 1024
    )

    batch = None
    if engine is not None:
        prompts = [[1, 5, 7, 9], [2, 3], [11, 12, 13, 14, 15, 16]]
        groups = engine.generate(
            prompts, SamplingParams(n=4, max_new_tokens=12, stop_token_ids=(0,), seed=3, temperature=0.8)
        )
        flat = [(p, c) for p, g in zip(prompts, groups) for c in g]
        assert any(c.finish_reason == "stop" for _, c in flat) or all(len(c.token_ids) == 12 for _, c in flat)
        count = len(flat)
        batch = RolloutBatch(
            prompt_ids=[p for p, _ in flat],
            response_ids=[c.token_ids for _, c in flat],
            rollout_logprobs=[c.logprobs for _, c in flat],
            truncated=torch.zeros(count, dtype=torch.bool),
            rewards=torch.zeros(count),
            correct=torch.zeros(count),
            advantages=torch.zeros(count),
            group_ids=torch.arange(count),
        )
    batch = broadcast_rollouts(ctx, batch)
    bins = [list(range(len(batch)))[i : i + 5] for i in range(0, len(batch), 5)]
    microbatches = make_microbatches(batch, bins, torch.device("cpu"), packed=False)

    def logprob(logits, mb):
        lp, _ = vocab_parallel_logprob_entropy(
            logits, mb["labels"], ps.get_tensor_model_parallel_group(), temperature=0.8, vocab_size=arch.vocab_size
        )
        return lp, mb

    outputs = forward_only(model, microbatches, logprob)
    if ps.is_pipeline_last_stage():
        worst = 0.0
        for lp, mb in outputs:
            mask = mb["response_mask"] > 0
            assert int(mask.sum()) > 0
            worst = max(worst, (lp - mb["rollout_logprobs"])[mask].abs().max().item())
        assert worst < 1e-5, f"engine vs Megatron log-prob differ by {worst} at TP={tp} PP={pp}"
