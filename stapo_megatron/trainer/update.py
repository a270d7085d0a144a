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
    mismatch_sums,
    needs_statistics_pass,
    policy_loss,
    reduce_metrics,
    s2t_candidates,
    select_tokens,
    summarize_mismatch,
    vocab_parallel_logprob_entropy,
)
from stapo_megatron.runtime.distributed import ParallelContext
from stapo_megatron.trainer.schedule import forward_backward, forward_only


@dataclasses.dataclass
class MinibatchResult:
    metrics: dict[str, float]
    skipped: bool
    selections: list  # per micro-batch Selection (last stage), for the inspector


class PolicyUpdater:
    def __init__(self, model, optimizer, cfg, arch, ctx: ParallelContext):
        # No scheduler here: the trainer steps it once per training step, after all mini-batches.
        self.model, self.optimizer = model, optimizer
        self.cfg, self.algo, self.arch = cfg, cfg.algo, arch
        self.ctx = ctx
        self.last_stage = ctx.is_last_stage
        self.tp_group = ctx.tp_group
        self.dp_group = ctx.dp_group

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
                clip_ratio_c=self.algo.clip_ratio_c,
                log_ratio_clamp=self.algo.log_ratio_clamp,
                entropy=entropy,
                entropy_coef=self.algo.entropy_coef,
                aggregation=self.algo.aggregation,
                response_mask=batch["response_mask"],
                candidates=selection.candidates,
                tau_h=selection.threshold,
                rollout_logprob=batch["rollout_logprobs"],
                rollout_correction=self.algo.rollout_correction,
                rollout_correction_cap=self.algo.rollout_correction_cap,
                rollout_correction_floor=self.algo.rollout_correction_floor,
            )
            return loss_sum, num_tokens, {"metrics": metrics}

        for chunk in self.model if isinstance(self.model, list) else [self.model]:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = forward_backward(self.model, microbatches, loss_fn)
        selections = selections or collected

        local = reduce_metrics([r["metrics"] for r in reports]) if reports else {}
        loss_nonfinite = self.last_stage and "pg_loss_sum" in local and not math.isfinite(float(local["pg_loss_sum"]))
        skipped = self.ctx.any_rank(loss_nonfinite or not self._grads_finite())
        metrics: dict[str, float] = {}
        if skipped:
            self.optimizer.zero_grad()
        else:
            _, grad_norm, _ = self.optimizer.step()
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



def candidate_mismatch(
    ctx: ParallelContext, old_stats: list[TokenStats], microbatches: list[dict], tau_p: float
) -> dict[str, float]:
    """The train/rollout log-prob mismatch split by S2T's candidate set (A > 0 and p < ``tau_p``
    under the old policy) and the other response tokens, over the data-parallel group
    (:func:`~stapo_megatron.loss.summarize_mismatch` names each metric and its reduction).
    Computed on the last stage (empty elsewhere); collective over ``ctx.dp_group``."""
    if not ctx.is_last_stage:
        return {}
    sums = reduce_metrics(
        mismatch_sums(
            stats.logprob, mb["rollout_logprobs"], mb["response_mask"],
            s2t_candidates(stats.logprob, stats.advantages, mb["response_mask"], tau_p),
        )
        for stats, mb in zip(old_stats, microbatches)
    )
    return summarize_mismatch(all_reduce_metrics(sums, ctx.dp_group))


def rollout_statistics(ctx: ParallelContext, old_stats: list[TokenStats], microbatches: list[dict]) -> dict[str, float]:
    """Policy entropy and the train/rollout log-prob mismatch over every response token of the
    data-parallel group; computed on the last stage (empty elsewhere). Collective over ``ctx.dp_group``."""
    if not ctx.is_last_stage:
        return {}
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # tokens, entropy sum, |mismatch| sum
    largest = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    for stats, mb in zip(old_stats, microbatches):
        mask = mb["response_mask"] > 0
        mismatch = (stats.logprob - mb["rollout_logprobs"])[mask].abs().double()
        totals[0] += mask.sum()
        totals[1] += stats.entropy[mask].double().sum()
        totals[2] += mismatch.sum()
        if mismatch.numel():
            largest = torch.maximum(largest, mismatch.max())
    dist.all_reduce(totals, group=ctx.dp_group)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ctx.dp_group)
    tokens = max(float(totals[0]), 1.0)
    return {
        "policy/entropy": float(totals[1]) / tokens,
        "mismatch/logprob_abs_mean": float(totals[2]) / tokens,
        "mismatch/logprob_abs_max": float(largest[0]),
    }


def merge_reporter_metrics(ctx: ParallelContext, metrics: dict) -> dict:
    """Rank 0's ``metrics`` with those of its pipeline's last stage merged in (rank 0's win on a
    clash); other ranks get theirs back. The update's metrics live on the last stage, and its
    first TP and DP rank (the reporter) sends them to rank 0 over gloo; no other rank takes part."""
    if ctx.pp_size == 1:
        return metrics  # rank 0 is its own last stage
    pipeline = dist.get_process_group_ranks(ctx.pp_group)
    reporter = ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0
    if reporter:
        dist.send_object_list([metrics], dst=pipeline[0], group=ctx.cpu_group)
    elif ctx.rank == 0:
        payload = [None]
        dist.recv_object_list(payload, src=pipeline[-1], group=ctx.cpu_group)
        return {**payload[0], **metrics}
    return metrics


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
        "policy/dual_clip_fraction": ratio("dual_clip_tokens", "kept_tokens"),
        "policy/approx_kl": ratio("approx_kl_sum", "kept_tokens"),
        "policy/ratio_mean": ratio("ratio_sum", "kept_tokens"),
        "policy/entropy_kept": ratio("entropy_kept_sum", "kept_tokens"),
    }
    if "ratio_max" in m and math.isfinite(float(m["ratio_max"])):
        out["policy/ratio_max"] = float(m["ratio_max"])
        out["policy/ratio_min"] = float(m["ratio_min"])
    if "rollout_weight_sum" in m:  # a rollout correction is on
        out["rollout_correction/weight_mean"] = ratio("rollout_weight_sum", "kept_tokens")
        out["rollout_correction/truncated_fraction"] = ratio("rollout_truncated_tokens", "kept_tokens")
        out["rollout_correction/rejected_fraction"] = ratio("rollout_rejected_tokens", "response_tokens")
    if "candidate_tokens" in m:
        out["s2t/candidates"] = value("candidate_tokens")
        out["s2t/silenced_candidates"] = value("silenced_candidate_tokens")
    silenced = value("silenced_tokens")
    out["s2t/entropy_silenced"] = value("entropy_silenced_sum") / silenced if silenced > 0 else 0.0
    # No candidates (no threshold) is logged as null, so the series keeps its gaps.
    out["s2t/tau_h"] = ratio("tau_h_sum", "tau_h_count") if value("tau_h_count") > 0 else float("nan")
    return out
