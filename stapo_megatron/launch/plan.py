"""``stapo plan``: per-GPU memory of a training layout, and the (TP, PP, DP) layouts that fit.

Symbols: h hidden size, f SwiGLU width, a query heads, q = a x head_dim, k = kv_heads x head_dim,
L layers, V vocabulary (Vp: padded to a multiple of 128 x t), t/p/D tensor/pipeline/data
parallel sizes, s tokens per sequence (prompt + response), b sequences per micro-batch, e bytes
per parameter (2 bf16, 4 fp32), m micro-batches per optimizer step on one DP rank.

Parameters of pipeline stage r (every tensor-parallel rank holds the same count):

    per layer   2h + 2 head_dim + (h q + (q + 2k) h + 3 h f) / t
    N_r         L_r x per layer    [+ Vp h / t embedding, first stage]
                                   [+ h final norm + Vp h / t output layer, last stage; the
                                      output layer exists unless embeddings are tied and p = 1]
    L_r         the layers of stage r: L/p, or when p does not divide L the split of
                models/qwen3/config.py::pipeline_split (first, m, ..., m, last: Megatron's
                uneven first/last stages), which the planner reports

Static bytes (Megatron DDP with an fp32 gradient buffer, as the trainer builds it):

    weights     e x N_buf        N_buf = N_r plus Megatron's buffer alignment: with the distributed
    gradients   4 x N_buf                optimizer each parameter starts at a multiple of 64
                                         elements and each bucket ends at a multiple of lcm(D, 128)
    optimizer   (8 + 4 [e < 4]) x N_shard   Adam's two fp32 moments plus an fp32 master copy of
                                         16-bit weights; N_shard = this DP rank's slice of each
                                         bucket (about N_r / D), or N_r without the distributed
                                         optimizer
    Megatron's local spec (no Transformer Engine) builds the RMSNorm weights in fp32 whatever e
    is: they form a second, fp32 buffer (4 bytes each, no master copy).
    reference   e x N_r          with a KL penalty (algo.kl_coef > 0): the frozen reference model's
                                 weights (no DDP buffer, no gradients); with --offload it leaves with
                                 the optimizer state while the servers generate

Activations: bytes one layer keeps for backward, per token, A (multiply by s b per micro-batch):

    kernels "te" (Transformer Engine: fused norm + linear, flash attention, fused SwiGLU; GPUs)
        none, selective   4 e h + e (3q + 3k + 3f) / t
    kernels "local" (Megatron's local spec: torch RMSNorm with fp32 statistics, unfused attention
    that keeps the softmax, unfused SwiGLU; the coefficients are what these kernels keep, counted
    on CPU)
        none              (16 + 2e) h + ((8 + 5e) q + 12 k + 5e f + (4 + e [e < 4]) a s) / t
        selective         (16 + 2e) h + ((8 + 3e) q + (12 + e) k + 5e f) / t
    full (either)         e h, the layer's input: the layer runs again in backward
    With sequence parallelism (sp, t > 1) every term of h above is divided by t too: the norms,
    residuals and each layer's input hold s/t positions per rank, and the column-parallel layers
    keep their input before the all-gather (gathered again in backward).

Stage r has min(p - r, m) micro-batches in flight (1F1B) and keeps
    kept = min(p - r, m) x L_r x A x s b   [+ the final norm's input and output, last stage; / t with sp]
On top of that, one at a time (the loss's backward ends before the first layer's begins):
    work     one layer's backward working set: te 2e f s b / t (SwiGLU input gradient); local
             4 a s^2 b / t (softmax gradient), plus with selective the recomputed attention core
             ((4 + e [e < 4]) a s + 3e q per token, / t); with full, plus one whole layer (A of none)
    logits   last stage, the loss: the vocabulary-parallel logits and their gradient, 2 e s b Vp / t
             (Megatron also makes a transposed copy of the same size in forward), plus the fp32 chunk
             buffers of stapo_megatron/loss/logprob_entropy.py: 2 x 4 c V/t in forward, 4 c V/t in
             backward for 16-bit logits (+1 with an entropy bonus), c = compute.logits_chunk_size;
             without Transformer Engine also the output layer's weight gradient, e Vp h / t
    activations = kept + max(work, logits)

Per GPU, the two phases of a step with colocated servers holding a share S (their
mem_fraction_static x GPU memory) and a fixed reserve R (CUDA context, NCCL buffers, allocator
fragmentation):
    train phase    weights + gradients + optimizer + activations  (of the worst stage)
                   + S unless the servers release their memory while the trainer runs
                     (--sglang-released) + R
    rollout phase  S + R + what the trainer keeps: weights + gradients + optimizer, or with
                   --offload (compute.offload_while_generating) only the weights, resident for
                   the weight sync while the servers hold their memory
    total          max(train phase, rollout phase)
Rollout capacity of a server of TP t_s (SGLang sizes its KV cache per GPU at start):
    KV bytes per token per GPU   2 x L x max(kv_heads / t_s, 1) x head_dim x 2 (bf16 cache)
    KV cache per GPU             S - (parameters x 2) / t_s
    tokens per server            floor(KV cache per GPU / KV bytes per token per GPU)
    sequences per server         floor(tokens per server / (max prompt + max new tokens))
Colocated, every GPU of the job serves (GPUs / t_s servers); disaggregated, the dedicated servers.
Sizes are GiB (2^30 bytes); "80 GB" GPUs such as the H100 have 79.6 GiB usable, within the
reserve. Checked against models built on the meta device (parameter counts per stage, exact)
and against the peak memory of forward + backward of small models on CPU (tests/launch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, Literal

from stapo_megatron.config import MAX_BATCH, MAX_TOKENS, ConfigError, apply_overrides, build, option
from stapo_megatron.config.command import (
    CommandConfig,
    Flag,
    FlagKind,
    add_command_arguments,
    load_command,
    register_command_config,
)
from stapo_megatron.config.core import field_default
from stapo_megatron.models.qwen3.config import Qwen3Config, padded_vocab_size

GIB = 1 << 30
# Megatron's param/grad buffer alignment with the distributed optimizer (param_and_grad_buffer.py).
PARAM_ALIGN = 64
BUCKET_ALIGN = 128

Recompute = Literal["none", "selective", "full"]
Kernels = Literal["te", "local"]


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


@dataclasses.dataclass(frozen=True)
class Workload:
    seq_len: int
    micro_batch: int = 1
    sequences_per_minibatch: int = 512  # the paper: 64 prompts x G = 8
    recompute: Recompute = "none"
    sequence_parallel: bool = False  # Megatron's sequence parallelism (only acts at TP > 1)
    kernels: Kernels = "te"
    params_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    distributed_optimizer: bool = True
    logits_chunk: int = 1024
    entropy_grad: bool = False
    reference_model: bool = False  # the KL penalty's frozen reference (algo.kl_coef > 0)

    @property
    def param_bytes(self) -> int:
        return 2 if self.params_dtype == "bfloat16" else 4


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    numel: int
    shared_embedding: bool = False


def check_layout_fits_model(arch: Qwen3Config, tp: int, pp: int) -> str | None:
    """Why Megatron cannot build ``arch`` at this TP/PP (None: it can)."""
    if arch.num_attention_heads % tp:
        return f"TP {tp} does not divide the {arch.num_attention_heads} attention heads"
    if arch.num_key_value_heads % tp:
        return f"TP {tp} does not divide the {arch.num_key_value_heads} key/value heads"
    if pp > arch.num_hidden_layers:
        return f"PP {pp} is more than the {arch.num_hidden_layers} layers"
    return None


def stage_parameters(arch: Qwen3Config, tp: int, pp: int, stage: int) -> list[Param]:
    """This stage's parameters (one tensor-parallel rank), named and ordered as Megatron's
    local-spec GPTModel registers them (the order decides the buffer padding)."""
    h, f, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q = arch.num_attention_heads * d
    k = arch.num_key_value_heads * d
    vp = padded_vocab_size(arch.vocab_size, tp)
    first, last = stage == 0, stage == pp - 1
    tied = arch.tie_word_embeddings
    params = []
    if first:
        params.append(Param("embedding.word_embeddings.weight", vp // tp * h, shared_embedding=tied and pp > 1))
    for i in range(arch.layers_per_stage(pp)[stage]):
        prefix = f"decoder.layers.{i}."
        params += [
            Param(prefix + "input_layernorm.weight", h),
            Param(prefix + "self_attention.linear_proj.weight", h * q // tp),
            Param(prefix + "self_attention.linear_qkv.weight", (q + 2 * k) // tp * h),
            Param(prefix + "self_attention.q_layernorm.weight", d),
            Param(prefix + "self_attention.k_layernorm.weight", d),
            Param(prefix + "pre_mlp_layernorm.weight", h),
            Param(prefix + "mlp.linear_fc1.weight", 2 * f // tp * h),
            Param(prefix + "mlp.linear_fc2.weight", h * (f // tp)),
        ]
    if last:
        params.append(Param("decoder.final_layernorm.weight", h))
        if not tied or pp > 1:
            params.append(Param("output_layer.weight", vp // tp * h, shared_embedding=tied and pp > 1))
    return params


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def buffer_layout(params: list[Param], dp: int, distributed: bool) -> tuple[int, list[int]]:
    """(elements of Megatron's param/grad buffer, main-parameter elements of each DP rank).

    Follows megatron.core.distributed.param_and_grad_buffer with overlap_grad_reduce off (one
    bucket, plus one of its own for a shared embedding) and the distributed optimizer's split of
    every bucket into D equal ranges; without it, no padding and every rank keeps everything.
    """
    total = sum(p.numel for p in params)
    if not distributed:
        return total, [total] * dp
    buckets: list[tuple[int, int, list[tuple[int, int]]]] = []  # (start, end, param ranges)
    start = bucket_start = 0
    members: list[tuple[int, int]] = []
    for param in reversed(params):  # Megatron fills the buffer in reverse (backprop) order
        start = _pad(start, PARAM_ALIGN)
        if param.shared_embedding and members:
            end = _pad(start, math.lcm(dp, BUCKET_ALIGN))
            buckets.append((bucket_start, end, members))
            start = bucket_start = end
            members = []
        members.append((start, start + param.numel))
        start += param.numel
        if param.shared_embedding:
            end = _pad(start, math.lcm(dp, BUCKET_ALIGN))
            buckets.append((bucket_start, end, members))
            start = bucket_start = end
            members = []
    if members:
        end = _pad(start, math.lcm(dp, BUCKET_ALIGN))
        buckets.append((bucket_start, end, members))
        start = end
    shards = [0] * dp
    for b_start, b_end, ranges in buckets:
        size = (b_end - b_start) // dp
        for rank in range(dp):
            lo, hi = b_start + rank * size, b_start + (rank + 1) * size
            shards[rank] += sum(max(0, min(hi, r_end) - max(lo, r_start)) for r_start, r_end in ranges)
    return start, shards


def layer_activation_bytes(arch: Qwen3Config, tp: int, work: Workload, recompute: str | None = None) -> float:
    """Bytes per token that one layer keeps for backward (the table in the module docstring)."""
    recompute = recompute or work.recompute
    e = work.param_bytes
    h, f = arch.hidden_size, arch.intermediate_size
    q = arch.num_attention_heads * arch.head_dim
    k = arch.num_key_value_heads * arch.head_dim
    a, s = arch.num_attention_heads, work.seq_len
    sp = tp if work.sequence_parallel else 1  # the sequence-parallel regions hold s/t positions
    if recompute == "full":
        return e * h / sp
    if work.kernels == "te":
        return 4 * e * h / sp + e * (3 * q + 3 * k + 3 * f) / tp
    low = 1 if e < 4 else 0
    if recompute == "selective":
        return (16 + 2 * e) * h / sp + ((8 + 3 * e) * q + (12 + e) * k + 5 * e * f) / tp
    return (16 + 2 * e) * h / sp + ((8 + 5 * e) * q + 12 * k + 5 * e * f + (4 + e * low) * a * s) / tp


def backward_working_set(arch: Qwen3Config, tp: int, work: Workload) -> float:
    """Bytes of one layer's backward on top of what the stage keeps (per micro-batch)."""
    e, tokens = work.param_bytes, work.seq_len * work.micro_batch
    a, s, f = arch.num_attention_heads, work.seq_len, arch.intermediate_size
    q = arch.num_attention_heads * arch.head_dim
    if work.kernels == "te":
        base = 2 * e * f * tokens / tp
        extra = 0.0
    else:
        base = 4 * a * s * tokens / tp
        low = 1 if e < 4 else 0
        extra = ((4 + e * low) * a * s + 3 * e * q) * tokens / tp if work.recompute == "selective" else 0.0
    if work.recompute == "full":
        extra = layer_activation_bytes(arch, tp, work, "none") * tokens
    return base + extra


def logits_bytes(arch: Qwen3Config, tp: int, work: Workload) -> float:
    """Peak of the loss on the last stage: logits slice + its gradient + fp32 chunk buffers."""
    e, tokens = work.param_bytes, work.seq_len * work.micro_batch
    vp = padded_vocab_size(arch.vocab_size, tp) // tp
    v_real = -(-arch.vocab_size // tp)
    chunk = min(work.logits_chunk, tokens)
    # forward: the logits and Megatron's transposed copy of them, then the chunk buffers
    forward = max(2 * e * tokens * vp, e * tokens * vp + 2 * 4 * chunk * v_real)
    buffers = (1 if e < 4 else 0) + (1 if work.entropy_grad else 0)
    backward = 2 * e * tokens * vp + buffers * 4 * chunk * v_real
    if work.kernels == "local":  # no gradient-accumulation fusion: the weight gradient is a tensor first
        backward += e * vp * arch.hidden_size
    return max(forward, backward)


@dataclasses.dataclass
class StageMemory:
    stage: int
    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float  # kept for backward by the micro-batches in flight
    working: float  # one layer's backward working set
    logits: float  # the loss's peak (last stage): logits slice, its gradient, chunk buffers
    optimizer_by_dp_rank: list[float] = dataclasses.field(default_factory=list)
    layers: int = 0  # decoder layers of this stage
    reference: float = 0.0  # the KL penalty's frozen reference model (weights only)

    @property
    def peak_activations(self) -> float:
        # the loss runs before any layer's backward, so the two transients never coincide
        return self.activations + max(self.working, self.logits)

    @property
    def trainer(self) -> float:
        return self.weights + self.grads + self.optimizer + self.reference + self.peak_activations


@dataclasses.dataclass
class Estimate:
    layout: Layout
    stages: list[StageMemory]
    sglang: float
    reserve: float
    gpu_memory: float
    sglang_released: bool = False  # the servers free their share while the trainer runs
    offload: bool = False  # the trainer's state waits in host memory while the servers generate

    @property
    def layer_split(self) -> str:
        """Decoder layers per pipeline stage, e.g. ``9/10/9``."""
        return "/".join(str(st.layers) for st in self.stages)

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.trainer)

    @property
    def train_phase(self) -> float:
        return self.worst.trainer + (0.0 if self.sglang_released else self.sglang) + self.reserve

    @property
    def rollout_phase(self) -> float:
        """The servers' share plus what the trainer keeps while they hold it (at the weight sync)."""
        return max(self.kept_while_generating(st) for st in self.stages) + self.sglang + self.reserve

    def kept_while_generating(self, stage: StageMemory) -> float:
        """What a rank of ``stage`` keeps on its GPU while the servers hold their share."""
        return stage.weights if self.offload else stage.weights + stage.grads + stage.optimizer + stage.reference

    @property
    def total(self) -> float:
        return max(self.train_phase, self.rollout_phase)

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_memory


def microbatches_per_step(layout: Layout, work: Workload) -> int:
    return max(1, -(-work.sequences_per_minibatch // (layout.dp * work.micro_batch)))


def _buffers(params: list[Param], work: Workload) -> list[tuple[int, list[Param]]]:
    """Parameters grouped the way Megatron's DDP builds one buffer per dtype, with bytes per element.

    Megatron's local spec builds its RMSNorm weights in fp32 whatever params_dtype is (torch's
    RMSNorm gets no dtype), so without Transformer Engine a 16-bit model has a second, fp32
    buffer of norm weights; with it, every parameter has params_dtype.
    """
    e = work.param_bytes
    if work.kernels == "te" or e == 4:
        return [(e, params)]
    groups: dict[int, list[Param]] = {}  # in order of first appearance, like Megatron's dict
    for param in params:
        groups.setdefault(4 if param.name.endswith("layernorm.weight") else e, []).append(param)
    return list(groups.items())


def stage_memory(arch: Qwen3Config, layout: Layout, work: Workload, stage: int) -> StageMemory:
    tp, pp = layout.tp, layout.pp
    params = stage_parameters(arch, tp, pp, stage)
    weights = grads = reference = 0.0
    shards = [0.0] * layout.dp
    for nbytes, group in _buffers(params, work):
        n_buf, group_shards = buffer_layout(group, layout.dp, work.distributed_optimizer)
        weights += nbytes * n_buf
        if work.reference_model:
            reference += nbytes * sum(p.numel for p in group)
        grads += 4 * n_buf  # the trainer reduces gradients in fp32
        # Adam's two fp32 moments, plus an fp32 master copy of 16-bit weights
        for rank, numel in enumerate(group_shards):
            shards[rank] += (8 + (4 if nbytes < 4 else 0)) * numel
    tokens = work.seq_len * work.micro_batch
    in_flight = min(pp - stage, microbatches_per_step(layout, work))
    layers = arch.layers_per_stage(pp)[stage]
    kept = in_flight * layers * layer_activation_bytes(arch, tp, work) * tokens
    logits = 0.0
    if stage == pp - 1:
        # the final norm keeps its input and output (te: 2e h; local: (16 + 2e) h / 2), s/t positions with sp
        e = work.param_bytes
        sp = tp if work.sequence_parallel else 1
        kept += (2 * e if work.kernels == "te" else 8 + e) * arch.hidden_size * tokens / sp
        logits = logits_bytes(arch, tp, work)
    return StageMemory(
        stage=stage,
        params=sum(p.numel for p in params),
        weights=weights,
        grads=grads,
        optimizer=max(shards),
        activations=kept,
        working=backward_working_set(arch, tp, work),
        logits=logits,
        optimizer_by_dp_rank=shards,
        layers=layers,
        reference=reference,
    )


def estimate(
    arch: Qwen3Config,
    layout: Layout,
    work: Workload,
    *,
    gpu_memory_gb: float = 80.0,
    colocate_fraction: float = 0.0,
    reserve_gb: float = 4.0,
    sglang_released: bool = False,
    offload: bool = False,
) -> Estimate:
    reason = check_layout_fits_model(arch, layout.tp, layout.pp)
    if reason:
        raise ConfigError(f"layout TP={layout.tp} PP={layout.pp}: {reason}")
    if not 0.0 <= colocate_fraction < 1.0:
        raise ConfigError(f"--colocate-fraction: must be in [0, 1), got {colocate_fraction}")
    stages = [stage_memory(arch, layout, work, r) for r in range(layout.pp)]
    return Estimate(
        layout=layout,
        stages=stages,
        sglang=colocate_fraction * gpu_memory_gb * GIB,
        reserve=reserve_gb * GIB,
        gpu_memory=gpu_memory_gb * GIB,
        sglang_released=sglang_released,
        offload=offload,
    )


KV_CACHE_BYTES = 2  # SGLang's KV cache in bf16 (the dtype of the paper configs' servers)


def kv_bytes_per_token(arch: Qwen3Config, server_tp: int) -> int:
    """K and V of every layer for one token, on one GPU of a server (SGLang splits the key/value
    heads over its TP ranks and replicates them when TP exceeds their count)."""
    heads = max(arch.num_key_value_heads // server_tp, 1)
    return 2 * arch.num_hidden_layers * heads * arch.head_dim * KV_CACHE_BYTES


@dataclasses.dataclass(frozen=True)
class RolloutCapacity:
    """How many sequences of the longest length the servers of one placement hold at once."""

    placement: str
    servers: int
    server_tp: int
    mem_fraction: float
    kv_cache_per_gpu: float  # bytes
    tokens_per_server: int
    max_seq_len: int

    @property
    def sequences_per_server(self) -> int:
        return self.tokens_per_server // self.max_seq_len

    @property
    def sequences(self) -> int:
        return self.servers * self.sequences_per_server


def rollout_capacity(
    arch: Qwen3Config,
    *,
    placement: str,
    servers: int,
    server_tp: int,
    mem_fraction: float,
    gpu_memory_gb: float,
    max_seq_len: int,
) -> RolloutCapacity:
    weights_per_gpu = arch.num_parameters() * KV_CACHE_BYTES / server_tp
    kv_cache = max(mem_fraction * gpu_memory_gb * GIB - weights_per_gpu, 0.0)
    return RolloutCapacity(
        placement=placement,
        servers=servers,
        server_tp=server_tp,
        mem_fraction=mem_fraction,
        kv_cache_per_gpu=kv_cache,
        tokens_per_server=int(kv_cache // kv_bytes_per_token(arch, server_tp)),
        max_seq_len=max_seq_len,
    )


def format_capacity(capacities: Iterable[RolloutCapacity], arch: Qwen3Config) -> str:
    lines = []
    for cap in capacities:
        lines.append(
            f"rollout {cap.placement}: {cap.servers} server(s) x TP {cap.server_tp} at mem_fraction_static "
            f"{cap.mem_fraction:g}: KV cache {cap.kv_cache_per_gpu / GIB:.1f} GiB per GPU "
            f"({kv_bytes_per_token(arch, cap.server_tp):,} bytes per token) = {cap.tokens_per_server:,} tokens per "
            "server "
            f"= {cap.sequences_per_server:,} sequences of {cap.max_seq_len:,} tokens per server, {cap.sequences:,} "
            "at once"
        )
    return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def candidate_layouts(arch: Qwen3Config, gpus: int, gpus_per_node: int = 8) -> list[Layout]:
    """Every (TP, PP, DP) with TP x PP x DP = gpus that Megatron can build, TP within a node,
    smallest model-parallel group first."""
    layouts = []
    for tp in _divisors(gpus):
        if tp > max(1, gpus_per_node):
            continue
        for pp in _divisors(gpus // tp):
            if check_layout_fits_model(arch, tp, pp) is None:
                layouts.append(Layout(tp, pp, gpus // (tp * pp)))
    return sorted(layouts, key=lambda lay: (lay.tp * lay.pp, lay.pp, lay.tp))


def plan(
    arch: Qwen3Config,
    gpus: int,
    work: Workload,
    *,
    gpu_memory_gb: float = 80.0,
    colocate_fraction: float = 0.0,
    reserve_gb: float = 4.0,
    gpus_per_node: int = 8,
    sglang_released: bool = False,
    offload: bool = False,
) -> list[Estimate]:
    """Estimates for every buildable layout of ``gpus`` GPUs, smallest model-parallel group first."""
    if gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1, got {gpus}")
    return [
        estimate(
            arch,
            layout,
            work,
            gpu_memory_gb=gpu_memory_gb,
            colocate_fraction=colocate_fraction,
            reserve_gb=reserve_gb,
            sglang_released=sglang_released,
            offload=offload,
        )
        for layout in candidate_layouts(arch, gpus, gpus_per_node)
    ]


# ---- the command ---------------------------------------------------------------------------


def _gib(x: float) -> str:
    return f"{x / GIB:7.1f}"


def format_table(estimates: Iterable[Estimate]) -> str:
    head = (
        f"{'TP':>3} {'PP':>3} {'DP':>4} {'layers':>11} {'params/GPU':>14} {'weights':>7} {'grads':>7} {'optim':>7} "
        f"{'activ':>7} "
        f"{'work':>7} {'logits':>7} {'sglang':>7} {'reserve':>7} {'total':>7}  fits"
    )
    lines = [head]
    for est in estimates:
        w = est.worst
        lines.append(
            f"{est.layout.tp:>3} {est.layout.pp:>3} {est.layout.dp:>4} {est.layer_split:>11} {w.params:>14,} "
            f"{_gib(w.weights)} {_gib(w.grads)} "
            f"{_gib(w.optimizer)} {_gib(w.activations)} {_gib(w.working)} {_gib(w.logits)} {_gib(est.sglang)} "
            f"{_gib(est.reserve)} {_gib(est.total)}  {'yes' if est.fits else 'no'}"
        )
    lines.append(
        "layers: decoder layers of each pipeline stage; GiB per GPU of the worst pipeline stage; total = weights "
        "+ grads + optim + activ + max(work, logits) + sglang + reserve (with --sglang-released: sglang takes "
        "turns with the activations)"
    )
    return "\n".join(lines)


def format_stages(est: Estimate) -> str:
    lines = [
        f"TP={est.layout.tp} PP={est.layout.pp} DP={est.layout.dp}, layers per stage {est.layer_split}, "
        "GiB per GPU of each pipeline stage:",
        (
            f"{'stage':>5} {'layers':>6} {'params':>14} {'weights':>7} {'grads':>7} {'optim':>7} {'activ':>7} "
            f"{'work':>7} "
            f"{'logits':>7} {'trainer':>7}"
        ),
    ]
    for st in est.stages:
        lines.append(
            f"{st.stage:>5} {st.layers:>6} {st.params:>14,} {_gib(st.weights)} {_gib(st.grads)} {_gib(st.optimizer)} "
            f"{_gib(st.activations)} {_gib(st.working)} {_gib(st.logits)} {_gib(st.trainer)}"
        )
    worst, total = (
        est.worst,
        f"{_gib(est.total).strip()} of {_gib(est.gpu_memory).strip()} GiB: " + ("fits" if est.fits else "does not fit"),
    )
    if est.sglang_released:
        kept = "weights (the rest offloaded)" if est.offload else "weights + grads + optim"
        lines.append(
            f"train phase: worst stage {_gib(worst.trainer).strip()} + reserve {_gib(est.reserve).strip()} "
            f"(servers released) = {_gib(est.train_phase).strip()}; rollout phase: sglang {_gib(est.sglang).strip()} "
            f"+ trainer {kept} + reserve = {_gib(est.rollout_phase).strip()}; peak {total}"
        )
    else:
        lines.append(
            f"worst stage {_gib(worst.trainer).strip()} + sglang {_gib(est.sglang).strip()} + reserve "
            f"{_gib(est.reserve).strip()} = {total}"
        )
    return "\n".join(lines)


@dataclasses.dataclass
class PlanConfig:
    """``stapo plan``'s fields: the ``plan:`` section of a training config, or the command line alone.
    Unset (None) fields take the training config's value, else the default their documentation names."""

    model: str = option(
        "", "Qwen3 preset (qwen3_0.6b ... qwen3_32b) or a model YAML ('': the training config's model)."
    )
    gpus: int | None = option(
        None, "GPUs of the trainer (default: the training config's world size).", ge=1, le=MAX_BATCH
    )
    seq_len: int | None = option(
        None,
        "Tokens per micro-batch row, prompt + response (default: the training config's "
        "batch.max_tokens_per_microbatch, else its default).",
        ge=1,
        le=MAX_BATCH * MAX_TOKENS,
    )
    micro_batch: int | None = option(None, "Sequences per micro-batch (default 1).", ge=1, le=MAX_BATCH)
    sequences_per_minibatch: int | None = option(
        None,
        "Sequences per optimizer step, all DP ranks (default: the training config's, else 512 = 64 prompts x 8); "
        "bounds the micro-batches in flight under pipeline parallelism.",
        ge=1,
        le=MAX_BATCH,
    )
    recompute: Recompute | None = option(None, "Activation recomputation (default: the training config's, else none).")
    sequence_parallel: bool | None = option(
        None,
        "Megatron sequence parallelism: the norm/residual activations split over TP (default: the training "
        "config's parallel.sequence_parallel, else false).",
    )
    kernels: Kernels = option(
        "te", "te: Transformer Engine with flash attention (GPU); local: Megatron's local spec (no TE)."
    )
    dtype: Literal["bfloat16", "float32"] | None = option(
        None, "Parameter dtype (default: the training config's, else bfloat16)."
    )
    gpu_memory_gb: float = option(80.0, "Memory per GPU in GiB.", gt=0, le=1 << 20)
    gpus_per_node: int = option(
        8,
        "GPUs per node: the largest TP considered (TP stays within a node), and the nodes of --check.",
        ge=1,
        le=MAX_BATCH,
    )
    colocate_fraction: float | None = option(
        None,
        "Fraction of each GPU held by colocated SGLang servers (their mem_fraction_static); 0: separate GPUs "
        "(default: the training config's, else 0).",
        ge=0,
        lt=1,
    )
    sglang_released: bool | None = option(
        None,
        "Colocated servers free their share while the trainer runs (default: the training config's "
        "rollout.release_memory_between_steps or offload, else false).",
    )
    offload: bool | None = option(
        None,
        "The trainer's state waits in host memory while colocated servers generate; implies sglang_released "
        "(default: the training config's compute.offload_while_generating, else false).",
    )
    server_tp: int | None = option(
        None,
        "Tensor-parallel size of each SGLang server, for the rollout capacity (default: the training config's, "
        "else 1).",
        ge=1,
        le=MAX_BATCH,
    )
    reserve_gb: float = option(4.0, "CUDA context, NCCL and fragmentation, GiB per GPU.", ge=0, le=1 << 20)
    logits_chunk: int | None = option(
        None, "Tokens per log-prob/entropy chunk (default: the training config's, else 1024).", ge=1, le=MAX_TOKENS
    )
    distributed_optimizer: bool | None = option(
        None, "Optimizer state sharded over DP (default: the training config's optim.distributed, else true)."
    )
    tp: int | None = option(
        None,
        "Show this layout's stages in detail (with pp; default with a training config: its layout).",
        ge=1,
        le=MAX_BATCH,
    )
    pp: int | None = option(None, "Pipeline stages of the detailed layout.", ge=1, le=MAX_BATCH)
    search: bool = option(False, "With a training config: list layouts instead of the config's own.")
    all: bool = option(False, "List layouts that do not fit too.")
    check: bool = option(
        False,
        "With a training config: check its whole layout on nodes x gpus_per_node GPUs (ranks, groups, servers, "
        "weight-sync routes, memory of each phase) and refuse one that cannot work (stapo_megatron/launch/layout.py).",
    )
    nodes: int | None = option(
        None, "Nodes of the checked layout (default: the config's world size / gpus_per_node).", ge=1, le=MAX_BATCH
    )
    verbose: bool = option(False, "With check: list every weight-sync route.")


def _from_config(cfg) -> dict:
    """Defaults taken from a training config (its model, lengths, batch and layout)."""
    sglang = cfg.rollout.sglang
    colocated = cfg.rollout.engine == "sglang" and sglang.colocated
    return {
        "model": cfg.model,
        "gpus": cfg.parallel.world_size,
        # a micro-batch is one packed row of up to max_tokens_per_microbatch tokens
        "seq_len": cfg.batch.max_tokens_per_microbatch,
        "micro_batch": 1,
        "recompute": cfg.compute.recompute,
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "dtype": cfg.compute.params_dtype,
        "sequences_per_minibatch": cfg.batch.prompts_per_minibatch * cfg.batch.group_size,
        "logits_chunk": cfg.compute.logits_chunk_size,
        "distributed_optimizer": cfg.optim.distributed,
        "colocate_fraction": sglang.mem_fraction_static if colocated else 0.0,
        # the trainer has colocated servers free their memory while it trains (always with offload)
        "sglang_released": colocated
        and (cfg.rollout.release_memory_between_steps or cfg.compute.offload_while_generating),
        "offload": colocated and cfg.compute.offload_while_generating,
        "server_tp": sglang.tp_size,
        "mem_fraction": sglang.mem_fraction_static,
        "dedicated_servers": len(sglang.urls) or sglang.num_servers,
        "rollout_len": cfg.data.max_prompt_tokens + cfg.batch.max_new_tokens,
        "entropy_grad": cfg.algo.entropy_coef > 0,
        "reference_model": cfg.algo.kl_coef > 0,
        "tp": cfg.parallel.tensor_parallel,
        "pp": cfg.parallel.pipeline_parallel,
    }


def _pick(cfg: PlanConfig, defaults: dict, name: str, fallback):
    value = getattr(cfg, name)
    if value is not None:
        return value
    return defaults.get(name, fallback)


def plan_command() -> CommandConfig:
    return CommandConfig(
        "plan",
        PlanConfig,
        FLAGS,
        section="plan",
        note="With --config (a training config), unset fields take its values; its other fields may be overridden "
        "(e.g. batch.max_new_tokens=8192), see stapo config --docs.",
    )


def load_plan(args):
    """(the plan section, its field names, the training config or None)."""
    loaded = load_command(plan_command(), args)
    train = None
    if loaded.train_data is not None:
        from stapo_megatron.trainer.config import TrainConfig

        train = build(TrainConfig, apply_overrides(loaded.train_data, loaded.train_overrides))
    elif loaded.train_overrides:
        raise ConfigError(
            f"override '{loaded.train_overrides[0]}': sets a training config field, but no --config is given"
        )
    return loaded.cfg, loaded.names, train


def run_plan(args) -> None:
    cfg, names, train = load_plan(args)
    with names.renaming():
        show_plan(cfg, names, train)


def memory_model(cfg: PlanConfig, train) -> tuple[Workload, dict[str, Any]]:
    """The workload and :func:`estimate`'s options of ``cfg``, its unset fields taken from the
    training config ``train`` (None: their defaults)."""
    from stapo_megatron.trainer.config import BatchConfig

    defaults = _from_config(train) if train is not None else {}
    work = Workload(
        seq_len=_pick(cfg, defaults, "seq_len", field_default(BatchConfig, "max_tokens_per_microbatch")),
        micro_batch=_pick(cfg, defaults, "micro_batch", 1),
        sequences_per_minibatch=_pick(cfg, defaults, "sequences_per_minibatch", 512),
        recompute=_pick(cfg, defaults, "recompute", "none"),
        sequence_parallel=_pick(cfg, defaults, "sequence_parallel", False),
        kernels=cfg.kernels,
        params_dtype=_pick(cfg, defaults, "dtype", "bfloat16"),
        distributed_optimizer=_pick(cfg, defaults, "distributed_optimizer", True),
        logits_chunk=_pick(cfg, defaults, "logits_chunk", 1024),
        entropy_grad=defaults.get("entropy_grad", False),
        reference_model=defaults.get("reference_model", False),
    )
    offload = _pick(cfg, defaults, "offload", False)
    options = {
        "gpu_memory_gb": cfg.gpu_memory_gb,
        "colocate_fraction": _pick(cfg, defaults, "colocate_fraction", 0.0),
        "reserve_gb": cfg.reserve_gb,
        "sglang_released": _pick(cfg, defaults, "sglang_released", False) or offload,
        "offload": offload,
    }
    return work, options


def show_layout_check(cfg: PlanConfig, train) -> None:
    from stapo_megatron.launch.layout import Machines, check_train_layout

    if train is None:
        raise ConfigError("plan.check: checks a training config's layout; give one (--config)")
    nodes = cfg.nodes or -(-train.parallel.world_size // cfg.gpus_per_node)
    layout = check_train_layout(train, Machines(nodes, cfg.gpus_per_node), cfg)
    print(layout.summary())
    if cfg.verbose:
        print("\n".join(layout.route_lines()))


def show_plan(cfg: PlanConfig, names, train) -> None:
    if cfg.check:
        show_layout_check(cfg, train)
        return
    defaults = _from_config(train) if train is not None else {}
    arch = build(Qwen3Config, cfg.model, "plan.model") if cfg.model else defaults.get("model")
    if arch is None:
        raise ConfigError("plan.model: give a model preset (e.g. qwen3_32b), or a training config (--config)")
    work, options = memory_model(cfg, train)
    gpus = _pick(cfg, defaults, "gpus", None)
    if gpus is None:
        raise ConfigError("plan.gpus: required without a training config (--config)")
    print(
        f"{arch.num_parameters():,} parameters; {gpus} GPUs of {cfg.gpu_memory_gb:g} GiB; sequence {work.seq_len} "
        f"tokens x micro-batch {work.micro_batch}; recompute {work.recompute}"
        f"{' with sequence parallelism' if work.sequence_parallel else ''}; kernels {work.kernels}; "
        f"{work.params_dtype}; colocated SGLang share {options['colocate_fraction']:g}"
        f"{' (released while training)' if options['sglang_released'] else ''}"
        f"{'; trainer offloaded while generating' if options['offload'] else ''}"
    )
    server_tp = _pick(cfg, defaults, "server_tp", 1)
    if gpus % server_tp:
        raise ConfigError(f"plan.server_tp: must be >= 1 and divide the {gpus} GPUs, got {server_tp}")
    mem_fraction = options["colocate_fraction"] or defaults.get("mem_fraction", 0.8)
    rollout_len = defaults.get("rollout_len", work.seq_len)
    print(
        format_capacity(
            [
                rollout_capacity(
                    arch,
                    placement=placement,
                    servers=servers,
                    server_tp=server_tp,
                    mem_fraction=mem_fraction,
                    gpu_memory_gb=cfg.gpu_memory_gb,
                    max_seq_len=rollout_len,
                )
                for placement, servers in (
                    ("colocated", gpus // server_tp),
                    ("disaggregated", defaults.get("dedicated_servers", 1)),
                )
            ],
            arch,
        )
    )
    if cfg.tp is not None or cfg.pp is not None or (train is not None and not cfg.search):
        tp, pp = _pick(cfg, defaults, "tp", 1), _pick(cfg, defaults, "pp", 1)
        if gpus % (tp * pp):
            raise ConfigError(f"plan.gpus: {gpus} is not a multiple of TP x PP = {tp * pp}")
        est = estimate(arch, Layout(tp, pp, gpus // (tp * pp)), work, **options)
        print(format_stages(est))
        return
    estimates = plan(arch, gpus, work, gpus_per_node=cfg.gpus_per_node, **options)
    shown = estimates if cfg.all else [e for e in estimates if e.fits]
    if not shown:
        best = min(estimates, key=lambda e: e.total) if estimates else None
        hint = f" (least: TP={best.layout.tp} PP={best.layout.pp}, {best.total / GIB:.1f} GiB)" if best else ""
        print(
            f"no layout of {gpus} GPUs fits in {cfg.gpu_memory_gb:g} GiB{hint}; try recompute full, more GPUs or a "
            "shorter sequence"
        )
        return
    print(format_table(shown))


_PLAN_FLAG_KINDS: tuple[tuple[str, FlagKind], ...] = (
    ("model", "value"),
    ("gpus", "value"),
    ("seq_len", "value"),
    ("micro_batch", "value"),
    ("sequences_per_minibatch", "value"),
    ("recompute", "value"),
    ("sequence_parallel", "true"),
    ("kernels", "value"),
    ("dtype", "value"),
    ("gpu_memory_gb", "value"),
    ("gpus_per_node", "value"),
    ("colocate_fraction", "value"),
    ("sglang_released", "true"),
    ("offload", "true"),
    ("server_tp", "value"),
    ("reserve_gb", "value"),
    ("logits_chunk", "value"),
    ("tp", "value"),
    ("pp", "value"),
    ("search", "true"),
    ("all", "true"),
    ("check", "true"),
    ("nodes", "value"),
    ("verbose", "true"),
)
FLAGS = tuple(Flag(f"--{name.replace('_', '-')}", f"plan.{name}", kind=kind) for name, kind in _PLAN_FLAG_KINDS) + (
    Flag("--no-distributed-optimizer", "plan.distributed_optimizer", kind="false"),
)


def register(subparsers) -> None:
    register_command_config("plan", plan_command)
    parser = subparsers.add_parser(
        "plan",
        help="per-GPU memory of a training layout and the (TP, PP, DP) layouts that fit",
        description="Estimate weights, gradients, optimizer state, activations, logits and SGLang's share per GPU "
        "(formula: stapo_megatron/launch/plan.py).",
    )
    add_command_arguments(
        parser,
        plan_command(),
        config_help="training config: model, lengths, batch, recompute and layout; "
        "its plan: section holds these fields",
        overrides_help="dotted overrides: plan.FIELD=VALUE, or a field of the training config",
    )
    parser.set_defaults(func=run_plan)
