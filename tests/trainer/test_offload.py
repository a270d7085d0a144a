"""Trainer offload while generating: the real DDP-wrapped model and Megatron optimizer, 2 gloo ranks (DP2).

One spawn checks, for fp32 and bf16 weights with the distributed optimizer off and on: the
offloaded storages really hold 0 bytes (views included), the optimizer part leaves the parameters
resident for the weight sync, the reload restores parameters, gradients and Adam's state bit for
bit, and training with an offload/reload cycle before every step matches training without one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

LAYOUTS = [("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True)]
STEPS_BEFORE, STEPS_AFTER = 2, 3


def _microbatches(rank: int, step: int, vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    batches = []
    for _ in range(2):
        tokens = torch.randint(0, vocab, (2, 9), generator=generator)
        batches.append(
            {
                "input_ids": tokens[:, :-1],
                "position_ids": torch.arange(8).expand(2, 8),
                "labels": tokens[:, 1:],
            }
        )
    return batches


def _loss(logits, batch):
    labels = batch["labels"]
    flat = logits.float().reshape(-1, logits.shape[-1])
    loss_sum = torch.nn.functional.cross_entropy(flat, labels.reshape(-1), reduction="sum")
    return loss_sum, torch.tensor(labels.numel(), dtype=torch.int), {"loss_sum": loss_sum.detach()}


def _train_step(model, optimizer, rank: int, step: int, vocab: int) -> float:
    from stapo_megatron.trainer.schedule import forward_backward

    model.zero_grad_buffer()
    optimizer.zero_grad()
    reports = forward_backward(model, _microbatches(rank, step, vocab), _loss)
    optimizer.step()
    return float(sum(r["loss_sum"] for r in reports))


def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    from stapo_megatron.trainer.offload import _torch_optimizers

    tensors = {}
    for name, param in model.named_parameters():
        tensors[f"param/{name}"] = param.detach().clone()
        tensors[f"main_grad/{name}"] = param.main_grad.detach().clone()
    for k, torch_optimizer in enumerate(_torch_optimizers(optimizer)):
        for g, group in enumerate(torch_optimizer.param_groups):
            for i, main_param in enumerate(group["params"]):
                tensors[f"main_param/{k}/{g}/{i}"] = main_param.detach().clone()
                for key, value in torch_optimizer.state[main_param].items():
                    tensors[f"state/{k}/{g}/{i}/{key}"] = value.detach().clone()
    return tensors


def _all_freed(tensors) -> bool:
    return all(t.untyped_storage().nbytes() == 0 for t in tensors)


def offload_round_trips(out_dir: str) -> None:
    """Rank function: every check for every layout, recorded (not raised) so the ranks stay in step."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from stapo_megatron.models.qwen3.config import Qwen3Config
    from stapo_megatron.models.qwen3.parallelize import build_stage
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed
    from stapo_megatron.trainer.config import TrainConfig
    from stapo_megatron.trainer.offload import OPTIMIZER, PARAMS, TrainerOffload, _torch_optimizers
    from stapo_megatron.trainer.trainer import Trainer

    ctx = init_distributed(ParallelConfig(data_parallel=2, timeout_minutes=2), seed=0)
    arch = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    results = {}
    for dtype_name, distributed in LAYOUTS:
        dtype = getattr(torch, dtype_name)
        cfg = TrainConfig()
        cfg.optim.distributed, cfg.optim.lr, cfg.optim.warmup_steps = distributed, 1e-2, 0
        cfg.compute.params_dtype = dtype_name

        def build(initial=None, dtype=dtype, cfg=cfg):
            module = build_stage(arch, ctx, params_dtype=dtype, calculate_per_token_loss=True, device=ctx.device)
            if initial is not None:
                module.load_state_dict(initial)
            holder = SimpleNamespace(cfg=cfg, params_dtype=dtype, rank=ctx.rank)
            holder.model = Trainer._wrap_ddp(holder, module)
            optimizer, _ = Trainer._build_optimizer(holder)
            return holder.model, optimizer, module.state_dict()

        model, optimizer, initial = build()
        reference_model, reference_optimizer, _ = build(initial)
        losses, reference_losses = [], []
        for step in range(STEPS_BEFORE):
            losses.append(_train_step(model, optimizer, ctx.rank, step, arch.vocab_size))
            reference_losses.append(_train_step(reference_model, reference_optimizer, ctx.rank, step, arch.vocab_size))
        before = _snapshot(model, optimizer)

        offload = TrainerOffload(model, optimizer, ctx.device)
        params = [p for p in model.parameters()]
        main_grads = [p.main_grad for p in params]
        states = [v for o in _torch_optimizers(optimizer) for s in o.state.values() for v in s.values() if v.dim() > 0]
        main_params = [p for o in _torch_optimizers(optimizer) for g in o.param_groups for p in g["params"]]
        # fp32 master copies of 16-bit weights; fp32 weights (the local spec's norms) are their own master
        model_storages = {p.untyped_storage().data_ptr() for p in params}
        masters = [p for p in main_params if p.untyped_storage().data_ptr() not in model_storages]
        optimizer_bytes = offload.offload(OPTIMIZER)
        check = {
            "optimizer_part_keeps_params": all(p.untyped_storage().nbytes() > 0 for p in params),
            "grads_freed": _all_freed(main_grads) and _all_freed(b.grad_data for b in model.buffers),
            "adam_state_freed": _all_freed(states),
            "main_params_freed": _all_freed(masters) and (dtype == torch.float32) == (not masters),
            "second_offload_moves_nothing": offload.offload(OPTIMIZER) == 0,
        }
        param_bytes = offload.offload(PARAMS)
        check["params_freed"] = _all_freed(params) and _all_freed(main_params)
        if distributed:
            check["param_buffers_freed"] = _all_freed(b.param_data for b in model.buffers)
        # what each part moved, against the sizes Megatron's structures have
        grad_buffer_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in model.buffers)
        param_storage_bytes = (
            sum(b.param_data.numel() * b.param_data.element_size() for b in model.buffers)
            if distributed
            else sum(p.numel() * p.element_size() for p in params)
        )
        shard_numel = sum(p.numel() for p in main_params)
        adam_bytes = 2 * 4 * shard_numel + 4 * len(main_params)  # exp_avg, exp_avg_sq in fp32, one step scalar each
        main_param_bytes = 4 * sum(p.numel() for p in masters)
        check["param_bytes"] = [param_bytes, param_storage_bytes]
        check["optimizer_bytes"] = [optimizer_bytes, grad_buffer_bytes + adam_bytes + main_param_bytes]
        check["reload_bytes"] = [offload.reload(), optimizer_bytes + param_bytes]
        after = _snapshot(model, optimizer)
        check["bit_identical_after_reload"] = sorted(k for k in before if not torch.equal(before[k], after[k]))
        check["snapshot_size"] = len(before)

        for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
            offload.offload(OPTIMIZER)
            offload.offload(PARAMS)
            offload.reload()
            losses.append(_train_step(model, optimizer, ctx.rank, step, arch.vocab_size))
            reference_losses.append(_train_step(reference_model, reference_optimizer, ctx.rank, step, arch.vocab_size))
        trained, reference = _snapshot(model, optimizer), _snapshot(reference_model, reference_optimizer)
        check["training_matches"] = sorted(k for k in trained if not torch.equal(trained[k], reference[k]))
        check["losses"] = [losses, reference_losses]
        first = f"param/{next(name for name, _ in model.named_parameters())}"
        check["params_moved"] = not torch.equal(trained[first], before[first])  # the later steps did train
        results[f"{dtype_name}/{'distributed' if distributed else 'plain'}"] = check
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


def test_offload_round_trip_is_bit_exact_and_training_matches(tmp_path):
    from stapo_megatron.runtime.launch import spawn_ranks

    spawn_ranks(offload_round_trips, 2, str(tmp_path))
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(results) == sorted(f"{d}/{'distributed' if o else 'plain'}" for d, o in LAYOUTS)
        for layout, check in results.items():
            where = f"rank {rank} {layout}"
            for flag in (
                "optimizer_part_keeps_params",
                "grads_freed",
                "adam_state_freed",
                "main_params_freed",
                "second_offload_moves_nothing",
                "params_freed",
                "params_moved",
            ):
                assert check[flag], f"{where}: {flag}"
            if layout.endswith("distributed"):
                assert check["param_buffers_freed"], where
            moved, expected = check["param_bytes"]
            assert moved == expected > 0, f"{where}: params moved {moved} bytes, expected {expected}"
            moved, expected = check["optimizer_bytes"]
            assert moved == expected > 0, f"{where}: optimizer part moved {moved} bytes, expected {expected}"
            moved, expected = check["reload_bytes"]
            assert moved == expected, where
            assert check["snapshot_size"] > 20, where
            assert check["bit_identical_after_reload"] == [], f"{where}: changed by the round trip"
            assert check["training_matches"] == [], f"{where}: differs from training without offload"
            losses, reference = check["losses"]
            assert losses == reference, where


def test_offload_needs_the_servers_on_the_trainers_gpus():
    from stapo_megatron.config import ConfigError, load_config
    from stapo_megatron.trainer.config import TrainConfig

    server = ["rollout.engine=sglang", "rollout.sglang.model_path=/models/qwen3"]
    with pytest.raises(
        ConfigError,
        match=r"^compute.offload_while_generating: needs the rollout servers on the trainer's "
        r"GPUs \(rollout.sglang.placement: colocated\)",
    ):
        load_config(TrainConfig, None, [*server, "compute.offload_while_generating=true"])
    colocated = load_config(
        TrainConfig, None, [*server, "rollout.sglang.placement=colocated", "compute.offload_while_generating=true"]
    )
    assert colocated.compute.offload_while_generating
    # the in-process engine runs on the trainer's device: colocated by construction
    assert load_config(TrainConfig, None, ["compute.offload_while_generating=true"]).compute.offload_while_generating
    assert not load_config(TrainConfig, None, []).compute.offload_while_generating


class _RecordingOffload:
    """What TrainerOffload does, as far as the order of the trainer's phases can see it."""

    def __init__(self, calls: list):
        self.calls, self.off = calls, {"optimizer": False, "params": False}

    def offloaded(self, part):
        return self.off[part]

    def offload(self, part):
        moved = 0 if self.off[part] else 10
        self.off[part] = True
        self.calls.append(f"offload {part}" + ("" if moved else " (already)"))
        return moved

    def reload(self, part=None):
        parts = [part] if part else [p for p in ("params", "optimizer") if self.off[p]]
        for p in parts:
            self.off[p] = False
        self.calls.append("reload " + "+".join(parts))
        return 10 * len(parts)


def test_phases_around_generation_run_in_the_order_the_gpu_memory_needs(monkeypatch):
    """Optimizer state leaves before the servers take their memory back, the weights are synced
    from resident parameters, which leave before generation; the servers release before any rank
    reloads."""
    from types import SimpleNamespace

    from stapo_megatron.trainer import trainer as trainer_module
    from stapo_megatron.trainer.metrics import PhaseTimer
    from stapo_megatron.trainer.trainer import Trainer

    calls = []
    monkeypatch.setattr(trainer_module.dist, "barrier", lambda group=None: calls.append("barrier"))
    rollouts = SimpleNamespace(
        resume_engine=lambda: calls.append("engine resume"),
        release_engine=lambda: calls.append("engine release"),
        sync_weights=lambda model, version, timer: calls.append(f"sync {version}"),
    )
    holder = SimpleNamespace(
        rank=0,
        offload=_RecordingOffload(calls),
        engine_released=False,
        engine_version=None,
        release_engine=True,
        moved_bytes={"offload": 0, "reload": 0},
        ctx=SimpleNamespace(cpu_group=None),
        model=None,
        rollouts=rollouts,
    )
    holder.offload.off = {"optimizer": True, "params": True}  # as __init__ leaves it before the servers launch
    timer = PhaseTimer()

    Trainer.ready_to_generate(holder, 0, timer)
    assert calls == ["offload optimizer (already)", "reload params", "sync 0", "offload params"]
    calls.clear()
    Trainer.ready_to_train(holder, timer)
    assert calls == ["engine release", "barrier", "reload params+optimizer"]
    assert holder.engine_version is None  # released weights are not trusted: the next generation resyncs
    calls.clear()
    Trainer.ready_to_generate(holder, 1, timer)
    assert calls == ["offload optimizer", "barrier", "engine resume", "sync 1", "offload params"]  # all ranks off first
    calls.clear()
    Trainer.ready_to_generate(holder, 1, timer)  # evaluation right after: nothing to move, nothing to sync
    assert calls == ["offload optimizer (already)", "offload params (already)"]
    assert holder.moved_bytes == {"offload": 30, "reload": 30}
    timer.stop()
    assert {"time/offload", "time/reload", "time/sync", "time/release", "time/resume"} <= set(timer.metrics())


def _phase_sum(row: dict) -> float:
    return sum(v for k, v in row.items() if k.startswith("time/") and k != "time/step")


@pytest.mark.slow
def test_a_run_offloaded_while_generating_trains_exactly_like_one_that_is_not(tmp_path):
    from tests.trainer.runs import metrics, run, train_command

    plain, offloaded = tmp_path / "plain", tmp_path / "offloaded"
    run(train_command(plain, "run.steps=3"))
    run(train_command(offloaded, "run.steps=3", "compute.offload_while_generating=true"))
    plain_rows, offloaded_rows = metrics(plain), metrics(offloaded)
    assert [r["step"] for r in offloaded_rows] == [1, 2, 3]

    def learning(row):
        return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "memory/"))}

    for p, o in zip(plain_rows, offloaded_rows):
        assert learning(o) == learning(p), f"step {o['step']} differs with offload"
        assert "memory/offloaded_gb" not in p
        assert o["memory/offloaded_gb"] > 0 and o["time/offload"] > 0 and o["time/reload"] > 0
        assert abs(_phase_sum(o) - o["time/step"]) <= 1e-9 * o["time/step"], o
    # from step 2 on, each step moves the whole state out and back; step 1 started offloaded
    for row in offloaded_rows[1:]:
        assert row["memory/offloaded_gb"] == row["memory/reloaded_gb"]
