"""The ``stapo train`` config: every section, and the checks that run before any process starts."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

from stapo_megatron.config import MAX_BATCH, MAX_SEED, MAX_STEPS, MAX_TOKENS, MAX_VOCAB, ConfigError, option
from stapo_megatron.data.config import DataConfig
from stapo_megatron.eval.config import EvalConfig
from stapo_megatron.loss.config import AlgoConfig, resolve_rollout_correction
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.rewards.config import RewardConfig
from stapo_megatron.rollout.config import RolloutConfig
from stapo_megatron.runtime.distributed import ParallelConfig

MAX_GROUP = 4096  # responses per prompt


@dataclasses.dataclass
class RunConfig:
    name: str = option("stapo", "Run name: names the output directory and the experiment in loggers.")
    output_dir: str = option("", "Directory of metrics, checkpoints and dumps; '' means runs/<name>.")
    steps: int = option(
        300, "Rollout steps to train for (each: sample, score, one or more optimizer steps).", ge=1, le=MAX_STEPS
    )
    seed: int = option(1234, "Seed of model initialisation, sampling and Megatron's RNG tracker.", ge=0, le=MAX_SEED)
    hang_timeout_s: float = option(
        1200.0,
        "A rank that makes no progress (no phase of a step starts, no checkpoint completes) for this long "
        "ends the run with exit code 75, naming the phase and step; below parallel.timeout_minutes.",
        gt=0,
    )

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ConfigError(f"name: must be a non-empty name without '/', got {self.name!r}")

    @property
    def directory(self) -> Path:
        return Path(self.output_dir or os.path.join("runs", self.name))


@dataclasses.dataclass
class BatchConfig:
    REMOVED_FIELDS = {
        "micro_batch_size": "removed: micro-batches are packed by tokens; set batch.max_tokens_per_microbatch "
        "(forward/backward) and batch.max_tokens_per_forward (statistics passes) instead",
    }

    prompts_per_step: int = option(256, "Prompts sampled per rollout step (the paper: 256).", ge=1, le=MAX_BATCH)
    group_size: int = option(8, "Responses sampled per prompt, G (the paper: 8).", ge=1, le=MAX_GROUP)
    prompts_per_minibatch: int = option(
        64,
        "Prompts per optimizer step; prompts_per_step / prompts_per_minibatch optimizer steps per rollout step.",
        ge=1,
        le=MAX_BATCH,
    )
    max_tokens_per_microbatch: int = option(
        18432,
        "Token budget of a forward/backward micro-batch on each data-parallel rank: whole sequences "
        "(prompt + response) packed into one row up to this many tokens; at least the longest "
        "sequence (data.max_prompt_tokens + max_new_tokens).",
        ge=1,
        le=MAX_BATCH * MAX_TOKENS,
    )
    max_tokens_per_forward: int = option(
        36864,
        "Token budget of a micro-batch of the forward-only statistics passes (no activations are "
        "kept for backward, so it can be larger); at least the longest sequence.",
        ge=1,
        le=MAX_BATCH * MAX_TOKENS,
    )
    skip_zero_advantage: bool = option(
        True,
        "Leave sequences with advantage 0 out of the statistics passes and forward/backward when no term "
        "of the loss reads them (no entropy bonus, KL or masked importance sampling; a token rule that "
        "keeps them all); their tokens still count in the loss denominator, so the update is the same.",
    )
    entropy_over_skipped: bool = option(
        True,
        "With skip_zero_advantage: run the left-out zero-advantage sequences through a forward-only pass "
        "(metrics only, never the update) so that policy/entropy, its quantiles and mismatch/logprob_abs_* "
        "cover every response token of the step for every preset; off: only the sequences the update runs "
        "(cheaper by that forward; the curves of presets that skip and of those that cannot are then not "
        "comparable).",
    )
    max_new_tokens: int = option(
        15360, "Longest response in tokens; longer ones are cut (finish reason 'length').", ge=1, le=MAX_TOKENS
    )
    temperature: float = option(
        1.0, "Sampling temperature of rollouts; log-probs are computed at the same temperature.", gt=0, le=100
    )
    top_p: float = option(1.0, "Nucleus sampling of rollouts (1.0: off).", gt=0, le=1)
    top_k: int = option(-1, "Top-k sampling of rollouts (<= 0: off).", ge=-1, le=MAX_VOCAB)
    stop_token_ids: list[int] = option(
        [], "Token ids that end a response; empty: the tokenizer's end-of-text tokens.", ge=0, lt=MAX_VOCAB
    )
    max_sampling_rounds: int = option(
        4,
        "With dynamic sampling: most rounds of sampling per step to fill the batch with informative groups.",
        ge=1,
        le=1000,
    )

    def __post_init__(self):
        if self.group_size < 2:
            raise ConfigError(
                f"group_size: group-relative advantages need at least 2 responses per prompt, got {self.group_size}"
            )
        if self.prompts_per_step % self.prompts_per_minibatch:
            raise ConfigError(
                f"prompts_per_minibatch: {self.prompts_per_minibatch} does not divide prompts_per_step "
                f"{self.prompts_per_step}"
            )

    @property
    def minibatches_per_step(self) -> int:
        return self.prompts_per_step // self.prompts_per_minibatch


@dataclasses.dataclass
class ComputeConfig:
    params_dtype: Literal["float32", "bfloat16"] = option(
        "bfloat16", "dtype of the model's weights and activations (the optimizer keeps fp32 master weights)."
    )
    recompute: Literal["none", "selective", "full"] = option(
        "none", "Activation recomputation: none, selective (attention core) or full (every layer)."
    )
    logits_chunk_size: int = option(
        256,
        "Tokens per chunk when computing log-probs and entropies from the vocabulary-parallel logits.",
        ge=1,
        le=MAX_TOKENS,
    )
    offload_while_generating: bool = option(
        False,
        "Move the trainer's parameters, gradient buffers and optimizer state (and the KL penalty's reference "
        "model, when algo.kl_coef > 0) to (pinned) host memory while the "
        "colocated rollout servers generate, and back for the update, so the servers can take most of each GPU "
        "(rollout.sglang.mem_fraction_static ~0.8); the servers release their memory while the trainer trains. "
        "Needs the rollout on the trainer's GPUs (rollout.sglang.placement: colocated, or the local engine).",
    )


@dataclasses.dataclass
class OptimConfig:
    lr: float = option(
        1e-6,
        "Peak learning rate of AdamW. Changed on resume, it takes effect (as do min_lr, warmup_steps, schedule "
        "and weight_decay), at the checkpoint's point in the schedule.",
        gt=0,
    )
    min_lr: float = option(0.0, "Learning rate at the end of decay (with a decaying schedule).", ge=0)
    warmup_steps: int = option(
        10,
        "Training (rollout) steps of linear warm-up from 0 to lr. The schedule advances once per training "
        "step, after all of its mini-batches (as veRL, the paper's trainer), not once per optimizer step; "
        "the decay after it also runs over run.steps.",
        ge=0,
        le=MAX_STEPS,
    )
    schedule: Literal["constant", "cosine", "linear"] = option("constant", "Learning-rate schedule after warm-up.")
    weight_decay: float = option(0.01, "AdamW decoupled weight decay.", ge=0, le=1)
    beta1: float = option(0.9, "AdamW beta1.", ge=0, lt=1)
    beta2: float = option(0.999, "AdamW beta2.", ge=0, lt=1)
    eps: float = option(1e-8, "AdamW epsilon.", gt=0, le=1)
    clip_grad: float = option(1.0, "Global gradient-norm clipping threshold (0: off).", ge=0)
    distributed: bool = option(
        True, "Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer)."
    )

    def __post_init__(self):
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr: must be in [0, lr], got {self.min_lr}")


@dataclasses.dataclass
class CheckpointConfig:
    save_every: int = option(
        50, "Save a checkpoint every this many rollout steps (0: only at the end and on Ctrl-C).", ge=0, le=MAX_STEPS
    )
    keep_last: int = option(
        3, "Complete checkpoints kept; older ones are deleted once a newer one is whole.", ge=1, le=10_000
    )
    resume: Literal["auto", "never", "required"] = option(
        "auto",
        "auto: continue from the run's latest complete checkpoint when there is one; required: fail without one.",
    )
    load_hf: str = option(
        "", "Start from this Hugging Face Qwen3 directory (converted on the fly, each rank reading its shards)."
    )
    load_megatron: str = option(
        "", "Start from this Megatron checkpoint (written by stapo convert or a previous run; any TP/PP)."
    )

    def __post_init__(self):
        if self.load_hf and self.load_megatron:
            raise ConfigError("load_hf: give either load_hf or load_megatron, not both")


@dataclasses.dataclass
class LoggingConfig:
    tensorboard: bool = option(True, "Write TensorBoard event files under <run>/tensorboard.")
    wandb_project: str = option("", "Log to this Weights & Biases project ('' : off; needs the wandb extra).")
    wandb_entity: str = option("", "Weights & Biases entity (team) of the project.")
    progress_bar: bool = option(True, "Show a progress bar on the console (rank 0).")
    all_ranks: bool = option(
        False,
        "Console messages of every rank, each line naming its rank (default: rank 0's, and every rank's "
        "warnings and errors). STAPO_LOG_ALL_RANKS=1 in the environment does the same for any command.",
    )
    inspect_every: int = option(
        10, "Save the silenced tokens with their context every this many steps (0: never).", ge=0, le=MAX_STEPS
    )
    inspect_context_tokens: int = option(
        16,
        "Tokens of context saved on each side of a silenced token (before it: the response, then the prompt).",
        ge=0,
        le=MAX_TOKENS,
    )


@dataclasses.dataclass
class FaultConfig:
    max_skipped_steps: int = option(
        5,
        "Optimizer steps skipped for a NaN/inf loss or gradient before training stops with an error.",
        ge=0,
        le=MAX_STEPS,
    )


@dataclasses.dataclass
class TrainConfig:
    run: RunConfig = option(doc="Name, output directory, length and seed of the run.", factory=RunConfig)
    model: Qwen3Config = option(
        doc="Qwen3 architecture (a preset name such as qwen3_8b, or the fields).", factory=Qwen3Config
    )
    tokenizer: str = option(
        "", "Hugging Face tokenizer directory; '' : the load_hf directory (the synthetic task has its own)."
    )
    parallel: ParallelConfig = option(doc="Tensor, pipeline, context and data parallel sizes.", factory=ParallelConfig)
    compute: ComputeConfig = option(doc="Precision, recomputation and log-prob chunking.", factory=ComputeConfig)
    data: DataConfig = option(doc="Training prompts.", factory=DataConfig)
    reward: RewardConfig = option(doc="How responses are scored.", factory=RewardConfig)
    rollout: RolloutConfig = option(doc="The rollout engine.", factory=RolloutConfig)
    batch: BatchConfig = option(doc="Rollout and optimizer batch sizes, sampling settings.", factory=BatchConfig)
    algo: AlgoConfig = option(
        doc="The RL algorithm (a preset of configs/algo: stapo, grpo, justrl, ...).", factory=AlgoConfig
    )
    optim: OptimConfig = option(doc="AdamW, schedule and clipping.", factory=OptimConfig)
    checkpoint: CheckpointConfig = option(doc="Saving, resuming and initial weights.", factory=CheckpointConfig)
    logging: LoggingConfig = option(doc="Metrics sinks and the spurious-token inspector.", factory=LoggingConfig)
    eval: EvalConfig = option(doc="Periodic evaluation during training.", factory=EvalConfig)
    faults: FaultConfig = option(doc="What to tolerate before stopping.", factory=FaultConfig)

    @property
    def hf_tokenizer_dir(self) -> str:
        """The Hugging Face tokenizer directory of a real dataset: ``tokenizer``, else ``checkpoint.load_hf``
        ('': neither is set)."""
        return self.tokenizer or self.checkpoint.load_hf

    def __post_init__(self):
        # 'auto': none in the synchronous loop, tis_token when generation runs ahead (docs/async.md)
        self.algo = resolve_rollout_correction(self.algo, self.rollout.async_.max_staleness)
        if (
            self.compute.offload_while_generating
            and self.rollout.engine == "sglang"
            and not self.rollout.sglang.colocated
        ):
            raise ConfigError(
                "compute.offload_while_generating: needs the rollout servers on the trainer's GPUs "
                "(rollout.sglang.placement: colocated); servers on other GPUs never compete for its memory"
            )
        if self.rollout.pipelined:
            if self.compute.offload_while_generating:
                raise ConfigError(
                    "compute.offload_while_generating: the servers generate while the trainer trains "
                    "(rollout.async.max_staleness > 0), so the trainer's state never waits in host memory"
                )
            if self.algo.dynamic_sampling:
                raise ConfigError(
                    "algo.dynamic_sampling: not with rollout.async.max_staleness > 0 (a step's batch is the first "
                    "prompts_per_step groups to finish; resampling filtered groups is not part of the pipeline)"
                )
        longest = self.data.max_prompt_tokens + self.batch.max_new_tokens
        # under sequence parallelism a packed row is padded to a multiple of TP
        multiple = self.parallel.tensor_parallel if self.parallel.sequence_parallel else 1
        for name in ("max_tokens_per_microbatch", "max_tokens_per_forward"):
            budget = getattr(self.batch, name)
            if budget // multiple * multiple < longest:  # checked here, never cut at run time
                raise ConfigError(
                    f"batch.{name}: {budget} tokens is less than the longest sequence, "
                    f"data.max_prompt_tokens + batch.max_new_tokens = {longest}"
                    + (
                        f", in whole multiples of tensor_parallel={multiple} (sequence parallelism)"
                        if multiple > 1
                        else ""
                    )
                )
        collective_s = self.parallel.timeout_minutes * 60
        startup_s = self.rollout.sglang.startup_timeout_s
        if self.rollout.engine == "sglang" and startup_s >= collective_s:
            # the other ranks wait for the node leaders' servers in a collective, which would give up first
            raise ConfigError(
                f"rollout.sglang.startup_timeout_s: {startup_s:g} s must be below the collective timeout "
                f"parallel.timeout_minutes={self.parallel.timeout_minutes} ({collective_s} s)"
            )
        if self.run.hang_timeout_s >= collective_s:
            # a hung collective would end the run first, with no message naming the phase
            raise ConfigError(
                f"run.hang_timeout_s: {self.run.hang_timeout_s:g} s must be below the collective timeout "
                f"parallel.timeout_minutes={self.parallel.timeout_minutes} ({collective_s} s)"
            )
