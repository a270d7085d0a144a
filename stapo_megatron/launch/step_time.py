"""The step-time model of ``stapo plan --async``: how long one training step takes with the servers on
the trainer's GPUs (synchronous, colocated) and on GPUs of their own with generation overlapped with
training (asynchronous, disaggregated).

A step generates ``samples`` responses (prompts_per_step x group_size) of ``response_tokens`` each and
trains on them with their prompts:

    generation   samples x response_tokens / (server GPUs x decode tokens/s per GPU)
    training     samples x (prompt_tokens + response_tokens) / (trainer GPUs x train tokens/s per GPU
                 x pipeline efficiency relative to the reference's)
    synchronous  generation + training + pause          (every GPU does both, in turns)
    asynchronous max(generation, training) + pause + generation / steps
                 (the two overlap; the first batch's generation has nothing to overlap with, which a run
                 of ``steps`` steps pays once)

``pause`` is the weight sync between the two (with colocated servers also their memory release and
resume). Pipeline efficiency is 1F1B's m / (m + p - 1) for p stages and m micro-batches per optimizer
step on a data-parallel rank.

The per-GPU figures are derived from one published pair of runs on the same workload (NeMo-RL v0.5,
docs/about/performance-summary.md, H100 BF16, GRPO on OpenMathInstruct-2, Qwen3-32B, 2,048 samples
per step of 3,251 tokens on average, prompt + response; recipes
examples/configs/recipes/llm/performance/grpo-qwen3-32b-4n8g.yaml and -8n8g-async-1off.yaml):

* on-policy, colocated on 32 GPUs (training TP4 PP4, vLLM TP4): 376 s per step;
* one step off-policy on 64 GPUs, 32 generating and 32 training at the same layouts: 200 s per step.

Assumed: the off-policy step is bound by generation (its weight updates go in flight, so it pauses
for none), which makes generation on 32 GPUs 200 s; the colocated step's transition is 16 s (the
upper end of the 7-16 s bucketed weight syncs of a 30B model the anchors report), which leaves
376 - 200 - 16 = 160 s of training. Prompt tokens are counted as decoded (OpenMathInstruct-2's are a
few percent of the 3,251). Other sizes scale every figure by 32B's parameters over theirs (decode and
training both move or multiply every weight once per token; the weight sync moves each once). The
model ignores the tail of a synchronous generation that waits for its longest response, tensor-
parallel communication, and the KV cache's limit on concurrent sequences; the figures are H100's
(set ``plan.decode_tokens_per_gpu_s`` and ``plan.train_tokens_per_gpu_s`` for other GPUs).
"""

from __future__ import annotations

import dataclasses

REFERENCE_PARAMETERS = 32_762_123_264  # Qwen3-32B (configs/model preset qwen3_32b, num_parameters())
REFERENCE_SAMPLES = 2048  # G-GBS: 64 prompts x 32 generations
REFERENCE_SEQUENCE_TOKENS = 3251  # G-Average Seq len, on-policy row
REFERENCE_GPUS = 32  # GPUs of the on-policy run; each side of the one-step-off run
REFERENCE_SYNC_STEP_S = 376.0
REFERENCE_ASYNC_STEP_S = 200.0
REFERENCE_PAUSE_S = 16.0
# the reference's training pipeline: PP 4, T-GBS 512 sequences of micro-batch 1 over DP 2 -> 256 micro-batches
REFERENCE_PIPELINE = 4
REFERENCE_MICROBATCHES = 256

REFERENCE_TOKENS = REFERENCE_SAMPLES * REFERENCE_SEQUENCE_TOKENS
DECODE_TOKENS_PER_GPU_S = REFERENCE_TOKENS / (REFERENCE_ASYNC_STEP_S * REFERENCE_GPUS)  # 1,040.3
TRAIN_TOKENS_PER_GPU_S = REFERENCE_TOKENS / (
    (REFERENCE_SYNC_STEP_S - REFERENCE_ASYNC_STEP_S - REFERENCE_PAUSE_S) * REFERENCE_GPUS
)  # 1,300.4


def pipeline_efficiency(stages: int, microbatches: int) -> float:
    """The busy fraction of a 1F1B pipeline: m / (m + p - 1)."""
    return microbatches / (microbatches + stages - 1)


REFERENCE_EFFICIENCY = pipeline_efficiency(REFERENCE_PIPELINE, REFERENCE_MICROBATCHES)


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Per-GPU rates of one model size: response tokens a server GPU decodes per second, sequence tokens
    a trainer GPU trains on per second (at the reference's pipeline efficiency), and the pause of one
    weight sync."""

    decode_tokens_per_gpu_s: float
    train_tokens_per_gpu_s: float
    pause_s: float

    @classmethod
    def scaled(cls, parameters: int) -> Throughput:
        """The reference's figures for a model of ``parameters`` (see the module docstring)."""
        ratio = REFERENCE_PARAMETERS / parameters
        return cls(DECODE_TOKENS_PER_GPU_S * ratio, TRAIN_TOKENS_PER_GPU_S * ratio, REFERENCE_PAUSE_S / ratio)


@dataclasses.dataclass(frozen=True)
class StepTokens:
    """What one step generates and trains on."""

    samples: int
    prompt_tokens: float  # mean per sample
    response_tokens: float  # expected mean per sample

    @property
    def generated(self) -> float:
        return self.samples * self.response_tokens

    @property
    def trained(self) -> float:
        return self.samples * (self.prompt_tokens + self.response_tokens)


@dataclasses.dataclass(frozen=True)
class StepTime:
    generation_s: float
    training_s: float
    pause_s: float
    startup_s: float  # per step: the first generation that overlaps nothing, spread over the run
    overlapped: bool

    @property
    def total_s(self) -> float:
        if self.overlapped:
            return max(self.generation_s, self.training_s) + self.pause_s + self.startup_s
        return self.generation_s + self.training_s + self.pause_s


def generation_s(tokens: StepTokens, server_gpus: int, rate: Throughput) -> float:
    return tokens.generated / (server_gpus * rate.decode_tokens_per_gpu_s)


def training_s(tokens: StepTokens, trainer_gpus: int, rate: Throughput, efficiency: float) -> float:
    """Training time at a pipeline ``efficiency`` (the reference's trains at REFERENCE_EFFICIENCY)."""
    return tokens.trained / (trainer_gpus * rate.train_tokens_per_gpu_s * efficiency / REFERENCE_EFFICIENCY)


def synchronous_step(tokens: StepTokens, gpus: int, rate: Throughput, efficiency: float) -> StepTime:
    """Every one of ``gpus`` generates, then trains (colocated servers)."""
    return StepTime(
        generation_s(tokens, gpus, rate), training_s(tokens, gpus, rate, efficiency), rate.pause_s, 0.0, False
    )


def asynchronous_step(
    tokens: StepTokens, server_gpus: int, trainer_gpus: int, rate: Throughput, efficiency: float, steps: int
) -> StepTime:
    """Servers on ``server_gpus`` generate the next steps' batches while ``trainer_gpus`` train."""
    generation = generation_s(tokens, server_gpus, rate)
    return StepTime(
        generation, training_s(tokens, trainer_gpus, rate, efficiency), rate.pause_s, generation / steps, True
    )
