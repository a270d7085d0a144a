"""The policy update: token statistics passes, the masked loss, and optimizer steps.

Everything about tokens happens on the last pipeline stage, where the logits are; the
statistics and selections it keeps are indexed like the micro-batches every stage holds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

from stapo_megatron.loss import (
    TokenStats,
    all_reduce_metrics,
    minibatch_threshold,
    needs_statistics_pass,
    policy_loss,
    reduce_metrics,
    select_tokens,
    vocab_parallel_logprob_entropy,
)
from stapo_megatron.trainer.schedule import forward_backward, forward_only


@dataclasses.dataclass
class MinibatchResult:
    metrics: dict[str, float]
    skipped: bool
    selections: list  # per micro-batch Selection (last stage), for the inspector


def _parallel():
    from megatron.core import parallel_state as ps

    return ps


class PolicyUpdater:
    def __init__(self, model, optimizer, scheduler, cfg, arch):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.cfg, self.algo, self.arch = cfg, cfg.algo, arch
        ps = _parallel()
        self.last_stage = ps.is_pipeline_last_stage()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()

    # ---- token statistics --------------------------------------------------------------------

    def _token_logprob_entropy(self, logits: torch.Tensor, batch: dict, entropy_grad: bool = False):
        return vocab_parallel_logprob_entropy(
            logits,
            batch["labels"],
            tp_group=self.tp_group,
            temperature=self.cfg.batch.temperature,
            chunk_size=self.cfg.compute.logits_chunk_size,
            vocab_size=self.arch.vocab_size,
            entropy_grad=entropy_grad,
        )

    def statistics(self, microbatches: list[dict]) -> list[TokenStats]:
        """Forward-only log-prob and entropy of every token under the current weights (last stage)."""

        def step(logits, batch):
            logprob, entropy = self._token_logprob_entropy(logits, batch)
            return TokenStats(logprob, entropy, batch["advantages"], batch["response_mask"])

        return forward_only(self.model, microbatches, step)

    # ---- one optimizer step ------------------------------------------------------------------

    def train_minibatch(self, microbatches: list[dict], old: list[TokenStats], current: Optional[list[TokenStats]]) -> MinibatchResult:
        """Accumulate the masked loss over ``microbatches`` and take one optimizer step.

        ``old``: statistics before this rollout step's first update (their log-probs are the
        ratio's denominator). ``current``: statistics under the weights about to be updated, over
        the whole mini-batch, for the rule's mini-batch threshold (None: not needed).
        """
        selections: list = []
        if self.last_stage:
            for batch, stats in zip(microbatches, old):
                batch["old_logprob"] = stats.logprob
            if needs_statistics_pass(self.algo):
                threshold = minibatch_threshold(self.algo, current, self.dp_group)
                selections = [select_tokens(self.algo, stats, threshold) for stats in current]
                for batch, selection in zip(microbatches, selections):
                    batch["selection"] = selection

        collected = []

        def loss_fn(logits, batch):
            logprob, entropy = self._token_logprob_entropy(logits, batch, entropy_grad=self.algo.entropy_coef > 0)
            selection = batch.get("selection")
            if selection is None:  # a rule without a mini-batch threshold: this micro-batch decides
                stats = TokenStats(logprob.detach(), entropy.detach(), batch["advantages"], batch["response_mask"])
                selection = select_tokens(self.algo, stats, None)
                collected.append(selection)
            loss_sum, num_tokens, metrics = policy_loss(
                logprob,
                batch["old_logprob"],
                batch["advantages"],
                selection.keep,
                eps_low=self.algo.eps_low,
                eps_high=self.algo.eps_high,
                entropy=entropy,
                entropy_coef=self.algo.entropy_coef,
                aggregation=self.algo.aggregation,
                response_mask=batch["response_mask"],
                candidates=selection.candidates,
                tau_h=selection.threshold,
            )
            return loss_sum, num_tokens, {"metrics": metrics}

        for chunk in self.model if isinstance(self.model, list) else [self.model]:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = forward_backward(self.model, microbatches, loss_fn)
        selections = selections or collected

        local = reduce_metrics([r["metrics"] for r in reports]) if reports else {}
        nonfinite = torch.tensor(0.0, device=self._device())
        if self.last_stage and "pg_loss_sum" in local and not math.isfinite(float(local["pg_loss_sum"])):
            nonfinite.fill_(1.0)
        if not self._grads_finite():
            nonfinite.fill_(1.0)
        dist.all_reduce(nonfinite, op=dist.ReduceOp.MAX)
        skipped = bool(nonfinite.item())
        metrics: dict[str, float] = {}
        if skipped:
            self.optimizer.zero_grad()
        else:
            _, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            metrics["optim/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["optim/lr"] = float(self.optimizer.param_groups[0]["lr"])
        if self.last_stage:
            reduced = all_reduce_metrics(local, self.dp_group)
            metrics.update(summarize_loss_metrics(reduced))
        return MinibatchResult(metrics=metrics, skipped=skipped, selections=selections)

    def _grads_finite(self) -> bool:
        chunks = self.model if isinstance(self.model, list) else [self.model]
        for chunk in chunks:
            for buffer in getattr(chunk, "buffers", []):
                if not torch.isfinite(buffer.grad_data).all():
                    return False
        return True

    def _device(self) -> torch.device:
        from stapo_megatron.runtime.distributed import device

        return device()


def summarize_loss_metrics(m: dict[str, torch.Tensor]) -> dict[str, float]:
    """Exact mini-batch means from summed counts (see :mod:`stapo_megatron.loss.metrics`)."""

    def value(key: str) -> float:
        return float(m[key]) if key in m else 0.0

    def ratio(num: str, den: str) -> float:
        return value(num) / value(den) if value(den) > 0 else 0.0

    out = {
        "s2t/masked_fraction": ratio("silenced_tokens", "response_tokens"),
        "s2t/silenced_tokens": value("silenced_tokens"),
        "policy/kept_tokens": value("kept_tokens"),
        "policy/response_tokens": value("response_tokens"),
        "policy/pg_loss": ratio("pg_loss_sum", "kept_tokens"),
        "policy/clip_low_fraction": ratio("clip_low_tokens", "kept_tokens"),
        "policy/clip_high_fraction": ratio("clip_high_tokens", "kept_tokens"),
        "policy/approx_kl": ratio("approx_kl_sum", "kept_tokens"),
        "policy/ratio_mean": ratio("ratio_sum", "kept_tokens"),
        "policy/entropy_kept": ratio("entropy_kept_sum", "kept_tokens"),
    }
    if "ratio_max" in m and math.isfinite(float(m["ratio_max"])):
        out["policy/ratio_max"] = float(m["ratio_max"])
        out["policy/ratio_min"] = float(m["ratio_min"])
    if "candidate_tokens" in m:
        out["s2t/candidates"] = value("candidate_tokens")
        out["s2t/silenced_candidates"] = value("silenced_candidate_tokens")
    silenced = value("silenced_tokens")
    out["s2t/entropy_silenced"] = value("entropy_silenced_sum") / silenced if silenced > 0 else 0.0
    # No candidates (no threshold) is logged as null, so the series keeps its gaps.
    out["s2t/tau_h"] = ratio("tau_h_sum", "tau_h_count") if value("tau_h_count") > 0 else float("nan")
    return out
