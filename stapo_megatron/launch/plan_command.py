"""``stapo plan``: the command line, the memory model's (:mod:`.plan`) tables, and the layout check
(:mod:`.layout`) of a training config."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stapo_megatron.config import ConfigError, apply_overrides, build
from stapo_megatron.config.command import (
    CommandConfig,
    Flag,
    FlagKind,
    add_command_arguments,
    load_command,
    register_command_config,
)
from stapo_megatron.launch.plan import (
    GIB,
    Estimate,
    Layout,
    RolloutCapacity,
    Workload,
    estimate,
    kv_bytes_per_token,
    plan,
    rollout_capacity,
)
from stapo_megatron.launch.plan_config import PlanConfig, memory_model, plan_value, training_config_defaults
from stapo_megatron.models.qwen3.config import Qwen3Config


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
        show_plan(cfg, train)


def show_layout_check(cfg: PlanConfig, train) -> None:
    from stapo_megatron.launch.layout import Machines, check_train_layout

    if train is None:
        raise ConfigError("plan.check: checks a training config's layout; give one (--config)")
    nodes = cfg.nodes or -(-train.parallel.world_size // cfg.gpus_per_node)
    layout = check_train_layout(train, Machines(nodes, cfg.gpus_per_node), cfg)
    print(layout.summary())
    if cfg.verbose:
        print("\n".join(layout.route_lines()))


def show_plan(cfg: PlanConfig, train) -> None:
    """What ``stapo plan`` prints: the workload, the rollout capacity, then one layout's stages (given
    one, or a training config's own) or every layout of the GPUs that fits."""
    if cfg.check:
        show_layout_check(cfg, train)
        return
    if cfg.async_:
        from stapo_megatron.launch.split_plan import format_async_plan, plan_async

        if train is None:
            raise ConfigError("plan.async: splits a training config's job; give one (--config)")
        print(format_async_plan(plan_async(cfg, train)))
        return
    defaults = training_config_defaults(train) if train is not None else {}
    arch = build(Qwen3Config, cfg.model, "plan.model") if cfg.model else defaults.get("model")
    if arch is None:
        raise ConfigError("plan.model: give a model preset (e.g. qwen3_32b), or a training config (--config)")
    work, options = memory_model(cfg, train)
    gpus = plan_value(cfg, defaults, "gpus", None)
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
    print(format_capacity(rollout_capacities(cfg, defaults, arch, gpus, work, options), arch))
    if cfg.tp is not None or cfg.pp is not None or (train is not None and not cfg.search):
        tp, pp = plan_value(cfg, defaults, "tp", 1), plan_value(cfg, defaults, "pp", 1)
        if gpus % (tp * pp):
            raise ConfigError(f"plan.gpus: {gpus} is not a multiple of TP x PP = {tp * pp}")
        print(format_stages(estimate(arch, Layout(tp, pp, gpus // (tp * pp)), work, **options)))
        return
    show_fitting_layouts(cfg, arch, gpus, work, options)


def rollout_capacities(
    cfg: PlanConfig, defaults: dict, arch: Qwen3Config, gpus: int, work: Workload, options: dict[str, Any]
) -> list[RolloutCapacity]:
    """The servers' capacity colocated on the trainer's GPUs and on dedicated ones."""
    server_tp = plan_value(cfg, defaults, "server_tp", 1)
    if gpus % server_tp:
        raise ConfigError(f"plan.server_tp: must be >= 1 and divide the {gpus} GPUs, got {server_tp}")
    mem_fraction = options["colocate_fraction"] or defaults.get("mem_fraction", 0.8)
    return [
        rollout_capacity(
            arch,
            placement=placement,
            servers=servers,
            server_tp=server_tp,
            mem_fraction=mem_fraction,
            gpu_memory_gb=cfg.gpu_memory_gb,
            max_seq_len=defaults.get("rollout_len", work.seq_len),
        )
        for placement, servers in (
            ("colocated", gpus // server_tp),
            ("disaggregated", defaults.get("dedicated_servers", 1)),
        )
    ]


def show_fitting_layouts(
    cfg: PlanConfig, arch: Qwen3Config, gpus: int, work: Workload, options: dict[str, Any]
) -> None:
    """The table of the layouts that fit (all of them with ``cfg.all``), or the one that comes closest."""
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
    ("async", "true"),
    ("trainer_gpus_per_node", "value"),
    ("response_tokens", "value"),
    ("prompt_tokens", "value"),
    ("decode_tokens_per_gpu_s", "value"),
    ("train_tokens_per_gpu_s", "value"),
    ("sync_pause_s", "value"),
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
