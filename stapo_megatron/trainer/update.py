"""The policy update of one rollout step and its outcome: token statistics passes, thresholds and
selections, the masked loss, the optimizer steps, the count of skipped ones, and the step's metrics.

The micro-batches come from the step plan (:mod:`.step_plan`). Statistics live in per-rank token
vectors (:class:`~stapo_megatron.trainer.batch.TokenSlots`), so a pass in one layout feeds the
loss in the other. The left-out zero-advantage sequences (see :mod:`.step_plan`) add their kept
tokens to the loss denominator, so the update is the same; they still get a forward-only
statistics pass of their own, which feeds only the step's metrics: the policy entropy and its
quantiles cover every response token of the step for every preset (``time/skipped_statistics``
is its cost).

Everything about tokens happens on the last pipeline stage, where the logits are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from stapo_megatron.loss import (
    LossInputs,
    PolicyLoss,
    Selection,
    TokenStats,
    all_reduce_metrics,
    minibatch_threshold,
    needs_statistics_pass,
    reduce_metrics,
    select_tokens,
    vocab_parallel_logprob_entropy,
)
from stapo_megatron.loss.diagnostics import PositiveTokens, positive_token_gradients, quadrant_metrics
from stapo_megatron.loss.logprob_entropy import vocab_parallel_token_statistics
from stapo_megatron.loss.metrics import Reduction, combine_steps, declare
from stapo_megatron.loss.policy_metrics import summarize_loss_metrics
from stapo_megatron.models.qwen3.parallelize import sequence_multiple
from stapo_megatron.runtime.distributed import ParallelContext
from stapo_megatron.trainer.batch import RolloutBatch, TokenSlots
from stapo_megatron.trainer.inspector import SpuriousTokenDump
from stapo_megatron.trainer.reference import ReferenceModel
from stapo_megatron.trainer.schedule import forward_backward, forward_only
from stapo_megatron.trainer.step_plan import MinibatchPlan, StepPlan, plan_step
from stapo_megatron.trainer.step_statistics import candidate_mismatch, rollout_statistics

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class MinibatchResult:
    metrics: dict[str, float]
    skipped: bool
    selections: list[Selection]  # per micro-batch (last stage), for the inspector


@dataclasses.dataclass
class StepResult:
    metrics: dict[str, float]
    results: list[MinibatchResult]
    microbatches: list[list[dict]]  # per mini-batch, its update micro-batches
    decided_on: list[list[TokenStats]]  # the statistics each mini-batch's selection read, per micro-batch


@dataclasses.dataclass
class PreparedMicrobatch:
    """An update micro-batch with what its loss reads besides the logits (last stage)."""

    tensors: dict  # the packed micro-batch (trainer/batch.py)
    old_logprob: torch.Tensor | None  # None off the last stage, where no loss runs
    ref_logprob: torch.Tensor | None
    selection: Selection | None  # None: the micro-batch decides in the loss (no mini-batch threshold)
    # what the left-out zero-advantage sequences add to the loss denominator, and their response
    # tokens: on one micro-batch of one data-parallel rank, 0 elsewhere
    skipped_count: int
    skipped_tokens: int


# Of each optimizer step (PolicyUpdater.train_minibatch); the loss's own metrics are declared in
# stapo_megatron.loss.policy_metrics.
declare(
    Reduction.MEAN,
    {
        "optim/grad_norm": "gradient norm before clipping (plain mean over the step's optimizer steps)",
        "optim/lr": "learning rate (one value per training step: the scheduler steps after the last mini-batch)",
    },
)


class PolicyUpdater:
    """Owns the update of a step and its outcome: the plan, the statistics passes, thresholds and
    selections, the loss inputs of each micro-batch, the optimizer steps and the count of those
    skipped for non-finite values (``faults.max_skipped_steps``; saved with the checkpoint through
    :meth:`state_dict`), the silenced-token dump, and the step's metrics on rank 0."""

    def __init__(
        self,
        model,
        optimizer,
        cfg,
        arch,
        ctx: ParallelContext,
        reference: ReferenceModel | None = None,
        inspector: SpuriousTokenDump | None = None,
    ):
        # No scheduler here: the trainer steps it once per training step, after all mini-batches.
        # ``reference``: the frozen model of the KL penalty (needed when algo.kl_coef > 0).
        if cfg.algo.kl_coef > 0 and reference is None:
            raise ValueError("reference: algo.kl_coef > 0 needs the frozen reference model")
        self.model, self.optimizer, self.reference, self.inspector = model, optimizer, reference, inspector
        self.cfg, self.algo, self.arch = cfg, cfg.algo, arch
        self.loss = PolicyLoss(cfg.algo)
        self.ctx = ctx
        self.last_stage = ctx.is_last_stage
        self.tp_group = ctx.tp_group
        self.dp_group = ctx.dp_group
        self.step: int | None = None  # set by update_step
        # sequence parallelism splits the packed row over the tensor-parallel ranks
        self.pad_to_multiple = sequence_multiple(ctx.tp_size, cfg.parallel.sequence_parallel)
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss or gradient
        self.optimizer_steps = 0  # optimizer steps taken

    # ---- the outcome -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict) -> None:
        # absent in checkpoints of earlier versions
        self.skipped_steps = state.get("skipped_steps", 0)
        self.optimizer_steps = state.get("optimizer_steps", 0)

    def train_step(self, batch: RolloutBatch, step: int, timer) -> dict[str, float]:
        """Update on ``batch`` (training step ``step``); returns the step's metrics, on rank 0 with
        those of its pipeline's last stage (:func:`merge_reporter_metrics`). ``timer(name)``: a
        context manager per phase."""
        with timer("update"):  # micro-batch building and metrics; the passes time themselves inside
            done = self.update_step(batch, timer, step=step)
        inspect_every = self.cfg.logging.inspect_every
        if self.inspector is not None and inspect_every and step % inspect_every == 0:
            with timer("inspect"):
                self.inspector.dump(
                    step, done.microbatches, done.decided_on, [r.selections for r in done.results], batch
                )
        metrics = done.metrics
        metrics.update(combine_steps([r.metrics for r in done.results]))
        metrics["optim/skipped_steps"] = float(self.skipped_steps)
        with timer("logging"):  # the metrics on their way to rank 0's logger
            return merge_reporter_metrics(self.ctx, metrics)

    def _count(self, result: MinibatchResult) -> None:
        if not result.skipped:
            self.optimizer_steps += 1
            return
        self.skipped_steps += 1
        if self.ctx.rank == 0:  # every rank skips it: said once (the console shows every rank's warnings)
            logger.warning(
                "step %d: non-finite loss or gradient, optimizer step skipped (%d so far)",
                self.step,
                self.skipped_steps,
            )
        if self.skipped_steps > self.cfg.faults.max_skipped_steps:
            raise RuntimeError(
                f"{self.skipped_steps} optimizer steps skipped for non-finite values, more than "
                f"faults.max_skipped_steps={self.cfg.faults.max_skipped_steps}"
            )

    # ---- token statistics --------------------------------------------------------------------

    def _vocab_parallel_args(self, entropy_grad: bool = False) -> dict:
        return dict(
            tp_group=self.tp_group,
            temperature=self.cfg.batch.temperature,
            chunk_size=self.cfg.compute.logits_chunk_size,
            vocab_size=self.arch.vocab_size,
            entropy_grad=entropy_grad,
        )

    def _token_logprob_entropy(self, logits: torch.Tensor, batch: dict):
        return vocab_parallel_logprob_entropy(logits, batch["labels"], **self._vocab_parallel_args())

    def statistics(self, microbatches: list[dict]) -> list[TokenStats]:
        """Forward-only log-prob and entropy of every token under the current weights (last stage)."""

        def step(logits, batch):
            logprob, entropy = self._token_logprob_entropy(logits, batch)
            return TokenStats(
                logprob, entropy, batch["advantages"], batch["response_mask"], **self._token_identity(batch)
            )

        return forward_only(self.model, microbatches, step)

    def _slot_vector(self, slots: TokenSlots, microbatches: list[dict], values: list[torch.Tensor]) -> torch.Tensor:
        """``values`` (one tensor per micro-batch, shaped like its tokens) as a per-rank token vector."""
        vector = torch.zeros(slots.size, dtype=torch.float32, device=self.ctx.device)
        for mb, v in zip(microbatches, values):
            vector[mb["token_index"].reshape(-1)] = v.reshape(-1).float()
        return vector

    def _to_slots(
        self, slots: TokenSlots, microbatches: list[dict], stats: list[TokenStats]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of ``stats`` (one per micro-batch) as per-rank token vectors."""
        return (
            self._slot_vector(slots, microbatches, [s.logprob for s in stats]),
            self._slot_vector(slots, microbatches, [s.entropy for s in stats]),
        )

    def reference_logprobs(self, slots: TokenSlots, microbatches: list[dict]) -> torch.Tensor | None:
        """The reference model's log-prob of every token of ``microbatches`` (forward layout) as a
        per-rank token vector, at the rollout temperature through the same vocabulary-parallel
        path as the policy's (last stage; None elsewhere)."""
        assert self.reference is not None, "called only when the update has a reference model"
        logprobs = self.reference.logprobs(microbatches, lambda logits, mb: self._token_logprob_entropy(logits, mb)[0])
        return self._slot_vector(slots, microbatches, logprobs) if self.last_stage else None

    def _read_slots(
        self, tables: tuple[torch.Tensor, torch.Tensor], mb: dict, step_entropy: float | None
    ) -> TokenStats:
        logprob, entropy = (t[mb["token_index"]] for t in tables)
        return TokenStats(
            logprob,
            entropy,
            mb["advantages"],
            mb["response_mask"],
            step_entropy=step_entropy,
            **self._token_identity(mb),
        )

    def _token_identity(self, mb: dict) -> dict:
        """Each token's identity in the step, for rules that draw at random (s2t_random)."""
        return dict(
            sample_ids=mb["sample_ids"], positions=mb["position_ids"], run_seed=self.cfg.run.seed, step=self.step
        )

    # ---- one rollout step --------------------------------------------------------------------

    def update_step(
        self,
        batch: RolloutBatch,
        timer: Callable | None = None,
        plan: StepPlan | None = None,
        step: int | None = None,
    ) -> StepResult:
        """Old statistics, then per mini-batch: threshold, selection, one optimizer step (counted).
        ``timer(name)``: a context manager per phase; ``plan``: micro-batches laid out by the
        caller (benchmarks/update.py's padded reference) instead of :func:`plan_step`'s."""
        phase = timer or (lambda name: contextlib.nullcontext())
        self.step = step  # the training step, for rules that draw at random (None: none given)
        if plan is None:
            with phase("microbatches"):
                plan = plan_step(batch, self.cfg, self.ctx, self.pad_to_multiple)
        forward_all = [mb for m in plan.minibatches for mb in m.forward]
        with phase("statistics"):
            old_stats = self.statistics(forward_all)
        skipped_stats: list[TokenStats] = []
        if plan.skipped_forward:  # metrics only: every response token of the step, for every preset
            with phase("skipped_statistics"):
                skipped_stats = self.statistics(plan.skipped_forward)
        # over every response token of the step; its mean entropy is STARE's gate (last stage; None elsewhere)
        step_statistics = rollout_statistics(self.ctx, old_stats + skipped_stats, forward_all + plan.skipped_forward)
        step_entropy = step_statistics.mean_entropy
        metrics = {**plan.metrics, **step_statistics.metrics}
        metrics.update(candidate_mismatch(self.ctx, old_stats, forward_all, self.algo.tau_p))
        old = self._to_slots(plan.slots, forward_all, old_stats) if self.last_stage else None
        ref = None
        if self.reference is not None:
            with phase("reference"):
                ref = self.reference_logprobs(plan.slots, forward_all)
        results, microbatches, decided_on = [], [], []
        first = 0
        for j, minibatch in enumerate(plan.minibatches):
            current = old
            threshold = None
            if needs_statistics_pass(self.algo):
                if j == 0:
                    current_stats = old_stats[first : first + len(minibatch.forward)]
                else:
                    with phase("statistics"):
                        current_stats = self.statistics(minibatch.forward)
                if self.last_stage:
                    threshold = minibatch_threshold(self.algo, current_stats, self.dp_group)
                    current = self._to_slots(plan.slots, minibatch.forward, current_stats) if j else old
            first += len(minibatch.forward)
            with phase("update"):
                result, stats = self.train_minibatch(minibatch, old, current, threshold, ref, step_entropy)
            self._count(result)
            results.append(result)
            microbatches.append(minibatch.update)
            decided_on.append(stats)
        return StepResult(metrics, results, microbatches, decided_on)

    # ---- one optimizer step ------------------------------------------------------------------

    def prepare(
        self, minibatch: MinibatchPlan, old, current, threshold, ref, step_entropy: float | None
    ) -> tuple[list[PreparedMicrobatch], list[TokenStats]]:
        """The update micro-batches of ``minibatch`` with their loss inputs, and the statistics each
        selection read (see :meth:`train_minibatch`; last stage: the tensors alone elsewhere)."""
        if not self.last_stage:
            return [PreparedMicrobatch(mb, None, None, None, 0, 0) for mb in minibatch.update], []
        scoped = needs_statistics_pass(self.algo)
        skipped_count = (
            minibatch.skipped_tokens if self.algo.aggregation == "token_mean" else minibatch.skipped_sequences
        )
        prepared, decided_on = [], []
        for k, mb in enumerate(minibatch.update):
            stats = self._read_slots(current, mb, step_entropy)
            decided_on.append(stats)
            counts_skipped = k == 0 and self.ctx.dp_rank == 0  # once over the data-parallel group
            prepared.append(
                PreparedMicrobatch(
                    tensors=mb,
                    old_logprob=old[0][mb["token_index"]],
                    ref_logprob=ref[mb["token_index"]] if ref is not None else None,
                    selection=select_tokens(self.algo, stats, threshold) if scoped else None,
                    skipped_count=skipped_count if counts_skipped else 0,
                    skipped_tokens=minibatch.skipped_tokens if counts_skipped else 0,
                )
            )
        return prepared, decided_on

    def train_minibatch(
        self, minibatch: MinibatchPlan, old, current, threshold, ref=None, step_entropy: float | None = None
    ) -> tuple[MinibatchResult, list]:
        """Accumulate the masked loss over the mini-batch's update micro-batches and take one
        optimizer step. ``old``/``current``: per-rank token vectors (log-prob, entropy) before this
        step's first update and under the weights about to be updated (last stage; None
        elsewhere); ``threshold``: the rule's mini-batch threshold (None: the micro-batch decides);
        ``ref``: the reference model's log-prob vector (KL penalty; None without one);
        ``step_entropy``: the step's mean policy entropy (``policy/entropy``), for gated rules (STARE)."""
        prepared, decided_on = self.prepare(minibatch, old, current, threshold, ref, step_entropy)
        decided_in_loss: list[Selection] = []  # selections made in the loss (no mini-batch threshold)
        positives: list[PositiveTokens] = []  # per micro-batch, for the quadrant/* metrics

        def loss_fn(logits, item: PreparedMicrobatch):
            loss_sum, num_tokens, metrics, positive, selection = self._microbatch_loss(logits, item, step_entropy)
            positives.append(positive)
            if item.selection is None:
                decided_in_loss.append(selection)
            return loss_sum, num_tokens, {"metrics": metrics}

        for chunk in self.model if isinstance(self.model, list) else [self.model]:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = forward_backward(self.model, prepared, loss_fn, tensors_of=lambda item: item.tensors)
        selections = decided_in_loss or [p.selection for p in prepared if p.selection is not None]
        skipped, metrics = self._optimizer_step(reports)
        if self.last_stage:
            metrics.update(
                quadrant_metrics(positives, self.algo.tau_p, self.algo.tau_h, self.dp_group, device=self.ctx.device)
            )
        return MinibatchResult(metrics=metrics, skipped=skipped, selections=selections), decided_on

    def _microbatch_loss(self, logits, item: PreparedMicrobatch, step_entropy: float | None):
        """(loss_sum, num_tokens, raw metrics, positive-token gradients, selection) of one micro-batch."""
        batch = item.tensors
        assert item.old_logprob is not None  # prepared on the last stage, the only one with a loss
        logprob, entropy, others_square_sum = vocab_parallel_token_statistics(
            logits, batch["labels"], **self._vocab_parallel_args(entropy_grad=self.algo.entropy_coef > 0)
        )
        selection = item.selection
        if selection is None:  # a rule without a mini-batch threshold: this micro-batch decides
            stats = TokenStats(
                logprob.detach(),
                entropy.detach(),
                batch["advantages"],
                batch["response_mask"],
                step_entropy=step_entropy,
                **self._token_identity(batch),
            )
            selection = select_tokens(self.algo, stats, None)
        loss_sum, num_tokens, metrics = self.loss(
            LossInputs(
                logprob,
                item.old_logprob,
                batch["advantages"],
                selection.keep,
                response_mask=batch["response_mask"],
                entropy=entropy,
                ref_logprob=item.ref_logprob,
                rollout_logprob=batch["rollout_logprobs"],
                segment_ids=batch["segment_ids"],
                candidates=selection.candidates,
                tau_h=selection.tau_h,
                objective_seed=self.loss.objective_seed(batch["labels"]),
            )
        )
        positive = positive_token_gradients(
            loss_sum, logprob, entropy, others_square_sum, batch["advantages"], batch["response_mask"]
        )
        if item.skipped_tokens:
            # left-out zero-advantage sequences: kept by the rule, no gradient, in the denominator
            num_tokens = num_tokens + item.skipped_count
            skipped = torch.tensor(float(item.skipped_tokens), dtype=torch.float64, device=logprob.device)
            metrics = {
                **metrics,
                "kept_tokens": metrics["kept_tokens"] + skipped,
                "response_tokens": metrics["response_tokens"] + skipped,
                "skipped_tokens": skipped,
            }
        return loss_sum, num_tokens, metrics, positive, selection

    def _optimizer_step(self, reports: list[dict]) -> tuple[bool, dict[str, float]]:
        """One optimizer step after the mini-batch's backward passes, skipped on every rank when a
        loss or gradient is not finite on any; (skipped, the step's logged metrics)."""
        local = reduce_metrics([r["metrics"] for r in reports]) if reports else {}
        if self.last_stage:
            local.setdefault("skipped_tokens", torch.zeros((), dtype=torch.float64, device=self.ctx.device))
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
            metrics.update(summarize_loss_metrics(all_reduce_metrics(local, self.dp_group)))
        return skipped, metrics

    def _grads_finite(self) -> bool:
        chunks = self.model if isinstance(self.model, list) else [self.model]
        for chunk in chunks:
            for buffer in getattr(chunk, "buffers", []):
                if not torch.isfinite(buffer.grad_data).all():
                    return False
        return True


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
        payload: list[dict[str, float]] = [{}]  # the reporter's metrics, received here
        dist.recv_object_list(payload, src=pipeline[-1], group=ctx.cpu_group)
        return {**payload[0], **metrics}
    return metrics
