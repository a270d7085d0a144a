"""The policy update of one rollout step: the micro-batch plan, token statistics passes, the
masked loss and the optimizer steps.

Each optimizer mini-batch's sequences are split over the data-parallel ranks by tokens
(:func:`~stapo_megatron.trainer.batch.balance_over_ranks`) and packed into micro-batches of at
most ``batch.max_tokens_per_microbatch`` tokens for forward/backward and
``batch.max_tokens_per_forward`` for the forward-only statistics passes, the same number on
every rank (empty ones fill up). Statistics live in per-rank token vectors
(:class:`~stapo_megatron.trainer.batch.TokenSlots`), so a pass in one layout feeds the loss in
the other. Sequences with advantage 0 are left out when nothing of the configured loss reads them
(:func:`~stapo_megatron.loss.zero_advantage_skippable`); their kept tokens are added to the loss
denominator, so the update is the same. They still get a forward-only statistics pass of their
own, which feeds only the step's metrics: the policy entropy and its quantiles cover every
response token of the step for every preset (``time/skipped_statistics`` is its cost).

Everything about tokens happens on the last pipeline stage, where the logits are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from stapo_megatron.loss import (
    TokenStats,
    all_reduce_metrics,
    get_objective,
    minibatch_threshold,
    mismatch_sums,
    needs_statistics_pass,
    policy_loss,
    reduce_metrics,
    s2t_candidates,
    select_tokens,
    summarize_mismatch,
    token_seed,
    vocab_parallel_logprob_entropy,
    zero_advantage_skippable,
)
from stapo_megatron.loss.diagnostics import (
    PositiveTokens,
    entropy_quantiles,
    positive_token_gradients,
    quadrant_metrics,
)
from stapo_megatron.loss.logprob_entropy import vocab_parallel_token_statistics
from stapo_megatron.loss.metrics import Reduction, combine_steps, declare
from stapo_megatron.models.qwen3.parallelize import sequence_multiple
from stapo_megatron.runtime.distributed import ParallelContext
from stapo_megatron.trainer.batch import (
    RolloutBatch,
    TokenSlots,
    balance_over_ranks,
    make_microbatches,
    model_tokens,
    pack_by_budget,
    token_imbalance,
    token_slots,
)
from stapo_megatron.trainer.reference import ReferenceModel
from stapo_megatron.trainer.schedule import forward_backward, forward_only


@dataclasses.dataclass
class MinibatchResult:
    metrics: dict[str, float]
    skipped: bool
    selections: list  # per micro-batch Selection (last stage), for the inspector


@dataclasses.dataclass
class MinibatchPlan:
    """One optimizer mini-batch on this data-parallel rank."""

    update: list[dict]  # packed micro-batches of the update budget; the same count on every rank
    forward: list[dict]  # packed micro-batches of the forward budget; the same count on every rank
    # Of the whole mini-batch (every rank): what the left-out zero-advantage sequences add to the
    # loss denominator: their response tokens (token_mean), their sequences with one (seq_mean_token_mean).
    skipped_tokens: int
    skipped_sequences: int


@dataclasses.dataclass
class StepPlan:
    minibatches: list[MinibatchPlan]
    slots: TokenSlots  # this rank's sequences of the whole step
    metrics: dict[str, float]  # batch/*: computed alike on every rank from the whole batch
    # The left-out zero-advantage sequences of the whole step, packed by the forward budget, the
    # same count on every rank (none when nothing is left out): the metrics-only statistics pass.
    skipped_forward: list[dict] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepResult:
    metrics: dict[str, float]
    results: list[MinibatchResult]
    microbatches: list[list[dict]]  # per mini-batch, its update micro-batches
    decided_on: list[list[TokenStats]]  # the statistics each mini-batch's selection read, per micro-batch


# The plan's metrics: one row per mini-batch, combined over the step by these reductions.
declare(
    Reduction.SUM,
    {
        "batch/sequences": "sequences of the step",
        "batch/model_tokens": "model tokens of the update micro-batches, padding included, all data-parallel ranks",
    },
)
declare(
    Reduction.MAX,
    {
        "batch/dp_token_imbalance": "largest over the mini-batches of (largest rank's tokens - mean) / mean",
    },
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "batch/skipped_fraction": "zero-advantage sequences left out of the passes / sequences",
    },
    weight="batch/sequences",
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "batch/padding_fraction": "padding / model tokens of the update micro-batches",
    },
    weight="batch/model_tokens",
)


def plan_step(batch: RolloutBatch, cfg, ctx: ParallelContext, pad_to_multiple: int = 1) -> StepPlan:
    """Mini-batches of whole groups, split over data-parallel ranks and packed by tokens (see the
    module docstring). Every rank computes every rank's share from the same batch, so the agreed
    micro-batch counts (the largest over the data-parallel ranks) need no communication.

    Metrics: per mini-batch, combined over the step by their declarations (above).
    """
    b = cfg.batch
    groups = int(batch.group_ids.max()) + 1
    count = min(b.minibatches_per_step, groups)
    bounds = [round(i * groups / count) for i in range(count + 1)]
    lengths = [model_tokens(batch, i) for i in range(len(batch))]
    skippable = b.skip_zero_advantage and zero_advantage_skippable(cfg.algo)
    # the largest multiples of pad_to_multiple in the budgets: padding never takes a row over them
    update_budget = b.max_tokens_per_microbatch // pad_to_multiple * pad_to_multiple
    forward_budget = b.max_tokens_per_forward // pad_to_multiple * pad_to_multiple
    mine_all: list[int] = []
    left_out_all: list[int] = []
    shares: list[tuple[list[list[int]], list[list[int]], list[int]]] = []  # this rank's (update, forward, skipped)
    rows: list[dict[str, float]] = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sequences = [i for i in range(len(batch)) if lo <= int(batch.group_ids[i]) < hi]
        zero = [i for i in sequences if skippable and float(batch.advantages[i]) == 0.0]
        left_out = set(zero)
        if b.entropy_over_skipped:  # a forward-only pass for the step's metrics (batch.entropy_over_skipped)
            left_out_all.extend(zero)
        run = [i for i in sequences if i not in left_out]
        parts = balance_over_ranks(run, lengths, ctx.dp_size)
        update_bins = [pack_by_budget(part, lengths, update_budget) for part in parts]
        forward_bins = [pack_by_budget(part, lengths, forward_budget) for part in parts]
        update_count = max(1, *(len(x) for x in update_bins))
        forward_count = max(1, *(len(x) for x in forward_bins))
        update_tokens = padded_tokens = 0
        for bins in update_bins:
            for chunk in bins + [[]] * (update_count - len(bins)):
                tokens = sum(lengths[i] for i in chunk)
                update_tokens += tokens
                padded_tokens += -(-max(tokens, 1) // pad_to_multiple) * pad_to_multiple
        mine = parts[ctx.dp_rank]
        mine_all.extend(mine)
        shares.append(
            (
                update_bins[ctx.dp_rank] + [[]] * (update_count - len(update_bins[ctx.dp_rank])),
                forward_bins[ctx.dp_rank] + [[]] * (forward_count - len(forward_bins[ctx.dp_rank])),
                zero,
            )
        )
        rows.append(
            {
                "batch/dp_token_imbalance": token_imbalance(parts, lengths),
                "batch/sequences": float(len(sequences)),
                "batch/skipped_fraction": len(zero) / len(sequences),
                "batch/model_tokens": float(padded_tokens),
                "batch/padding_fraction": 1.0 - update_tokens / padded_tokens if padded_tokens else 0.0,
            }
        )
    slots = token_slots(batch, mine_all)
    minibatches = []
    for update_share, forward_share, zero in shares:
        minibatches.append(
            MinibatchPlan(
                update=make_microbatches(batch, update_share, ctx.device, slots=slots, pad_to_multiple=pad_to_multiple),
                forward=make_microbatches(
                    batch, forward_share, ctx.device, slots=slots, pad_to_multiple=pad_to_multiple
                ),
                skipped_tokens=sum(len(batch.response_ids[i]) for i in zero),
                skipped_sequences=sum(1 for i in zero if batch.response_ids[i]),
            )
        )
    skipped_bins = [
        pack_by_budget(part, lengths, forward_budget) for part in balance_over_ranks(left_out_all, lengths, ctx.dp_size)
    ]
    skipped_count = max(len(x) for x in skipped_bins)
    mine_skipped = skipped_bins[ctx.dp_rank] + [[]] * (skipped_count - len(skipped_bins[ctx.dp_rank]))
    skipped_forward = (
        make_microbatches(batch, mine_skipped, ctx.device, pad_to_multiple=pad_to_multiple) if skipped_count else []
    )
    return StepPlan(minibatches, slots, combine_steps(rows), skipped_forward)


# Of each optimizer step (PolicyUpdater.train_minibatch); the loss's own metrics are declared in
# stapo_megatron.loss.policy, their logged forms at summarize_loss_metrics.
declare(
    Reduction.SUM,
    {
        "skipped_tokens": "response tokens of the left-out zero-advantage sequences (in the loss denominator, not run)",
    },
)
declare(
    Reduction.MEAN,
    {
        "optim/grad_norm": "gradient norm before clipping (plain mean over the step's optimizer steps)",
        "optim/lr": "learning rate (one value per training step: the scheduler steps after the last mini-batch)",
    },
)


class PolicyUpdater:
    """Owns the update of a step: the plan, the statistics passes, thresholds and selections, the
    loss inputs of each micro-batch (passed to the loss by the micro-batch's identity, never
    written into it), and the optimizer steps."""

    def __init__(self, model, optimizer, cfg, arch, ctx: ParallelContext, reference: ReferenceModel | None = None):
        # No scheduler here: the trainer steps it once per training step, after all mini-batches.
        # ``reference``: the frozen model of the KL penalty (needed when algo.kl_coef > 0).
        if cfg.algo.kl_coef > 0 and reference is None:
            raise ValueError("reference: algo.kl_coef > 0 needs the frozen reference model")
        self.model, self.optimizer, self.reference = model, optimizer, reference
        self.cfg, self.algo, self.arch = cfg, cfg.algo, arch
        self.ctx = ctx
        self.last_stage = ctx.is_last_stage
        self.tp_group = ctx.tp_group
        self.dp_group = ctx.dp_group
        self.step: int | None = None  # set by update_step
        # sequence parallelism splits the packed row over the tensor-parallel ranks
        self.pad_to_multiple = sequence_multiple(ctx.tp_size, cfg.parallel.sequence_parallel)

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

    def _read_slots(self, tables: tuple[torch.Tensor, torch.Tensor], mb: dict) -> TokenStats:
        logprob, entropy = (t[mb["token_index"]] for t in tables)
        return TokenStats(logprob, entropy, mb["advantages"], mb["response_mask"], **self._token_identity(mb))

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
        on_result: Callable[[MinibatchResult], None] | None = None,
        plan: StepPlan | None = None,
        step: int | None = None,
    ) -> StepResult:
        """Old statistics, then per mini-batch: threshold, selection, one optimizer step.
        ``timer(name)``: a context manager per phase; ``on_result``: called after each optimizer
        step (the trainer counts skipped steps there); ``plan``: micro-batches laid out by the
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
        metrics = dict(plan.metrics)
        metrics.update(rollout_statistics(self.ctx, old_stats + skipped_stats, forward_all + plan.skipped_forward))
        metrics.update(candidate_mismatch(self.ctx, old_stats, forward_all, self.algo.tau_p))
        # the mean over every response token of the step (last stage; None elsewhere): STARE's gate
        step_entropy = metrics.get("policy/entropy")
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
            if on_result is not None:
                on_result(result)
            results.append(result)
            microbatches.append(minibatch.update)
            decided_on.append(stats)
        return StepResult(metrics, results, microbatches, decided_on)

    # ---- one optimizer step ------------------------------------------------------------------

    def train_minibatch(
        self, minibatch: MinibatchPlan, old, current, threshold, ref=None, step_entropy: float | None = None
    ) -> tuple[MinibatchResult, list]:
        """Accumulate the masked loss over the mini-batch's update micro-batches and take one
        optimizer step. ``old``/``current``: per-rank token vectors (log-prob, entropy) before this
        step's first update and under the weights about to be updated (last stage; None
        elsewhere); ``threshold``: the rule's mini-batch threshold (None: the micro-batch decides);
        ``ref``: the reference model's log-prob vector (KL penalty; None without one);
        ``step_entropy``: the step's mean policy entropy (``policy/entropy``), for gated rules (STARE)."""
        microbatches = minibatch.update
        inputs: dict[int, dict] = {}
        decided_on: list[TokenStats] = []
        if self.last_stage:
            scoped = needs_statistics_pass(self.algo)
            for k, mb in enumerate(microbatches):
                stats = self._read_slots(current, mb)
                stats.step_entropy = step_entropy
                decided_on.append(stats)
                counts_skipped = k == 0 and self.ctx.dp_rank == 0  # once over the data-parallel group
                inputs[id(mb)] = {
                    "old_logprob": old[0][mb["token_index"]],
                    "ref_logprob": ref[mb["token_index"]] if ref is not None else None,
                    "selection": select_tokens(self.algo, stats, threshold) if scoped else None,
                    # what the left-out sequences add to the denominator, and their response tokens
                    "skipped_count": (
                        minibatch.skipped_tokens
                        if self.algo.aggregation == "token_mean"
                        else minibatch.skipped_sequences
                    )
                    if counts_skipped
                    else 0,
                    "skipped_tokens": minibatch.skipped_tokens if counts_skipped else 0,
                }

        collected = []
        positives: list[PositiveTokens] = []  # per micro-batch, for the quadrant/* metrics

        def loss_fn(logits, batch):
            given = inputs[id(batch)]
            logprob, entropy, others_square_sum = vocab_parallel_token_statistics(
                logits, batch["labels"], **self._vocab_parallel_args(entropy_grad=self.algo.entropy_coef > 0)
            )
            selection = given["selection"]
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
                collected.append(selection)
            loss_sum, num_tokens, metrics = policy_loss(
                logprob,
                given["old_logprob"],
                batch["advantages"],
                selection.keep,
                eps_low=self.algo.eps_low,
                eps_high=self.algo.eps_high,
                clip_ratio_c=self.algo.clip_ratio_c,
                log_ratio_clamp=self.algo.log_ratio_clamp,
                ref_logprob=given["ref_logprob"],
                kl_coef=self.algo.kl_coef,
                kl_estimator=self.algo.kl_estimator,
                entropy=entropy,
                entropy_coef=self.algo.entropy_coef,
                aggregation=self.algo.aggregation,
                response_mask=batch["response_mask"],
                candidates=selection.candidates,
                tau_h=selection.tau_h,
                rollout_logprob=batch["rollout_logprobs"],
                rollout_correction=self.algo.rollout_correction,
                rollout_correction_cap=self.algo.rollout_correction_cap,
                rollout_correction_floor=self.algo.rollout_correction_floor,
                segment_ids=batch["segment_ids"],
                objective=self.algo.objective,
                objective_cfg=self.algo,
                objective_seed=token_seed(batch["labels"]) if get_objective(self.algo.objective).draws_random else 0,
            )
            positives.append(
                positive_token_gradients(
                    loss_sum, logprob, entropy, others_square_sum, batch["advantages"], batch["response_mask"]
                )
            )
            if given["skipped_tokens"]:
                # left-out zero-advantage sequences: kept by the rule, no gradient, in the denominator
                num_tokens = num_tokens + given["skipped_count"]
                skipped = torch.tensor(float(given["skipped_tokens"]), dtype=torch.float64, device=logprob.device)
                metrics = {
                    **metrics,
                    "kept_tokens": metrics["kept_tokens"] + skipped,
                    "response_tokens": metrics["response_tokens"] + skipped,
                    "skipped_tokens": skipped,
                }
            return loss_sum, num_tokens, {"metrics": metrics}

        for chunk in self.model if isinstance(self.model, list) else [self.model]:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = forward_backward(self.model, microbatches, loss_fn)
        selections = collected or [inputs[id(mb)]["selection"] for mb in microbatches if id(mb) in inputs]

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
            reduced = all_reduce_metrics(local, self.dp_group)
            metrics.update(summarize_loss_metrics(reduced))
            metrics.update(
                quadrant_metrics(positives, self.algo.tau_p, self.algo.tau_h, self.dp_group, device=self.ctx.device)
            )
        return MinibatchResult(metrics=metrics, skipped=skipped, selections=selections), decided_on

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
            stats.logprob,
            mb["rollout_logprobs"],
            mb["response_mask"],
            s2t_candidates(stats.logprob, stats.advantages, mb["response_mask"], tau_p),
        )
        for stats, mb in zip(old_stats, microbatches)
    )
    return summarize_mismatch(all_reduce_metrics(sums, ctx.dp_group))


declare(
    Reduction.SUM,
    {
        "old_response_tokens": "response tokens of the old-policy statistics passes",
        "old_entropy_sum": "sum of the old policy's entropy over them",
        "old_mismatch_abs_sum": "sum of |log pi_old - log pi_rollout| over them",
        "policy/statistics_tokens": "response tokens of the step, all data-parallel ranks, zero-advantage ones "
        "included (what policy/entropy, its quantiles and mismatch/logprob_abs_* cover; with "
        "batch.entropy_over_skipped off: only the sequences run)",
    },
)
declare(
    Reduction.MAX,
    {
        "old_mismatch_abs_max": "largest |log pi_old - log pi_rollout| over them (0: none)",
        "mismatch/logprob_abs_max": "largest |log pi_old - log pi_rollout| over every response token of the step",
    },
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "policy/entropy": "mean entropy of the old policy over every response token of the step, zero-advantage "
        "sequences included (those batch.skip_zero_advantage leaves out of the update get a forward-only pass "
        "for it; with batch.entropy_over_skipped off: only the sequences run), the same population for every "
        "preset",
        "mismatch/logprob_abs_mean": "mean |log pi_old - log pi_rollout| over every response token of the step",
    },
    weight="policy/statistics_tokens",
)


def rollout_statistics(ctx: ParallelContext, old_stats: list[TokenStats], microbatches: list[dict]) -> dict[str, float]:
    """Policy entropy with its quantiles (:func:`~stapo_megatron.loss.diagnostics.entropy_quantiles`)
    and the train/rollout log-prob mismatch (declared above) over the response tokens of
    ``microbatches`` on every rank of the data-parallel group (the update passes every response
    token of the step); computed on the last stage (empty elsewhere). Collective over ``ctx.dp_group``."""
    if not ctx.is_last_stage:
        return {}

    def raw(stats: TokenStats, mb: dict) -> dict[str, torch.Tensor]:
        mask = mb["response_mask"] > 0
        mismatch = (stats.logprob - mb["rollout_logprobs"])[mask].abs().double()
        return {
            "old_response_tokens": mask.sum().double(),
            "old_entropy_sum": stats.entropy[mask].double().sum(),
            "old_mismatch_abs_sum": mismatch.sum(),
            "old_mismatch_abs_max": mismatch.max() if mismatch.numel() else mismatch.new_zeros(()),
        }

    zero = torch.zeros((), dtype=torch.float64, device=ctx.device)
    local = reduce_metrics(
        [
            dict.fromkeys(
                ("old_response_tokens", "old_entropy_sum", "old_mismatch_abs_sum", "old_mismatch_abs_max"), zero
            )
        ]
        + [raw(stats, mb) for stats, mb in zip(old_stats, microbatches)]
    )
    totals = all_reduce_metrics(local, ctx.dp_group, device=ctx.device)
    tokens = float(totals["old_response_tokens"])
    entropies = [stats.entropy[mb["response_mask"] > 0] for stats, mb in zip(old_stats, microbatches)]
    return {
        "policy/statistics_tokens": tokens,
        "policy/entropy": float(totals["old_entropy_sum"]) / max(tokens, 1.0),
        **entropy_quantiles(entropies, ctx.dp_group, device=ctx.device),
        "mismatch/logprob_abs_mean": float(totals["old_mismatch_abs_sum"]) / max(tokens, 1.0),
        "mismatch/logprob_abs_max": float(totals["old_mismatch_abs_max"]),
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
        payload: list[dict[str, float]] = [{}]  # the reporter's metrics, received here
        dist.recv_object_list(payload, src=pipeline[-1], group=ctx.cpu_group)
        return {**payload[0], **metrics}
    return metrics


# The logged metrics of one optimizer step (summarize_loss_metrics), combined over the optimizer
# steps of a training step (stapo_megatron.loss.metrics.combine_steps) by these reductions.
# "Run tokens": kept tokens of the sequences run through the loss (left-out zero-advantage ones
# count in the loss denominator but were not computed).
declare(
    Reduction.SUM,
    {
        "policy/response_tokens": "response tokens, all data-parallel ranks (left-out zero-advantage ones included)",
        "policy/kept_tokens": "tokens in the loss denominator (left-out zero-advantage ones included)",
        "policy/run_tokens": "kept tokens of the sequences run through the loss",
        "s2t/silenced_tokens": "response tokens the token rule silenced",
        "s2t/candidates": "S2T candidates",
        "s2t/silenced_candidates": "S2T candidates the rule silenced",
    },
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "s2t/masked_fraction": "silenced / response tokens",
        "rollout_correction/rejected_fraction": "tokens the masked rollout correction rejected / response tokens",
    },
    weight="policy/response_tokens",
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "policy/pg_loss": "policy-gradient term per token of the loss denominator",
    },
    weight="policy/kept_tokens",
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "policy/clip_low_fraction": "run tokens with A < 0 clipped at 1 - eps_low",
        "policy/clip_high_fraction": "run tokens with A > 0 clipped at 1 + eps_high",
        "policy/dual_clip_fraction": "run tokens the dual-clip caps",
        "policy/approx_kl": "mean k3(old || current) per run token",
        "policy/ratio_mean": "mean importance ratio per run token",
        "policy/entropy_kept": "mean entropy of the current policy per run token (only the sequences run)",
        "policy/ref_kl": "mean KL estimate against the reference policy per run token",
        "rollout_correction/weight_mean": "mean rollout-correction weight per run token",
        "rollout_correction/truncated_fraction": "run tokens whose rollout-correction weight was cut at the cap",
    },
    weight="policy/run_tokens",
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "s2t/entropy_silenced": "mean entropy of the current policy over the silenced tokens",
    },
    weight="s2t/silenced_tokens",
)
declare(Reduction.MAX, {"policy/ratio_max": "largest importance ratio of a run token"})
declare(Reduction.MIN, {"policy/ratio_min": "smallest importance ratio of a run token"})
declare(
    Reduction.MEAN,
    {
        "s2t/tau_h": "entropy threshold, mean over the optimizer steps that had one (null: none had)",
    },
)
# The policy objective's (stapo_megatron.loss.objectives), logged when it reports them.
declare(
    Reduction.SUM,
    {
        "objective/cov_candidate_tokens": "clip_cov: unclipped tokens with clip_cov_lb < Cov < clip_cov_ub",
        "objective/cov_selected_tokens": "clip_cov / kl_cov: tokens the covariance picked",
        "objective/gspo_sequences": "gspo: sequences with a token in the loss",
    },
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "objective/cov_selected_fraction": "clip_cov / kl_cov: picked tokens / run tokens",
        "objective/kl_cov_penalty": "kl_cov: kl_cov_coef * |log r| summed over the picked tokens, per run token",
    },
    weight="policy/run_tokens",
)
declare(
    Reduction.WEIGHTED_MEAN,
    {
        "objective/gspo_clipped_fraction": "gspo: sequences whose ratio s_i is clipped on the side A pushes it / "
        "sequences",
    },
    weight="objective/gspo_sequences",
)


def summarize_loss_metrics(m: dict[str, torch.Tensor]) -> dict[str, float]:
    """The logged metrics (declared above) of one optimizer step from its reduced raw ones: exact
    mini-batch means from summed counts."""

    def value(key: str) -> float:
        return float(m[key]) if key in m else 0.0

    def ratio(num: str, den: str) -> float:
        return value(num) / value(den) if value(den) > 0 else 0.0

    # Left-out zero-advantage tokens are in kept/response tokens (the loss denominator) but were
    # not run: per-token means of what was computed divide by the tokens run.
    run = value("kept_tokens") - value("skipped_tokens")

    def per_run_token(num: str) -> float:
        return value(num) / run if run > 0 else 0.0

    out = {
        "s2t/masked_fraction": ratio("silenced_tokens", "response_tokens"),
        "s2t/silenced_tokens": value("silenced_tokens"),
        "policy/kept_tokens": value("kept_tokens"),
        "policy/response_tokens": value("response_tokens"),
        "policy/run_tokens": run,
        "policy/pg_loss": ratio("pg_loss_sum", "kept_tokens"),
        "policy/clip_low_fraction": per_run_token("clip_low_tokens"),
        "policy/clip_high_fraction": per_run_token("clip_high_tokens"),
        "policy/dual_clip_fraction": per_run_token("dual_clip_tokens"),
        "policy/approx_kl": per_run_token("approx_kl_sum"),
        "policy/ratio_mean": per_run_token("ratio_sum"),
        "policy/entropy_kept": per_run_token("entropy_kept_sum"),
    }
    if "ratio_max" in m and math.isfinite(float(m["ratio_max"])):
        out["policy/ratio_max"] = float(m["ratio_max"])
        out["policy/ratio_min"] = float(m["ratio_min"])
    if "ref_kl_sum" in m:  # a reference policy is given
        out["policy/ref_kl"] = per_run_token("ref_kl_sum")
    if "rollout_weight_sum" in m:  # a rollout correction is on
        out["rollout_correction/weight_mean"] = per_run_token("rollout_weight_sum")
        out["rollout_correction/truncated_fraction"] = per_run_token("rollout_truncated_tokens")
        out["rollout_correction/rejected_fraction"] = ratio("rollout_rejected_tokens", "response_tokens")
    if "candidate_tokens" in m:
        out["s2t/candidates"] = value("candidate_tokens")
        out["s2t/silenced_candidates"] = value("silenced_candidate_tokens")
    silenced = value("silenced_tokens")
    out["s2t/entropy_silenced"] = value("entropy_silenced_sum") / silenced if silenced > 0 else 0.0
    # No candidates (no threshold) is logged as null, so the series keeps its gaps.
    out["s2t/tau_h"] = ratio("tau_h_sum", "tau_h_count") if value("tau_h_count") > 0 else float("nan")
    if "cov_selected_tokens" in m:  # clip_cov / kl_cov
        out["objective/cov_selected_tokens"] = value("cov_selected_tokens")
        out["objective/cov_selected_fraction"] = per_run_token("cov_selected_tokens")
    if "cov_candidate_tokens" in m:
        out["objective/cov_candidate_tokens"] = value("cov_candidate_tokens")
    if "kl_cov_penalty_sum" in m:
        out["objective/kl_cov_penalty"] = per_run_token("kl_cov_penalty_sum")
    if "gspo_sequences" in m:
        out["objective/gspo_sequences"] = value("gspo_sequences")
        out["objective/gspo_clipped_fraction"] = ratio("gspo_clipped_sequences", "gspo_sequences")
    return out
