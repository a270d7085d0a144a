"""The memory model of ``stapo plan``: per-GPU memory of a training layout, and the (TP, PP, DP)
layouts that fit. The command is :mod:`.plan_command`, its fields :mod:`.plan_config`.

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
mem_fraction_static x GPU memory) and a fixed reserve R of what no tensor accounts for
(:class:`DeviceCosts`; every term a ``plan:`` setting):
    R = contexts x C + sum over the communicators on the GPU of (M + NVLS) + F
    C   one CUDA context per process on the GPU: the trainer rank, and a colocated server's
    M   one NCCL communicator's buffers; NCCL makes a group's communicator at its first collective and
        keeps it (offload does not free it): a trainer rank holds the world's, TP's, DP's, the model-
        parallel group's (the gradient norm), one per pipeline neighbour (batched p2p) and the
        embedding group's (tied, PP > 1); a colocated server of TP > 1 its TP group's
    NVLS with NCCL_NVLS_ENABLE on (off by default: runtime/environment.py), per communicator of 4 or
        more ranks (NVLS buffers: NCCL issue 864 reports 1.6 GB for one)
    F   the caching allocator's fragmentation
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
The weight-sync phase (``stapo plan --check``, launch/layout.py) adds the sync's buckets and
communicators on each GPU. Sizes are GiB (2^30 bytes) of the device's usable memory: an "80 GB"
H100 has 79.6 GiB (what torch.cuda.mem_get_info reports as its total). Checked against models built
on the meta device (parameter counts per stage, exact)
and against the peak memory of forward + backward of small models on CPU (tests/launch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

from stapo_megatron.config import ConfigError
from stapo_megatron.models.qwen3.config import Qwen3Config, padded_vocab_size

GIB = 1 << 30
USABLE_GPU_MEMORY_GB = 79.6  # an "80 GB" H100: the total torch.cuda.mem_get_info reports
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


@dataclasses.dataclass(frozen=True)
class DeviceCosts:
    """Per-GPU memory that no tensor of the model or the servers' share accounts for, in GiB (the
    ``plan:`` section's settings; estimates for an H100 with CUDA 12, to be raised where measured)."""

    cuda_context_gb: float = 0.6  # one process's CUDA context with torch's cuBLAS/cuDNN handles
    nccl_communicator_gb: float = 0.4  # one NCCL communicator's buffers (channels x peers x protocols)
    nvls_gb: float = 1.6  # added per communicator of 4+ ranks with NVLS on (NCCL issue 864: 1.6 GB)
    nvls: bool = False  # NCCL_NVLS_ENABLE as the job runs (off unless exported: runtime/environment.py)
    fragmentation_gb: float = 2.0  # the caching allocator's fragmentation

    def communicators(self, sizes: Sequence[int]) -> float:
        """Bytes of NCCL communicators of these sizes (ranks) on one GPU."""
        nvls = self.nvls_gb if self.nvls else 0.0
        return GIB * sum(self.nccl_communicator_gb + (nvls if size >= 4 else 0.0) for size in sizes)


def trainer_communicators(layout: Layout, tied_embeddings: bool) -> list[int]:
    """The sizes of the NCCL communicators a trainer rank holds once it has trained a step: the world
    (the batch's broadcast, flags), TP, DP (gradients), the model-parallel group (the gradient norm),
    one per pipeline neighbour (batched p2p makes a two-rank communicator per peer) and the embedding
    group (tied embeddings with PP > 1)."""
    sizes = [layout.gpus]
    if layout.tp > 1:
        sizes.append(layout.tp)
    if layout.dp > 1:
        sizes.append(layout.dp)
    if layout.tp * layout.pp > 1:
        sizes.append(layout.tp * layout.pp)
    if layout.pp > 1:
        sizes += [2] * min(2, layout.pp - 1)
        if tied_embeddings:
            sizes.append(2)
    return sizes


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
    gpu_memory_gb: float = USABLE_GPU_MEMORY_GB,
    colocate_fraction: float = 0.0,
    costs: DeviceCosts = DeviceCosts(),
    server_tp: int = 1,
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
        reserve=fixed_bytes(layout, arch.tie_word_embeddings, costs, colocate_fraction > 0, server_tp),
        gpu_memory=gpu_memory_gb * GIB,
        sglang_released=sglang_released,
        offload=offload,
    )


def fixed_bytes(layout: Layout, tied_embeddings: bool, costs: DeviceCosts, colocated: bool, server_tp: int) -> float:
    """R of a GPU with a trainer rank of ``layout`` (and a colocated server's process, when there is one)."""
    communicators = trainer_communicators(layout, tied_embeddings)
    if colocated and server_tp > 1:
        communicators.append(server_tp)
    contexts = 1 + colocated
    return contexts * costs.cuda_context_gb * GIB + costs.communicators(communicators) + costs.fragmentation_gb * GIB


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
    gpu_memory_gb: float = USABLE_GPU_MEMORY_GB,
    colocate_fraction: float = 0.0,
    costs: DeviceCosts = DeviceCosts(),
    server_tp: int = 1,
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
            costs=costs,
            server_tp=server_tp,
            sglang_released=sglang_released,
            offload=offload,
        )
        for layout in candidate_layouts(arch, gpus, gpus_per_node)
    ]
