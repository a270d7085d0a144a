"""Functions run on every rank of a spawned test (importable by the spawned processes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stapo_megatron.runtime.distributed import ParallelContext


def check_logits_match_hf(tp: int, pp: int, cases: list[tuple[str, str]]) -> ParallelContext:
    """For each (HF checkpoint dir, reference file): Megatron logits == transformers logits. Returns
    this rank's parallel context, for checks that follow in the same world."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from stapo_megatron.checkpoint.convert import fill_from_hf
    from stapo_megatron.checkpoint.hf_io import HFCheckpoint
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from stapo_megatron.trainer.schedule import forward_only

    ctx = init_distributed(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp))
    for hf_dir, reference_file in cases:
        reference = torch.load(reference_file, weights_only=True)
        arch = Qwen3Config.from_hf(hf_dir)
        model = build_stage(arch, ctx, perform_initialization=False)
        fill_from_hf(model, arch, HFCheckpoint(hf_dir), ctx)
        ids = reference["input_ids"]
        batches = [
            {"input_ids": ids[i : i + 1], "position_ids": torch.arange(ids.shape[1]).unsqueeze(0)}
            for i in range(ids.shape[0])
        ]

        def full_logits(logits, batch, vocab_size=arch.vocab_size):
            return gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]

        outputs = forward_only(model, batches, full_logits)
        if ctx.is_last_stage:
            got = torch.cat(outputs)
            assert got.shape == reference["logits"].shape, (got.shape, reference["logits"].shape)
            diff = (got - reference["logits"]).abs().max().item()
            assert diff <= 1e-4, f"{hf_dir} at TP={tp} PP={pp}: max |logits diff| = {diff}"
        else:
            assert outputs == []
    return ctx


def count_preset_parameters(names: list[str], out_file: str) -> None:
    """Megatron GPTModel parameter count of each preset, built on the meta device (no memory)."""
    from stapo_megatron.config import build
    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.model import build_gpt_model, transformer_config
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    init_distributed(ParallelConfig())
    counts = {}
    for name in names:
        arch = build(Qwen3Config, name)
        with torch.device("meta"):
            config = transformer_config(arch, perform_initialization=False, use_cpu_initialization=True)
            model = build_gpt_model(arch, config)
        assert all(p.device.type == "meta" for p in model.parameters())
        counts[name] = sum(p.numel() for p in model.parameters())
    torch.save(counts, out_file)
