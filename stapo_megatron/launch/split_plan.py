"""``stapo plan --async``: the splits of a job's GPUs between the trainer and disaggregated SGLang servers,
each checked by the layout check (:mod:`.layout`) and timed by the step-time model (:mod:`.step_time`),
next to the synchronous layout with colocated servers.

A split gives every node ``t`` trainer ranks (GPUs 0..t-1: torchrun starts the same number on every
node) and its other GPUs to servers of ``server_tp`` GPUs from ``base_gpu_id = t``. The servers counted
are the ones the layout check places (``rollout.node_servers.plan_node_servers``), so the figure is
that of the job ``stapo submit`` would start; GPUs that run neither are listed as idle.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from stapo_megatron.config import ConfigError
from stapo_megatron.launch.layout import JobLayout, Machines, MemoryModel, check_layout, largest_export_entry
from stapo_megatron.launch.plan import GIB, Layout, candidate_layouts, estimate, rollout_capacity
from stapo_megatron.launch.plan_config import PlanConfig, memory_model
from stapo_megatron.launch.step_time import (
    StepTime,
    StepTokens,
    Throughput,
    asynchronous_step,
    pipeline_efficiency,
    synchronous_step,
)

if TYPE_CHECKING:
    from stapo_megatron.trainer.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Split:
    """One way to share the nodes: ``refused`` says why it cannot work ('' when it can)."""

    trainer_per_node: int
    server_tp: int = 0
    layout: Layout | None = None
    job: JobLayout | None = None
    time: StepTime | None = None
    refused: str = ""
    share: float = 0.0  # the colocated servers' mem_fraction_static (the synchronous split)

    @property
    def server_gpus(self) -> int:
        return sum(len(s.gpus) for s in self.job.servers) if self.job else 0

    @property
    def trainer_gpus(self) -> int:
        return self.layout.gpus if self.layout else 0


@dataclasses.dataclass(frozen=True)
class AsyncPlan:
    nodes: int
    gpus_per_node: int
    tokens: StepTokens
    rate: Throughput
    steps: int
    synchronous: Split  # trainer_per_node = gpus_per_node, servers colocated on every GPU
    splits: list[Split]
    own: Split | None  # the training config's own split, when it is asynchronous and disaggregated

    @property
    def best(self) -> Split | None:
        timed = [s for s in self.splits if s.time is not None]
        return min(timed, key=lambda s: s.time.total_s) if timed else None  # type: ignore[union-attr]

    def speedup(self, split: Split) -> float | None:
        if split.time is None or self.synchronous.time is None:
            return None
        return self.synchronous.time.total_s / split.time.total_s


def step_tokens(cfg: PlanConfig, train: TrainConfig) -> StepTokens:
    response = cfg.response_tokens if cfg.response_tokens is not None else train.batch.max_new_tokens / 3
    return StepTokens(train.batch.prompts_per_step * train.batch.group_size, cfg.prompt_tokens, response)


def throughput(cfg: PlanConfig, train: TrainConfig) -> Throughput:
    scaled = Throughput.scaled(train.model.num_parameters())
    return Throughput(
        cfg.decode_tokens_per_gpu_s or scaled.decode_tokens_per_gpu_s,
        cfg.train_tokens_per_gpu_s or scaled.train_tokens_per_gpu_s,
        scaled.pause_s if cfg.sync_pause_s is None else cfg.sync_pause_s,
    )


def efficiency(layout: Layout, train: TrainConfig, tokens: StepTokens) -> float:
    """The pipeline's busy fraction: micro-batches are packed rows of max_tokens_per_microbatch tokens."""
    per_minibatch = train.batch.prompts_per_minibatch * train.batch.group_size
    sample = tokens.prompt_tokens + tokens.response_tokens
    rows = math.ceil(per_minibatch * sample / (layout.dp * train.batch.max_tokens_per_microbatch))
    return pipeline_efficiency(layout.pp, max(rows, 1))


def _parallel(train: TrainConfig, layout: Layout):
    return dataclasses.replace(
        train.parallel,
        tensor_parallel=layout.tp,
        pipeline_parallel=layout.pp,
        data_parallel=layout.dp,
        context_parallel=1,
        sequence_parallel=train.parallel.sequence_parallel and layout.tp > 1,
    )


def _memory(cfg: PlanConfig, train: TrainConfig, colocated: bool, share: float | None = None) -> MemoryModel:
    """The memory model of ``train`` with its servers colocated at ``share`` (default: its own) or not."""
    work, options = memory_model(cfg, train)
    share = (train.rollout.sglang.mem_fraction_static if share is None else share) if colocated else 0.0
    options = {**options, "colocate_fraction": share, "sglang_released": colocated, "offload": colocated}
    bucket = max(train.rollout.sglang.weight_bucket_bytes, largest_export_entry(train.model, work.param_bytes))
    return MemoryModel(work, options, bucket, cfg.headroom_gb * GIB)


def _fastest_first(layouts: list[Layout], train: TrainConfig, tokens: StepTokens) -> list[Layout]:
    """Highest pipeline efficiency first; among equals, the planner's order (smallest model-parallel group)."""
    return sorted(layouts, key=lambda lay: -efficiency(lay, train, tokens))


def _fitting(layouts: list[Layout], train: TrainConfig, memory: MemoryModel) -> list[Layout]:
    return [lay for lay in layouts if estimate(train.model, lay, memory.work, **memory.options).fits]


def _least_memory(layouts: list[Layout], train: TrainConfig, memory: MemoryModel) -> str:
    totals = [(estimate(train.model, lay, memory.work, **memory.options).total, lay) for lay in layouts]
    if not totals:
        return ""
    total, lay = min(totals, key=lambda t: t[0])
    return f" (least: TP{lay.tp} PP{lay.pp} DP{lay.dp}, {total / GIB:.1f} GiB)"


# The synchronous comparison's colocated servers take the config's mem_fraction_static, or the largest
# share below it, in these steps down to the floor, whose every phase fits (a share sized for dedicated
# server GPUs may leave no room on a GPU the trainer shares).
SHARE_STEP, LEAST_SHARE = 0.05, 0.5


def synchronous_split(cfg: PlanConfig, train: TrainConfig, machines: Machines, tokens: StepTokens, rate) -> Split:
    """Every GPU trains and generates in turns: the config's own layout when it is that, else the fitting
    colocated layout of all the GPUs with the fastest modelled training, at the largest share that fits."""
    gpn, gpus = machines.gpus_per_node, machines.nodes * machines.gpus_per_node
    sglang = train.rollout.sglang
    own = Layout(train.parallel.tensor_parallel, train.parallel.pipeline_parallel, train.parallel.data_parallel)
    if sglang.colocated and not train.rollout.pipelined and own.gpus == gpus:
        layouts = [own]
    else:
        layouts = [lay for lay in candidate_layouts(train.model, gpus, gpn) if gpn % lay.tp == 0]
    server_tp = sglang.tp_size if gpn % sglang.tp_size == 0 else gpn
    refusal = ""
    share = sglang.mem_fraction_static
    while share >= LEAST_SHARE - 1e-9:
        colocated = dataclasses.replace(
            sglang,
            placement="colocated",
            tp_size=server_tp,
            num_servers=1,
            base_gpu_id=0,
            urls=[],
            weight_sync="auto",
            mem_fraction_static=round(share, 2),
        )
        memory = _memory(cfg, train, colocated=True, share=colocated.mem_fraction_static)
        fitting = _fitting(layouts, train, memory)
        if not fitting:
            refusal = refusal or f"no layout of {gpus} GPUs fits{_least_memory(layouts, train, memory)}"
        for layout in _fastest_first(fitting, train, tokens):
            try:  # the whole job: the weight sync's phase too, which the estimate alone does not count
                job = check_layout(train.model, _parallel(train, layout), colocated, machines, memory)
            except ConfigError as err:
                refusal = refusal or str(err)
                continue
            time = synchronous_step(tokens, gpus, rate, efficiency(layout, train, tokens))
            return Split(gpn, server_tp, layout, job, time, share=colocated.mem_fraction_static)
        share -= SHARE_STEP
    return Split(gpn, refused=refusal)


def server_tps(cfg: PlanConfig, train: TrainConfig, gpus: int) -> list[int]:
    """Server sizes to try on ``gpus`` GPUs of a node: plan.server_tp when set, else every size that
    divides them and the attention heads, largest first (the most KV cache per server GPU)."""
    if cfg.server_tp is not None:
        return [cfg.server_tp]
    heads = train.model.num_attention_heads
    return [d for d in range(gpus, 0, -1) if gpus % d == 0 and heads % d == 0]


def disaggregated_split(
    cfg: PlanConfig,
    train: TrainConfig,
    machines: Machines,
    tokens: StepTokens,
    rate: Throughput,
    trainer_per_node: int,
    *,
    server_tp: int | None = None,
    layout: Layout | None = None,
) -> Split:
    """``trainer_per_node`` trainer ranks on every node and servers on the rest: the given server size and
    trainer layout, else the largest server that holds the model and the fastest trainer layout that fits."""
    t, gpn, nodes = trainer_per_node, machines.gpus_per_node, machines.nodes
    if not 0 < t < gpn:
        return Split(t, refused=f"{t} trainer GPUs per node leave none of the {gpn} for servers")
    sglang = train.rollout.sglang
    seq_len = train.data.max_prompt_tokens + train.batch.max_new_tokens
    reasons = []
    sizes = [server_tp] if server_tp else server_tps(cfg, train, gpn - t)
    holding = []
    for stp in sizes:
        capacity = rollout_capacity(
            train.model,
            placement="disaggregated",
            servers=(gpn - t) // stp,
            server_tp=stp,
            mem_fraction=sglang.mem_fraction_static,
            gpu_memory_gb=cfg.gpu_memory_gb,
            max_seq_len=seq_len,
        )
        if (gpn - t) % stp:
            reasons.append(f"a TP{stp} server does not divide the {gpn - t} server GPUs of a node")
        elif capacity.sequences_per_server < 1:
            weights = train.model.num_parameters() * 2 / stp / GIB
            reasons.append(
                f"a TP{stp} server cannot hold the model: {weights:.1f} GiB of weights per GPU of its "
                f"{sglang.mem_fraction_static:g} x {cfg.gpu_memory_gb:g} GiB leave less KV cache than one "
                f"{seq_len:,}-token sequence needs"
            )
        else:
            holding.append(stp)
    if not holding:
        return Split(t, refused=reasons[0] if reasons else f"no server size fits {gpn - t} GPUs")
    stp = holding[0]
    servers = dataclasses.replace(
        sglang, placement="disaggregated", tp_size=stp, num_servers=(gpn - t) // stp, base_gpu_id=t, urls=[],
        weight_sync="auto" if sglang.weight_sync == "tensor" else sglang.weight_sync,
    )  # fmt: skip
    memory = _memory(cfg, train, colocated=False)
    if layout is not None:
        layouts = [layout]
    else:
        layouts = [lay for lay in candidate_layouts(train.model, nodes * t, t) if t % lay.tp == 0]
    fitting = _fitting(layouts, train, memory)
    if not fitting:
        least = _least_memory(layouts, train, memory)
        return Split(t, stp, refused=f"no trainer layout of {nodes * t} GPUs ({t} per node) fits{least}")
    chosen = _fastest_first(fitting, train, tokens)[0]
    job = check_layout(train.model, _parallel(train, chosen), servers, machines, memory)
    time = asynchronous_step(
        tokens,
        sum(len(s.gpus) for s in job.servers),
        chosen.gpus,
        rate,
        efficiency(chosen, train, tokens),
        train.run.steps,
    )
    return Split(t, stp, chosen, job, time)


def job_nodes(cfg: PlanConfig, train: TrainConfig) -> int:
    """The nodes of the job: plan.nodes, else the world size over the ranks per node (base_gpu_id of
    disaggregated servers launched beside the trainer, else gpus_per_node)."""
    if cfg.nodes:
        return cfg.nodes
    sglang = train.rollout.sglang
    per_node = cfg.gpus_per_node
    if train.rollout.engine == "sglang" and sglang.launches and not sglang.colocated and sglang.base_gpu_id:
        per_node = min(sglang.base_gpu_id, cfg.gpus_per_node)
    return -(-train.parallel.world_size // per_node)


def plan_async(cfg: PlanConfig, train: TrainConfig) -> AsyncPlan:
    """Every split of the job's GPUs (or plan.trainer_gpus_per_node's alone) with its modelled step time;
    ConfigError when the asked split, or the config's own asynchronous one, cannot work."""
    machines = Machines(job_nodes(cfg, train), cfg.gpus_per_node)
    tokens, rate = step_tokens(cfg, train), throughput(cfg, train)
    sync = synchronous_split(cfg, train, machines, tokens, rate)
    sglang = train.rollout.sglang
    own = None
    if train.rollout.pipelined and train.rollout.engine == "sglang" and sglang.launches and not sglang.colocated:
        p = train.parallel
        own = disaggregated_split(
            cfg, train, machines, tokens, rate, p.world_size // machines.nodes, server_tp=sglang.tp_size,
            layout=Layout(p.tensor_parallel, p.pipeline_parallel, p.data_parallel),
        )  # fmt: skip
        if own.refused:
            raise ConfigError(f"the config's split ({own.trainer_per_node} trainer GPUs per node): {own.refused}")
    per_node = [cfg.trainer_gpus_per_node] if cfg.trainer_gpus_per_node else range(1, cfg.gpus_per_node)
    splits = []
    for t in per_node:
        try:
            split = disaggregated_split(cfg, train, machines, tokens, rate, t)
        except ConfigError as err:  # the layout check's one line
            split = Split(t, refused=str(err))
        if cfg.trainer_gpus_per_node and split.refused:
            raise ConfigError(f"plan.trainer_gpus_per_node: {t} per node cannot work: {split.refused}")
        splits.append(split)
    return AsyncPlan(machines.nodes, machines.gpus_per_node, tokens, rate, train.run.steps, sync, splits, own)


def _layout_text(split: Split) -> str:
    lay = split.layout
    return f"TP{lay.tp} PP{lay.pp} DP{lay.dp}" if lay else "-"


def format_async_plan(result: AsyncPlan) -> str:
    tok, rate = result.tokens, result.rate
    gpus = result.nodes * result.gpus_per_node
    lines = [
        f"step time model (stapo_megatron/launch/step_time.py): {tok.samples:,} samples x ({tok.prompt_tokens:,.0f} "
        f"prompt + {tok.response_tokens:,.0f} response) tokens, {result.steps:,} steps; per GPU: decode "
        f"{rate.decode_tokens_per_gpu_s:,.0f}, train {rate.train_tokens_per_gpu_s:,.0f} tokens/s; weight-sync pause "
        f"{rate.pause_s:.1f} s"
    ]
    sync = result.synchronous
    if sync.time is None:
        lines.append(f"synchronous, colocated on {gpus} GPUs: {sync.refused}")
    else:
        t = sync.time
        lines.append(
            f"synchronous, colocated on {gpus} GPUs: trainer {_layout_text(sync)}, {len(sync.job.servers)} servers x "  # type: ignore[union-attr]
            f"TP{sync.server_tp} at mem_fraction_static {sync.share:g}: generation {t.generation_s:.1f} + training "
            f"{t.training_s:.1f} + pause {t.pause_s:.1f} = {t.total_s:.1f} s"
        )
    lines.append(
        f"asynchronous splits of {result.nodes} node(s) x {result.gpus_per_node} GPUs (trainer ranks on GPUs "
        "0..t-1 of every node, servers from GPU t); speed-up = synchronous step / this step:"
    )
    lines.append(
        f"{'t':>2} {'trainer':>15} {'servers':>14} {'idle':>5} {'generation s':>12} {'training s':>10} "
        f"{'step s':>8} {'speed-up':>8}"
    )
    best = result.best
    for split in result.splits:
        lines.append(_split_line(result, split, best))
    if result.own is not None:
        lines.append("the config's own split:")
        lines.append(_split_line(result, result.own, None))
    return "\n".join(lines)


def _split_line(result: AsyncPlan, split: Split, best: Split | None) -> str:
    t = split.trainer_per_node
    if split.time is None:
        return f"{t:>2} {'':>15} {'':>14} {'':>5} refused: {split.refused}"
    job = split.job
    assert job is not None
    idle = result.nodes * result.gpus_per_node - split.trainer_gpus - split.server_gpus
    servers = f"{len(job.servers)} x TP{split.server_tp}"
    ratio = result.speedup(split)
    return (
        f"{t:>2} {_layout_text(split):>15} {servers:>14} {idle:>5} {split.time.generation_s:>12.1f} "
        f"{split.time.training_s:>10.1f} {split.time.total_s:>8.1f} "
        f"{(f'{ratio:.2f}' if ratio is not None else '-'):>8}{'  best' if split is best else ''}"
    )


def async_step_times(config_path: str, overrides: list[str] | None = None) -> str:
    """The modelled step times of a training config file, synchronous colocated against each asynchronous
    split (what ``stapo plan --config C --async`` prints; its ``plan:`` section applies)."""
    from stapo_megatron.config import build
    from stapo_megatron.config.command import load_training_config, read_training_file
    from stapo_megatron.trainer.config import TrainConfig

    plan = build(PlanConfig, read_training_file(config_path)[0]["plan"], "plan")
    train = load_training_config(TrainConfig, config_path, overrides or [])
    return format_async_plan(plan_async(plan, train))
