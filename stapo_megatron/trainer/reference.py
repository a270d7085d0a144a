"""The frozen reference policy of the KL penalty (``algo.kl_coef`` > 0).

The reference is this rank's stage of the same model in the same parallel layout as the policy,
holding the run's initial weights (``checkpoint.load_hf``, ``checkpoint.load_megatron`` or the
seeded random init): the trainer builds it from the policy right after the initial weights are
loaded and before any checkpoint is resumed, so a resumed run gets the initial weights back, never
the trained ones. It has no gradients, no optimizer and no DDP wrapper, and stays in eval mode.
With ``compute.offload_while_generating`` its weights wait in host memory while the rollout servers
generate (:data:`stapo_megatron.trainer.offload.REFERENCE`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.parallelize import build_stage
from stapo_megatron.runtime.distributed import ParallelContext
from stapo_megatron.trainer.schedule import forward_only


class ReferenceModel:
    """A frozen copy of ``initial`` (this rank's unwrapped policy stage, still at its initial weights,
    at its place in ``ctx``)."""

    def __init__(
        self,
        initial: torch.nn.Module,
        arch: Qwen3Config,
        ctx: ParallelContext,
        *,
        params_dtype: torch.dtype,
        sequence_parallel: bool,
        device: torch.device | None = None,
    ):
        # The weights are copied in whole below: no random init (it would also advance the RNG).
        model = build_stage(
            arch,
            ctx,
            params_dtype=params_dtype,
            perform_initialization=False,
            sequence_parallel=sequence_parallel,
            device=device,
        )
        model.load_state_dict(initial.state_dict(), strict=True)
        model.requires_grad_(False)
        model.eval()
        self.model = model

    def logprobs(
        self, microbatches: list[dict], token_logprob: Callable[[torch.Tensor, dict], torch.Tensor]
    ) -> list[torch.Tensor]:
        """``token_logprob(logits, micro-batch)`` under the reference weights, one tensor per
        micro-batch (forward only; last pipeline stage, [] elsewhere)."""
        return forward_only(self.model, microbatches, token_logprob)
